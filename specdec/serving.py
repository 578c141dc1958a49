"""gRPC server plumbing shared by every service: health, reflection, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def create_server(
    address: str,
    register: Iterable[Callable[[grpc.aio.Server], None]],
    service_names: Iterable[str],
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Build a server with our servicers, the standard health service and reflection.

    Returns the server, the bound port (bind port 0 in tests) and the health servicer, whose
    status starts as NOT_SERVING until `mark_serving` is called.
    """
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    for add in register:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}: is the port in use?")
    return server, port, health_servicer


async def mark_serving(health_servicer, service_names: Iterable[str]) -> None:
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def serve_until_signalled(server: grpc.aio.Server, grace: float = 5.0) -> None:
    """Run until SIGINT/SIGTERM, then stop gracefully, letting in-flight calls finish."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down (grace %.1fs)", grace)
    await server.stop(grace)


def channel(address: str) -> grpc.aio.Channel:
    """An insecure channel to one of our services, with our message-size limits.

    Reconnection backs off to at most 2 s (gRPC's default grows to 120 s), so a replica that
    comes back after an outage is used again within seconds.
    """
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS + [
        ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000),
    ])


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


async def serve_servicer(address: str, register: Callable[[grpc.aio.Server], None], service_name: str,
                         description: str) -> None:
    """Start a server for one servicer (plus health and reflection), mark it SERVING, run until signalled."""
    server, port, health_servicer = create_server(address, [register], [service_name])
    await server.start()
    await mark_serving(health_servicer, [service_name])
    log.info("%s listening on %s", description, f"{address.rsplit(':', 1)[0]}:{port}")
    await serve_until_signalled(server)


def start_metrics(registry, host: str, port: int | None) -> int:
    """Serve a Prometheus registry at http://host:port/metrics (port None: off, 0: a free one).

    Returns the bound port, 0 when off. The server runs in a daemon thread until the process ends.
    """
    if port is None:
        return 0
    from specdec.metrics import serve_metrics

    bound, _stop = serve_metrics(registry, host, port)
    log.info("metrics at http://%s:%d/metrics", host, bound)
    return bound


def run_main(config_cls, serve, prog: str, argv=None, startup_errors: tuple[type[Exception], ...] = ()) -> None:
    """The entry point of every service: flags → config → logging → asyncio.run(serve(config))."""
    config = config_cls.from_args(argv, prog=prog)
    configure_logging(config.log_level)
    try:
        asyncio.run(serve(config))
    except startup_errors as exc:
        log.error("cannot start: %s", exc)
        sys.exit(2)
    except KeyboardInterrupt:
        pass
