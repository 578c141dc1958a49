"""Replica placement: stickiness, cost-based choice, failover and address parsing (no network)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from orchestrator.backends import Busy, DraftReply, VerifyReply
from orchestrator.replicas import DraftPool, Replica, TargetPool, parse_addresses, resolve
from specdec.core.sampling import SamplingParams
from specdec.errors import FailedPrecondition, Unavailable
from specdec.v1 import common_pb2
from tests.unit.fakes import InMemorySessionStore


class FakeTarget:
    """Stands in for one target replica's client (pure placement logic under test)."""

    def __init__(self, address: str, fail: bool = False) -> None:
        self.address = address
        self.fail = fail
        self.calls: list[str] = []
        self.busy_for = 0  # calls answered Busy before one succeeds
        self.timed_out = True  # Busy by a passed time limit (else RESOURCE_EXHAUSTED)
        self.answers = True  # GetInfo answers (alive)
        self.limits: list[float | None] = []
        self.timeout_s = 1.0

    async def verify(self, session_id, history, proposal, params, seed, timeout=None, top_logprobs=None,
                     limit_s=None, continues=False, followers=None, decode_steps=1):
        self.calls.append(session_id)
        self.limits.append(limit_s)
        if self.fail:
            raise Unavailable(f"{self.address} is down")
        if self.busy_for:
            self.busy_for -= 1
            raise Busy(f"{self.address} is slow", retry_after_s=0.0 if self.timed_out else 0.01,
                       timed_out=self.timed_out)
        return VerifyReply(num_accepted=0, token_id=len(history), bonus=False, wall_ns=2_000_000, compute_ns=1_000_000)

    async def release(self, session_id, forget_output=True):
        self.calls.append("release:" + session_id)

    async def info(self, timeout=10.0, wait=True):
        if not self.answers:
            raise FakeRpcError()
        return None

    async def close(self):
        pass


def pool_of(*names: str, failing: set[str] = frozenset()) -> TargetPool:
    pool = TargetPool(",".join(names), lambda a: FakeTarget(a, a in failing), retry_s=60.0)
    for name in names:
        pool.replicas[name] = Replica(pool.make(name), fingerprint="fp")
    return pool


def verify(pool: TargetPool, session: str) -> VerifyReply:
    return asyncio.run(pool.verify(session, [1, 2, 3], DraftReply(), SamplingParams(), 0))


def test_parse_addresses():
    assert parse_addresses("a:1, b:2") == (["a:1", "b:2"], None)
    assert parse_addresses("dns:///svc.ns.svc.cluster.local:50053") == ([], "svc.ns.svc.cluster.local:50053")
    for bad in ("a", "a:b", "dns:///svc", ":5"):
        with pytest.raises(ValueError):
            parse_addresses(bad)


def test_resolve_localhost():
    addresses = asyncio.run(resolve("localhost:50053"))
    assert addresses and all(a.endswith(":50053") for a in addresses)
    assert "127.0.0.1:50053" in addresses or "[::1]:50053" in addresses


def test_sessions_stick_to_their_replica_and_spread_by_cost():
    pool = pool_of("a:1", "b:1")
    pool.replicas["a:1"].rtt_s = 0.010  # b is closer
    verify(pool, "s1")
    assert pool.replicas["b:1"].backend.calls == ["s1"]
    pool.replicas["b:1"].in_flight = 5  # b is busy now: a new session goes to a
    pool.replicas["b:1"].rtt_s = 0.001
    verify(pool, "s2")
    assert pool.replicas["a:1"].backend.calls == ["s2"]
    verify(pool, "s1")  # s1 keeps its replica (its KV cache is there)
    assert pool.replicas["b:1"].backend.calls == ["s1", "s1"]


def test_failed_replica_is_skipped_and_the_call_retried_elsewhere():
    pool = pool_of("a:1", "b:1", failing={"a:1"})
    pool._affinity["s"] = "a:1"
    verdict = verify(pool, "s")
    assert verdict.token_id == 3
    assert pool.replicas["a:1"].backend.calls == ["s"] and pool.replicas["b:1"].backend.calls == ["s"]
    assert pool.replicas["a:1"].down_until > time.monotonic()
    assert "a:1 is down" in pool.replicas["a:1"].error
    verify(pool, "s")  # now sticky to b, a is not tried again while down
    assert pool.replicas["a:1"].backend.calls == ["s"]


def test_all_replicas_down_is_unavailable_with_each_reason():
    pool = pool_of("a:1", "b:1", failing={"a:1", "b:1"})
    with pytest.raises(Unavailable) as info:
        verify(pool, "s")
    assert "a:1 is down" in str(info.value) and "b:1 is down" in str(info.value)
    assert not pool.available


