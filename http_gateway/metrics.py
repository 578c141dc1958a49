"""Prometheus metrics of the HTTP gateway, served on `--metrics-port` like the services' own.

- `specdec_http_requests_total{route, status}` (counter): requests answered, by route template
  and HTTP status; 499 is a client that hung up before a response began.
- `specdec_http_request_duration_seconds{route}` (histogram): from the request to the end of its
  response, a stream included.
- `specdec_http_requests_in_flight` (gauge): requests being answered.

PromQL, e.g. the error ratio: `sum(rate(specdec_http_requests_total{status=~"5.."}[5m])) /
sum(rate(specdec_http_requests_total[5m]))`.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Paths are reported by their route, so that a label never takes an unbounded set of values.
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/openapi.json", "/docs")
CLIENT_CLOSED = 499  # nginx's convention for "the client closed the request"


def route_of(path: str) -> str:
    """The route template a path belongs to (`/v1/models/{model}` for one model), or "other"."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter("specdec_http_requests", "HTTP requests answered, by route and status.",
                                ["route", "status"], registry=self.registry)
        self.duration = Histogram("specdec_http_request_duration_seconds",
                                  "Time from an HTTP request to the end of its response (streams included).",
                                  ["route"], registry=self.registry,
                                  buckets=(0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
        self.in_flight = Gauge("specdec_http_requests_in_flight", "HTTP requests being answered.",
                               registry=self.registry)


class MetricsMiddleware:
    """ASGI middleware that observes every HTTP request into `GatewayMetrics`."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route, status, start = route_of(scope.get("path", "")), CLIENT_CLOSED, time.perf_counter()

        async def send_observed(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_observed)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.duration.labels(route).observe(time.perf_counter() - start)
            self.metrics.requests.labels(route, str(status)).inc()
