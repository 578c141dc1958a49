"""Logging with request, session and trace ids on every line, as text (people) or JSON (machines).

The ids live in context variables: the server interceptor (`specdec.server.tracing.ServerTracing`)
sets the request id (the caller's `x-request-id`, or a new one) and the session id (from the
request, or from the first response that names one) for the call's task, and the trace and span
ids come from the current OpenTelemetry span. `ContextFilter` copies them onto every record, so a
log line written anywhere below a handler carries them without being passed around.

    --log-format text   2026-01-01 12:00:00,000 INFO specdec.orchestrator: ... [request=4f.. session=9a.. trace=c1..]
    --log-format json   {"time": "...", "level": "INFO", "logger": "...", "message": "...", "service": "orchestrator",
                         "request_id": "4f..", "session_id": "9a..", "trace_id": "c1..", "span_id": "7b.."}
"""

from __future__ import annotations

import contextvars
import logging
import uuid

from opentelemetry import trace

from specdec.channel import request_id

session_id: contextvars.ContextVar[str] = contextvars.ContextVar("specdec_session_id", default="")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(ids)s"
ID_FIELDS = ("request_id", "session_id", "trace_id", "span_id")


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def trace_ids() -> tuple[str, str]:
    """(trace id, span id) of the current span as hex, or ("", "") outside a sampled trace."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return "", ""
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


class ContextFilter(logging.Filter):
    """Adds service, request_id, session_id, trace_id, span_id (and `ids`, for text) to each record."""

    def __init__(self, service: str = "") -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        record.request_id = request_id.get()
        record.session_id = session_id.get()
        record.trace_id, record.span_id = trace_ids()
        parts = [f"{name}={value}" for name, value in (("request", record.request_id),
                                                       ("session", record.session_id),
                                                       ("trace", record.trace_id)) if value]
        record.ids = f" [{' '.join(parts)}]" if parts else ""
        return True


def json_formatter():
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "{asctime}{levelname}{name}{message}{service}{request_id}{session_id}{trace_id}{span_id}", style="{",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        reserved_attrs=[*logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys(), "ids", "message",
                        "asctime", "color_message"],
        json_ensure_ascii=False,
    )


def configure(level: str = "INFO", fmt: str = "text", service: str = "") -> None:
    """Root logging: one stderr handler with the context filter and the chosen format."""
    handler = logging.StreamHandler()
    handler.addFilter(ContextFilter(service))
    handler.setFormatter(json_formatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
