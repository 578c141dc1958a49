"""One Generate is one trace across processes, and every JSON log line carries the ids.

A real pipeline (tiny models) whose services write their finished spans to JSON-lines files
(`--otel-file`, the test's stand-in for an exporter) and log as JSON (`specdec up --log-format
json`). A generation sent with a request id must give: the orchestrator's Generate span, a
round span per round under it, and under each round the draft's Propose and the target's Verify,
all with one trace id; the orchestrator's access log line names the request, session and trace.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from specdec import Client
from specdec.launcher import free_port
from specdec.server import logs
from tests.conftest import orchestrator_address, start_tiny_pipeline

SERVICES = ("orchestrator", "draft", "target", "http")


@pytest.fixture(scope="module")
def traced(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("tracing")
    files = {name: root / f"{name}-spans.jsonl" for name in SERVICES}
    pipeline = start_tiny_pipeline(
        root / "logs", tiny_models, "good_draft", log_format="json", http_port=free_port(),
        extra_orchestrator_args=["--otel-file", str(files["orchestrator"])],
        extra_draft_args=["--otel-file", str(files["draft"])],
        extra_target_args=["--otel-file", str(files["target"])],
        extra_http_args=["--otel-file", str(files["http"])],
    )
    yield pipeline, files, root / "logs"
    pipeline.stop()


def spans(path: Path) -> list[dict]:
    """The finished spans a service has written so far (a line still being written is left out)."""
    if not path.exists():
        return []
    complete = path.read_text().split("\n")[:-1]  # what follows the last newline is not finished
    return [json.loads(line) for line in complete if line.strip()]


def wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_one_generate_is_one_trace_across_orchestrator_draft_and_target(traced):
    pipeline, files, _ = traced
    token = logs.request_id.set("req-trace-test-1")
    try:
        with Client(orchestrator_address(pipeline), timeout=120) as client:
            out = client.generate("Once upon a time", max_new_tokens=12, draft_length=4)
    finally:
        logs.request_id.reset(token)

    def generate_span():
        return next((s for s in spans(files["orchestrator"]) if s["name"] == "specdec.v1.Orchestrator/Generate"
                     and s["attributes"].get("specdec.session_id") == out.session_id), None)

    root = wait_for(generate_span)
    assert root is not None, "no Generate span for the session"
    trace_id = root["context"]["trace_id"]
    assert root["kind"] == "SpanKind.SERVER"
    assert root["attributes"]["specdec.request_id"] == "req-trace-test-1"
    rounds = [s for s in spans(files["orchestrator"]) if s["name"] == "orchestrator.round"
              and s["context"]["trace_id"] == trace_id]
    assert len(rounds) == out.stats["rounds"] >= 1
    assert {s["parent_id"] for s in rounds} == {root["context"]["span_id"]}
    round_ids = {s["context"]["span_id"] for s in rounds}

    def children(service: str, name: str) -> list[dict]:
        return [s for s in spans(files[service]) if s["name"] == name and s["context"]["trace_id"] == trace_id]

    verifies = wait_for(lambda: len(children("target", "specdec.v1.TargetService/Verify")) >= len(rounds) and
                        children("target", "specdec.v1.TargetService/Verify"))
    proposes = wait_for(lambda: children("draft", "specdec.v1.DraftService/Propose"))
    assert len(verifies) == len(rounds)
    assert proposes, "no draft Propose span in the trace"
    for span in verifies + proposes:
        assert span["parent_id"] in round_ids  # each call hangs under the round that made it
        assert span["attributes"]["specdec.session_id"] == out.session_id
        assert span["attributes"]["specdec.request_id"] == "req-trace-test-1"
        assert span["resource"]["attributes"]["service.name"] in ("draft_service", "target_service")


def test_json_log_lines_carry_request_session_and_trace_ids(traced):
    pipeline, files, log_dir = traced
    with Client(orchestrator_address(pipeline), timeout=120) as client:
        out = client.generate("It was a dark and stormy night", max_new_tokens=6)

    def access_line():
        for line in (log_dir / "orchestrator.log").read_text(errors="replace").splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record["logger"] == "specdec.access" and record["session_id"] == out.session_id:
                    return record
        return None

    record = wait_for(access_line)
    assert record is not None, "no access log line for the generation"
    assert record["message"].startswith("specdec.v1.Orchestrator/Generate OK")
    assert record["service"] == "orchestrator" and record["level"] == "INFO"
    assert len(record["request_id"]) >= 8 and len(record["trace_id"]) == 32
    root = next(s for s in spans(files["orchestrator"]) if s["name"] == "specdec.v1.Orchestrator/Generate"
                and s["attributes"].get("specdec.session_id") == out.session_id)
    assert root["context"]["trace_id"] == "0x" + record["trace_id"]
    for service in ("orchestrator", "draft", "target", "http"):
        lines = [line for line in (log_dir / f"{service}.log").read_text(errors="replace").splitlines()
                 if line.startswith("{")]
        assert lines, f"{service} wrote no JSON log line"
        for line in lines:
            record = json.loads(line)
            fields = {"time", "level", "logger", "message", "service", "request_id", "session_id", "trace_id"}
            assert fields <= set(record)


def test_the_http_gateway_continues_the_callers_trace(traced):
    pipeline, files, _ = traced
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    models = json.loads(urllib.request.urlopen(f"{pipeline.plan.http_url()}/models", timeout=30).read())
    body = json.dumps({"model": models["data"][0]["id"], "prompt": "Hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"{pipeline.plan.http_url()}/completions", data=body, method="POST",
        headers={"content-type": "application/json", "x-request-id": "req-http-1",
                 "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.headers["x-request-id"] == "req-http-1"
        session = json.loads(reply.read())["specdec"]["session_id"]
    root = wait_for(lambda: next((s for s in spans(files["orchestrator"])
                                  if s["name"] == "specdec.v1.Orchestrator/Generate"
                                  and s["attributes"].get("specdec.session_id") == session), None))
    assert root is not None and root["context"]["trace_id"] == "0x" + trace_id
    assert root["attributes"]["specdec.request_id"] == "req-http-1"

    def gateway_spans():  # the request's own span ends last, after the response's inner spans
        http = [s for s in spans(files["http"]) if s["context"]["trace_id"] == "0x" + trace_id]
        return http if any(s["name"] == "POST /v1/completions" for s in http) else None

    http = wait_for(gateway_spans)
    assert http, "no gateway span for the request"
    gateway = [s for s in http if s["name"] == "POST /v1/completions"]
    assert gateway[0]["parent_id"] == "0x00f067aa0ba902b7"  # under the caller's span
    assert root["parent_id"] in {s["context"]["span_id"] for s in http}  # the orchestrator under the gateway
