"""Replica sets of the draft and target services: discovery, health, placement and failover.

A backend is named by a comma-separated list of `host:port` addresses, by `dns:///name:port`,
whose name resolves to one address per replica (a Kubernetes headless service), or by
`kubernetes:///[namespace/]service:port`, whose EndpointSlices are watched (discovery.py). Each
replica is its own channel, so the orchestrator sees, measures and places on individual replicas
instead of letting a load balancer hide them.

Placement: a session sticks to the replica that holds its KV cache while that replica is
healthy; a new session (or one whose replica failed) goes to the healthy replica with the lowest
expected cost, (requests in flight + 1) × (measured round trip + compute), weighted by its
distance when discovery knows it (same node, same zone, elsewhere: `LOCALITY_WEIGHT`). A replica
that fails a call is skipped for `retry_s` and the call is retried on another one; a replica that
discovery reports not ready gets no session, not even its own ones, which move on their next
round; one that leaves the DNS answer or the EndpointSlices is dropped. Every call carries the
whole token history, so moving a session costs a re-prefill on the new replica and never changes
its output.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import grpc

from orchestrator.backends import (
    Busy,
    DraftBackend,
    DraftReleased,
    DraftReply,
    DraftUnavailable,
    Released,
    ScoreReply,
    TargetBackend,
    VerifyReply,
)
from orchestrator.discovery import (
    LOCALITY_WEIGHT,
    Endpoint,
    Source,
    locality,
    own_zone,
    parse_addresses,  # noqa: F401 - re-exported: where the spec forms used to live
    resolve,  # noqa: F401 - re-exported
    source_of,
    usable,
)
from orchestrator.store import ReleaseLedger
from specdec.core.sampling import SamplingParams
from specdec.errors import FailedPrecondition, SpecdecError, Unavailable
from specdec.v1 import common_pb2

log = logging.getLogger("specdec.orchestrator")
B = TypeVar("B", DraftBackend, TargetBackend)
MAX_AFFINITY = 100_000  # sessions remembered per pool (oldest forgotten first)
MAX_UNRELEASED = 10_000  # releases a replica owes, kept until it answers again (oldest dropped first)
RELEASE_RETRIES_AT_ONCE = 64
LEDGER_TIMEOUT_S = 1.0  # a ledger read or write past this is skipped: probes and closes do not wait on Redis


@dataclass
class Replica(Generic[B]):
    backend: B
    fingerprint: str = ""  # tokenizer fingerprint from its GetInfo ("" = not checked yet)
    info: common_pb2.ModelInfo | None = None
    down_until: float = 0.0
    error: str = ""
    in_flight: int = 0
    rtt_s: float = 0.0  # EWMA of wall - compute of its calls: network and queueing
    compute_s: float = 0.0  # EWMA of its compute per call
    calls: int = 0
    failures: int = 0
    ready: bool = True  # discovery says it may be given sessions
    node: str = ""  # where discovery says it runs ("" = unknown)
    zone: str = ""
    # Sessions whose release this replica did not answer (down, restarting, or its channel still
    # backing off): sent again once it answers a probe, so a session it took on after a restart is
    # not left holding KV cache. Value: the release's forget_output.
    unreleased: OrderedDict[str, bool] = field(default_factory=OrderedDict)

    def owe_release(self, session_id: str, forget_output: bool) -> None:
        self.unreleased[session_id] = forget_output
        self.unreleased.move_to_end(session_id)
        if len(self.unreleased) > MAX_UNRELEASED:
            dropped, _ = self.unreleased.popitem(last=False)
            log.warning("replica %s: %d releases owed; %s is dropped (its cache goes by eviction)", self.address,
                        MAX_UNRELEASED, dropped)

    @property
    def address(self) -> str:
        return self.backend.address

    def healthy(self, now: float) -> bool:
        return self.ready and bool(self.fingerprint) and now >= self.down_until

    def cost(self) -> float:
        return (self.in_flight + 1) * (self.rtt_s + self.compute_s + 1e-4)

    def observe(self, wall_s: float, compute_s: float, weight: float = 0.2) -> None:
        net = max(wall_s - compute_s, 0.0)
        if self.calls == 0:
            self.rtt_s, self.compute_s = net, compute_s
        else:
            self.rtt_s += weight * (net - self.rtt_s)
            self.compute_s += weight * (compute_s - self.compute_s)
        self.calls += 1


class Pool(Protocol):
    """What the orchestrator asks of one role's replicas, besides its calls."""

    role: str

    def members(self) -> list:
        """Each replica's client (`.address`, `info()`)."""

    async def release(self, session_id: str, forget_output: bool = True) -> None:
        """Free the session's caches; `forget_output`: its output must not join a draft's corpus."""

    async def save_snapshot(self, session_id: str) -> int: ...


