"""Channels to specdec services: our message-size limits, fast reconnection, trace context.

Used by the SDK and by every service that calls another (the orchestrator's draft and target
clients); it holds no server code.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def merge_options(base: Sequence[tuple[str, object]], extra: Sequence[tuple[str, object]]) -> list:
    """`base` with the keys of `extra` replaced (gRPC would take the first of a repeated key)."""
    keys = {k for k, _ in extra}
    return [(k, v) for k, v in base if k not in keys] + list(extra)


def channel(address: str, credentials: grpc.ChannelCredentials | None = None,
            options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """A channel to one of our services, with our message-size limits, carrying trace context.

    Plaintext unless `credentials` are given (mutual TLS: `specdec.server.tls.ClientTLS.credentials()`).
    Reconnection backs off to at most 2 s (gRPC's default grows to 120 s), so a replica that
    comes back after an outage is used again within seconds.
    """
    from specdec.server.tracing import client_interceptors

    opts = merge_options(CHANNEL_OPTIONS + [
        ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000),
    ], options)
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=opts, interceptors=client_interceptors())
    return grpc.aio.insecure_channel(address, options=opts, interceptors=client_interceptors())
