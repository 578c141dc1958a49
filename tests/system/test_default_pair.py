"""The real default pair (SmolLM2-135M-Instruct target, its bf16 copy as draft) through real processes."""

from __future__ import annotations

import pytest

from specdec import Client
from specdec.data import bundled_prompts
from tests.conftest import orchestrator_address, start_pipeline
from tests.reference import Reference

pytestmark = pytest.mark.slow
MAX_NEW = 24


@pytest.fixture(scope="module")
def default_pipeline(tmp_path_factory):
    pipeline = start_pipeline(tmp_path_factory.mktemp("logs-default"), draft_length=4)
    yield pipeline
    pipeline.stop()


def test_default_pair_greedy_equals_target_generate(default_pipeline):
    reference = Reference("default", dtype="float32")
    tok = reference.tokenizer
    accepted = drafted = 0
    with Client(orchestrator_address(default_pipeline)) as client:
        for p in bundled_prompts()[:3]:
            text = tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
            expected = reference.greedy_ids(list(tok(text, add_special_tokens=False)["input_ids"]), MAX_NEW)
            for k in (0, 4):
                out = client.generate(messages=p["messages"], max_new_tokens=MAX_NEW, draft_length=k)
                assert out.token_ids == expected, (p["id"], k)
                accepted += out.stats["accepted_tokens"]
                drafted += out.stats["draft_tokens"]
    assert drafted > 0 and accepted / drafted > 0.8  # the bf16 copy agrees with its fp32 original
