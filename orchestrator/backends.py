"""Clients of the draft and target services, with timing, as the loop sees them.

A generation's logit_bias and grammar go to each replica once per session: a replica that says
it keeps them (`ModelInfo.caches_sampling_constants`) gets their digest alone on later calls,
and a replica that answers NOT_FOUND to that (it lost them) gets the call again with them
(`specdec.server.constants`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from specdec.channel import channel
from specdec.core.sampling import SamplingParams
from specdec.errors import Cancelled, InvalidArgument, SpecdecError, Unavailable
from specdec.rpc_errors import from_backend_error
from specdec.server.tls import ClientTLS
from specdec.server.wire import constants_digest, followers_from_pb, followers_to_pb, sampling_to_pb
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger("specdec.orchestrator")

# `Proposal.source` as the orchestrator names it (metrics labels, per-source controller state).
SOURCE_NAMES = {draft_pb2.DRAFT_SOURCE_MODEL: "model", draft_pb2.DRAFT_SOURCE_NGRAM: "ngram",
                draft_pb2.DRAFT_SOURCE_SUFFIX: "suffix"}


@dataclass
class DraftReply:
    """What the draft proposed for one round (streamed in; `into` lets the loop watch it grow)."""

    tokens: list[int] = field(default_factory=list)
    probs: list[bytes] = field(default_factory=list)  # one float32 row per token, or empty
    wall_ns: int = 0
    compute_ns: int = 0
    prefill_tokens: int = 0  # history tokens the draft (re-)prefilled before proposing
    drafted: int = 0  # tokens the draft computed (more than `tokens` when drafted ahead)
    source: str = ""  # the proposer that drafted them (`SOURCE_NAMES`; "" when unknown or nothing was proposed)
    followers: frozenset[int] | None = None  # `ProposeBlock.followers` (None: not listed, or a Propose call)


@dataclass
class VerifyReply:
    """The target's verdict on a draft block, with timing: `num_accepted` draft tokens kept, then
    `token_id` (recovered at the first rejection, or the bonus when all were accepted)."""

    num_accepted: int
    token_id: int
    bonus: bool
    wall_ns: int
    compute_ns: int
    queue_ns: int = 0  # waited in the target's queues before the pass
    batch_size: int = 1  # sessions in the same pass
    batch_positions: int = 0  # positions that pass scored (0: not reported)
    prefill_tokens: int = 0  # history tokens the target (re-)prefilled before verifying
    logprobs: list = field(default_factory=list)  # common_pb2.TokenLogprobs per emitted token, when asked
    decoded_ahead: bool = False  # answered from a pass the target ran before the request came
    decoded: list[int] = field(default_factory=list)  # tokens of the further passes a request at k = 0 asked

    def emitted(self, draft_tokens: list[int]) -> list[int]:
        """The round's tokens: the accepted draft prefix, then the target's own token (and at k = 0
        those of its further passes, `decode_steps`)."""
        return draft_tokens[:self.num_accepted] + [self.token_id] + self.decoded


@dataclass
class ScoreReply:
    """Log-probabilities of scored tokens (common_pb2.TokenLogprobs each), with timing."""

    logprobs: list
    wall_ns: int
    compute_ns: int


class Busy(Unavailable):
    """A replica answered RESOURCE_EXHAUSTED, or did not answer within the call's own time limit (not
    the request's deadline): it may be alive and only loaded. The pool asks before calling it dead."""

    def __init__(self, message: str, retry_after_s: float = 0.0, timed_out: bool = False) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.timed_out = timed_out


class DraftUnavailable(Exception):
    """The draft failed or timed out; the round falls back to plain decoding."""


class Released(Exception):
    """A service dropped the call (CANCELLED from its side) because the session's caches were
    released after the call was sent: the cleanup of an earlier request on the session, e.g. one
    a resume took over from. The replica is healthy; the same call sent again runs."""


class DraftReleased(Released, DraftUnavailable):
    """`Released` from the draft: like any unusable draft, the round falls back to plain decoding."""


def _stale_call(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a call opened earlier failed because its connection is gone: UNAVAILABLE, or the
    client's own write failing as the connection closes under it (gRPC core reports that as INTERNAL
    "Internal error from Core": the request never left, so it is safe to send it again)."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE or (
        exc.code() == grpc.StatusCode.INTERNAL and exc.details() == "Internal error from Core")