def test_release_reaches_every_replica_and_forgets_affinity():
    pool = pool_of("a:1", "b:1")
    verify(pool, "s")
    asyncio.run(pool.release("s"))
    assert all("release:s" in r.backend.calls for r in pool.replicas.values())
    assert "s" not in pool._affinity


def test_unchecked_replica_is_not_used():
    pool = pool_of("a:1")
    pool.replicas["b:1"] = Replica(pool.make("b:1"))  # joined, GetInfo not answered yet
    for i in range(5):
        verify(pool, f"s{i}")
    assert pool.replicas["b:1"].backend.calls == []


class FakeDraft:
    """One draft replica's client: SaveSnapshot answers `tokens`, or fails with `error`."""

    def __init__(self, address: str, tokens: int = 0, error: grpc.StatusCode | None = None) -> None:
        self.address = address
        self.tokens = tokens
        self.error = error
        self.calls: list[str] = []

    async def save_snapshot(self, session_id):
        self.calls.append("snapshot:" + session_id)
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), grpc.aio.Metadata(), details="no luck")
        return self.tokens

    async def close(self):
        pass


def draft_pool_of(**replicas: dict) -> DraftPool:
    pool = DraftPool(",".join(replicas), lambda a: FakeDraft(a, **replicas[a]), retry_s=60.0)
    for name in replicas:
        pool.replicas[name] = Replica(pool.make(name), fingerprint="fp")
    return pool


def test_draft_snapshot_is_asked_of_the_replica_holding_the_session_only():
    pool = draft_pool_of(**{"a:1": dict(tokens=300), "b:1": dict(tokens=300)})
    assert asyncio.run(pool.save_snapshot("s")) == 0  # no replica holds s yet: nothing asked
    pool._affinity["s"] = "b:1"
    assert asyncio.run(pool.save_snapshot("s")) == 300
    assert pool.replicas["a:1"].backend.calls == [] and pool.replicas["b:1"].backend.calls == ["snapshot:s"]


def test_what_the_drafts_report_comes_from_their_model_info():
    pool = draft_pool_of(**{"a:1": {}, "b:1": {}, "c:1": {}})
    assert pool.sources == () and not pool.learns_outputs and not pool.reads_shared_outputs  # none probed yet
    pool.replicas["a:1"].info = common_pb2.ModelInfo(draft_sources=["model", "suffix"], learns_outputs=True)
    pool.replicas["b:1"].info = common_pb2.ModelInfo(draft_sources=["ngram"])  # a rollout to another draft
    assert pool.sources == ("model", "suffix", "ngram") and pool.learns_outputs and not pool.reads_shared_outputs
    pool.replicas["c:1"].info = common_pb2.ModelInfo(draft_sources=["suffix"], reads_shared_outputs=True)
    assert pool.sources == ("model", "suffix", "ngram") and pool.reads_shared_outputs


def test_failed_draft_snapshot_is_logged_never_raised(caplog):
    pool = draft_pool_of(**{"a:1": dict(error=grpc.StatusCode.UNAVAILABLE),
                            "b:1": dict(error=grpc.StatusCode.FAILED_PRECONDITION)})
    pool._affinity.update({"s1": "a:1", "s2": "b:1", "s3": "b:1"})
    with caplog.at_level("WARNING", logger="specdec.orchestrator"):
        assert [asyncio.run(pool.save_snapshot(s)) for s in ("s1", "s2", "s3")] == [0, 0, 0]
    messages = [r.getMessage() for r in caplog.records]
    assert any("snapshot of s1 on draft replica a:1 failed" in m for m in messages)
    # A replica without a snapshot store is reported once, not after every generation.
    assert sum("draft replica b:1 keeps no snapshots" in m for m in messages) == 1
    assert pool.available  # a failed snapshot does not take the replica out of service


class FakeRpcError(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "connection refused")


def test_a_busy_replica_that_still_answers_is_asked_again_with_a_longer_limit():
    pool = pool_of("a:1", "b:1")
    target = pool.replicas["a:1"].backend
    pool._affinity["s"] = "a:1"
    target.busy_for = 3
    reply = verify(pool, "s")
    assert reply.token_id == 3 and target.calls == ["s"] * 4 and pool.replicas["b:1"].backend.calls == []
    assert target.limits == [None, 2.0, 4.0, 8.0]  # each timeout doubles the call's own limit
    assert pool.replicas["a:1"].failures == 0  # slow is not dead


def test_an_overloaded_replica_is_retried_after_its_retry_after_without_a_longer_limit():
    pool = pool_of("a:1")
    target = pool.replicas["a:1"].backend
    target.busy_for, target.timed_out = 2, False
    verify(pool, "s")
    assert target.limits == [None, None, None] and pool.replicas["a:1"].failures == 0


