"""Channels to specdec services: our message-size limits, fast reconnection, trace context.

Used by the SDK and by every service that calls another (the orchestrator's draft and target
clients); it holds no server code. Every call carries the current W3C trace context
(`traceparent`, when OpenTelemetry is installed: the services always have it, a light SDK
install may not) and the request id of the call being served (`x-request-id`), so one request
is one trace and one id in the logs of every service it crosses.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import MutableMapping, Sequence
from typing import Any

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
REQUEST_ID_KEY = "x-request-id"
# The id of the request being served: set by the servers' interceptors (and the HTTP gateway),
# read by the log filter and sent on with every call made on its behalf.
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("specdec_request_id", default="")


@functools.cache
def _propagator() -> Any:
    try:
        from opentelemetry import propagate
    except ImportError:  # a light SDK install: no tracing to carry
        return None
    return propagate


def inject(carrier: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Put the current trace context (traceparent) and request id into outgoing metadata."""
    propagate = _propagator()
    if propagate is not None:
        propagate.inject(carrier)
    rid = request_id.get()
    if rid and REQUEST_ID_KEY not in carrier:
        carrier[REQUEST_ID_KEY] = rid
    return carrier


def merge_options(base: Sequence[tuple[str, object]], extra: Sequence[tuple[str, object]]) -> list:
    """`base` with the keys of `extra` replaced (gRPC would take the first of a repeated key)."""
    keys = {k for k, _ in extra}
    return [(k, v) for k, v in base if k not in keys] + list(extra)


def _with_context(details):
    pairs = list(details.metadata or ())
    present = {k for k, _ in pairs}
    pairs += [(k, v) for k, v in inject({}).items() if k not in present]
    return details._replace(metadata=grpc.aio.Metadata(*pairs))


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


def client_interceptors() -> list:
    """Interceptors of an aio channel that carry the trace context and request id to the server."""
    return [_UnaryUnary(), _UnaryStream()]


def channel(address: str, credentials: grpc.ChannelCredentials | None = None,
            options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """A channel to one of our services, with our message-size limits, carrying trace context.

    Plaintext unless `credentials` are given (mutual TLS: `specdec.server.tls.ClientTLS.credentials()`).
    Reconnection backs off to at most 2 s (gRPC's default grows to 120 s), so a replica that
    comes back after an outage is used again within seconds.
    """
    opts = merge_options(CHANNEL_OPTIONS + [
        ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000),
    ], options)
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=opts, interceptors=client_interceptors())
    return grpc.aio.insecure_channel(address, options=opts, interceptors=client_interceptors())
