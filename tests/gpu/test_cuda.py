"""The services on a CUDA GPU: the same tokens as on the CPU, caches and snapshots across devices.

These run only where torch sees a GPU (`scripts/gpu-check.sh` runs them on a GPU machine); on a
machine without one, pytest reports them as skipped, never as passed.
"""

from __future__ import annotations

import pytest
import torch

from specdec import Client
from specdec.core.sampling import SamplingParams
from specdec.runtime.kv import ScoreRequest, SessionCaches
from specdec.runtime.models import load_model
from specdec.runtime.snapshot_codec import SnapshotIdentity, decode, encode
from specdec.runtime.verifier import accept_block
from tests.conftest import orchestrator_address, start_tiny_pipeline
from tests.reference import Reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())")

HISTORIES = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


@pytest.fixture(scope="module")
def pair(tiny_models):
    """The tiny float64 target on the CPU and on the GPU."""
    path = str(tiny_models["target"])
    return load_model(path, dtype="float64", progress=False, device="cpu"), \
        load_model(path, dtype="float64", progress=False, device="cuda")


def test_model_lands_on_the_gpu(pair):
    _, gpu = pair
    assert gpu.device.type == "cuda"
    assert {p.device.type for p in gpu.model.parameters()} == {"cuda"}
    assert gpu.describe_device().startswith("cuda:")


def test_batched_scores_on_the_gpu_equal_the_cpu(pair):
    cpu, gpu = pair
    caches = {name: SessionCaches(m.model, m.max_context) for name, m in (("cpu", cpu), ("gpu", gpu))}
    requests = [ScoreRequest(f"s{i}", h, [1, 2, 3]) for i, h in enumerate(HISTORIES)]
    with torch.inference_mode():
        results = {name: c.score_batch(requests) for name, c in caches.items()}
    for on_cpu, on_gpu in zip(results["cpu"], results["gpu"]):
        assert on_gpu.logits.device.type == "cuda"
        torch.testing.assert_close(on_gpu.logits.cpu(), on_cpu.logits, rtol=1e-9, atol=1e-9)
        assert on_gpu.prefilled == on_cpu.prefilled


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_acceptance_on_gpu_logits_draws_what_the_cpu_draws(pair, temperature):
    cpu, gpu = pair
    params = SamplingParams(temperature=temperature)
    history, drafts = HISTORIES[0], [1, 2, 3]
    verdicts = []
    for loaded in (cpu, gpu):
        caches = SessionCaches(loaded.model, loaded.max_context)
        with torch.inference_mode():
            logits, _ = caches.score("s", history, drafts)
        verdicts.append(accept_block(logits, len(history), drafts, None, params, seed=7))
    assert verdicts[0] == verdicts[1]


def test_a_gpu_snapshot_restores_on_a_cpu_replica(pair):
    cpu, gpu = pair
    identity = SnapshotIdentity("tiny", "float64", gpu.fingerprint, gpu.model.config.num_hidden_layers)
    caches = SessionCaches(gpu.model, gpu.max_context)
    with torch.inference_mode():
        caches.score("s", HISTORIES[2], [])
    blob = encode(caches.table.entries["s"].cache, caches.table.entries["s"].tokens, identity)
    tokens, cache = decode(blob, identity, cpu.model.config, "cpu")
    assert tokens == HISTORIES[2][:-1] or tokens == HISTORIES[2]
    assert cache.layers[0].keys.device.type == "cpu"


@pytest.fixture(scope="module")
def gpu_pipeline(tiny_models, tmp_path_factory):
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-gpu"), tiny_models, "good_draft",
                                   target_device="cuda", draft_device="cuda")
    yield pipeline
    pipeline.stop()


def test_pipeline_on_the_gpu_is_lossless(gpu_pipeline, tiny_models):
    reference = Reference(str(tiny_models["target"]))
    with Client(orchestrator_address(gpu_pipeline)) as client:
        devices = [b["device"] for b in client.status()["backends"]]
        for prompt in ["The quick brown fox", "def main():\n", "Once upon a time"]:
            for k in (0, 4):
                out = client.generate(prompt, max_new_tokens=24, draft_length=k)
                assert out.token_ids == reference.greedy(prompt, 24), (prompt, k)
    assert len(devices) == 2 and all(d.startswith("cuda:") for d in devices), devices
