"""Batched scoring equals scoring one session at a time; the batcher's scheduling rules."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest
import torch

from specdec.core.sampling import SamplingParams
from specdec.errors import Cancelled, DeadlineExceeded, InvalidArgument
from specdec.runtime.batching import BatchConfig, Batcher
from specdec.runtime.kv import PREFILL_ALONE_ABOVE, ScoreRequest, SessionCaches
from specdec.runtime.latency import LatencyProfile
from specdec.runtime.proposers import ModelProposer
from specdec.runtime.verifier import Verifier
from tests.reference import full_logits, verify_alone

V = 100  # the tiny char tokenizer's vocabulary


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, V) for _ in range(n)]


def test_batched_scoring_equals_single_scoring_over_rounds(model):
    """Sessions with different pasts and block lengths, fresh and cached, diverging and released."""
    rng = random.Random(0)
    batched, single = SessionCaches(model, 512), SessionCaches(model, 512)
    histories = {f"s{i}": tokens(rng, rng.randrange(1, 30)) for i in range(6)}
    for i, extra in enumerate((20, 5, 33)):  # long re-prefills: a pass of their own first, then the batch
        histories[f"long{i}"] = tokens(rng, PREFILL_ALONE_ABOVE + extra)
    for _ in range(5):
        requests = [ScoreRequest(sid, list(h), tokens(rng, rng.randrange(0, 6))) for sid, h in histories.items()]
        results = batched.score_batch(requests)
        for request, result in zip(requests, results):
            alone, prefilled = single.score(request.session_id, request.history, request.new_tokens)
            assert result.logits.shape == (len(request.new_tokens) + 1, V)
            torch.testing.assert_close(result.logits, alone, rtol=0, atol=1e-9)
            assert torch.equal(result.logits.argmax(-1), alone.argmax(-1))
            assert result.prefilled == prefilled
            reference = full_logits(model, request.history + request.new_tokens)[len(request.history) - 1:]
            torch.testing.assert_close(result.logits, reference, rtol=0, atol=1e-9)
        for request in requests:  # accept a prefix, emit a token; sometimes diverge or lose the cache
            accepted = rng.randrange(0, len(request.new_tokens) + 1)
            batched.rollback(request.session_id, len(request.history) + accepted)
            single.rollback(request.session_id, len(request.history) + accepted)
            history = request.history + request.new_tokens[:accepted] + tokens(rng, 1)
            if rng.random() < 0.2:
                history = history[: rng.randrange(1, len(history) + 1)] + tokens(rng, 2)
            if rng.random() < 0.1:
                batched.release(request.session_id)
                single.release(request.session_id)
            histories[request.session_id] = history
    assert batched.cached_tokens == sum(len(e.tokens) for e in batched.table.entries.values())
    for sid in histories:
        batched.release(sid)
    assert len(batched) == 0 and batched.cached_tokens == 0


def test_a_bad_row_fails_alone(model):
    caches = SessionCaches(model, 512)
    results = caches.score_batch([ScoreRequest("good", [10, 11, 12], [13]), ScoreRequest("bad", [10, 10**6], []),
                                  ScoreRequest("empty", [], [])])
    assert results[0].logits.shape == (2, V)
    assert isinstance(results[1], InvalidArgument) and "outside the vocabulary" in str(results[1])
    assert isinstance(results[2], InvalidArgument)
    assert len(caches) == 1 and caches.cached_tokens == 4
    with pytest.raises(ValueError, match="at most once"):
        caches.score_batch([ScoreRequest("a", [1], []), ScoreRequest("a", [1], [])])


def block(rng: random.Random, history: list[int], reference_model, k: int) -> list[int]:
    """Draft tokens that are right about half the time (so some are accepted and some rejected)."""
    out, context = [], list(history)
    for _ in range(k):
        best = int(full_logits(reference_model, context)[-1].argmax())
        token = best if rng.random() < 0.6 else rng.randrange(3, V)
        out.append(token)
        context.append(token)
    return out


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9)],
                         ids=["greedy", "sampling"])
async def test_concurrent_verification_equals_one_at_a_time(model, params):
    rng = random.Random(1)
    sessions = {f"s{i}": tokens(rng, rng.randrange(2, 20)) for i in range(8)}
    rounds = {sid: [block(rng, h, model, rng.randrange(0, 5)) for _ in range(4)] for sid, h in sessions.items()}

    # One at a time, through the plain (unbatched) verifier.
    alone = Verifier(SessionCaches(model, 512), V)
    expected = {}
    for sid, history in sessions.items():
        history, verdicts = list(history), []
        for drafts in rounds[sid]:
            verdict = verify_alone(alone, sid, history, drafts, None, params, seed=7)
            verdicts.append(verdict)
            history = history + drafts[: verdict.num_accepted] + [verdict.token]
        expected[sid] = (history, verdicts)

    # All sessions at once, through the batcher.
    verifier = Verifier(SessionCaches(model, 512), V)
    batcher = Batcher(verifier.caches, BatchConfig(max_batch=16, window_s=0.02))
    sizes = []

    async def run(sid: str):
        history, verdicts = list(sessions[sid]), []
        for drafts in rounds[sid]:
            verified, step = await batcher.run(verifier.job(sid, history, drafts, None, params, seed=7))
            verdict = verified.verdict
            sizes.append(step.batch_size)
            verdicts.append(verdict)
            history = history + drafts[: verdict.num_accepted] + [verdict.token]
        return sid, (history, verdicts)

    got = dict(await asyncio.gather(*(run(sid) for sid in sessions)))
    await batcher.close()
    assert got == expected
    assert max(sizes) > 1 and batcher.batches < len(sizes), "no two sessions ever shared a forward pass"


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20)],
                         ids=["greedy", "sampling"])
async def test_batched_drafting_streams_the_same_tokens(model, params):
    rng = random.Random(2)
    sessions = {f"d{i}": (tokens(rng, rng.randrange(1, 25)), rng.randrange(1, 7)) for i in range(6)}
    alone = ModelProposer(SessionCaches(model, 512))
    expected = {sid: [(d.token_id, None if d.probs is None else d.probs.tolist())
                      for d in alone.propose(sid, history, k, params, seed=3)]
                for sid, (history, k) in sessions.items()}

    proposer = ModelProposer(SessionCaches(model, 512))
    batcher = Batcher(proposer.caches, BatchConfig(max_batch=4, window_s=0.02))
    sizes = []

    async def run(sid: str):
        history, k = sessions[sid]
        out = []
        async for draft, step in batcher.stream(proposer.job(sid, history, k, params, seed=3)):
            sizes.append(step.batch_size)
            out.append((draft.token_id, None if draft.probs is None else draft.probs.tolist()))
        return sid, out

    got = dict(await asyncio.gather(*(run(sid) for sid in sessions)))
    await batcher.close()
    assert got == expected
    assert max(sizes) == 4  # the batch is full, and jobs joined as others finished (6 jobs, 4 slots)


class SlowCaches(SessionCaches):
    """Counts scored rows; each pass takes `delay_s`."""

    def __init__(self, model, delay_s: float) -> None:
        super().__init__(model, 512)
        self.delay_s = delay_s
        self.scored: list[str] = []

    def score_batch(self, requests):
        time.sleep(self.delay_s)
        self.scored.extend(r.session_id for r in requests)
        return super().score_batch(requests)


async def test_expired_and_cancelled_jobs_are_dropped_before_compute(model):
    caches = SlowCaches(model, 0.3)
    verifier = Verifier(caches, V)
    dropped = []

    class Observer:
        def on_step(self, *_): ...
        def on_start(self, *_): ...
        def on_dropped(self, reason): dropped.append(reason)

    batcher = Batcher(caches, BatchConfig(max_batch=1, window_s=0), observer=Observer())
    greedy = SamplingParams()
    first = asyncio.ensure_future(batcher.run(verifier.job("a", [5, 6], [], None, greedy, 0)))
    await asyncio.sleep(0.05)  # "a" is computing; the next two queue behind it
    late = asyncio.ensure_future(batcher.run(verifier.job("b", [5, 6], [], None, greedy, 0,
                                                         deadline=time.monotonic() + 0.1)))
    gone = asyncio.ensure_future(batcher.run(verifier.job("c", [5, 6], [], None, greedy, 0)))
    await asyncio.sleep(0.05)
    gone.cancel()
    await first
    with pytest.raises(DeadlineExceeded, match="while queued"):
        await late
    with pytest.raises(asyncio.CancelledError):
        await gone
    await asyncio.sleep(0.05)
    assert caches.scored == ["a"] and sorted(dropped) == ["cancelled", "deadline"]
    assert batcher.waiting == 0 and batcher.running == 0
    await batcher.close()


async def test_a_session_is_never_twice_in_one_batch_and_keeps_its_order(model):
    caches = SlowCaches(model, 0.0)
    proposer = ModelProposer(caches)
    batcher = Batcher(caches, BatchConfig(max_batch=8, window_s=0.05))
    greedy = SamplingParams()
    first = [d async for d, _ in batcher.stream(proposer.job("s", [5, 6, 7], 3, greedy, 0))]
    caches.scored.clear()

    async def drafts(history, k):
        return [d.token_id async for d, _ in batcher.stream(proposer.job("s", history, k, greedy, 0))]

    # Two drafts of the same session submitted together run one after the other, in order.
    a, b = await asyncio.gather(drafts([5, 6, 7], 2), drafts([5, 6, 7, first[0].token_id], 2))
    assert a == [d.token_id for d in first[:2]] and b == [d.token_id for d in first[1:3]]
    assert caches.scored == ["s"] * 4
    await batcher.close()


async def test_cancel_session_stops_a_running_draft(model):
    caches = SlowCaches(model, 0.05)
    proposer = ModelProposer(caches)
    batcher = Batcher(caches, BatchConfig(max_batch=4, window_s=0))
    stream = batcher.stream(proposer.job("s", [5, 6, 7], 50, SamplingParams(), 0))
    await stream.__anext__()
    assert batcher.cancel_session("s") == 1
    with pytest.raises(Cancelled):
        async for _ in stream:
            pass
    assert len(caches.scored) < 5
    await batcher.close()


async def test_a_verify_whose_session_is_released_during_its_pass_ends_cancelled(model):
    """Released while its pass runs, the verify's result is dropped and it ends with Cancelled
    (the orchestrator's cue to send it again), not as a job that finished without a result."""
    caches = SlowCaches(model, 0.2)
    batcher = Batcher(caches, BatchConfig(max_batch=4, window_s=0))
    verifier = Verifier(caches, V)

    async def consume() -> list:
        return [item async for item in batcher.stream(verifier.job("s", [5, 6, 7], [8], None, SamplingParams(), 0))]

    running = asyncio.ensure_future(consume())
    while batcher.running == 0:  # noqa: ASYNC110 - admitted: its pass is running (the batcher has no event for it)
        await asyncio.sleep(0.01)
    assert batcher.cancel_session("s") == 1
    with pytest.raises(Cancelled):  # not a stream that just ends, with nothing in it
        await running
    await batcher.close()


async def test_a_request_sent_before_its_release_is_dropped_when_it_arrives_after(model):
    """The leak after cancellation: the orchestrator sends Verify, is cancelled, sends Release; the
    Release is handled first. The Verify, sent earlier by the caller's clock, must not re-create
    the cache; a Verify sent after the Release (a resumed session) runs."""
    caches = SessionCaches(model, 512)
    batcher = Batcher(caches, BatchConfig(max_batch=4, window_s=0))
    verifier = Verifier(caches, V)
    sent_before = time.time_ns()
    batcher.cancel_session("s", sent_unix_ns=time.time_ns())
    await asyncio.sleep(0.01)  # the stale request reaches the service after the release
    stale = verifier.job("s", [5, 6, 7], [8], None, SamplingParams(), 0)
    stale.sent_unix_ns = sent_before
    with pytest.raises(Cancelled):
        await batcher.run(stale)
    assert len(caches) == 0
    fresh = verifier.job("s", [5, 6, 7], [8], None, SamplingParams(), 0)
    fresh.sent_unix_ns = time.time_ns()
    await batcher.run(fresh)
    assert len(caches) == 1
    await batcher.close()


def test_emulated_latency_pads_a_batch_once(model):
    caches = SessionCaches(model, 512)
    batcher = Batcher(caches, BatchConfig(max_batch=4, window_s=0), profile=LatencyProfile(0.05, 0.0))
    verifier = Verifier(caches, V)
    jobs = [verifier.job(f"s{i}", [5, 6], [7], None, SamplingParams(), 0) for i in range(4)]
    start = time.perf_counter()
    outcomes = batcher._step(jobs)
    assert 0.05 <= time.perf_counter() - start < 0.15
    assert all(step.batch_size == 4 and step.compute_ns >= 5e7 for *_, step in outcomes)


def test_a_step_reports_the_positions_its_pass_scored(model):
    """What the draft-length controller fits the pass cost on: every row's positions, prefills included."""
    caches = SessionCaches(model, 512)
    batcher = Batcher(caches, BatchConfig(max_batch=4, window_s=0))
    verifier = Verifier(caches, V)
    caches.score("warm", [5, 6, 7, 8], [])  # the cache covers [5, 6, 7, 8]
    jobs = [verifier.job("warm", [5, 6, 7, 8, 9], [7, 8], None, SamplingParams(), 0),  # feeds 9, 7, 8
            verifier.job("new", [5, 6, 7], [9], None, SamplingParams(), 0)]  # feeds 5, 6 (prefill), 7, 9
    outcomes = batcher._step(jobs)
    assert [step.positions for *_, step in outcomes] == [7, 7]  # 3 + 4, packed without padding
    assert [result.prefilled for _, result, *_ in outcomes] == [0, 2]  # the prefills the verdicts report
    long = [verifier.job("long", list(range(5, 45)), [7], None, SamplingParams(), 0),  # 39 prefilled
            verifier.job("warm", [5, 6, 7, 8, 9, 7], [1, 2, 3], None, SamplingParams(), 0)]  # 4
    assert [step.positions for *_, step in batcher._step(long)] == [0, 0]  # a prefill's cost is not a decode's


def test_batch_config_is_validated():
    with pytest.raises(ValueError):
        BatchConfig(max_batch=0)
    with pytest.raises(ValueError):
        BatchConfig(window_s=-1)
    assert np.isclose(BatchConfig().window_s, 0.05)


async def test_closed_loop_clients_share_passes_and_a_lone_client_never_waits(model):
    """Two clients that each send their next request 5 ms after an answer: without waiting for the
    previous batch's sessions they would alternate in single-job passes."""
    caches = SlowCaches(model, 0.1)
    verifier = Verifier(caches, V)
    batcher = Batcher(caches, BatchConfig(max_batch=8, window_s=0.1))  # a wait would be 50 ms: half a pass
    greedy = SamplingParams()

    async def client(sid: str, offset: float, rounds: int) -> list:
        await asyncio.sleep(offset)
        history, steps = [5, 6], []
        for _ in range(rounds):
            verified, step = await batcher.run(verifier.job(sid, history, [], None, greedy, 0))
            verdict = verified.verdict
            steps.append(step)
            history = history + [verdict.token]
            await asyncio.sleep(0.005)  # the orchestrator's turnaround
        return steps

    a, b = await asyncio.gather(client("a", 0.0, 6), client("b", 0.05, 6))  # "b" starts mid-pass of "a"
    assert batcher.batches <= 8, f"{batcher.batches} passes for 12 requests: the clients did not pair up"
    assert sum(s.batch_size == 2 for s in a + b) >= 8
    before = batcher.batches
    alone = await client("c", 0.0, 3)  # "a" and "b" are gone: after one window "c" runs alone, then at once
    assert batcher.batches - before == 3
    waited = [s.queue_ns / 1e6 for s in alone[1:]]
    assert all(ms < 25 for ms in waited), f"a lone client waited {waited} ms (a gathering wait is 50)"
    await batcher.close()


async def test_a_long_prefill_is_fed_in_chunks_between_the_other_sessions_steps(model):
    """Chunked prefill: a 300-token prompt under a 40-token budget runs over 8 passes, each feeding at
    most 40 prompt tokens, while a decoding session goes on getting verdicts; both sessions' verdicts
    equal the plain verifier's."""
    rng, params = random.Random(9), SamplingParams()
    long_history, short_history = tokens(rng, 300), tokens(rng, 10)
    alone = Verifier(SessionCaches(model, 512), V)
    expected_long = verify_alone(alone, "long", long_history, [5, 6], None, params, seed=1)

    verifier = Verifier(SessionCaches(model, 512), V)
    batcher = Batcher(verifier.caches, BatchConfig(max_batch=4, window_s=0.0, prefill_chunk_tokens=40))
    fed: list[int] = []  # prompt tokens each pass fed
    score_batch = verifier.caches.score_batch

    def spy(requests):
        fed.append(sum(len(r.history) - verifier.caches.covered(r.session_id, r.history) for r in requests
                       if len(r.history) - verifier.caches.covered(r.session_id, r.history) > PREFILL_ALONE_ABOVE))
        return score_batch(requests)

    verifier.caches.score_batch = spy
    await batcher.run(verifier.job("short", short_history, [], None, params, seed=1))  # its cache exists
    long_job = asyncio.ensure_future(batcher.run(verifier.job("long", long_history, [5, 6], None, params, seed=1)))
    short_steps = 0
    history = short_history
    while not long_job.done():
        verified, _ = await batcher.run(verifier.job("short", history, [7], None, params, seed=1))
        expected = verify_alone(alone, "short", history, [7], None, params, seed=1)
        assert verified.verdict == expected
        history = history + [7][: verified.verdict.num_accepted] + [verified.verdict.token]
        short_steps += 1
    long_verified, _ = long_job.result()
    await batcher.close()
    assert long_verified.verdict == expected_long
    assert max(fed) <= 40 and sum(fed) >= 300 - 1 - 40  # the prompt went in chunks of the budget
    assert len([n for n in fed if n]) >= 7  # 299 prompt tokens at most 40 a pass
    assert short_steps >= 3  # the decoding session went on stepping while the prompt was fed


async def test_decoding_sessions_get_a_token_every_pass_while_a_prompt_is_fed_in_chunks(model):
    """A closed-loop client that sends its next verify 1 ms after each answer, while a 300-token
    prompt is fed 30 tokens a pass (each pass 0.1 s): the batcher waits those few ms for it between
    the prompt's chunks, so it gets a verdict from every pass, where without waiting the next pass
    would start without it and it would get one from every other pass."""
    rng, params = random.Random(3), SamplingParams()
    caches = SlowCaches(model, 0.1)
    verifier = Verifier(caches, V)
    batcher = Batcher(caches, BatchConfig(max_batch=4, window_s=0.05, prefill_chunk_tokens=30))
    history = tokens(rng, 10)
    for _ in range(6):  # the client's turnaround is measured: ~1 ms
        verified, _ = await batcher.run(verifier.job("short", history, [], None, params, seed=1))
        history = history + [verified.verdict.token]
        await asyncio.sleep(0.001)
    passes_before = batcher.batches
    long_job = asyncio.ensure_future(batcher.run(verifier.job("long", tokens(rng, 300), [], None, params, seed=1)))
    await asyncio.sleep(0)
    verdicts = 0
    while not long_job.done():
        verified, _ = await batcher.run(verifier.job("short", history, [], None, params, seed=1))
        history = history + [verified.verdict.token]
        verdicts += 1
        await asyncio.sleep(0.001)
    await long_job
    await batcher.close()
    passes = batcher.batches - passes_before
    assert passes >= 10  # 299 prompt tokens, at most 30 a pass
    assert verdicts >= passes - 1, f"{verdicts} verdicts in {passes} passes: the client sat out passes"


class FetchingCaches(SessionCaches):
    """Caches whose "slow" session has a cache to fetch first, which takes `fetch_s` (no Redis here)."""

    def __init__(self, model, fetch_s: float) -> None:
        super().__init__(model, 512)
        self.fetch_s = fetch_s
        self.fetched_on: list[int] = []
        self.passes: list[list[str]] = []

    def wants_fetch(self, request):
        return request.session_id == "slow" and request.session_id not in self.table.entries

    def prefetch(self, request):
        self.fetched_on.append(threading.get_ident())
        time.sleep(self.fetch_s)
        return False

    def score_batch(self, requests):
        self.passes.append([r.session_id for r in requests])
        return super().score_batch(requests)


async def test_a_job_joins_a_pass_once_its_cache_was_fetched_and_others_do_not_wait_for_it(model):
    caches = FetchingCaches(model, 0.4)
    verifier = Verifier(caches, V)
    batcher = Batcher(caches, BatchConfig(max_batch=4, window_s=0))
    greedy = SamplingParams()
    slow = asyncio.ensure_future(batcher.run(verifier.job("slow", [5, 6, 7], [8], None, greedy, 0)))
    later = asyncio.ensure_future(batcher.run(verifier.job("slow", [5, 6, 7, 8], [], None, greedy, 0)))
    await asyncio.sleep(0.05)
    await batcher.run(verifier.job("fast", [5, 6], [], None, greedy, 0))  # meanwhile: its own pass
    assert not slow.done() and caches.passes == [["fast"]]
    await slow
    await later  # the session's second job waited for its first
    assert caches.passes == [["fast"], ["slow"], ["slow"]]
    model_thread = batcher.executor.submit(threading.get_ident).result()
    assert len(caches.fetched_on) == 1 and model_thread not in caches.fetched_on  # the first job's fetch serves both
    await batcher.close()


async def test_a_job_whose_cache_left_after_it_was_submitted_fetches_it_before_its_pass(model):
    class Evicting(FetchingCaches):
        def wants_fetch(self, request):
            return request.session_id == "a" and request.session_id not in self.table.entries

        def score_batch(self, requests):
            time.sleep(0.2)  # long enough for the test to evict "a" while "x" computes
            return super().score_batch(requests)

    caches = Evicting(model, 0.0)
    verifier = Verifier(caches, V)
    batcher = Batcher(caches, BatchConfig(max_batch=1, window_s=0))
    greedy = SamplingParams()
    caches.score("a", [5, 6, 7], [])  # cached: its next job fetches nothing when submitted
    caches.fetched_on.clear()
    running = asyncio.ensure_future(batcher.run(verifier.job("x", [5, 6], [], None, greedy, 0)))
    await asyncio.sleep(0.05)
    queued = asyncio.ensure_future(batcher.run(verifier.job("a", [5, 6, 7, 8], [], None, greedy, 0)))
    await asyncio.sleep(0.01)
    assert caches.fetched_on == [] and batcher.waiting == 1
    caches.release("a")  # as an eviction would, while "a" waits
    await running
    await queued
    assert len(caches.fetched_on) == 1  # fetched when it was admitted, before its pass
    await batcher.close()
