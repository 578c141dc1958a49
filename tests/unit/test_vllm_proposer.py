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
    proposer = _proposer(pool)
    _run(engine, proposer, 6)
    assert len(pool.calls) == 6
    first, later = pool.calls[0], pool.calls[-1]
    assert [e.start for e in first.entries] == [0, 0, 0] and len(first.entries[0].tokens) == 11
    assert all(e.start > 10 and len(e.tokens) <= K + 1 for e in later.entries)
    assert engine.accepted > 0 and proposer.stats.acceptance == 1.0


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


def test_the_policy_chooses_the_length_when_auto():
    refs = _refs()
    engine, pool = Engine(refs, prompt_len=10), Pool(refs)
    proposer = SpecdecProposer(settings=Settings(address="fake"), pool=pool, clock=Clock(), k_max=K)
    _run(engine, proposer, 12)
    asked = {e.num_tokens for call in pool.calls for e in call.entries}
    assert asked and asked <= set(range(1, K + 1))


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
    proposer = _proposer(pool, metrics_port=port)
    _run(engine, proposer, 5)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    assert "specdec_vllm_draft_calls_total 5.0" in text
    assert f"specdec_vllm_accepted_tokens_total {float(proposer.stats.accepted)}" in text
    assert "specdec_vllm_step_acceptance 1.0" in text
    assert 'specdec_vllm_draft_latency_seconds{quantile="0.5"}' in text
