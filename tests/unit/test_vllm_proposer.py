"""The vLLM proposer without vLLM: a simulated persistent batch (rows, condensing, token arrays as vLLM
passes them) and a fake draft pool. Identity across steps, one call per step with only new tokens,
finished outputs sent once, failover bounded and resumed."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from specdec.integrations.vllm import RequestTracker, Settings, SpecdecProposer
from specdec.v1 import draft_pb2

K = 4
WIDTH = 256


class Engine:
    """vLLM's input batch as the proposer sees it: rows of token ids, each request writing its reference
    sequence, accepting the drafts that match it (greedy verification)."""

    def __init__(self, references: list[list[int]], prompt_len: int) -> None:
        self.refs = list(references)
        self.lengths = [prompt_len] * len(references)
        self.token_ids = np.zeros((8, WIDTH), dtype=np.int32)
        self.num_tokens = np.zeros(8, dtype=np.int32)
        self.sampled: list[list[int]] = []
        self.accepted = 0
        self._write()

    def _write(self) -> None:
        for i, (ref, n) in enumerate(zip(self.refs, self.lengths)):
            self.token_ids[i, :n] = ref[:n]
            self.num_tokens[i] = n

    def step(self, drafts: list[list[int]] | None) -> None:
        """Verify the last drafts and sample one token per row."""
        self.sampled = []
        for i, ref in enumerate(self.refs):
            n, ok = self.lengths[i], 0
            for t in (drafts or [[]] * len(self.refs))[i]:
                if n + ok < len(ref) and ref[n + ok] == t:
                    ok += 1
                else:
                    break
            self.accepted += ok
            self.sampled.append(ref[n:n + ok + 1])
            self.lengths[i] = min(n + ok + 1, len(ref))
        self._write()

    def finish(self, row: int) -> None:
        """The request of `row` leaves; the last row moves into its place (vLLM condenses its batch)."""
        last = len(self.refs) - 1
        self.refs[row], self.lengths[row] = self.refs[last], self.lengths[last]
        del self.refs[last], self.lengths[last]
        self.token_ids[last] = 0
        self._write()


class Pool:
    """A draft pool that knows the references (an oracle) and records its calls."""

    def __init__(self, refs: list[list[int]]) -> None:
        self.refs = refs
        self.held: dict[str, list[int]] = {}
        self.calls: list[draft_pb2.ProposeBatchRequest] = []
        self.fail = False

    def call(self, entries, finished):
        self.calls.append(draft_pb2.ProposeBatchRequest(entries=entries, finished=finished))
        if self.fail:
            raise grpc.RpcError("unavailable")
        blocks = []
        for e in entries:
            if e.start and e.session_id not in self.held:
                blocks.append(draft_pb2.DraftBlock(history_missing=True))
                continue
            history = self.held.setdefault(e.session_id, [])
            history[e.start:] = list(e.tokens)
            ref = next(r for r in self.refs if r[:len(history)] == history)
            blocks.append(draft_pb2.DraftBlock(token_ids=ref[len(history):len(history) + e.num_tokens]))
        for f in finished:
            self.held.pop(f.session_id, None)
        return draft_pb2.ProposeBatchResponse(blocks=blocks, outputs_learned=len(finished))

    def start(self, entries, finished):
        """The call drafting ahead: run at once (during the engine's step), its answer kept for later."""
        return Answered(lambda: self.call(entries, finished))


class Late:
    """A call drafting ahead still running when the step ends: `result` times out, recording its wait."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.cancelled = False

    def result(self, timeout=None):
        self.waits.append(timeout)
        raise grpc.FutureTimeoutError()

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class Answered:
    """A finished call as a gRPC future: its reply, or its error, on `result`."""

    def __init__(self, call) -> None:
        self.reply, self.error = None, None
        try:
            self.reply = call()
        except grpc.RpcError as exc:
            self.error = exc

    def result(self, timeout=None):
        if self.error is not None:
            raise self.error
        return self.reply

    def cancel(self) -> bool:
        return False


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def _refs(n: int = 3, length: int = 150) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[7, 7, 7] + rng.integers(10, 1000, length).tolist() for _ in range(n)]


def _proposer(pool: Pool, clock=None, **settings) -> SpecdecProposer:
    return SpecdecProposer(settings=Settings(address="fake", draft_length=settings.pop("draft_length", K), **settings),
                           pool=pool, clock=clock or Clock(), k_max=K)


def _run(engine: Engine, proposer: SpecdecProposer, steps: int) -> list[list[int]]:
    drafts = None
    for _ in range(steps):
        engine.step(drafts)
        drafts = proposer.propose(engine.sampled, engine.num_tokens, engine.token_ids)
    return drafts


def test_each_step_is_one_call_sending_only_new_tokens():
    refs = _refs()
    engine, pool = Engine(refs, prompt_len=10), Pool(refs)
    proposer = _proposer(pool, ahead=False)
    _run(engine, proposer, 6)
    assert len(pool.calls) == 6
    first, later = pool.calls[0], pool.calls[-1]
    assert [e.start for e in first.entries] == [0, 0, 0] and len(first.entries[0].tokens) == 11
    assert all(e.start > 10 and len(e.tokens) <= K + 1 for e in later.entries)
    assert engine.accepted > 0 and proposer.stats.acceptance == 1.0


def test_drafting_ahead_the_next_block_is_ready_when_the_step_ends():
    """With drafting ahead each step's one call goes out as the step's blocks are returned, with the
    blocks as the histories' guess and one token more asked for (the guess of vLLM's next token): when
    vLLM accepts the whole block and samples that token, the next step's blocks are already drafted
    and no call is waited for. Output and acceptance are those of drafting in the step."""
    refs = _refs()
    engine, pool = Engine(refs, prompt_len=10), Pool(refs)
    proposer = _proposer(pool)
    drafts = _run(engine, proposer, 6)
    assert len(pool.calls) == 7  # the first step's blocks (nothing was drafted ahead yet), then one a step
    assert [e.start for e in pool.calls[0].entries] == [0, 0, 0] and pool.calls[0].entries[0].num_tokens == K
    for call in pool.calls[1:]:
        assert all(e.num_tokens == K + 1 and len(e.tokens) in (K, K + 1) for e in call.entries)
    assert engine.accepted > 0 and proposer.stats.acceptance == 1.0 and all(len(d) == K for d in drafts)
    assert max(proposer.stats.draft_wall_s[1:]) <= 0.0011  # the blocks were waiting (one clock tick)


def test_a_late_block_drafted_ahead_costs_its_requests_the_step_not_the_pool():
    """A call drafting ahead still running at the end of vLLM's step (the draft held up behind prompts it
    prefills) is waited for at most half the step, then given up: its requests draft in the step,
    resending their history from before the guess; the pool is not counted failing."""
    refs = _refs()
    clock = Clock()
    engine, pool = Engine(refs, prompt_len=10), Pool(refs)
    proposer = _proposer(pool, clock=clock, timeout_s=2.0)
    drafts = _run(engine, proposer, 2)
    late = Late()
    real_start, pool.start = pool.start, lambda entries, finished: late
    engine.step(drafts)
    clock.now += 0.050  # vLLM's step
    drafts = proposer.propose(engine.sampled, engine.num_tokens, engine.token_ids)  # sends the late call
    bases = {t.session_id: t.sent for t in proposer.tracker.by_row.values()}  # what the pool held before it
    engine.step(drafts)
    clock.now += 0.050
    calls = len(pool.calls)
    drafts = proposer.propose(engine.sampled, engine.num_tokens, engine.token_ids)
    assert late.waits == [pytest.approx(0.025, abs=0.002)] and late.cancelled  # half the step, not 2 s
    assert proposer.stats.late == 1 and proposer.stats.failures == 0 and proposer.failover.failures == 0
    resent = pool.calls[calls].entries  # drafted in the step, from before the guess
    assert {e.session_id: e.start for e in resent} == bases
    assert all(len(d) == K for d in drafts)
    pool.start = real_start


def test_a_failed_guess_drafts_again_from_where_it_failed():
    """vLLM rejects a block's second token and samples another: the pool holds the block as the
    history's guess; this step's call rewrites it from the rejected token on, and the block it
    drafts follows the true history."""
    refs = _refs(n=1)
    engine, pool = Engine(refs, prompt_len=10), Pool(refs)
    proposer = _proposer(pool)
    drafts = _run(engine, proposer, 2)
    base = engine.lengths[0]
    truth = refs[0][:base + 1] + [999] + refs[0][base + 2:]  # where the request goes instead
    engine.refs[0] = truth
    pool.refs.append(truth)
    engine.step(drafts)
    assert engine.lengths[0] == base + 2
    drafts = proposer.propose(engine.sampled, engine.num_tokens, engine.token_ids)
    resent = pool.calls[-2].entries[0]  # this step's own call (the last one drafts ahead)
    assert resent.start == base + 1 and list(resent.tokens) == [999]
    assert drafts[0] == truth[base + 2:base + 2 + K]
    session = proposer.tracker.by_row[0].session_id
    assert pool.held[session][:base + 2] == truth[:base + 2]


def test_a_request_keeps_its_identity_when_vllm_moves_its_row():
    refs = _refs()
    engine, pool = Engine(refs, prompt_len=10), Pool(refs)
    proposer = _proposer(pool)
    _run(engine, proposer, 3)
    ids = [e.session_id for e in pool.calls[-1].entries]
    engine.finish(0)  # request 2 moves into row 0
    _run(engine, proposer, 2)
    last = pool.calls[-1]
    assert [e.session_id for e in last.entries] == [ids[2], ids[1]]
    assert all(e.start > 0 for e in last.entries)  # no history resent: the pool holds them
    done = [f for call in pool.calls for f in call.finished]
    assert [f.session_id for f in done] == [ids[0]] and done[0].output_start == 10


def test_rows_of_the_same_prompt_stay_apart_once_they_differ():
    tracker = RequestTracker(lambda: None)
    tokens = np.zeros((2, 16), dtype=np.int32)
    tokens[:, :5] = [1, 2, 3, 4, 5]
    tokens[1, 4] = 9  # same prefix up to the last sampled token
    rows, gone = tracker.step([[5], [9]], np.array([5, 5]), tokens)
    assert rows[0].session_id != rows[1].session_id and not gone
    tokens[[0, 1]] = tokens[[1, 0]]  # swapped rows
    again, gone = tracker.step([[6], [6]], np.array([5, 5]), tokens)
    assert [t.session_id for t in again] == [rows[1].session_id, rows[0].session_id] and not gone


def test_a_dead_pool_costs_no_error_and_drafting_resumes():
    refs = _refs()
    engine, pool = Engine(refs, prompt_len=10), Pool(refs)
    clock = Clock()
    proposer = _proposer(pool, clock)
    _run(engine, proposer, 2)
    pool.fail = True
    pool.held.clear()  # a new replica will answer: it holds nothing
    calls = len(pool.calls)
    assert _run(engine, proposer, 10) == [[], [], []]
    assert len(pool.calls) - calls < 10  # left alone after the failure, probed later
    pool.fail = False
    clock.now += 5.0
    drafts = _run(engine, proposer, 3)
    assert any(drafts)
    assert any(e.start == 0 for call in pool.calls[-3:] for e in call.entries)  # histories resent whole


@pytest.mark.parametrize("ahead", [False, True])
def test_the_policy_chooses_the_length_when_auto(ahead):
    refs = _refs()
    engine, pool = Engine(refs, prompt_len=10), Pool(refs)
    proposer = SpecdecProposer(settings=Settings(address="fake", ahead=ahead), pool=pool, clock=Clock(), k_max=K)
    _run(engine, proposer, 12)
    asked = {e.num_tokens - ahead for call in pool.calls[1:] for e in call.entries}  # ahead: one more
    assert asked and asked <= set(range(1, K + 1))


class ModelPool(Pool):
    """An oracle pool priced as a draft model on a CPU: its time passes on the proposer's clock, 2 ms
    a history token it feeds its cache (the whole prompt of a session it has not seen; then the
    tokens past what its last block left cached: the bonus token, and the last draft token when the
    whole block was accepted) and 14 ms a drafted token; each block says how many it fed when
    `reports`."""

    def __init__(self, refs: list[list[int]], clock: Clock, reports: bool = True) -> None:
        super().__init__(refs)
        self.clock, self.reports = clock, reports
        self.cached: dict[str, int] = {}  # tokens of the session's history in its cache

    def call(self, entries, finished):
        reply = super().call(entries, finished)
        for e, block in zip(entries, reply.blocks):
            history = self.held.get(e.session_id, [])
            ref = next(r for r in self.refs if r[:len(history)] == history)
            cached = self.cached.get(e.session_id, 0)
            held = min(cached, len(history))
            valid = next((i for i in range(held) if ref[i] != history[i]), held)
            fed = len(history) - valid
            self.cached[e.session_id] = len(history) + max(len(block.token_ids) - 1, 0)
            compute = 0.002 * fed + 0.014 * len(block.token_ids)
            self.clock.now += compute
            block.compute_ns, block.prefill_tokens = int(compute * 1e9), fed if self.reports else 0
        return reply


def test_a_model_drafts_prefill_does_not_read_as_its_cost_per_token():
    """A model draft's first block prefills the whole prompt (here 0.2 s, against a 50 ms engine step):
    counted as the cost of its 2 drafted tokens, drafting would never look worth it. Reported as a
    prefill, it seeds the estimate alone and the steady blocks (14 ms a token, all accepted) set it:
    the policy drafts long blocks from then on."""
    refs = _refs(n=1, length=250)
    clock = Clock()
    engine, pool = Engine(refs, prompt_len=100), ModelPool(refs, clock)
    proposer = SpecdecProposer(settings=Settings(address="fake"), pool=pool, clock=clock, k_max=K)
    drafts = None
    for _ in range(30):
        engine.step(drafts)
        clock.now += 0.050 + 0.002 * sum(len(d) for d in drafts or [])  # vLLM's step: more for each draft
        drafts = proposer.propose(engine.sampled, engine.num_tokens, engine.token_ids)
    asked = [e.num_tokens for call in pool.calls for e in call.entries]
    assert pool.calls[0].entries[0].start == 0 and len(pool.calls[0].entries[0].tokens) == 101
    assert len(asked) >= 10 and sum(asked[-5:]) / 5 >= 3, asked  # still drafting, long blocks
    assert engine.accepted >= 40


class WarmingPool(Pool):
    """Answers `warming` to a session's first `calls` calls (its prompt being prefilled), holding what
    they send."""

    def __init__(self, refs: list[list[int]], calls: int = 3) -> None:
        super().__init__(refs)
        self.warm_calls, self.seen = calls, {}

    def call(self, entries, finished):
        reply = super().call(entries, finished)
        for e, block in zip(entries, reply.blocks):
            self.seen[e.session_id] = self.seen.get(e.session_id, 0) + 1
            if self.seen[e.session_id] <= self.warm_calls and not block.history_missing:
                del block.token_ids[:]
                block.warming = True
        return reply


def test_a_warming_draft_costs_no_step_and_no_estimate():
    """While the pool prefills a request's prompt, the steps go on with no drafts, each sending only
    the new tokens, and the request's draft length stays what it was (a warming block is no block that
    proposed nothing); then blocks come, all accepted."""
    refs = _refs(n=2)
    engine, pool = Engine(refs, prompt_len=10), WarmingPool(refs, calls=3)
    proposer = _proposer(pool, draft_length=None)
    drafts = None
    for _ in range(4):
        engine.step(drafts)
        drafts = proposer.propose(engine.sampled, engine.num_tokens, engine.token_ids)
    assert [len(call.entries) for call in pool.calls[:3]] == [2, 2, 2] and drafts != [[], []]
    assert all(not e.start for e in pool.calls[0].entries) and all(e.start for c in pool.calls[1:] for e in c.entries)
    assert {e.num_tokens for call in pool.calls[:4] for e in call.entries} == {2}  # unchanged while warming
    assert engine.accepted == 0 and proposer.stats.drafted == sum(len(d) for d in drafts) > 0
    for _ in range(10):
        engine.step(drafts)
        drafts = proposer.propose(engine.sampled, engine.num_tokens, engine.token_ids)
    assert engine.accepted > 40


def test_settings_come_from_the_environment():
    s = Settings.from_env({"SPECDEC_DRAFT_ADDRESS": "draft:50052", "SPECDEC_DRAFT_TIMEOUT_MS": "20",
                           "SPECDEC_DRAFT_LENGTH": "3", "SPECDEC_CORPUS_GROUP": "team-a", "SPECDEC_SHARE_OUTPUTS": "0"})
    assert (s.address, s.timeout_s, s.draft_length, s.corpus_group, s.share_outputs) == (
        "draft:50052", 0.02, 3, "team-a", False)
    with pytest.raises(ValueError, match="SPECDEC_DRAFT_ADDRESS"):
        Settings.from_env({})


def test_no_draft_reaches_past_the_context():
    refs = _refs()
    engine, pool = Engine(refs, prompt_len=10), Pool(refs)
    proposer = _proposer(pool)
    proposer.max_model_len = 14
    drafts = _run(engine, proposer, 2)
    assert all(len(d) <= max(14 - n - 1, 0) for d, n in zip(drafts, engine.num_tokens))
    assert any(drafts) or max(engine.num_tokens) >= 13


def test_the_proposer_serves_its_counts_for_prometheus():
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    refs = _refs()
    engine, pool = Engine(refs, prompt_len=10), Pool(refs)
    proposer = _proposer(pool, metrics_port=port, ahead=False)
    _run(engine, proposer, 5)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    assert "specdec_vllm_draft_calls_total 5.0" in text
    assert f"specdec_vllm_accepted_tokens_total {float(proposer.stats.accepted)}" in text
    assert "specdec_vllm_step_acceptance 1.0" in text
    assert 'specdec_vllm_draft_latency_seconds{quantile="0.5"}' in text
