"""Real target and draft processes under concurrent calls: batched results equal one-at-a-time
results, admission refuses with a retry hint, queued calls past their deadline or cancelled cost
no compute, and the admin view (GetInfo, /metrics) shows every cache freed after Release."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from specdec.channel import channel
from specdec.launcher import free_port, wait_healthy
from specdec.server.admission import retry_after_ms
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.reference import Reference

PROMPTS = ["The quick brown fox", "Once upon a time", "def main():", "Hello, world!", "1, 2, 3, 4,",
           "In the beginning", "import torch", "Dear Sir or Madam,", "The answer is", "SELECT * FROM",
           "Roses are red,", "abcabcabc"]
ROUNDS = 4


@contextmanager
def service(module: str, log_dir: Path, *args: str) -> Iterator[tuple[str, int]]:
    """A service process on free ports; yields its gRPC address and metrics port."""
    port, metrics_port = free_port(), free_port()
    with open(log_dir / f"{module}-{port}.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), "--metrics-port",
                                 str(metrics_port), "--threads", "1", *args], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"127.0.0.1:{port}", 180, proc)
        yield f"127.0.0.1:{port}", metrics_port
    finally:
        proc.terminate()
        proc.wait(20)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "service"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def target(tiny_models, tmp_path_factory):
    with service("target_service", tmp_path_factory.mktemp("target-logs"), "--model", str(tiny_models["target"]),
                 "--dtype", "float64", "--max-batch", "16", "--batch-window-ms", "20") as running:
        yield running


def drafts_for(reference: Reference, history: list[int], k: int, salt: int) -> list[int]:
    """k draft tokens: the target's greedy choices, each replaced by a fixed wrong one now and then."""
    out, context = [], list(history)
    for i in range(k):
        with torch.inference_mode():
            best = int(reference.loaded.model(torch.tensor([context])).logits[0, -1].argmax())
        token = best if (salt + len(context) + i) % 3 else (best + 7) % 100
        out.append(token)
        context.append(token)
    return out


async def run_session(stub, reference: Reference, sid: str, prompt_ids: list[int], temperature: float, seed: int,
                      batch_sizes: list[int]) -> list[tuple]:
    history, trace = list(prompt_ids), []
    for r in range(ROUNDS):
        drafts = drafts_for(reference, history, (r + seed) % 5, seed)
        reply = await stub.Verify(target_pb2.VerifyRequest(
            session_id=sid, history=history, draft_tokens=drafts, seed=seed,
            sampling=common_pb2.SamplingParams(temperature=temperature)), timeout=120)
        batch_sizes.append(reply.batch_size)
        trace.append((reply.num_accepted, reply.token_id, reply.bonus))
        history = history + drafts[:reply.num_accepted] + [reply.token_id]
    return trace


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
async def test_concurrent_verify_equals_one_at_a_time(target, reference, temperature):
    address, metrics_port = target
    prompts = {p: reference.encode(p) for p in PROMPTS}
    async with channel(address) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        alone_sizes, together_sizes = [], []
        alone = {}
        for i, (prompt, ids) in enumerate(prompts.items()):
            alone[prompt] = await run_session(stub, reference, f"alone-{temperature}-{i}", ids, temperature, i,
                                              alone_sizes)
        together = await asyncio.gather(*(
            run_session(stub, reference, f"together-{temperature}-{i}", ids, temperature, i, together_sizes)
            for i, (prompt, ids) in enumerate(prompts.items())))
        assert dict(zip(prompts, together)) == alone
        assert set(alone_sizes) == {1}
        assert max(together_sizes) > 1, "concurrent calls never shared a forward pass"

        info = await stub.GetInfo(common_pb2.GetInfoRequest())
        assert info.cached_sessions == 2 * len(PROMPTS) and info.cached_tokens > 0 and info.max_batch == 16
        assert info.metrics_port == metrics_port
        metrics = scrape(metrics_port)
        assert metrics[("specdec_kv_cache_sessions", ())] == info.cached_sessions
        assert metrics[("specdec_kv_cache_tokens", ())] == info.cached_tokens
        assert metrics[("specdec_batch_size_count", ())] > 0 and metrics[("specdec_batch_size_sum", ())] > 0
        for name in ("alone", "together"):
            for i in range(len(PROMPTS)):
                reply = await stub.Release(common_pb2.ReleaseRequest(session_id=f"{name}-{temperature}-{i}"))
                assert reply.released
        info = await stub.GetInfo(common_pb2.GetInfoRequest())
        assert (info.cached_sessions, info.cached_tokens, info.running_requests, info.waiting_requests) == (0, 0, 0, 0)
        metrics = scrape(metrics_port)
        assert metrics[("specdec_kv_cache_sessions", ())] == 0 and metrics[("specdec_kv_cache_tokens", ())] == 0


