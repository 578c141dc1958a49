"""Scoring a prompt for its log-probabilities (`ScoreTokens`: the HTTP API's `echo`, gRPC's
`prompt_logprobs`) costs what a prefill of it costs: it runs in steps under the pass's prefill budget,
each pass computes the logits of a bounded number of positions, and only a few rows at a time are
turned into float64 log-probabilities. What it returns equals a plain forward pass."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.core import logprobs as core_logprobs
from specdec.core.sampling import SamplingParams
from specdec.errors import InvalidArgument
from specdec.runtime import verifier as verifier_module
from specdec.runtime.batching import BatchConfig, Batcher
from specdec.runtime.kv import SessionCaches
from specdec.runtime.verifier import LogprobRequest, Verifier
from tests.reference import full_logits

V = 100  # the tiny char tokenizer's vocabulary
BUDGET = 64


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, V) for _ in range(n)]


class Passes:
    """What each pass of `caches` computed: (tokens fed, logits rows) over all its rows."""

    def __init__(self, caches: SessionCaches) -> None:
        self.fed: list[int] = []
        self.rows: list[int] = []
        score_batch = caches.score_batch

        def spy(requests):
            fed = rows = 0
            for r in requests:
                fed += max(1, len(r.history) - caches.covered(r.session_id, r.history)) + len(r.new_tokens)
                rows += len(r.new_tokens) + 1
            self.fed.append(fed)
            self.rows.append(rows)
            return score_batch(requests)

        caches.score_batch = spy  # type: ignore[method-assign]


def float64_rows(monkeypatch) -> list[int]:
    """Rows of every log-distribution computed (each one a float64 `[rows, V]`)."""
    seen: list[int] = []
    original = core_logprobs.log_distribution

    def spy(logits, params):
        seen.append(logits.shape[0])
        return original(logits, params)

    monkeypatch.setattr(core_logprobs, "log_distribution", spy)
    monkeypatch.setattr(verifier_module, "log_distribution", spy, raising=False)
    return seen


async def scored(batcher: Batcher, job) -> list:
    entries = []
    async for chunk, _ in batcher.stream(job):
        entries.extend(chunk)
    return entries


async def test_a_long_prompt_is_scored_in_steps_under_the_prefill_budget(model, monkeypatch):
    rng = random.Random(1)
    prompt = tokens(rng, 300)
    caches = SessionCaches(model, 512)
    batcher = Batcher(caches, BatchConfig(max_batch=4, window_s=0, prefill_chunk_tokens=BUDGET))
    verifier = Verifier(caches, V, score_positions=batcher.config.score_positions)
    passes = Passes(caches)
    converted = float64_rows(monkeypatch)

    entries = await scored(batcher, verifier.score_job("s", prompt, 1, LogprobRequest(top=3), None))
    await batcher.close()

    assert max(passes.rows) <= BUDGET and max(passes.fed) <= BUDGET, (passes.rows, passes.fed)
    assert sum(passes.fed) == len(prompt) - 1  # every token fed once (the last one is only scored)
    assert converted and max(converted) <= core_logprobs.LOGPROB_ROWS
    reference = torch.log_softmax(full_logits(model, prompt).double(), dim=-1)  # row i: after prompt[:i + 1]
    assert [e.token for e in entries] == prompt[1:]
    for i, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(float(reference[i, prompt[i + 1]]), abs=1e-9)
        assert entry.rank == 1 + int((reference[i] > reference[i, prompt[i + 1]]).sum())
        assert [t for t, _ in entry.top] == reference[i].topk(3).indices.tolist()
    assert caches.table.entries["s"].tokens == prompt[:-1]  # left in the cache, as a prefill would


async def test_scoring_after_a_long_history_prefills_it_in_chunks_then_scores_in_steps(model, monkeypatch):
    """A resume with log-probabilities: the history before `start` is prefilled in chunks, then the
    rest scored in steps; processed mode (penalties) equals processing each position's own context."""
    rng = random.Random(2)
    all_tokens = tokens(rng, 400)
    start = 150
    params = SamplingParams(temperature=0.7, repetition_penalty=1.3, output_start=100)
    caches = SessionCaches(model, 512)
    batcher = Batcher(caches, BatchConfig(max_batch=4, window_s=0, prefill_chunk_tokens=BUDGET))
    verifier = Verifier(caches, V, score_positions=batcher.config.score_positions)
    passes = Passes(caches)

    entries = await scored(batcher, verifier.score_job("s", all_tokens, start, LogprobRequest(2, "processed"),
                                                       params))
    await batcher.close()

    assert max(passes.rows) <= BUDGET and max(passes.fed) <= BUDGET
    alone = Verifier(SessionCaches(model, 512), V)  # no budget: the whole block in one pass
    expected = await scored(Batcher(alone.caches, BatchConfig(max_batch=1, window_s=0, prefill_chunk_tokens=0)),
                            alone.score_job("s", all_tokens, start, LogprobRequest(2, "processed"), params))
    assert [e.token for e in entries] == all_tokens[start:]
    for got, want in zip(entries, expected, strict=True):
        assert got.rank == want.rank and [t for t, _ in got.top] == [t for t, _ in want.top]
        assert got.logprob == pytest.approx(want.logprob, abs=1e-9)


async def test_decode_and_verify_rows_run_whole_while_a_prompt_is_scored(model):
    """A verify of many draft tokens is a step, not a prefill: it joins every pass, whatever the budget
    a scoring step takes."""
    rng = random.Random(3)
    caches = SessionCaches(model, 512)
    batcher = Batcher(caches, BatchConfig(max_batch=4, window_s=0, prefill_chunk_tokens=BUDGET))
    verifier = Verifier(caches, V, score_positions=batcher.config.score_positions)
    caches.score("v", tokens(rng, 20), [])
    jobs = [verifier.score_job("s", tokens(rng, 300), 1, LogprobRequest(), None),
            verifier.job("v", caches.table.entries["v"].tokens + [7], tokens(rng, 40), None, SamplingParams(), 0)]
    outcomes = batcher._step(jobs)
    assert outcomes[1][2] is True  # the verify finished in the pass the scoring step took the budget in
    await batcher.close()


def test_a_verify_of_more_draft_tokens_than_a_step_takes_is_refused(model):
    verifier = Verifier(SessionCaches(model, 512), V)
    with pytest.raises(InvalidArgument, match="draft tokens"):
        verifier.job("s", [5, 6], [7] * 65, None, SamplingParams(), 0)


def test_log_probabilities_go_a_few_rows_at_a_time_and_equal_the_whole(monkeypatch):
    logits = torch.randn(100, 1000, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 1000, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = core_logprobs.token_logprobs(core_logprobs.log_distribution(logits, None), ids, top=5)
    converted = float64_rows(monkeypatch)
    assert core_logprobs.logprobs_of(logits, ids, top=5) == whole
    assert max(converted) <= core_logprobs.LOGPROB_ROWS
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    whole = core_logprobs.token_logprobs(core_logprobs.log_distribution(logits, params), ids, top=5)
    assert core_logprobs.logprobs_of(logits, ids, top=5, params=params) == whole
