"""The whole pipeline under concurrent requests: batched target and batched model draft give every
request exactly the tokens it gets alone (greedy and seeded sampling), and closing the sessions
frees every cache on both services (checked through GetInfo and /metrics)."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec import Client
from specdec.launcher import free_port
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.conftest import orchestrator_address, start_tiny_pipeline
from tests.reference import Reference

PROMPTS = [
    "The quick brown fox", "Once upon a time", "def main():\n", "Hello, world!", "1, 2, 3, 4,",
    "Speculative decoding", "In the beginning", "import torch\n", "Dear Sir or Madam,", "The answer is",
    "<html><body>", "SELECT * FROM", "Q: What is 2+2?\nA:", "It was a dark and stormy night",
    "To be or not to be", "for i in range(10):",
]
MAX_NEW = 20


@pytest.fixture(scope="module")
def batched_pipeline(tiny_models, tmp_path_factory):
    ports = {"target": free_port(), "draft": free_port()}
    batching = ["--max-batch", "16", "--batch-window-ms", "10"]
    pipeline = start_tiny_pipeline(
        tmp_path_factory.mktemp("logs-concurrency"), tiny_models, "good_draft",
        extra_target_args=[*batching, "--metrics-port", str(ports["target"])],
        extra_draft_args=[*batching, "--metrics-port", str(ports["draft"])],
        # the tests close every session at once, past the close rate limit on a fast machine
        extra_orchestrator_args=["--max-closes-per-s", "0"],
    )
    yield pipeline, ports
    pipeline.stop()


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if "reason" not in s.labels}


def generate_all(address: str, jobs: list[dict]) -> list:
    def one(job):
        with Client(address) as client:
            return client.generate(**job)

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        return list(pool.map(one, jobs))


def test_concurrent_greedy_requests_equal_the_target_alone(batched_pipeline, tiny_models):
    pipeline, ports = batched_pipeline
    reference = Reference(str(tiny_models["target"]))
    before = {name: scrape(port) for name, port in ports.items()}
    outs = generate_all(orchestrator_address(pipeline),
                        [dict(prompt=p, max_new_tokens=MAX_NEW, draft_length=3) for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference.greedy(prompt, MAX_NEW), prompt
    for name, port in ports.items():  # both services shared forward passes between sessions
        after = scrape(port)
        batches = after["specdec_batch_size_count"] - before[name]["specdec_batch_size_count"]
        jobs = after["specdec_batch_size_sum"] - before[name]["specdec_batch_size_sum"]
        assert batches > 0 and jobs / batches > 1.2, f"{name}: {jobs} jobs in {batches} passes"
    with Client(orchestrator_address(pipeline)) as client:
        for out in outs:
            assert client.close_session(out.session_id)
    assert_no_caches_left(pipeline, ports)


def test_concurrent_seeded_sampling_equals_each_request_alone(batched_pipeline):
    pipeline, ports = batched_pipeline
    address = orchestrator_address(pipeline)
    jobs = [dict(prompt=p, max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=100 + i, draft_length=3)
            for i, p in enumerate(PROMPTS[:8])]
    together = generate_all(address, jobs)
    with Client(address) as client:
        alone = [client.generate(**job) for job in jobs]
        for out in together + alone:
            client.close_session(out.session_id)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert_no_caches_left(pipeline, ports)


def assert_no_caches_left(pipeline, ports) -> None:
    addresses = pipeline.plan.grpc_addresses()
    for name, stub_class in (("target", target_pb2_grpc.TargetServiceStub), ("draft", draft_pb2_grpc.DraftServiceStub)):
        with grpc.insecure_channel(addresses[name]) as ch:
            info = stub_class(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        assert (info.cached_sessions, info.cached_tokens) == (0, 0), name
        metrics = scrape(ports[name])
        assert (metrics["specdec_kv_cache_sessions"], metrics["specdec_kv_cache_tokens"]) == (0, 0), name