class Targets(Pool, Protocol):
    """The target replicas as the loop sees them (TargetPool; a fake in unit tests)."""

    async def verify(self, session_id: str, history: list[int], proposal: DraftReply, params: SamplingParams,
                     seed: int, timeout: float | None = None, top_logprobs: int | None = None,
                     continues: bool = False, followers: frozenset[int] | None = None,
                     decode_steps: int = 1) -> VerifyReply: ...

    async def score(self, session_id: str, tokens: list[int], start: int, top: int, params: SamplingParams | None,
                    timeout: float | None = None) -> ScoreReply: ...


class Drafts(Pool, Protocol):
    """The draft replicas as the loop sees them (DraftPool; a fake in unit tests)."""

    @property
    def available(self) -> bool:
        """Whether a draft replica is up (else the round runs at k = 0 without asking)."""

    @property
    def sources(self) -> tuple[str, ...]:
        """The sources the drafts' proposals may name (ModelInfo.draft_sources), the one that drafts
        when the others propose nothing first."""

    @property
    def learns_outputs(self) -> bool:
        """Whether a draft keeps a corpus of finished outputs (ModelInfo.learns_outputs)."""

    @property
    def reads_shared_outputs(self) -> bool:
        """Whether a draft feeds that corpus from the outputs stream in Redis (ModelInfo.reads_shared_outputs)."""

    async def propose(self, session_id: str, history: list[int], k: int, params: SamplingParams, seed: int,
                      fingerprint: str, into: DraftReply | None = None,
                      progress: asyncio.Event | None = None, timeout: float | None = None,
                      corpus_group: str = "", sources: Sequence[str] = ()) -> DraftReply: ...