def test_a_busy_replica_that_does_not_answer_is_dead_and_the_call_moves_on():
    pool = pool_of("a:1", "b:1")
    pool._affinity["s"] = "a:1"
    a = pool.replicas["a:1"].backend
    a.busy_for, a.answers = 5, False
    verify(pool, "s")
    assert a.calls == ["s"] and pool.replicas["b:1"].backend.calls == ["s"]
    assert pool.replicas["a:1"].failures == 1


class DyingTarget(FakeTarget):
    """A replica the call itself brings down (as a prompt that runs a target out of memory): it
    fails the call and answers nothing after it."""

    async def verify(self, session_id, history, proposal, params, seed, timeout=None, top_logprobs=None,
                     limit_s=None, continues=False, followers=None, decode_steps=1):
        self.calls.append(session_id)
        self.answers = False
        raise Unavailable(f"{self.address}: UNAVAILABLE: Socket closed")


def dying_pool(*names: str, dying: set[str]) -> TargetPool:
    pool = TargetPool(",".join(names), lambda a: (DyingTarget if a in dying else FakeTarget)(a), retry_s=60.0)
    for name in names:
        pool.replicas[name] = Replica(pool.make(name), fingerprint="fp")
    return pool


def test_a_call_that_brings_replicas_down_is_retried_once_never_swept_across_the_pool():
    names = ("a:1", "b:1", "c:1", "d:1")
    pool = dying_pool(*names, dying=set(names))
    pool._affinity["s"] = "a:1"
    with pytest.raises(FailedPrecondition, match="stopped answering") as info:
        verify(pool, "s")
    reached = [n for n in names if pool.replicas[n].backend.calls]
    assert len(reached) == 2, reached  # the first replica and one retry; the other two never see it
    assert all(n in str(info.value) for n in reached) and "session is kept" in str(info.value)


def test_the_one_retry_goes_to_a_replica_that_answers_health_first():
    pool = dying_pool("a:1", "b:1", "c:1", dying={"a:1"})
    pool._affinity["s"] = "a:1"
    pool.replicas["b:1"].rtt_s, pool.replicas["c:1"].rtt_s = 0.001, 0.010  # b is picked first
    pool.replicas["b:1"].backend.answers = False  # down since its last probe: it must not get the call
    assert verify(pool, "s").token_id == 3
    assert pool.replicas["b:1"].backend.calls == [] and pool.replicas["c:1"].backend.calls == ["s"]
    assert pool.replicas["b:1"].down_until > time.monotonic()


def test_a_replica_that_fails_a_call_but_still_answers_is_not_counted_against_the_call():
    pool = pool_of("a:1", "b:1", "c:1", failing={"a:1", "b:1"})  # errors, but alive
    pool._affinity["s"] = "a:1"
    pool.replicas["b:1"].rtt_s, pool.replicas["c:1"].rtt_s = 0.001, 0.010
    assert verify(pool, "s").token_id == 3
    assert [len(pool.replicas[n].backend.calls) for n in ("a:1", "b:1", "c:1")] == [1, 1, 1]


class RestartedTarget(FakeTarget):
    """A replica whose releases fail as a down one's do (`down`), and that answers GetInfo."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.down = False

    async def release(self, session_id, forget_output=True):
        if self.down:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")
        self.calls.append(f"release:{session_id}:{forget_output}")

    async def info(self, timeout=10.0, wait=True):
        return common_pb2.ModelInfo(tokenizer_fingerprint="fp")


def test_a_release_a_replica_missed_is_sent_by_any_orchestrator_once_it_answers():
    """Orchestrator A's release reaches a replica that is down: owed in A and in the shared ledger.
    A is killed; orchestrator B's probe finds the replica back and sends it; the ledger forgets it.
    Without a ledger (Redis down) A still keeps its own."""
    ledger = InMemorySessionStore()
    a = TargetPool("t:1", RestartedTarget, retry_s=60.0)
    a.replicas["t:1"] = Replica(a.make("t:1"), fingerprint="fp")
    a.ledger = ledger
    a.replicas["t:1"].backend.down = True
    asyncio.run(a.release("s1", forget_output=False))
    assert a.replicas["t:1"].unreleased == {"s1": False} and ledger.owed == {"t:1": {"s1": False}}

    b = TargetPool("t:1", RestartedTarget, retry_s=60.0)
    b.replicas["t:1"] = Replica(b.make("t:1"))
    b.ledger = ledger
    asyncio.run(b._probe(b.replicas["t:1"]))
    assert b.replicas["t:1"].backend.calls == ["release:s1:False"] and ledger.owed == {"t:1": {}}

    ledger.down = True  # the store is unreachable: A's own release goes all the same when t1 is back
    a.replicas["t:1"].backend.down = False
    asyncio.run(a._probe(a.replicas["t:1"]))
    assert a.replicas["t:1"].backend.calls == ["release:s1:False"] and a.replicas["t:1"].unreleased == {}
