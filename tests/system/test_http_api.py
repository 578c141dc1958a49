"""The OpenAI-compatible API, driven by the official `openai` package against a real pipeline.

`specdec up`'s gateway (PipelineSpec.http_port) in front of the tiny target + poor draft: models,
completions and chat, streaming and not, usage with the speculation extension, stop, seed,
sessions, the error objects and statuses, and greedy text equal to the gRPC SDK's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager

import openai
import pytest
from openai import OpenAI

from specdec import Client
from specdec.launcher import free_port, wait_http_healthy
from tests.conftest import orchestrator_address

PROMPT = "It was a dark and stormy night"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def http(method: str, url: str, body: dict | bytes | None = None, timeout: float = 60):
    """(status, headers, parsed JSON body) of one plain HTTP request."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.headers, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read())


@contextmanager
def sse(url: str, body: dict, timeout: float = 120):
    """The raw lines of a streamed response, as they arrive."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        yield reply, (line.decode().rstrip("\r\n") for line in reply)


@pytest.fixture(scope="module")
def sdk(http_pipeline):
    with Client(orchestrator_address(http_pipeline)) as client:
        yield client


def test_models_and_health(api, http_pipeline, tiny_models):
    models = api.models.list().data
    assert [m.id for m in models] == [tiny_models["target"].name]  # the target's model, as it reports it
    assert api.models.retrieve(models[0].id).id == models[0].id
    _, _, health = http("GET", http_pipeline.plan.http_url().removesuffix("/v1") + "/health")
    assert health["status"] == "ok" and {b["role"] for b in health["backends"]} == {"target", "draft"}


def test_completion_greedy_equals_the_sdk(api, sdk, model):
    out = api.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    ref = sdk.generate(PROMPT, max_new_tokens=24, temperature=0)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == {"length": "length", "eos": "stop", "stop": "stop"}[ref.finish_reason]
    assert out.object == "text_completion" and out.model == model and out.id.startswith("cmpl-")
    usage = out.usage
    assert usage.completion_tokens == len(ref.token_ids) and usage.prompt_tokens == ref.stats["prompt_tokens"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.speculation  # the extension rides along as an extra field
    assert spec["rounds"] >= 1 and spec["draft_tokens"] >= spec["accepted_tokens"] >= 0
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] >= 1
    assert out.specdec["session_id"]


def test_streamed_completion_adds_up_with_usage(api, model):
    whole = api.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    events = list(api.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text_events, usage_event = events[:-1], events[-1]
    assert "".join(e.choices[0].text for e in text_events) == whole.choices[0].text
    assert text_events[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(e.choices[0].finish_reason is None for e in text_events[:-1])
    assert usage_event.choices == [] and usage_event.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_event.usage.speculation["rounds"] >= 1


def test_chat_greedy_equals_the_sdk_streamed_and_not(api, sdk, model):
    ref = sdk.chat(CHAT, max_new_tokens=20, temperature=0)
    out = api.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ref.text
    assert out.usage.completion_tokens == len(ref.token_ids)
    events = list(api.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=20, temperature=0,
                                              stream=True))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events) == ref.text
    assert events[-1].choices[0].finish_reason in ("stop", "length") and events[-1].object == "chat.completion.chunk"
    assert all(e.usage is None for e in events)  # no usage event unless asked for


def test_raw_sse_ends_with_done(http_pipeline, model):
    body = {"model": model, "messages": CHAT, "max_tokens": 5, "temperature": 0, "stream": True}
    with sse(http_pipeline.plan.http_url() + "/chat/completions", body) as (reply, lines):
        assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
        data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and all(json.loads(d)["object"] == "chat.completion.chunk" for d in data[:-1])


def test_stop_string(api, sdk, model):
    ref = sdk.generate(PROMPT, max_new_tokens=24, temperature=0).text
    stop = ref[5:7]
    cut = ref[:ref.index(stop)]
    out = api.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "never"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = api.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True)
    assert "".join(e.choices[0].text for e in streamed) == cut


def test_seed_reproduces_a_sampled_completion(api, model):
    def sample(seed):
        return api.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95,
                                      seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1  # and the seed is what it depends on


def test_session_continues_through_the_extension_field(api, model):
    first = api.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0)
    session = first.specdec["session_id"]
    second = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "More"}], max_tokens=5,
                                         temperature=0, extra_body={"session_id": session})
    assert second.specdec["session_id"] == session
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def _error(exc_info) -> dict:
    return exc_info.value.body if isinstance(exc_info.value.body, dict) and "message" in exc_info.value.body \
        else exc_info.value.body["error"]


@pytest.mark.parametrize("kwargs,status,param,code", [
    (dict(n=200), 400, "n", "invalid_value"),
    (dict(max_tokens=0), 400, "max_tokens", "invalid_value"),
    (dict(max_tokens=10**6), 400, "max_tokens", "invalid_value"),
    (dict(temperature=-1), 400, "temperature", "invalid_value"),
    (dict(top_p=1.5), 400, "top_p", "invalid_value"),
    (dict(seed=-1), 400, "seed", "invalid_value"),
    (dict(frequency_penalty=2.5), 400, "frequency_penalty", "invalid_value"),
    (dict(model="gpt-4o"), 404, "model", "model_not_found"),
    (dict(extra_body={"session_id": "no-such-session"}), 404, "session_id", "session_not_found"),
    (dict(stream=True, max_tokens=0), 400, "max_tokens", "invalid_value"),  # before the stream starts
], ids=["n", "max_tokens-0", "max_tokens-huge", "temperature", "top_p", "seed", "penalty", "model", "session",
        "stream-bad-input"])
def test_errors_are_openai_error_objects(api, model, kwargs, status, param, code):
    args = dict(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    args.update(kwargs)
    with pytest.raises(openai.APIStatusError) as info:
        api.completions.create(**args)
    assert info.value.status_code == status
    error = _error(info)
    assert error["param"] == param and error["code"] == code and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_malformed_bodies_and_routes(http_pipeline, model):
    url = http_pipeline.plan.http_url()
    status, _, reply = http("POST", url + "/chat/completions", {"model": model, "messages": []})
    assert status == 400 and reply["error"]["param"] == "messages"
    status, _, reply = http("POST", url + "/chat/completions",
                            {"model": model, "messages": [{"role": "robot", "content": "x"}]})
    assert status == 400 and reply["error"]["param"] == "messages[0].role"
    status, _, reply = http("POST", url + "/chat/completions",
                            {"model": model, "messages": [{"role": "tool", "content": "x"}]})
    assert status == 400 and reply["error"]["param"] == "messages[0].tool_call_id"  # which call it answers
    status, _, reply = http("POST", url + "/completions", b"{not json")
    assert status == 400 and reply["error"]["type"] == "invalid_request_error"
    status, _, reply = http("GET", url + "/engines")
    assert status == 404 and reply["error"]["code"] == "not_found"


def test_busy_session_is_a_conflict_and_hanging_up_cancels(api, http_pipeline, model):
    """A request on a session that is still generating gets 409; closing a stream stops its generation."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    with Client(orchestrator_address(http_pipeline)) as sdk:
        tokens_before = sdk.status()["generated_tokens"]
        with sse(http_pipeline.plan.http_url() + "/completions", body) as (_, lines):
            first = json.loads(next(line for line in lines if line.startswith("data: ")).removeprefix("data: "))
            session = first["specdec"]["session_id"]
            with pytest.raises(openai.ConflictError) as info:
                api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Me too"}],
                                            max_tokens=2, extra_body={"session_id": session})
            assert _error(info)["code"] == "session_busy" and _error(info)["param"] == "session_id"
            assert sdk.status()["active_generations"] == 1
        # The HTTP client hung up: the gateway cancels the gRPC call, the orchestrator the generation
        # (which would otherwise run to 400 greedy tokens: this prompt meets no end-of-sequence token).
        for _ in range(100):
            if sdk.status()["active_generations"] == 0:
                break
            threading.Event().wait(0.1)
        status = sdk.status()
    assert status["active_generations"] == 0
    assert 0 < status["generated_tokens"] - tokens_before < 400


def test_unreachable_orchestrator_is_503(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "http_gateway", "--port", str(port), "--orchestrator", f"127.0.0.1:{free_port()}",
           "--model-name", "m", "--health-timeout-s", "1"]
    with open(tmp_path / "gateway.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):  # up once it answers at all (its health is 503: no orchestrator)
            try:
                status, _, health = http("GET", base + "/health", timeout=10)
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail((tmp_path / "gateway.log").read_text())
                threading.Event().wait(0.1)
        assert status == 503 and health["error"]["code"] == "unavailable"
        api = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            api.completions.create(model="m", prompt="hi", max_tokens=2)
        assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
        assert _error(info)["type"] == "service_unavailable_error"
    finally:
        proc.terminate()
        proc.wait(10)


def test_wait_http_healthy_reports_a_dead_gateway(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="exited with code 3"):
        wait_http_healthy(f"http://127.0.0.1:{free_port()}/health", 30, proc)