class ReplicaPool(Generic[B]):
    """One role's replicas; subclasses add the role's calls with failover."""

    role = "replica"

    def __init__(self, spec: str, make: Callable[[str], B], retry_s: float, refresh_s: float = 5.0,
                 node: str = "", zone: str = "", source: Source | None = None) -> None:
        self.spec = spec
        try:
            self.source = source or source_of(spec)
        except ValueError as exc:
            raise ValueError(f"{self.role}: {exc}") from exc
        self.node, self.zone = node, zone  # this orchestrator's, for locality (zone: else learnt from discovery)
        self.make = make
        self.retry_s = retry_s
        self.refresh_s = refresh_s
        self.expected_fingerprint = ""
        self.replicas: dict[str, Replica[B]] = {}
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._without_store: set[str] = set()  # replicas that answered SaveSnapshot with "no store"
        self._task: asyncio.Task | None = None
        self._retiring: set[asyncio.Task] = set()
        # Releases a replica did not answer, also kept here for every orchestrator: one killed before
        # the replica answers again would otherwise take them along (None: this orchestrator's only).
        self.ledger: ReleaseLedger | None = None

    # -- membership ---------------------------------------------------------------------

    async def start(self, timeout_s: float = 60.0) -> common_pb2.ModelInfo:
        """Discover the replicas and wait until at least one answers; returns its model info."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.refresh()
            ready = [r for r in self.replicas.values() if r.info is not None]
            if ready:
                return ready[0].info
            if time.monotonic() > deadline:
                errors = "; ".join(f"{r.address}: {r.error}" for r in self.replicas.values()) or "no address resolved"
                raise Unavailable(f"no {self.role} replica of {self.spec} answered within {timeout_s:.0f}s ({errors})")
            await asyncio.sleep(0.5)

    def watch(self) -> None:
        """Re-discover and probe the replicas every `refresh_s`, and at once when discovery reports a
        change, in the background."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await self.source.wait(self.refresh_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("refreshing the %s replicas failed", self.role)

    async def refresh(self) -> None:
        """Add replicas that appeared, drop those that left, probe each one's health."""
        try:
            endpoints = await self.source.endpoints()
        except OSError as exc:
            log.warning("cannot discover the %s replicas of %s (%s); keeping those already known", self.role,
                        self.spec, exc)
        else:
            self.update(endpoints)
        await asyncio.gather(*(self._probe(r) for r in list(self.replicas.values())))

    def update(self, endpoints: list[Endpoint]) -> None:
        """Make the replica set the endpoints discovery reports, with their readiness and locality."""
        eligible = usable(endpoints)
        for ep in endpoints:
            replica = self.replicas.get(ep.address)
            if replica is None:
                replica = self.replicas[ep.address] = Replica(self.make(ep.address))
                log.info("%s replica %s joined%s", self.role, ep.address, f" (node {ep.node})" if ep.node else "")
            ready = ep.address in eligible
            if ready != replica.ready:
                log.info("%s replica %s is %s", self.role, ep.address, "ready" if ready else
                         "not ready: its sessions move on their next round")
            replica.ready, replica.node, replica.zone = ready, ep.node, ep.zone
        self.zone = self.zone or own_zone(endpoints, self.node)
        listed = {ep.address for ep in endpoints}
        for address in [a for a in self.replicas if a not in listed]:
            log.info("%s replica %s left", self.role, address)
            task = asyncio.get_running_loop().create_task(self._retire(self.replicas.pop(address)))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _retire(self, replica: Replica[B], grace_s: float = 60.0) -> None:
        """Close a replica that left; one with calls in flight gets `grace_s` to finish them."""
        if replica.in_flight:
            await asyncio.sleep(grace_s)
        await replica.backend.close()

    async def _probe(self, replica: Replica[B]) -> None:
        start = time.perf_counter()
        try:
            info = await replica.backend.info(timeout=2.0, wait=False)
        except grpc.aio.AioRpcError as exc:
            replica.error = f"{exc.code().name}: {exc.details()}"
            replica.down_until = time.monotonic() + self.retry_s
            return
        replica.observe(time.perf_counter() - start, 0.0)
        if self.expected_fingerprint and info.tokenizer_fingerprint != self.expected_fingerprint:
            replica.error = (f"tokenizer {info.tokenizer_fingerprint} of {info.model!r} does not match "
                             f"{self.expected_fingerprint}; not used")
            replica.fingerprint = ""
            log.error("%s replica %s: %s", self.role, replica.address, replica.error)
            return
        if replica.info is None or replica.down_until:
            log.info("%s replica %s is serving %s", self.role, replica.address, info.model)
        replica.info, replica.fingerprint, replica.error, replica.down_until = info, info.tokenizer_fingerprint, "", 0.0
        if replica.unreleased or self.ledger is not None:
            await self._release_owed(replica)

    async def _release_owed(self, replica: Replica[B]) -> None:
        """Send the releases `replica` did not answer (this orchestrator's, and those the ledger holds
        from any orchestrator), a batch at a time; any still failing stay owed."""
        owed = dict(list(replica.unreleased.items())[:RELEASE_RETRIES_AT_ONCE])
        if self.ledger is not None:
            try:
                stored = await asyncio.wait_for(self.ledger.owed_releases(replica.address, RELEASE_RETRIES_AT_ONCE),
                                                LEDGER_TIMEOUT_S)
            except (SpecdecError, asyncio.TimeoutError) as exc:  # the store is down: our own releases go anyway
                log.debug("reading the releases %s owes failed: %r", replica.address, exc)
            else:
                for session_id, forget in stored.items():
                    owed.setdefault(session_id, forget)
        if not owed:
            return
        results = await asyncio.gather(*(replica.backend.release(s, forget) for s, forget in owed.items()),
                                       return_exceptions=True)
        paid = [session_id for session_id, result in zip(owed, results) if not isinstance(result, Exception)]
        for session_id in paid:
            replica.unreleased.pop(session_id, None)
        if paid and self.ledger is not None:
            try:
                await asyncio.wait_for(self.ledger.paid_releases(replica.address, paid), LEDGER_TIMEOUT_S)
            except (SpecdecError, asyncio.TimeoutError) as exc:  # sent again later: it frees nothing then
                log.debug("recording the releases %s answered failed: %r", replica.address, exc)

    # -- placement ----------------------------------------------------------------------

    @property
    def available(self) -> bool:
        now = time.monotonic()
        return any(r.healthy(now) for r in self.replicas.values())

    def pick(self, session_id: str, exclude: set[str] = frozenset()) -> Replica[B] | None:
        now = time.monotonic()
        address = self._affinity.get(session_id)
        sticky = self.replicas.get(address) if address else None
        if sticky is not None and sticky.healthy(now) and address not in exclude:
            self._affinity.move_to_end(session_id)
            return sticky
        candidates = [r for a, r in self.replicas.items() if a not in exclude and r.healthy(now)]
        if not candidates:
            return None
        best = min(candidates, key=self._placement_cost)
        self._affinity[session_id] = best.address
        self._affinity.move_to_end(session_id)
        while len(self._affinity) > MAX_AFFINITY:
            self._affinity.popitem(last=False)
        return best

    def _placement_cost(self, replica: Replica[B]) -> tuple[float, int]:
        """Expected cost weighted by distance; at equal cost the nearer replica."""
        tier = locality(replica.node, replica.zone, self.node, self.zone)
        return replica.cost() * LOCALITY_WEIGHT[tier], tier

    def failed(self, replica: Replica[B], error: str) -> None:
        replica.failures += 1
        replica.error = error
        replica.down_until = time.monotonic() + self.retry_s

    def members(self) -> list[B]:
        return [r.backend for r in self.replicas.values()]

    async def release(self, session_id: str, forget_output: bool = True) -> None:
        """Free the session's caches on every replica (it may have moved); `forget_output`: a draft
        that learns released sessions' outputs must not learn this one's."""
        self._affinity.pop(session_id, None)
        results = await asyncio.gather(*(r.backend.release(session_id, forget_output)
                                         for r in self.replicas.values()),
                                       return_exceptions=True)
        for replica, result in zip(self.replicas.values(), results):
            if isinstance(result, grpc.aio.AioRpcError) and result.code() in (grpc.StatusCode.UNAVAILABLE,
                                                                                grpc.StatusCode.DEADLINE_EXCEEDED):
                log.info("release of %s on %s failed (%s); sent again once it answers", session_id,
                         replica.address, result.code().name)
                replica.owe_release(session_id, forget_output)
                await self._record_owed(replica.address, session_id, forget_output)
            elif isinstance(result, Exception):
                log.warning("release of %s on %s failed: %s", session_id, replica.address, result)

    async def _record_owed(self, address: str, session_id: str, forget_output: bool) -> None:
        """Keep an owed release in the ledger too (best effort: this orchestrator keeps it anyway)."""
        if self.ledger is None:
            return
        try:
            await asyncio.wait_for(self.ledger.owe_release(address, session_id, forget_output), LEDGER_TIMEOUT_S)
        except (SpecdecError, asyncio.TimeoutError) as exc:
            log.info("the release of %s owed by %s is kept by this orchestrator only: %r", session_id, address, exc)

    async def save_snapshot(self, session_id: str) -> int:
        """Snapshot the session's cache on the replica that holds it (0 if none is known).

        Runs in the background after a generation: a failure is logged, never raised. A replica
        without a snapshot store (FAILED_PRECONDITION) is reported once, not after every request.
        """
        address = self._affinity.get(session_id)
        replica = self.replicas.get(address) if address else None
        if replica is None:
            return 0
        try:
            return await replica.backend.save_snapshot(session_id)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                log.warning("snapshot of %s on %s replica %s failed: %s", session_id, self.role, replica.address,
                            exc.details())
            elif replica.address not in self._without_store:
                self._without_store.add(replica.address)
                log.warning("%s replica %s keeps no snapshots (%s); not reported again", self.role,
                            replica.address, exc.details())
            return 0
        except Exception:
            log.exception("snapshot of %s on %s replica %s failed", session_id, self.role, replica.address)
            return 0

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.source.close()
        for replica in self.replicas.values():
            await replica.backend.close()


