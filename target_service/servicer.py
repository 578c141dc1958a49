"""gRPC translation for the target service; the logic lives in specdec.runtime (verifier, batching)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from specdec.core.logprobs import MAX_TOP_LOGPROBS
from specdec.defaults import MAX_DECODE_STEPS
from specdec.errors import DeadlineExceeded, InvalidArgument
from specdec.rpc_errors import grpc_errors
from specdec.runtime.batching import Batcher
from specdec.runtime.grammars import prepare
from specdec.runtime.verifier import LogprobRequest, Verifier
from specdec.server.admission import Admission, deadline_of
from specdec.server.model_service import ModelServicer
from specdec.server.wire import followers_from_pb, logprobs_to_pb, probs_from_bytes
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.ahead import DecodeAhead


class TargetServicer(ModelServicer, target_pb2_grpc.TargetServiceServicer):
    """Verify; Release, SaveSnapshot and GetInfo: `ModelServicer`."""

    def __init__(self, verifier: Verifier, info: common_pb2.ModelInfo, batcher: Batcher,
                 admission: Admission, logprobs_mode: str = "raw") -> None:
        super().__init__(info, admission, batcher)
        self.verifier = verifier
        self.batcher: Batcher = batcher
        self.ahead = DecodeAhead(batcher, verifier, info.eos_token_ids)
        self._decoding: dict[str, set[asyncio.Event]] = {}  # `_decode_more` loops by session (a Release stops them)
        self.logprobs_mode = logprobs_mode

    @grpc_errors
    async def ScoreTokens(self, request: target_pb2.ScoreTokensRequest, context):
        arrived = time.monotonic()
        params = None if request.raw else self.constants.resolve(request.session_id, request.sampling,
                                                                 self.info.vocab_size)
        if request.top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be 0..{MAX_TOP_LOGPROBS}, got {request.top_logprobs}")
        deadline = deadline_of(context)
        async with self.admission.slot(deadline, context):
            await prepare(self.verifier.grammars, params)  # compiled off the model thread
            job = self.verifier.score_job(request.session_id, list(request.tokens), request.start,
                                          LogprobRequest(request.top_logprobs, self.logprobs_mode), params, deadline)
            job.enqueued = arrived
            job.sent_unix_ns = request.sent_unix_ns
            entries, compute_ns = [], 0
            async for step_entries, step in self.batcher.stream(job):  # a step's positions at a time
                entries.extend(logprobs_to_pb(e) for e in step_entries)
                compute_ns += step.compute_ns
        return target_pb2.ScoreTokensResponse(logprobs=entries, compute_ns=compute_ns)

    @grpc_errors
    async def Verify(self, request: target_pb2.VerifyRequest, context):
        return await self._verify(request, context)

    @grpc_errors
    async def VerifyStream(self, requests: AsyncIterator[target_pb2.VerifyRequest], context):
        """Verify, request after request on one call; an error ends the call with its status (see
        `requests_of` for a stop while the call waits)."""
        async for request in self.requests_of(requests):
            yield await self._verify(request, context)

    async def Release(self, request: common_pb2.ReleaseRequest, context) -> common_pb2.ReleaseResponse:
        self.ahead.cancel(request.session_id)  # (its job goes with the session's other work)
        for stop in self._decoding.get(request.session_id, ()):
            stop.set()  # no further pass of a request with decode_steps
        return await super().Release(request, context)

    async def _verify(self, request: target_pb2.VerifyRequest, context) -> target_pb2.VerifyResponse:
        arrived = time.monotonic()
        params = self.constants.resolve(request.session_id, request.sampling, self.info.vocab_size)
        if request.top_logprobs > MAX_TOP_LOGPROBS or (request.top_logprobs and not request.logprobs):
            raise InvalidArgument(f"top_logprobs must be 0..{MAX_TOP_LOGPROBS} and needs logprobs set, "
                                  f"got {request.top_logprobs}")
        logprobs = LogprobRequest(request.top_logprobs, self.logprobs_mode) if request.logprobs else None
        draft_tokens = list(request.draft_tokens)
        steps = max(1, request.decode_steps)
        if steps > MAX_DECODE_STEPS or (steps > 1 and draft_tokens):
            raise InvalidArgument(f"decode_steps must be 0..{MAX_DECODE_STEPS} and at most 1 with draft tokens, got "
                                  f"{request.decode_steps} with {len(draft_tokens)}: send the block alone")
        q = probs_from_bytes(request.draft_probs, len(draft_tokens), self.info.vocab_size)
        deadline = deadline_of(context, request.timeout_ms, arrived)
        history = list(request.history)
        listed = followers_from_pb(request)  # (checked even when `continues` makes it moot)
        followers = None if request.continues or steps > 1 else listed  # `continues` follows whatever is emitted
        follow = request.continues or followers is not None or steps > 1  # further passes follow this one
        async with self.admission.slot(deadline, context):
            await prepare(self.verifier.grammars, params)  # compiled off the model thread
            job = self.verifier.job(request.session_id, history, draft_tokens, q, params, request.seed, deadline,
                                    logprobs)
            guessed = await self.ahead.take(request.session_id, history, draft_tokens, params, request.seed,
                                            logprobs, follow, request.sent_unix_ns, followers)
            if guessed is None:
                job.enqueued = arrived  # the queue wait includes the admission queue
                job.sent_unix_ns = request.sent_unix_ns
                if follow:
                    self.ahead.plan(job, request.sent_unix_ns, followers=followers)
                verified, step = await self.batcher.run(job)
            else:
                verified, step = guessed
                step = replace(step, queue_ns=0)  # it ran before the request came
            verdict = verified.verdict
            reply = target_pb2.VerifyResponse(
                num_accepted=verdict.num_accepted, token_id=verdict.token, bonus=verdict.bonus,
                compute_ns=step.compute_ns, prefill_tokens=verified.prefilled, batch_size=step.batch_size,
                queue_ns=step.queue_ns, batch_positions=step.positions,
                logprobs=[logprobs_to_pb(entry) for entry in verified.logprobs], decoded_ahead=guessed is not None,
            )
            if steps > 1:
                await self._decode_more(request, reply, history + [verdict.token], steps - 1, params, logprobs,
                                        deadline)
        return reply

    async def _decode_more(self, request: target_pb2.VerifyRequest, reply: target_pb2.VerifyResponse,
                           history: list[int], steps: int, params, logprobs: LogprobRequest | None,
                           deadline: float | None) -> None:
        """The further passes of a request with decode_steps, into `reply`: up to `steps` k = 0 rounds
        after `history` (which ends with the reply's token), each the job its own request would make,
        submitted by the batcher the moment the pass before it ends (`DecodeAhead`; when the batcher
        has other sessions' work, in turn with it)."""
        stop = asyncio.Event()
        self._decoding.setdefault(request.session_id, set()).add(stop)
        try:
            await self._decode_passes(request, reply, history, steps, params, logprobs, deadline, stop)
        finally:
            loops = self._decoding[request.session_id]
            loops.discard(stop)
            if not loops:
                del self._decoding[request.session_id]

    async def _decode_passes(self, request: target_pb2.VerifyRequest, reply: target_pb2.VerifyResponse,
                             history: list[int], steps: int, params, logprobs: LogprobRequest | None,
                             deadline: float | None, stop: asyncio.Event) -> None:
        for left in range(steps, 0, -1):
            if self.ahead.ends_text(history[-1], params) or len(history) > self.info.max_context or stop.is_set():
                return
            follows = left > 1 or request.continues
            guessed = await self.ahead.take(request.session_id, history, [], params, request.seed, logprobs,
                                            follows, request.sent_unix_ns)
            if stop.is_set():
                return  # released while the guess ran (it was cancelled): no pass after the Release
            if guessed is None:
                job = self.verifier.job(request.session_id, history, [], None, params, request.seed, deadline,
                                        logprobs)
                job.sent_unix_ns = request.sent_unix_ns  # a Release sent after the request drops it
                if follows:
                    self.ahead.plan(job, request.sent_unix_ns)
                try:
                    verified, step = await self.batcher.run(job)
                except DeadlineExceeded:
                    return  # the request's time is up: it has the tokens so far
                if stop.is_set():
                    return  # released while the pass ran
            else:
                verified, step = guessed
            token = verified.verdict.token
            reply.decoded.append(token)
            reply.logprobs.extend(logprobs_to_pb(entry) for entry in verified.logprobs)
            reply.compute_ns += step.compute_ns
            reply.queue_ns += 0 if guessed is not None else step.queue_ns
            history = history + [token]