async def _exchange(call: grpc.aio.StreamStreamCall, request, timeout: float):
    """Write one request on a streaming call and read its answer, within `timeout` seconds."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):  # no task of its own, unlike wait_for
            await call.write(request)
            return await call.read()

    async def both():
        await call.write(request)
        return await call.read()

    return await asyncio.wait_for(both(), timeout)  # pragma: no cover - Python 3.10


def _add(proposal: DraftReply, msg: draft_pb2.Proposal) -> None:
    """One proposed token into the reply being collected."""
    proposal.tokens.append(msg.token_id)
    proposal.source = SOURCE_NAMES.get(msg.source, "")
    if msg.probs:
        proposal.probs.append(msg.probs)
    proposal.compute_ns += msg.compute_ns
    proposal.prefill_tokens += msg.prefill_tokens


MAX_IDLE_STREAMS = 64  # idle long-lived calls a client keeps open to a replica (more are closed)
MAX_SENT = 100_000  # sessions whose sampling constants a client remembers a replica holds (oldest forgotten)


class _ModelBackend:
    """What draft and target clients share: a channel, GetInfo, Release, SaveSnapshot and close, and
    which sessions' sampling constants the replica holds."""

    def __init__(self, address: str, timeout_s: float, stub_class, tls: ClientTLS | None = None,
                 stream: bool = False) -> None:
        self.address = address
        self.timeout_s = timeout_s
        secure = tls is not None and tls.enabled
        self._channel = channel(address, tls.credentials() if secure else None, tls.options() if secure else ())
        self.stub = stub_class(self._channel)
        self.keeps_constants = False  # from its GetInfo: it keeps each session's logit_bias and grammar
        self._sent: OrderedDict[str, bytes] = OrderedDict()  # session -> digest of the constants it was sent
        self.stream = stream  # send the per-round RPC over long-lived calls (`_on_stream`)
        self._idle: list[grpc.aio.StreamStreamCall] = []  # open long-lived calls with nothing in flight

    def _open_stream(self) -> grpc.aio.StreamStreamCall:
        """A new long-lived call of the per-round RPC (VerifyStream, ProposeStream)."""
        raise NotImplementedError

    async def _on_stream(self, request, timeout: float, rpc: str):
        """`request` on an idle long-lived call (or a new one), within `timeout` seconds, which it also
        carries (`timeout_ms`: the replica drops it if still queued by then); fails as a call of its own
        would (AioRpcError). None when the replica lacks the RPC (`rpc`, for the log): `stream` is off
        from then on and the caller sends the request its own way."""
        request.timeout_ms = max(1, math.ceil(timeout * 1e3))
        for _ in range(2):
            call, reused = self._take_stream()
            try:
                reply = await _exchange(call, request, timeout)
            except asyncio.TimeoutError:
                call.cancel()
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "Deadline Exceeded") from None
            except grpc.aio.AioRpcError as exc:
                call.cancel()
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED and not reused:
                    log.info("%s has no %s: a call a round from now on", self.address, rpc)
                    self.stream = False
                    return None
                if reused and _stale_call(exc):
                    continue  # opened before the replica went away or restarted: once more on a new call
                raise
            except BaseException:  # cancelled by our caller: where the call stands is unknown
                call.cancel()
                raise
            if reply is grpc.aio.EOF:  # the replica ended the call (it is stopping) before answering
                call.cancel()
                if reused:
                    continue
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           f"the replica ended the {rpc} call without an answer")
            if len(self._idle) < MAX_IDLE_STREAMS:
                self._idle.append(call)
            else:
                call.cancel()
            return reply
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   f"the replica ended two {rpc} calls in a row")

    def _take_stream(self) -> tuple[grpc.aio.StreamStreamCall, bool]:
        """An open idle long-lived call (reused: True), else a new one."""
        while self._idle:
            call = self._idle.pop()
            if not call.done():
                return call, True
        return self._open_stream(), False

    async def info(self, timeout: float = 10.0, wait: bool = True) -> common_pb2.ModelInfo:
        info = await self.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=timeout, wait_for_ready=wait)
        self.keeps_constants = info.caches_sampling_constants
        return info

    def _sampling(self, session_id: str, params: SamplingParams, resend: bool = False) -> common_pb2.SamplingParams:
        """The call's sampling message: with the constants, unless the replica keeps them and was sent
        these already for the session (`resend`: it said it lost them)."""
        digest = constants_digest(params)
        held = digest and self.keeps_constants and not resend and self._sent.get(session_id) == digest
        return sampling_to_pb(params, constants=not held)

    def _sent_constants(self, session_id: str, msg: common_pb2.SamplingParams) -> None:
        """The call carrying `msg` succeeded: the replica holds what it carried."""
        if msg.constants_digest and (msg.logit_bias or msg.grammar_kind or msg.grammar_text):
            self._sent[session_id] = msg.constants_digest
            self._sent.move_to_end(session_id)
            while len(self._sent) > MAX_SENT:
                self._sent.popitem(last=False)

    def _lost_constants(self, exc: grpc.aio.AioRpcError, session_id: str, msg: common_pb2.SamplingParams) -> bool:
        """Whether a failed call was refused because the replica no longer holds the constants it was
        named by digest (NOT_FOUND): the call goes again with them."""
        lost = exc.code() == grpc.StatusCode.NOT_FOUND and bool(msg.constants_digest) and not msg.grammar_kind \
            and not msg.logit_bias and not msg.grammar_text
        if lost:
            self._sent.pop(session_id, None)
            log.info("%s holds no logit_bias and grammar for session %s (restarted or evicted): sent them again",
                     self.address, session_id)
        return lost

    def _timeout(self, remaining: float | None, limit_s: float | None = None) -> float:
        limit = limit_s or self.timeout_s
        return limit if remaining is None else min(limit, remaining)

    def _busy(self, exc: grpc.aio.AioRpcError, remaining: float | None, limit_s: float | None) -> Busy | None:
        """The failure as `Busy` when it may only mean load: RESOURCE_EXHAUSTED, or our own limit passed."""
        code = exc.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            hint = dict(exc.trailing_metadata() or ()).get("retry-after-ms", "0")
            return Busy(f"{self.address} is overloaded: {exc.details()}", float(hint or 0) / 1e3)
        limit = limit_s or self.timeout_s
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and (remaining is None or remaining > limit):
            return Busy(f"{self.address} did not answer within {limit:.1f}s", timed_out=True)
        return None

    def _failure(self, exc: grpc.aio.AioRpcError, passed_on: tuple[grpc.StatusCode, ...], remaining: float | None,
                 doing: str) -> SpecdecError:
        """The typed error of a failed call (specdec.errors); `remaining` cut it if shorter than ours."""
        cut = remaining is not None and remaining < self.timeout_s
        return from_backend_error(exc, passed_on, request_deadline=doing if cut else "")

    async def release(self, session_id: str, forget_output: bool = True) -> None:
        self._sent.pop(session_id, None)
        request = common_pb2.ReleaseRequest(session_id=session_id, sent_unix_ns=time.time_ns(),
                                            forget_output=forget_output)
        await self.stub.Release(request, timeout=self.timeout_s)

    async def save_snapshot(self, session_id: str) -> int:
        """Ask this replica to write the session's KV cache to Redis; the tokens it covers."""
        reply = await self.stub.SaveSnapshot(common_pb2.SaveSnapshotRequest(session_id=session_id),
                                             timeout=self.timeout_s)
        return reply.tokens

    async def close(self) -> None:
        for call in self._idle:
            call.cancel()
        self._idle.clear()
        await self._channel.close()