@dataclass
class _Attempts:
    """One call's way through a target pool: the replicas tried, those that stopped answering during
    it, and how it is being retried on a busy replica."""

    session_id: str
    what: str  # "verify" or "score"
    tried: set[str] = field(default_factory=set)
    lost: list[str] = field(default_factory=list)  # replicas that failed it and answer nothing since
    resent: bool = False  # sent again after a release dropped it
    limit: float | None = None  # the call's own time limit after a timeout (None: the backend's)
    busy: int = 0  # busy answers so far


class TargetPool(ReplicaPool[TargetBackend]):
    """Verify with failover: a replica that fails is skipped and the call retried on another.

    A call after which its replica answers nothing may be what brought it down (a prompt that runs a
    target out of memory), so it is replayed once at most: on a replica that answers GetInfo just
    before, and if that one goes down too the call fails with FAILED_PRECONDITION instead of sweeping
    the pool (a poison request takes two replicas down, never all of them). A replica that fails a
    call but still answers, or one that is only busy, does not count."""

    role = "target"
    MAX_LOST = 2  # replicas a call may leave not answering before it is refused

    async def verify(self, session_id: str, history: list[int], proposal: DraftReply, params: SamplingParams,
                     seed: int, timeout: float | None = None, top_logprobs: int | None = None,
                     continues: bool = False, followers: frozenset[int] | None = None,
                     decode_steps: int = 1) -> VerifyReply:
        return await self._call(session_id, "verify", lambda backend, limit: backend.verify(
            session_id, history, proposal, params, seed, timeout, top_logprobs, limit, continues, followers,
            decode_steps))

    async def score(self, session_id: str, tokens: list[int], start: int, top: int, params: SamplingParams | None,
                    timeout: float | None = None) -> ScoreReply:
        """The log-probabilities of tokens[start:] after what precedes each (see TargetBackend.score)."""
        return await self._call(session_id, "score", lambda backend, limit: backend.score(
            session_id, tokens, start, top, params, timeout, limit))

    async def _call(self, session_id: str, what: str, call):
        """`call(backend, limit_s)` on the session's replica, failing over to another when it fails.

        A busy replica (RESOURCE_EXHAUSTED, or no answer within the call's limit) is not a dead one:
        if it still answers GetInfo, the call goes to it again after a pause (its Retry-After, or a
        growing backoff) and, after a timeout, with twice the time limit; only a replica that does
        not answer is marked failed. So load alone never fails a request: its deadline does."""
        attempts = _Attempts(session_id, what)
        while True:
            replica = await self._next(attempts)
            replica.in_flight += 1
            try:
                reply = await call(replica.backend, attempts.limit)
            except Busy as exc:
                if await self._answers(replica):
                    await self._wait_busy(replica, exc, attempts)
                else:
                    await self._failed_call(replica, exc, attempts, answers=False)
                continue
            except Released as exc:
                # An earlier request's cleanup released the session after this call was sent: sent
                # again (now after the release) it runs, re-prefilling the history.
                if attempts.resent:
                    raise Unavailable(f"target replica {replica.address} dropped the {what} twice: {exc}") from exc
                attempts.resent = True
                attempts.tried.discard(replica.address)
                log.info("%s of %s dropped by a release on %s; sent again", what, session_id, replica.address)
                continue
            except Unavailable as exc:
                await self._failed_call(replica, exc, attempts)
                continue
            finally:
                replica.in_flight -= 1
            replica.observe(reply.wall_ns / 1e9, reply.compute_ns / 1e9)
            return reply

    async def _next(self, attempts: _Attempts) -> Replica[TargetBackend]:
        """The replica the call goes to next. After a replica went down with the call, only one that
        answers GetInfo now (one that does not is marked failed and skipped: it never sees the call)."""
        while True:
            replica = self.pick(attempts.session_id, exclude=attempts.tried)
            if replica is None:
                errors = "; ".join(f"{r.address}: {r.error}" for r in self.replicas.values())
                raise Unavailable(f"no healthy target replica ({errors or 'none known'}); the session is kept, "
                                  "retry the request")
            attempts.tried.add(replica.address)
            if not attempts.lost or await self._answers(replica):
                return replica
            self.failed(replica, "does not answer GetInfo")

    async def _failed_call(self, replica: Replica[TargetBackend], exc: Exception, attempts: _Attempts,
                           answers: bool | None = None) -> None:
        """Mark the replica failed; if it answers nothing since, count it against the call, which is
        refused once MAX_LOST replicas went down with it."""
        self.failed(replica, str(exc))
        log.warning("target replica %s failed; session %s moves on: %s", replica.address, attempts.session_id, exc)
        if answers is None:
            answers = await self._answers(replica)
        if answers:
            return
        attempts.lost.append(replica.address)
        if len(attempts.lost) >= self.MAX_LOST:
            raise FailedPrecondition(
                f"target replicas {' and '.join(attempts.lost)} stopped answering during the {attempts.what} of "
                f"session {attempts.session_id}, each right after it was sent: it is not sent to another replica, "
                "since a request that brings replicas down would take them all (the session is kept; if they "
                "failed for another reason, resume the generation once they are back)")

    async def _wait_busy(self, replica: Replica[TargetBackend], exc: Busy, attempts: _Attempts) -> None:
        """A busy replica that still answers gets the call again after a pause; after a timeout, with
        twice the time limit."""
        attempts.busy += 1
        if exc.timed_out:
            attempts.limit = 2 * (attempts.limit or replica.backend.timeout_s)
        attempts.tried.discard(replica.address)
        pause = exc.retry_after_s or min(0.05 * 2 ** attempts.busy, 2.0)
        log.info("target replica %s is busy (%s) but alive: %s of %s again in %.2fs%s", replica.address, exc,
                 attempts.what, attempts.session_id, pause,
                 f" with a {attempts.limit:.0f}s limit" if attempts.limit else "")
        await asyncio.sleep(pause)

    @staticmethod
    async def _answers(replica: Replica[TargetBackend]) -> bool:
        """Whether a replica that did not finish a call still answers (GetInfo, served beside the model's
        work): busy if so, dead if not."""
        try:
            await replica.backend.info(timeout=5.0, wait=False)
            return True
        except grpc.aio.AioRpcError:
            return False


