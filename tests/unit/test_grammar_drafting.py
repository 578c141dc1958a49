"""The draft side of structured output: a model draft's q is masked by the grammar at every position,
prompt lookup is cut at the first token the grammar refuses, and forced tokens are proposed without
the model (one-hot q). A real tiny model and its character-level tokenizer."""

from __future__ import annotations

import json
import time

import pytest
import torch

from specdec.core.sampling import SamplingParams
from specdec.runtime.batching import BatchConfig, Batcher
from specdec.runtime.drafting import Drafter
from specdec.runtime.grammars import SessionGrammars
from specdec.runtime.kv import SessionCaches
from specdec.runtime.models import load_model
from specdec.runtime.proposers import ModelProposer, NgramProposer

DIGITS = ("regex", "[0-9]{1,12}")
KEYED = ("json_schema", json.dumps({"type": "object", "properties": {"temperature": {"type": "integer"}},
                                    "required": ["temperature"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return load_model(str(tiny_models["poor_draft"]), dtype="float64", progress=False)


@pytest.fixture(scope="module")
def grammars(loaded) -> SessionGrammars:
    return SessionGrammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)


def params(grammar: tuple[str, str], output_start: int, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, grammar_kind=grammar[0], grammar_text=grammar[1],
                          output_start=output_start)


async def drafts(drafter: Drafter, session: str, history: list[int], k: int, p: SamplingParams, seed: int = 0):
    return [d async for d, _ in drafter.stream(session, history, k, p, seed, None, time.monotonic())]


async def test_a_model_draft_samples_only_what_the_grammar_allows(loaded, grammars):
    caches = SessionCaches(loaded.model, 512)
    batcher = Batcher(caches, BatchConfig(max_batch=4, window_s=0.0))
    drafter = Drafter(ModelProposer.batched(batcher), "fp", "tiny", grammars=grammars)
    prompt = list(loaded.tokenizer("Number: ")["input_ids"])
    digits = [loaded.tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]
    free = Batcher(SessionCaches(loaded.model, 512), BatchConfig(4, 0.0))
    unconstrained = await drafts(Drafter(ModelProposer.batched(free), "fp", "tiny"), "free", prompt, 6,
                                 SamplingParams(temperature=1.0))
    assert any(d.token_id not in digits for d in unconstrained)  # the model alone writes more than digits
    for seed in range(5):
        got = await drafts(drafter, f"s{seed}", prompt, 6, params(DIGITS, len(prompt)), seed)
        tokens = [d.token_id for d in got]
        ends = [i for i, t in enumerate(tokens) if t in loaded.eos_token_ids]
        allowed = tokens[:ends[0]] if ends else tokens
        assert len(got) == 6 and allowed and all(t in digits for t in allowed)
        for i, d in enumerate(got[:len(allowed) + 1]):  # q is zero outside the grammar's tokens
            q = torch.tensor(d.probs, dtype=torch.float64)
            legal = digits + (list(loaded.eos_token_ids) if i > 0 else [])  # an end needs a digit first
            assert abs(float(q[legal].sum()) - 1.0) < 1e-6 and float(q[d.token_id]) > 0


async def test_prompt_lookup_is_cut_at_the_first_refused_token(loaded, grammars):
    drafter = Drafter(NgramProposer(max_ngram=2, min_ngram=1), "fp", "tiny", grammars=grammars)
    encode = loaded.tokenizer.convert_tokens_to_ids
    prompt = [encode(c) for c in "12a4 1"]  # the suffix "1" was followed by "2", "a", "4"
    free = await drafts(drafter, "n0", prompt, 3, SamplingParams())
    assert [d.token_id for d in free] == [encode("2"), encode("a"), encode("4")]
    cut = await drafts(drafter, "n1", prompt, 3, params(DIGITS, len(prompt), temperature=0.0))
    assert [d.token_id for d in cut] == [encode("2")]  # "a" is not a digit: the proposal stops there


async def test_tokens_the_grammar_forces_are_proposed_without_the_model(loaded, grammars):
    drafter = Drafter(NgramProposer(), "fp", "tiny", grammars=grammars)
    prompt = list(loaded.tokenizer("Weather: ")["input_ids"])
    got = await drafts(drafter, "f", prompt, 8, params(KEYED, len(prompt), temperature=0.0))
    assert loaded.tokenizer.decode([d.token_id for d in got]) == '{"temper'
    assert all(d.probs is None for d in got)


async def test_a_grammar_without_a_tokenizer_is_refused(loaded):
    drafter = Drafter(NgramProposer(), "fp", "tiny")
    with pytest.raises(Exception, match="no tokenizer to apply grammars"):
        await drafts(drafter, "x", [5, 6], 2, params(DIGITS, 2))
