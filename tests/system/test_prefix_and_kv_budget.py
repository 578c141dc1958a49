"""Through the whole pipeline: sessions sharing a system prompt reuse its keys/values on both model
services (GetInfo, /metrics, `specdec status`), and a KV budget that holds about one session serves
concurrent requests by evicting and retrying, never failing one; output always equals the target alone."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specdec.client import Client
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.conftest import free_port, orchestrator_address, start_tiny_pipeline
from tests.reference import Reference

SYSTEM = ("You are a careful assistant. Answer in one short sentence, cite nothing, and keep the tone "
          "friendly. Rules: be brief; be exact; never invent facts. ")  # 148 characters: tokens of the tiny models
QUESTIONS = ["what is a cat", "name a colour", "count to three", "say hello"]


def _info(pipeline, name: str) -> common_pb2.ModelInfo:
    stub = {"target": target_pb2_grpc.TargetServiceStub, "draft": draft_pb2_grpc.DraftServiceStub}[name]
    with grpc.insecure_channel(pipeline.plan.grpc_addresses()[name]) as channel:
        return stub(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=10)


def _scrape(port: int) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


@pytest.fixture(scope="module")
def prefix_pipeline(tiny_models, tmp_path_factory):
    port = free_port()
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-prefix"), tiny_models, "good_draft",
                                   extra_target_args=["--prefix-block-tokens", "16", "--metrics-port", str(port)],
                                   extra_draft_args=["--prefix-block-tokens", "16"])
    pipeline.target_metrics_port = port
    yield pipeline
    pipeline.stop()


def test_sessions_sharing_a_system_prompt_reuse_its_blocks_and_match_the_target_alone(prefix_pipeline, tiny_models):
    pipeline = prefix_pipeline
    reference = Reference(str(tiny_models["target"]), dtype="float64")
    with Client(orchestrator_address(pipeline), resume=False) as client:
        outs = [client.generate(SYSTEM + q, max_new_tokens=12, temperature=0) for q in QUESTIONS]
    for question, out in zip(QUESTIONS, outs):
        assert out.token_ids == reference.greedy(SYSTEM + question, 12)
    for name in ("target", "draft"):
        info = _info(pipeline, name)
        # every session after the first found the system prompt's whole blocks (148 // 16 = 9 blocks)
        blocks = len(SYSTEM) // 16
        assert info.prefix_cache_hits >= (len(QUESTIONS) - 1) * blocks * 16, (name, info)
        assert info.prefix_cache_queries >= info.prefix_cache_hits
        assert info.prefix_cache_blocks >= blocks
        assert 0 < info.kv_cache_bytes_used <= info.kv_cache_bytes_budget
    metrics = _scrape(pipeline.target_metrics_port)
    assert metrics["specdec_prefix_cache_hits_total"] == _info(pipeline, "target").prefix_cache_hits
    assert metrics["specdec_kv_cache_used_bytes"] > 0 and 0 < metrics["specdec_kv_cache_usage_ratio"] <= 1

    status = subprocess.run([sys.executable, "-m", "specdec.cli", "status", "--address", orchestrator_address(pipeline),
                             "--json"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    target = next(b for b in json.loads(status.stdout)["orchestrators"][0]["backends"] if b["role"] == "target")
    assert int(target["prefix_cache_hits"]) > 0 and int(target["kv_cache_bytes_budget"]) > 0
    text = subprocess.run([sys.executable, "-m", "specdec.cli", "status", "--address", orchestrator_address(pipeline)],
                          capture_output=True, text=True, timeout=60).stdout
    assert "prefix hits" in text and "GiB" in text


def test_a_budget_for_about_one_session_serves_concurrent_requests_without_failing_any(tiny_models, tmp_path):
    # the tiny target: 2 layers x 2 KV heads x 16 x 2 x 8 bytes = 1 KiB per position; a session of
    # ~100 positions grows its buffer to 128 positions (128 KiB): the budget holds one such session
    # and a bit, so concurrent sessions must wait for room (RESOURCE_EXHAUSTED, retried) or evict.
    budget = str(200 * 1024)
    pipeline = start_tiny_pipeline(tmp_path, tiny_models, "good_draft",
                                   extra_target_args=["--kv-cache-bytes", budget, "--no-prefix-cache"],
                                   extra_draft_args=["--kv-cache-bytes", budget, "--no-prefix-cache"])
    try:
        prompts = [f"{q}, and then {q} again, slowly and in order, please: " for q in QUESTIONS]

        def run(prompt: str):
            with Client(orchestrator_address(pipeline), resume=False) as client:
                return client.generate(prompt, max_new_tokens=40, temperature=0, timeout=300)

        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(run, prompts))
        reference = Reference(str(tiny_models["target"]), dtype="float64")
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == reference.greedy(prompt, 40)
        info = _info(pipeline, "target")
        assert info.kv_cache_bytes_budget == int(budget)
        assert info.kv_cache_bytes_used <= info.kv_cache_bytes_budget
        assert info.kv_cache_evictions > 0 or "is busy" in (tmp_path / "orchestrator.log").read_text()
    finally:
        pipeline.stop()
