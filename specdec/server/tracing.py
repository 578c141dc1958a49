"""OpenTelemetry tracing across orchestrator, draft and target (export optional, off by default).

Every service installs an SDK tracer provider, so trace ids exist (they are on every log line and
travel to the next service) even when nothing is exported. Spans leave the process only when an
exporter is configured:

    --otel-endpoint http://collector:4317     OTLP over gRPC (needs opentelemetry-exporter-otlp-proto-grpc)
    OTEL_TRACES_EXPORTER=otlp|console|none     the standard variables (with OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER)    OTEL_SERVICE_NAME and the sampler ones) work as usual
    --otel-file spans.jsonl                    every finished span as one JSON line (debugging, tests)

Propagation is W3C `traceparent` in gRPC metadata: `ServerTracing` (a server interceptor) opens a
SERVER span per call, a child of the caller's context; the client interceptors of
`specdec.channel` (on the orchestrator's channels to draft and target) and the SDK put the current
context and the request id into the metadata of every call. One Generate is thus one trace: the
orchestrator's call span, a span per speculative round (`traced`), and under each round the
draft's Propose and the target's Verify.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import grpc
from opentelemetry import context as otel_context, propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from specdec.channel import REQUEST_ID_KEY
from specdec.errors import CANCELLATIONS
from specdec.server import logs
from specdec.server.interceptors import is_open_method, wrap_handler

log = logging.getLogger(__name__)
access_log = logging.getLogger("specdec.access")
_configured = False
_exporting = False


@functools.cache
def tracer() -> trace.Tracer:
    """The process's tracer, made once: the SDK builds a new one on every `get_tracer` (a round's
    span paid for it). One made before `setup` is OpenTelemetry's proxy, which then forwards to the
    provider `setup` installs."""
    return trace.get_tracer("specdec")


class JsonLinesExporter:
    """Writes every finished span as one JSON line to a file (appending)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (closed by shutdown())

    def export(self, spans) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        for span in spans:
            self._file.write(span.to_json(indent=None) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._file.flush()
        return True


def setup(service: str, endpoint: str = "", file: str = "") -> None:
    """Install the tracer provider of this process (once) and the configured exporters."""
    global _configured, _exporting
    if _configured or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service})
    provider = TracerProvider(resource=resource)
    wanted = {e.strip() for e in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()} - {"none"}
    if endpoint or "otlp" in wanted:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError("exporting traces over OTLP needs `pip install opentelemetry-exporter-otlp-proto-grpc` "
                               "(or `pip install specdec[otlp]`)") from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None)))
        log.info("exporting traces over OTLP to %s",
                 endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "the default"))
    if "console" in wanted:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    if file:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(file)))
    trace.set_tracer_provider(provider)
    _configured = True
    _exporting = bool(endpoint or file or wanted & {"otlp", "console"})


def exporting() -> bool:
    """Whether this process exports the spans it makes (`setup` was given somewhere to send them)."""
    return _exporting


def traced(name: str, attributes: Callable[..., dict[str, Any]] | None = None):
    """Decorate an async function to run inside a span (`attributes(*args, **kwargs)` adds some)."""

    def decorate(fn):
        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            attrs = attributes(*args, **kwargs) if attributes is not None else None
            with tracer().start_as_current_span(name, attributes=attrs):
                return await fn(*args, **kwargs)

        return wrapper

    return decorate


def _metadata_dict(metadata) -> dict[str, str]:
    out = {}
    for key, value in metadata or ():
        if not key.endswith("-bin"):
            out[key] = value if isinstance(value, str) else value.decode("latin-1")
    return out


class _CallScope:
    """One served call: its SERVER span and the ids the log lines carry."""

    def __init__(self, method: str, metadata: dict[str, str], request, context, access_level: int) -> None:
        self.method = method.lstrip("/")
        self.metadata = metadata
        self.request = request
        self.context = context
        self.access_level = access_level
        self.span: Any = None
        self.started = 0.0

    def __enter__(self):
        rid = self.metadata.get(REQUEST_ID_KEY, "")
        rid = rid if rid and len(rid) <= 128 and rid.isprintable() else logs.new_request_id()
        logs.request_id.set(rid)
        sid = getattr(self.request, "session_id", "") or ""
        logs.session_id.set(sid)
        service, _, name = self.method.partition("/")
        attrs = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name, "specdec.request_id": rid}
        if sid:
            attrs["specdec.session_id"] = sid
        parent = propagate.extract(self.metadata)
        self.span = tracer().start_span(self.method, context=parent, kind=SpanKind.SERVER, attributes=attrs,
                                        record_exception=False, set_status_on_exception=False)
        # Current for the rest of the call's own task, as the log ids are, and never detached: a
        # stream whose client went away is closed from another context, where a detach fails.
        otel_context.attach(trace.set_span_in_context(self.span, parent))
        self.started = time.perf_counter()
        return self

    def observe(self, item) -> None:
        """A response naming the session (the orchestrator's first chunk of a new session)."""
        sid = getattr(item, "session_id", "")
        if sid and not logs.session_id.get():
            logs.session_id.set(sid)
            self.span.set_attribute("specdec.session_id", sid)

    def __exit__(self, exc_type, exc, tb):
        code = None
        try:
            code = self.context.code()
        except Exception:  # noqa: BLE001 - older gRPC releases have no code()
            pass
        if exc_type is not None and code in (None, grpc.StatusCode.OK):
            code = grpc.StatusCode.CANCELLED if issubclass(exc_type, CANCELLATIONS) else grpc.StatusCode.UNKNOWN
        code = code or grpc.StatusCode.OK
        self.span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            self.span.set_status(Status(StatusCode.ERROR, code.name))
        elapsed_ms = (time.perf_counter() - self.started) * 1e3
        access_log.log(self.access_level, "%s %s %.1f ms", self.method, code.name, elapsed_ms)
        self.span.end()
        return False


class ServerTracing(grpc.aio.ServerInterceptor):
    """A SERVER span per call (child of the caller's traceparent), the log ids of the call, and one
    access log line per call (method, status, milliseconds) at `access_level`."""

    def __init__(self, access_level: int = logging.DEBUG) -> None:
        self.access_level = access_level

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or is_open_method(method):
            return handler
        metadata = _metadata_dict(handler_call_details.invocation_metadata)
        scopes: list[_CallScope] = []

        def scope(request, context):
            call = _CallScope(method, metadata, request, context, self.access_level)
            scopes.append(call)
            return call

        def observe(item):
            if scopes:
                scopes[-1].observe(item)

        return wrap_handler(handler, scope, observe)
