"""Load alone never fails a request: 8 concurrent requests with 3,000-token prompts, against a target
whose per-call time limit (--target-timeout-s 0.2) is far below what their prefills take, all
complete with output equal to the target alone. The orchestrator finds the replica busy, not dead
(it still answers), and sends the calls again with longer limits."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specdec.client import Client
from tests.conftest import orchestrator_address
from tests.reference import Reference

PROMPT_TOKENS, SESSIONS, MAX_NEW = 3000, 8, 12


def test_eight_long_prompts_at_once_all_complete_as_the_target_alone(long_pipeline, long_models):
    pipeline = long_pipeline
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
