"""Load alone never fails a request: 8 concurrent requests with 3,000-token prompts, against a target
whose per-call time limit (--target-timeout-s 0.2) is far below what their prefills take, all
complete with output equal to the target alone. The orchestrator finds the replica busy, not dead
(it still answers), and sends the calls again with longer limits."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from specdec.client import Client
from specdec.runtime.tiny import make_tiny_model
from tests.conftest import orchestrator_address, start_tiny_pipeline
from tests.reference import Reference

PROMPT_TOKENS, SESSIONS, MAX_NEW = 3000, 8, 12


@pytest.fixture(scope="module")
def long_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models-4k")
    target = make_tiny_model(root / "target", seed=0, max_context=4096)
    return {"target": target, "poor_draft": make_tiny_model(root / "poor_draft", base=target, perturb=1.5, seed=2,
                                                            max_context=4096)}


@pytest.fixture(scope="module")
def pipeline(long_models, tmp_path_factory):
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-load"), long_models, "poor_draft",
                                   extra_orchestrator_args=["--target-timeout-s", "0.2"])
    yield pipeline
    pipeline.stop()


def test_eight_long_prompts_at_once_all_complete_as_the_target_alone(pipeline, long_models):
    rng = random.Random(3)
    letters = "abcdefghijklmnopqrstuvwxyz "
    prompts = ["".join(rng.choice(letters) for _ in range(PROMPT_TOKENS)) for _ in range(SESSIONS)]

    def run(prompt: str):
        with Client(orchestrator_address(pipeline), resume=False) as client:
            return client.generate(prompt, max_new_tokens=MAX_NEW, temperature=0, draft_length=4, timeout=600)

    with ThreadPoolExecutor(SESSIONS) as pool:
        outs = list(pool.map(run, prompts))
    reference = Reference(str(long_models["target"]))
    for prompt, out in zip(prompts, outs):
        assert out.stats["prompt_tokens"] >= PROMPT_TOKENS
        assert out.token_ids == reference.greedy(prompt, MAX_NEW)
    log = Path(pipeline.plan.log_dir, "orchestrator.log").read_text()
    assert "is busy" in log and "failed; session" not in log  # the slow path ran, and no replica was called dead
