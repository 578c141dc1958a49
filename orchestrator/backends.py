"""Clients of the draft and target services, with timing, as the loop sees them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from specdec.core.sampling import SamplingParams
from specdec.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from specdec.channel import channel
from specdec.server.tls import ClientTLS
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.server.wire import sampling_to_pb


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    probs: list[bytes] = field(default_factory=list)  # one float32 row per token, or empty
    wall_ns: int = 0
    compute_ns: int = 0
    prefill_tokens: int = 0  # history tokens the draft (re-)prefilled before proposing
    drafted: int = 0  # tokens the draft computed (more than `tokens` when drafted ahead)


@dataclass
class Verdict:
    num_accepted: int
    token_id: int
    bonus: bool
    wall_ns: int
    compute_ns: int
    queue_ns: int = 0  # waited in the target's queues before the pass
    batch_size: int = 1  # sessions in the same pass
    batch_positions: int = 0  # positions that pass scored (0: not reported)
    prefill_tokens: int = 0  # history tokens the target (re-)prefilled before verifying


class DraftUnavailable(Exception):
    """The draft failed or timed out; the round falls back to plain decoding."""


class Released(Exception):
    """A service dropped the call (CANCELLED from its side) because the session's caches were
    released after the call was sent: the cleanup of an earlier request on the session, e.g. one
    a resume took over from. The replica is healthy; the same call sent again runs."""


class DraftReleased(Released, DraftUnavailable):
    """`Released` from the draft: like any unusable draft, the round falls back to plain decoding."""


class _ModelBackend:
    """What draft and target clients share: a channel, GetInfo, Release, SaveSnapshot and close."""

    def __init__(self, address: str, timeout_s: float, stub_class, tls: ClientTLS | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        secure = tls is not None and tls.enabled
        self._channel = channel(address, tls.credentials() if secure else None, tls.options() if secure else ())
        self.stub = stub_class(self._channel)

    async def info(self, timeout: float = 10.0, wait: bool = True) -> common_pb2.ModelInfo:
        return await self.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=timeout, wait_for_ready=wait)

    def _timeout(self, remaining: float | None) -> float:
        return self.timeout_s if remaining is None else min(self.timeout_s, remaining)

    async def release(self, session_id: str) -> None:
        await self.stub.Release(common_pb2.ReleaseRequest(session_id=session_id, sent_unix_ns=time.time_ns()), timeout=self.timeout_s)

    async def save_snapshot(self, session_id: str) -> int:
        """Ask this replica to write the session's KV cache to Redis; the tokens it covers."""
        reply = await self.stub.SaveSnapshot(common_pb2.SaveSnapshotRequest(session_id=session_id),
                                             timeout=self.timeout_s)
        return reply.tokens

    async def close(self) -> None:
        await self._channel.close()


class DraftBackend(_ModelBackend):
    """Calls one draft replica; a failure raises DraftUnavailable (the round falls to k = 0)."""

    def __init__(self, address: str, timeout_s: float, tls: ClientTLS | None = None) -> None:
        super().__init__(address, timeout_s, draft_pb2_grpc.DraftServiceStub, tls)

    async def propose(self, session_id: str, history: list[int], k: int, params: SamplingParams,
                      seed: int, fingerprint: str, into: Proposal | None = None,
                      progress: asyncio.Event | None = None, timeout: float | None = None) -> Proposal:
        """Collect the streamed proposals (into `into`, as they arrive, if given).

        `timeout` is what is left of the request's deadline (the call's own limit if shorter).
        """
        start = time.perf_counter_ns()
        request = draft_pb2.ProposeRequest(
            session_id=session_id, history=history, num_tokens=k, sampling=sampling_to_pb(params),
            seed=seed, tokenizer_fingerprint=fingerprint, sent_unix_ns=time.time_ns(),
        )
        proposal = into if into is not None else Proposal()
        try:
            async for msg in self.stub.Propose(request, timeout=self._timeout(timeout)):
                proposal.tokens.append(msg.token_id)
                if msg.probs:
                    proposal.probs.append(msg.probs)
                proposal.compute_ns += msg.compute_ns
                proposal.prefill_tokens += msg.prefill_tokens
                if progress is not None:
                    progress.set()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise FailedPrecondition(exc.details()) from exc
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None and timeout < self.timeout_s:
                raise DeadlineExceeded("the request's deadline passed while the draft proposed") from exc
            if exc.code() == grpc.StatusCode.CANCELLED:  # by the server: our own cancel raises CancelledError
                raise DraftReleased(exc.details()) from exc
            raise DraftUnavailable(f"{exc.code().name}: {exc.details()}") from exc
        proposal.wall_ns = time.perf_counter_ns() - start
        proposal.drafted = len(proposal.tokens)
        return proposal


class TargetBackend(_ModelBackend):
    """Calls one target replica; a transport failure raises Unavailable (another may take over)."""

    def __init__(self, address: str, timeout_s: float, tls: ClientTLS | None = None) -> None:
        super().__init__(address, timeout_s, target_pb2_grpc.TargetServiceStub, tls)

    async def verify(self, session_id: str, history: list[int], proposal: Proposal, params: SamplingParams,
                     seed: int, timeout: float | None = None) -> Verdict:
        start = time.perf_counter_ns()
        request = target_pb2.VerifyRequest(
            session_id=session_id, history=history, draft_tokens=proposal.tokens,
            draft_probs=b"".join(proposal.probs), sampling=sampling_to_pb(params), seed=seed,
            sent_unix_ns=time.time_ns(),
        )
        try:
            reply = await self.stub.Verify(request, timeout=self._timeout(timeout))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(exc.details()) from exc
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None and timeout < self.timeout_s:
                raise DeadlineExceeded("the request's deadline passed while the target verified") from exc
            if exc.code() == grpc.StatusCode.CANCELLED:  # by the server: our own cancel raises CancelledError
                raise Released(exc.details()) from exc
            raise Unavailable(
                f"target service at {self.address} failed ({exc.code().name}: {exc.details()}); "
                "the session is kept, retry the request"
            ) from exc
        return Verdict(reply.num_accepted, reply.token_id, reply.bonus,
                       time.perf_counter_ns() - start, reply.compute_ns, reply.queue_ns, max(1, reply.batch_size),
                       reply.batch_positions, reply.prefill_tokens)
