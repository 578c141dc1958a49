"""The gateway's request metrics, on a bare ASGI app (no server, no orchestrator)."""

from __future__ import annotations

import asyncio

import pytest

from http_gateway.metrics import GatewayMetrics, MetricsMiddleware, route_of


@pytest.mark.parametrize("path, route", [
    ("/v1/chat/completions", "/v1/chat/completions"), ("/v1/models", "/v1/models"),
    ("/v1/models/smollm2", "/v1/models/{model}"), ("/health", "/health"), ("/etc/passwd", "other"),
])
def test_paths_are_reported_by_route(path, route):
    assert route_of(path) == route


def _call(app, path: str) -> list[dict]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "path": path, "method": "GET", "headers": []}, receive, send))
    return sent


def _value(metrics: GatewayMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_each_request_is_counted_by_route_and_status_and_timed():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    metrics = GatewayMetrics()
    wrapped = MetricsMiddleware(app, metrics)
    _call(wrapped, "/v1/models/nope")
    _call(wrapped, "/v1/models/nope")
    assert _value(metrics, "specdec_http_requests_total", route="/v1/models/{model}", status="404") == 2
    assert _value(metrics, "specdec_http_request_duration_seconds_count", route="/v1/models/{model}") == 2
    assert _value(metrics, "specdec_http_requests_in_flight") == 0


def test_a_request_that_ends_before_any_response_counts_as_client_closed():
    async def app(scope, receive, send):
        raise asyncio.CancelledError  # the client hung up: the app is cancelled before it answers

    metrics = GatewayMetrics()
    with pytest.raises(asyncio.CancelledError):
        _call(MetricsMiddleware(app, metrics), "/v1/chat/completions")
    assert _value(metrics, "specdec_http_requests_total", route="/v1/chat/completions", status="499") == 1
    assert _value(metrics, "specdec_http_requests_in_flight") == 0