class DraftBackend(_ModelBackend):
    """Calls one draft replica; a failure raises DraftUnavailable (the round falls to k = 0).

    With `stream` (the default) a round's Propose goes over a long-lived ProposeStream call, one
    request in flight on each, the block in one message; a block whose tokens are taken as they
    come (`progress`, a block drafted ahead) is a Propose call of its own. A replica without
    ProposeStream (UNIMPLEMENTED) is sent Propose calls from then on.
    """

    def __init__(self, address: str, timeout_s: float, tls: ClientTLS | None = None, stream: bool = True) -> None:
        super().__init__(address, timeout_s, draft_pb2_grpc.DraftServiceStub, tls, stream)

    def _open_stream(self) -> grpc.aio.StreamStreamCall:
        return self.stub.ProposeStream()

    async def propose(self, session_id: str, history: list[int], k: int, params: SamplingParams,
                      seed: int, fingerprint: str, into: DraftReply | None = None,
                      progress: asyncio.Event | None = None, timeout: float | None = None,
                      corpus_group: str = "", sources: Sequence[str] = ()) -> DraftReply:
        """Collect the streamed proposals (into `into`, as they arrive, if given).

        `timeout` is what is left of the request's deadline (the call's own limit if shorter);
        `corpus_group`: whose earlier outputs may draft it (orchestrator.corpus); `sources`: the
        draft's sources that may draft it (empty: any).
        """
        start = time.perf_counter_ns()
        request = draft_pb2.ProposeRequest(
            session_id=session_id, history=history, num_tokens=k, sampling=self._sampling(session_id, params),
            seed=seed, tokenizer_fingerprint=fingerprint, sent_unix_ns=time.time_ns(), corpus_group=corpus_group,
            sources=list(sources),
        )
        proposal = into if into is not None else DraftReply()
        try:
            await self._stream(request, proposal, progress, timeout)
        except grpc.aio.AioRpcError as exc:
            if proposal.tokens or not self._lost_constants(exc, session_id, request.sampling):
                raise self._propose_failure(exc, timeout) from exc
            request.sampling.CopyFrom(self._sampling(session_id, params, resend=True))
            try:
                await self._stream(request, proposal, progress, timeout)
            except grpc.aio.AioRpcError as again:
                raise self._propose_failure(again, timeout) from again
        self._sent_constants(session_id, request.sampling)
        proposal.wall_ns = time.perf_counter_ns() - start
        proposal.drafted = len(proposal.tokens)
        return proposal

    async def _stream(self, request: draft_pb2.ProposeRequest, proposal: DraftReply, progress: asyncio.Event | None,
                      timeout: float | None) -> None:
        if self.stream and progress is None:
            block = await self._on_stream(request, self._timeout(timeout), "ProposeStream")
            if block is not None:
                for msg in block.proposals:
                    _add(proposal, msg)
                try:
                    proposal.followers = followers_from_pb(block)
                except InvalidArgument:  # a draft that lists more than a target takes: not listed
                    proposal.followers = None
                return
        async for msg in self.stub.Propose(request, timeout=self._timeout(timeout)):
            _add(proposal, msg)
            if progress is not None:
                progress.set()

    def _propose_failure(self, exc: grpc.aio.AioRpcError, timeout: float | None) -> Exception:
        error = self._failure(exc, (grpc.StatusCode.FAILED_PRECONDITION,), timeout, "the draft proposed")
        if isinstance(error, Cancelled):
            return DraftReleased(str(error))
        if isinstance(error, Unavailable):
            return DraftUnavailable(str(error))
        return error