@pytest.fixture(scope="module")
def slow_target(tiny_models, tmp_path_factory):
    """One request computes at a time (400 ms each); 2 admitted, 1 more may queue."""
    with service("target_service", tmp_path_factory.mktemp("slow-target-logs"), "--model", str(tiny_models["target"]),
                 "--dtype", "float64", "--max-batch", "1", "--batch-window-ms", "0", "--emulate-verify-ms", "400",
                 "--max-concurrent", "2", "--max-queued", "1") as running:
        yield running


def request(sid: str) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(session_id=sid, history=[40, 41, 42], draft_tokens=[43])


async def test_admission_refuses_at_once_with_a_retry_hint(slow_target):
    address, metrics_port = slow_target
    before = scrape(metrics_port)
    async with channel(address) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        calls = [asyncio.ensure_future(stub.Verify(request(f"adm-{i}"), timeout=30)) for i in range(5)]
        results = await asyncio.gather(*calls, return_exceptions=True)
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) == 2 and len(results) - len(refused) == 3  # 2 slots + 1 queued
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-concurrent 2" in error.details()
        assert retry_after_ms(error) >= 1
    after = scrape(metrics_port)
    assert after[("specdec_admission_rejections_total", ())] - before[("specdec_admission_rejections_total", ())] == 2
    assert after[("specdec_compute_seconds_count", ())] - before[("specdec_compute_seconds_count", ())] == 3


async def test_queued_calls_past_their_deadline_or_cancelled_cost_no_compute(slow_target):
    address, metrics_port = slow_target
    before = scrape(metrics_port)
    async with channel(address) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        first = asyncio.ensure_future(stub.Verify(request("dl-a"), timeout=30))
        await asyncio.sleep(0.1)  # "dl-a" computes for 400 ms; "dl-b" waits in the batch queue behind it
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await stub.Verify(request("dl-b"), timeout=0.15)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await first
        second = asyncio.ensure_future(stub.Verify(request("cx-a"), timeout=30))
        await asyncio.sleep(0.1)
        doomed = stub.Verify(request("cx-b"), timeout=30)
        await asyncio.sleep(0.1)
        doomed.cancel()
        await second
        await asyncio.sleep(0.2)
        info = await stub.GetInfo(common_pb2.GetInfoRequest())
    after = scrape(metrics_port)

    def delta(name, *labels):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("specdec_compute_seconds_count") == 2  # only "dl-a" and "cx-a" reached the model
    assert delta("specdec_requests_dropped_total", ("reason", "deadline")) == 1
    assert delta("specdec_requests_dropped_total", ("reason", "cancelled")) == 1
    assert (info.running_requests, info.waiting_requests) == (0, 0)


@pytest.fixture(scope="module")
def model_draft(tiny_models, tmp_path_factory):
    with service("draft_service", tmp_path_factory.mktemp("draft-logs"), "--proposer", "model",
                 "--model", str(tiny_models["good_draft"]), "--dtype", "float64", "--max-batch", "8",
                 "--batch-window-ms", "20") as running:
        yield running


