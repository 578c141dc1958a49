"""The gateway under clients that misbehave: hang-ups, oversized chunked bodies, bad JSON, typos.

A real pipeline (tiny target + poor draft) behind a real gateway, driven over raw sockets where
the `openai` package would hide what happens on the wire.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from openai import BadRequestError, OpenAI
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from specdec import Client
from specdec.launcher import free_port, wait_http_healthy
from tests.conftest import orchestrator_address


def _connect(http_pipeline) -> socket.socket:
    host, port = http_pipeline.plan.http_url().removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def _head(path: str, extra: str = "") -> bytes:
    return f"POST /v1{path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{extra}".encode()


def _response(sock: socket.socket) -> tuple[int, bytes, dict]:
    """Status, head and JSON body of the response that arrives (a Content-Length one)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        part = sock.recv(65536)
        if not part:
            break
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, json.loads(body)


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_non_streaming_request_is_cancelled_when_its_client_hangs_up(http_pipeline, model):
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0}).encode()
    with Client(orchestrator_address(http_pipeline)) as sdk:
        before = sdk.status()["generated_tokens"]
        with _connect(http_pipeline) as sock:
            sock.sendall(_head("/completions", f"Content-Length: {len(body)}\r\n\r\n") + body)
            assert _wait_for(lambda: sdk.status()["active_generations"] == 1, 30), "the generation never started"
            time.sleep(0.5)  # well into it
        # The client is gone: the generation (400 greedy tokens, no end-of-sequence on this prompt) stops.
        assert _wait_for(lambda: sdk.status()["active_generations"] == 0, 5)
        assert sdk.status()["generated_tokens"] - before < 400


def test_a_chunked_body_over_the_limit_is_413_before_it_is_all_sent(http_pipeline, model):
    limit = 4 * 1024 * 1024  # the gateway's default --max-body-bytes
    chunk = b"x" * 65536
    rss_before = _rss_bytes(http_pipeline.procs["http"].pid)
    with _connect(http_pipeline) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        sock.sendall(_head("/completions", "Transfer-Encoding: chunked\r\n\r\n"))
        opening = b'{"model": "m", "prompt": "'
        sock.sendall(b"%x\r\n%s\r\n" % (len(opening), opening))
        sent = 0
        sock.settimeout(5)
        while sent < 50 * limit and not select.select([sock], [], [], 0)[0]:  # a 200 MB body, were it all sent
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # the gateway stopped reading (or closed): its answer is waiting
                break
            sent += len(chunk)
        status, head, reply = _response(sock)
    assert sent < 50 * limit, "the answer came only once the whole body was sent"
    # What was sent past the limit sat in socket buffers or was discarded, never in the gateway's memory.
    assert _rss_bytes(http_pipeline.procs["http"].pid) - rss_before < 2 * limit
    assert status == 413 and b"retry-after" not in head.lower()
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert "--max-body-bytes" in error["message"] and str(limit) in error["message"]


def test_invalid_json_names_no_param(http_pipeline):
    body = b'{"model": "m", "prompt": "hi", "max_tokens": }'
    with _connect(http_pipeline) as sock:
        sock.sendall(_head("/completions", f"Content-Length: {len(body)}\r\n\r\n") + body)
        status, _, reply = _response(sock)
    assert status == 400
    error = reply["error"]
    assert error["param"] is None and error["code"] == "invalid_json"
    assert "not valid JSON" in error["message"] and "character 45" in error["message"]


def test_a_misspelled_field_is_refused_with_the_nearest_name(api, model):
    with pytest.raises(BadRequestError) as info:
        api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                    extra_body={"max_token": 5})
    error = info.value.body
    assert error["param"] == "max_token" and error["code"] == "unknown_parameter"
    assert "'max_tokens'" in error["message"]


def test_fields_openai_clients_send_are_accepted(api, model):
    reply = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0, user="u-1",
        metadata={"k": "v"}, store=False, stream_options=None, parallel_tool_calls=False,
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    reply = api.completions.create(model=model, prompt="Hi", max_tokens=3, temperature=0, user="u-1")
    assert reply.usage.completion_tokens <= 3


def test_chat_without_max_tokens_runs_to_the_end_or_the_context(api, model):
    """No `max_tokens`: as OpenAI, up to end-of-sequence or a full context (512 tokens for the tiny
    target), within the orchestrator's --max-new-tokens-limit; not a 128-token default."""
    reply = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a long story"}],
                                        temperature=0)
    used = reply.usage
    if reply.choices[0].finish_reason == "length":
        assert used.prompt_tokens + used.completion_tokens == 512
    else:
        assert reply.choices[0].finish_reason == "stop"


def test_the_openapi_document_lists_the_real_statuses(http_pipeline):
    with _connect(http_pipeline) as sock:
        sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: test\r\n\r\n")
        status, _, document = _response(sock)
    assert status == 200
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat and {"200", "400", "404", "413", "429", "503"} <= set(chat)
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    assert chat["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorObject")


def test_responses_conform_to_the_openapi_document(http_pipeline):
    """Generated requests (most of them invalid) get the statuses, content types and bodies the
    document declares, and never a 5xx (the pipeline is up). Schemathesis's pytest plugin is not
    used: hypothesis drives each operation's strategy here, a bounded number of examples each."""
    schema = schemathesis.openapi.from_url(http_pipeline.plan.http_url().removesuffix("/v1") + "/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 5
    statuses: list[int] = []

    # invalid inputs (negative mode) for the routes that take a body; /health has no input to spoil
    runs = [(op, GenerationMode.POSITIVE) for op in operations]
    runs += [(op, GenerationMode.NEGATIVE) for op in operations if op.method.upper() == "POST"]
    for operation, mode in runs:
        @given(case=operation.as_strategy(mode))
        @settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def conforms(case):
            statuses.append(case.call_and_validate(timeout=60, checks=checks).status_code)

        conforms()
    assert len(statuses) >= 5 * 5 and {200, 400, 404} <= set(statuses), sorted(statuses)


def test_a_gateway_with_a_metrics_port_counts_its_requests(http_pipeline, tmp_path):
    port, metrics_port = free_port(), free_port()
    with open(tmp_path / "gateway.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "http_gateway", "--port", str(port), "--metrics-port",
                                 str(metrics_port), "--orchestrator", orchestrator_address(http_pipeline)],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http_healthy(f"http://127.0.0.1:{port}/health", 60, proc)
        api = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        model = api.models.list().data[0].id
        api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        with pytest.raises(BadRequestError):
            api.chat.completions.create(model=model, messages=[], max_tokens=3)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        assert 'specdec_http_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
        assert 'specdec_http_requests_total{route="/v1/chat/completions",status="400"} 1.0' in text
        assert 'specdec_http_requests_total{route="/v1/models",status="200"} 1.0' in text
        assert 'specdec_http_request_duration_seconds_count{route="/v1/chat/completions"} 2.0' in text
    finally:
        proc.terminate()
        proc.wait(20)
