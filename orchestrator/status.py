"""What GetStatus reports: this orchestrator's counters and a recent look at its backends.

The counters are GetStatus's sink of the per-round `SpecDecodingStats` the orchestrator builds
once and feeds to the Prometheus metrics too (`Orchestrator.observe_round`), so both count the
same rounds, and stay true for generations that are cancelled or fail half-way. They are per
process, since start.

The look at the backends is a GetInfo to every replica; `BackendProbes` asks each at most once
per `--status-cache-s` however many callers ask (concurrent ones share one call), so GetStatus
cannot be used to fan calls out to the whole pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata

from specdec.server.metrics import SpecDecodingStats
from specdec.v1 import orchestrator_pb2 as pb


def specdec_version() -> str:
    try:
        return metadata.version("specdec")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "unknown"


@dataclass
class Counters:
    """Load and acceptance of one orchestrator since it started."""

    started: float = field(default_factory=time.monotonic)
    active_generations: int = 0
    generations_total: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def observe_round(self, stats: SpecDecodingStats) -> None:
        self.generated_tokens += stats.num_emitted_tokens
        self.draft_tokens += stats.num_draft_tokens
        self.accepted_tokens += stats.num_accepted_tokens

    @contextlib.contextmanager
    def generation(self) -> Iterator[None]:
        """Count a generation while it runs and once it ends (any outcome)."""
        self.active_generations += 1
        try:
            yield
        finally:
            self.active_generations -= 1
            self.generations_total += 1

    def fill(self, reply: pb.GetStatusResponse) -> None:
        reply.uptime_s = time.monotonic() - self.started
        reply.active_generations = self.active_generations
        reply.generations_total = self.generations_total
        reply.generated_tokens = self.generated_tokens
        reply.draft_tokens = self.draft_tokens
        reply.accepted_tokens = self.accepted_tokens
        reply.acceptance_rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


async def backend_status(role: str, backend, timeout_s: float) -> pb.BackendStatus:
    """Ask one draft or target replica for its ModelInfo; an error marks it unhealthy."""
    out = pb.BackendStatus(role=role, address=backend.address)
    start = time.perf_counter()
    try:
        info = await backend.info(timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised
        out.healthy = False
        details = exc.details() if hasattr(exc, "details") else str(exc)
        code = exc.code().name if hasattr(exc, "code") else type(exc).__name__
        out.error = f"{code}: {details}"
    else:
        out.healthy = True
        out.model, out.kind, out.dtype, out.device = info.model, info.kind, info.dtype, info.device
        out.kv_cache_bytes_used, out.kv_cache_bytes_budget = info.kv_cache_bytes_used, info.kv_cache_bytes_budget
        out.prefix_cache_queries, out.prefix_cache_hits = info.prefix_cache_queries, info.prefix_cache_hits
        out.reads_shared_outputs = info.reads_shared_outputs
        out.weights, out.weights_fingerprint = info.weights, info.weights_fingerprint
    out.rtt_ms = (time.perf_counter() - start) * 1e3
    return out


class BackendProbes:
    """The BackendStatus of every current replica (`members()`: (role, backend) pairs), each answer
    reused for `ttl_s`; replicas that joined are asked, those that left are dropped at once."""

    def __init__(self, members: Callable[[], list[tuple[str, object]]], ttl_s: float, timeout_s: float = 2.0) -> None:
        self.members = members
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._recent: dict[tuple[str, str], tuple[float, asyncio.Future]] = {}  # (role, address) -> (asked at, answer)

    async def statuses(self) -> list[pb.BackendStatus]:
        now, current = time.monotonic(), self.members()
        futures = []
        for role, backend in current:
            key = (role, backend.address)
            asked = self._recent.get(key)
            if asked is None or now - asked[0] >= self.ttl_s:
                asked = (now, asyncio.ensure_future(backend_status(role, backend, self.timeout_s)))
                self._recent[key] = asked
            futures.append(asked[1])
        keys = {(role, backend.address) for role, backend in current}
        for key in [k for k in self._recent if k not in keys]:
            del self._recent[key]
        # Awaited one by one (they run at once): a caller that leaves cancels none of them.
        return [_copy(f.result() if f.done() else await asyncio.shield(f)) for f in futures]


def _copy(status: pb.BackendStatus) -> pb.BackendStatus:
    out = pb.BackendStatus()
    out.CopyFrom(status)
    return out


async def status(counters: Counters, probes: BackendProbes, default_draft_length: int | str) -> pb.GetStatusResponse:
    reply = pb.GetStatusResponse(version=specdec_version(), default_draft_length=str(default_draft_length))
    counters.fill(reply)
    reply.backends.extend(await probes.statuses())
    return reply
