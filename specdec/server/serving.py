"""gRPC server plumbing shared by every service: health, reflection, graceful shutdown."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import _async as reflection_aio, reflection, reflection_pb2

from specdec.channel import CHANNEL_OPTIONS, merge_options

log = logging.getLogger(__name__)


class HealthServicer(health.aio.HealthServicer):
    """The standard health servicer, plus `List` (every service's status), which grpcio-health-checking
    declares in its proto but does not implement (1.85: Check and Watch only).
    """

    async def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:
        # _server_status is the parent's table (set() and enter_graceful_shutdown() write it).
        statuses = {name: health_pb2.HealthCheckResponse(status=status) for name, status in self._server_status.items()}
        return health_pb2.HealthListResponse(statuses=statuses)

V1_REFLECTION = "grpc.reflection.v1.ServerReflection"


def _enable_v1_reflection(server: grpc.aio.Server, names: list[str]) -> None:
    """Serve reflection under v1's name too (grpcurl and Postman ask for v1 first). grpcio-reflection
    ships only the v1alpha servicer, but v1's messages are v1alpha's with another package name (same
    fields, same numbers), so the v1alpha servicer answers v1 calls byte for byte."""
    servicer = reflection_aio.ReflectionServicer(names)
    handler = grpc.method_handlers_generic_handler(V1_REFLECTION, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        ),
    })
    server.add_generic_rpc_handlers((handler,))


def create_server(
    address: str,
    register: Iterable[Callable[[grpc.aio.Server], None]],
    service_names: Iterable[str],
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    options: Sequence[tuple[str, object]] = (),
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Build a server with our servicers, the standard health service and reflection.

    Returns the server, the bound port (bind port 0 in tests) and the health servicer, whose
    status starts as NOT_SERVING until `mark_serving` is called. `credentials` (see
    `specdec.server.tls`) serve TLS instead of plaintext; `options` override the channel options
    (e.g. a smaller `grpc.max_receive_message_length`).
    """
    server = grpc.aio.server(options=merge_options(CHANNEL_OPTIONS, options), interceptors=list(interceptors))
    for add in register:
        add(server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    _enable_v1_reflection(server, names + [health.SERVICE_NAME, reflection.SERVICE_NAME])
    port = (server.add_secure_port(address, credentials) if credentials is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise RuntimeError(f"could not bind {address}: is the port in use?")
    return server, port, health_servicer


async def mark_serving(health_servicer, service_names: Iterable[str],
                       status: int = health_pb2.HealthCheckResponse.SERVING) -> None:
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


async def watch_health(health_servicer, service_names: Sequence[str], why_not_serving: Callable[[], str | None],
                       interval_s: float = 1.0) -> None:
    """Keep `service_names` (and "") NOT_SERVING while `why_not_serving()` gives a reason, SERVING
    otherwise, checking every `interval_s` (until cancelled): a service whose work is stuck (a model
    thread that completes no pass) must not keep answering SERVING to Kubernetes' probes."""
    reason_before: str | None = None
    while True:
        reason = why_not_serving()
        if reason and not reason_before:
            log.error("health: NOT_SERVING: %s", reason)
            await mark_serving(health_servicer, service_names, health_pb2.HealthCheckResponse.NOT_SERVING)
        elif not reason and reason_before:
            log.warning("health: SERVING again")
            await mark_serving(health_servicer, service_names)
        reason_before = reason
        await asyncio.sleep(interval_s)


async def serve_until_signalled(server: grpc.aio.Server, grace: float = 5.0,
                                on_stop: Callable[[], None] | None = None) -> None:
    """Run until SIGINT/SIGTERM, then stop gracefully, letting in-flight calls finish (`on_stop`
    runs first: it ends calls that are open but idle)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down (grace %.1fs)", grace)
    if on_stop is not None:
        on_stop()
    await server.stop(grace)


def configure_logging(level: str = "INFO", fmt: str = "text", service: str = "") -> None:
    """Log lines with request, session and trace ids: text for people, `fmt="json"` for machines."""
    from specdec.server.logs import configure

    configure(level, fmt, service)


async def serve_servicer(address: str, register: Callable[[grpc.aio.Server], None], service_name: str,
                         description: str, credentials: grpc.ServerCredentials | None = None,
                         interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None,
                         options: Sequence[tuple[str, object]] = (),
                         health_check: Callable[[], str | None] | None = None,
                         on_stop: Callable[[], None] | None = None) -> None:
    """Start a server for one servicer (plus health and reflection), mark it SERVING, run until signalled.

    `interceptors` default to `default_interceptors()` (tracing and log ids, safe decoding);
    `health_check`: why the service cannot serve now, or None (`watch_health` polls it);
    `on_stop`: called when the stop signal comes, before the graceful stop.
    """
    if interceptors is None:
        interceptors = default_interceptors()
    server, port, health_servicer = create_server(address, [register], [service_name], credentials, interceptors,
                                                  options)
    # What startup made (modules, the model, the tokenizer: some 400,000 objects in the target) lives as
    # long as the process: out of the collector's sight, a full collection while serving takes
    # microseconds instead of 0.2 s stalls of the event loop.
    gc.collect()  # (startup's own garbage first: frozen, it would never be freed)
    gc.freeze()
    await server.start()
    await mark_serving(health_servicer, [service_name])
    watch = (asyncio.get_running_loop().create_task(watch_health(health_servicer, [service_name], health_check))
             if health_check is not None else None)
    log.info("%s listening on %s (%s)", description, f"{address.rsplit(':', 1)[0]}:{port}",
             "TLS" if credentials is not None else "plaintext")
    try:
        await serve_until_signalled(server, on_stop=on_stop)
    finally:
        if watch is not None:
            watch.cancel()


def start_metrics(registry, host: str, port: int | None) -> int:
    """Serve a Prometheus registry at http://host:port/metrics (port None: off, 0: a free one).

    Returns the bound port, 0 when off. The server runs in a daemon thread until the process ends.
    """
    if port is None:
        return 0
    from specdec.server.metrics import serve_metrics

    bound, _stop = serve_metrics(registry, host, port)
    log.info("metrics at http://%s:%d/metrics", host, bound)
    return bound


def default_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """What every service runs: a span and log ids per call, then requests that fail to parse refused."""
    from specdec.server.interceptors import DecodeGuard
    from specdec.server.tracing import ServerTracing

    return [ServerTracing(), DecodeGuard()]


class StartupError(RuntimeError):
    """A service cannot serve with this configuration on this machine; the message says why."""


def run_main(config_cls, serve, prog: str, argv=None) -> None:
    """The entry point of every service: flags → config → logging, tracing → asyncio.run(serve(config))."""
    from specdec.server.tracing import setup as setup_tracing

    config = config_cls.from_args(argv, prog=prog)
    service = prog.rsplit(" ", 1)[-1]
    configure_logging(config.log_level, config.log_format, service)
    try:
        setup_tracing(service, config.otel_endpoint, config.otel_file)
    except RuntimeError as exc:
        log.error("cannot start: %s", exc)
        sys.exit(2)
    try:
        asyncio.run(serve(config))
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        sys.exit(2)
    except KeyboardInterrupt:
        pass
