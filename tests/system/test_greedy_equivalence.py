"""The pipeline's greedy output is token for token the target's own greedy decoding."""

from __future__ import annotations

import pytest

from specdec import Client
from tests.conftest import orchestrator_address, start_tiny_pipeline

PROMPTS = [
    "The quick brown fox", "Once upon a time", "def main():\n", "Hello, world!", "1, 2, 3, 4,",
    "Speculative decoding", "In the beginning", "import torch\n", "Dear Sir or Madam,", "The answer is",
    "<html><body>", "SELECT * FROM", "Q: What is 2+2?\nA:", "It was a dark and stormy night",
    "To be or not to be", "for i in range(10):", "#include <stdio.h>", "Roses are red,", "abcabcabc",
    "The capital of France is",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def expected(reference) -> dict[str, list[int]]:
    return {p: reference.greedy(p, MAX_NEW) for p in PROMPTS}


@pytest.mark.parametrize("k", [0, 1, 2, 4, 8])
def test_model_draft_greedy_equals_target_generate(tiny_pipeline, expected, k):
    with Client(orchestrator_address(tiny_pipeline)) as client:
        for prompt in PROMPTS:
            out = client.generate(prompt, max_new_tokens=MAX_NEW, draft_length=k)
            assert out.token_ids == expected[prompt], f"k={k} prompt={prompt!r}"
            assert out.stats["completion_tokens"] == len(expected[prompt])
            if k == 0:
                assert out.stats["draft_tokens"] == 0
                # the first round's token, then rounds of up to 4 (--decode-steps' default), the last cut short
                assert out.stats["rounds"] == 1 + -(-(len(out.token_ids) - 1) // 4)


def test_streamed_chunks_add_up_to_the_unary_result(tiny_pipeline, expected):
    prompt = PROMPTS[0]
    with Client(orchestrator_address(tiny_pipeline)) as client:
        chunks = list(client.stream(prompt, max_new_tokens=MAX_NEW, draft_length=4))
        unary = client.generate(prompt, max_new_tokens=MAX_NEW, draft_length=4)
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == expected[prompt] == unary.token_ids
    assert "".join(c.text for c in chunks) == unary.text
    assert all(1 <= len(c.token_ids) <= 5 for c in chunks)  # each round yields 1..k+1 tokens
    assert chunks[-1].finish_reason == unary.finish_reason in ("length", "eos") and chunks[-1].stats is not None
    assert all(c.finish_reason is None for c in chunks[:-1])


@pytest.fixture(scope="module")
def ngram_pipeline(tiny_models, tmp_path_factory):
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-ngram"), tiny_models, "target", proposer="ngram")
    yield pipeline
    pipeline.stop()


def test_prompt_lookup_draft_greedy_equals_target_generate(ngram_pipeline, expected):
    proposed = 0
    with Client(orchestrator_address(ngram_pipeline)) as client:
        for prompt in PROMPTS:
            out = client.generate(prompt, max_new_tokens=MAX_NEW, draft_length=3)
            assert out.token_ids == expected[prompt], prompt
            proposed += out.stats["draft_tokens"]
    assert proposed > 0, "prompt lookup never proposed anything: the test would not exercise verification"


def test_stop_string_and_continued_session(tiny_pipeline, reference):
    prompt = PROMPTS[3]
    full = reference.tokenizer.decode(reference.greedy(prompt, MAX_NEW))
    stop = full[5:7]
    with Client(orchestrator_address(tiny_pipeline)) as client:
        out = client.generate(prompt, max_new_tokens=MAX_NEW, stop=[stop])
        assert out.finish_reason == "stop"
        assert out.text == full[: full.index(stop)]
        # Continue the same session: the history comes from Redis, the new input is appended.
        more = client.generate(" and", session_id=out.session_id, max_new_tokens=8)
        assert more.session_id == out.session_id
        history = reference.encode(prompt) + out.token_ids + list(reference.tokenizer(" and")["input_ids"])
        assert more.stats["prompt_tokens"] == len(history)
        assert client.close_session(out.session_id) is True
        assert client.close_session(out.session_id) is False