async def propose(stub, sid: str, history: list[int], k: int, temperature: float, seed: int, sizes: list[int]):
    out = []
    async for msg in stub.Propose(draft_pb2.ProposeRequest(
            session_id=sid, history=history, num_tokens=k, seed=seed,
            sampling=common_pb2.SamplingParams(temperature=temperature)), timeout=120):
        sizes.append(msg.batch_size)
        out.append((msg.index, msg.token_id, msg.probs))
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampling"])
async def test_concurrent_drafts_equal_one_at_a_time(model_draft, reference, temperature):
    address, metrics_port = model_draft
    jobs = {p: (reference.encode(p), 1 + i % 6) for i, p in enumerate(PROMPTS)}
    async with channel(address) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        alone_sizes, together_sizes = [], []
        alone = {p: await propose(stub, f"a-{temperature}-{i}", ids, k, temperature, i, alone_sizes)
                 for i, (p, (ids, k)) in enumerate(jobs.items())}
        together = await asyncio.gather(*(propose(stub, f"t-{temperature}-{i}", ids, k, temperature, i, together_sizes)
                                          for i, (p, (ids, k)) in enumerate(jobs.items())))
        assert dict(zip(jobs, together)) == alone
        assert all(len(alone[p]) == k for p, (_, k) in jobs.items())
        assert set(alone_sizes) == {1} and max(together_sizes) > 1
        for name in ("a", "t"):
            for i in range(len(PROMPTS)):
                await stub.Release(common_pb2.ReleaseRequest(session_id=f"{name}-{temperature}-{i}"))
        info = await stub.GetInfo(common_pb2.GetInfoRequest())
        assert (info.cached_sessions, info.cached_tokens) == (0, 0)
    metrics = scrape(metrics_port)
    assert metrics[("specdec_kv_cache_sessions", ())] == 0 and metrics[("specdec_batch_size_count", ())] > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampling"])
async def test_a_propose_stream_answers_each_request_as_a_propose_call_would(model_draft, reference, temperature):
    """Rounds of two sessions on one long-lived ProposeStream call: each block (tokens, q rows,
    source) is the one a Propose call gives the same request; a request the service refuses ends
    the call with the refusal's status, and a new call goes on."""
    address, _ = model_draft
    prompts = [reference.encode(p) for p in PROMPTS[:2]]

    def request(sid: str, history: list[int], k: int, seed: int) -> draft_pb2.ProposeRequest:
        return draft_pb2.ProposeRequest(session_id=sid, history=history, num_tokens=k, seed=seed,
                                        sampling=common_pb2.SamplingParams(temperature=temperature), timeout_ms=60_000)

    async with channel(address) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        call = stub.ProposeStream()
        histories = [list(ids) for ids in prompts]
        for step in range(3):
            for i, history in enumerate(histories):
                k = 1 + (step + i) % 4
                await call.write(request(f"stream-{temperature}-{i}", history, k, i))
                block = await call.read()
                alone = [m async for m in stub.Propose(request(f"call-{temperature}-{i}", history, k, i), timeout=60)]
                assert [(m.index, m.token_id, m.probs, m.source) for m in block.proposals] == \
                       [(m.index, m.token_id, m.probs, m.source) for m in alone]
                assert len(block.proposals) == k and bool(block.proposals[0].probs) == (temperature > 0)
                history.extend(m.token_id for m in block.proposals[:1])  # the first draft accepted, say
        await call.write(request("stream-bad", [], 2, 0))  # no history: refused
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        error = refused.value
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "history is empty" in error.details()
        again = stub.ProposeStream()
        await again.write(request(f"stream-{temperature}-0", histories[0], 2, 0))
        assert len((await again.read()).proposals) == 2
        await again.done_writing()
        for name in ("stream", "call"):
            for i in range(2):
                await stub.Release(common_pb2.ReleaseRequest(session_id=f"{name}-{temperature}-{i}"))