class DraftPool(ReplicaPool[DraftBackend]):
    """Propose on the session's draft replica; a failure marks it down and the round runs at k = 0."""

    role = "draft"

    def _infos(self) -> list[common_pb2.ModelInfo]:
        """The replicas' ModelInfo as last probed (probes repeat, so a rollout is followed)."""
        return [r.info for r in self.replicas.values() if r.info is not None]

    @property
    def sources(self) -> tuple[str, ...]:
        """The sources the replicas' proposals may name (ModelInfo.draft_sources), in the order the first
        replica lists them, then any that only others name (replicas of two kinds, during a rollout)."""
        return tuple(dict.fromkeys(source for info in self._infos() for source in info.draft_sources))

    @property
    def reads_shared_outputs(self) -> bool:
        """Whether a replica feeds its corpus of outputs from the outputs stream in Redis
        (ModelInfo.reads_shared_outputs)."""
        return any(info.reads_shared_outputs for info in self._infos())

    @property
    def learns_outputs(self) -> bool:
        """Whether a replica keeps a corpus of finished outputs (ModelInfo.learns_outputs): from the
        outputs stream, or from the sessions it releases."""
        return any(info.learns_outputs for info in self._infos())

    async def propose(self, session_id: str, history: list[int], k: int, params: SamplingParams, seed: int,
                      fingerprint: str, into: DraftReply | None = None,
                      progress: asyncio.Event | None = None, timeout: float | None = None,
                      corpus_group: str = "", sources: Sequence[str] = ()) -> DraftReply:
        replica = self.pick(session_id)
        if replica is None:
            raise DraftUnavailable("no healthy draft replica")
        replica.in_flight += 1
        try:
            proposal = await replica.backend.propose(session_id, history, k, params, seed, fingerprint,
                                                     into=into, progress=progress, timeout=timeout,
                                                     corpus_group=corpus_group, sources=sources)
        except DraftReleased:
            raise  # the session's caches were released after the call was sent: the replica is fine
        except DraftUnavailable as exc:
            self.failed(replica, str(exc))
            log.warning("draft replica %s failed (%s); plain decoding on it for %.1fs",
                        replica.address, exc, self.retry_s)
            raise
        finally:
            replica.in_flight -= 1
        replica.observe(proposal.wall_ns / 1e9, proposal.compute_ns / 1e9)
        return proposal