class TargetBackend(_ModelBackend):
    """Calls one target replica; a transport failure raises Unavailable (another may take over).

    With `stream` (the default) verifies go over long-lived VerifyStream calls, one request in
    flight on each: a call is taken from the idle ones (or opened), used for one round and put back.
    That saves a call's setup on every round. A call that fails or times out is dropped, never
    reused; a replica without VerifyStream (UNIMPLEMENTED) is sent Verify calls from then on.
    """

    def __init__(self, address: str, timeout_s: float, tls: ClientTLS | None = None, stream: bool = True) -> None:
        super().__init__(address, timeout_s, target_pb2_grpc.TargetServiceStub, tls, stream)

    def _open_stream(self) -> grpc.aio.StreamStreamCall:
        return self.stub.VerifyStream()

    def _call_failure(self, exc: grpc.aio.AioRpcError, remaining: float | None, limit_s: float | None,
                      doing: str) -> Exception:
        """What a failed Verify or ScoreTokens means: Busy (maybe only loaded), Released (the session's
        caches were released after it was sent), the request's own error, or Unavailable."""
        busy = self._busy(exc, remaining, limit_s)
        if busy is not None:
            return busy
        error = self._failure(exc, (grpc.StatusCode.INVALID_ARGUMENT,), remaining, doing)
        if isinstance(error, Cancelled):
            return Released(str(error))
        if isinstance(error, Unavailable):
            return Unavailable(f"target service at {self.address} failed ({error}); "
                               "the session is kept, retry the request")
        return error

    async def verify(self, session_id: str, history: list[int], proposal: DraftReply, params: SamplingParams,
                     seed: int, timeout: float | None = None, top_logprobs: int | None = None,
                     limit_s: float | None = None, continues: bool = False,
                     followers: frozenset[int] | None = None, decode_steps: int = 1) -> VerifyReply:
        """`top_logprobs`: None for no log-probabilities, else how many alternatives with each;
        `limit_s`: this call's own time limit (default --target-timeout-s); `continues`: the next
        round follows this one's answer at k = 0 (the target may verify it ahead); `followers`: the
        draft's followers of the block (the next round drafts nothing after any other token);
        `decode_steps`: with no draft tokens, up to this many k = 0 rounds' tokens in this call."""
        start = time.perf_counter_ns()
        request = target_pb2.VerifyRequest(
            session_id=session_id, history=history, draft_tokens=proposal.tokens,
            draft_probs=b"".join(proposal.probs), sampling=self._sampling(session_id, params), seed=seed,
            sent_unix_ns=time.time_ns(), logprobs=top_logprobs is not None, top_logprobs=top_logprobs or 0,
            continues=continues, decode_steps=decode_steps if decode_steps > 1 else 0,
        )
        if followers is not None:
            followers_to_pb(request, followers)
        reply = await self._unary(self._verify_call, request, params, timeout, limit_s, "the target verified")
        if len(reply.decoded) >= max(decode_steps, 1) or (reply.decoded and proposal.tokens):
            raise Unavailable(f"target service at {self.address} answered {len(reply.decoded)} further tokens to a "
                              f"request of {len(proposal.tokens)} draft tokens and decode_steps {decode_steps}")
        return VerifyReply(reply.num_accepted, reply.token_id, reply.bonus,
                       time.perf_counter_ns() - start, reply.compute_ns, reply.queue_ns, max(1, reply.batch_size),
                       reply.batch_positions, reply.prefill_tokens, list(reply.logprobs), reply.decoded_ahead,
                       list(reply.decoded))

    async def score(self, session_id: str, tokens: list[int], start: int, top: int, params: SamplingParams | None,
                    timeout: float | None = None, limit_s: float | None = None) -> ScoreReply:
        """Log-probabilities of tokens[start:] (start >= 1), each after the tokens before it, from one
        pass that also leaves them in the session's cache. `params` None: the raw distribution;
        else the one the service's --logprobs-mode names under `params`."""
        begin = time.perf_counter_ns()
        request = target_pb2.ScoreTokensRequest(
            session_id=session_id, tokens=tokens, start=start, top_logprobs=top, raw=params is None,
            sampling=self._sampling(session_id, params) if params is not None else None, sent_unix_ns=time.time_ns())
        reply = await self._unary(self.stub.ScoreTokens, request, params, timeout, limit_s, "the target scored")
        return ScoreReply(list(reply.logprobs), time.perf_counter_ns() - begin, reply.compute_ns)

    async def _verify_call(self, request: target_pb2.VerifyRequest, timeout: float) -> target_pb2.VerifyResponse:
        """One Verify, on an idle VerifyStream call when streaming; fails as a Verify call would (AioRpcError)."""
        if self.stream:
            reply = await self._on_stream(request, timeout, "VerifyStream")
            if reply is not None:
                return reply
        return await self.stub.Verify(request, timeout=timeout)

    async def _unary(self, method, request, params: SamplingParams | None, timeout: float | None,
                     limit_s: float | None, doing: str):
        """One Verify or ScoreTokens, sent again with the sampling constants if the replica lost them."""
        for resend in (False, True):
            try:
                reply = await method(request, timeout=self._timeout(timeout, limit_s))
            except grpc.aio.AioRpcError as exc:
                if resend or params is None or not self._lost_constants(exc, request.session_id, request.sampling):
                    raise self._call_failure(exc, timeout, limit_s, doing) from exc
                request.sampling.CopyFrom(self._sampling(request.session_id, params, resend=True))
                continue
            if params is not None:
                self._sent_constants(request.session_id, request.sampling)
            return reply
        raise AssertionError("unreachable")
