"""gRPC translation for the target service; the logic lives in specdec.runtime.verifier."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from specdec.errors import grpc_errors
from specdec.runtime.verifier import Verifier
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.wire import probs_from_bytes, sampling_from_pb


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, verifier: Verifier, info: common_pb2.ModelInfo, executor: ThreadPoolExecutor) -> None:
        self.verifier = verifier
        self.info = info
        self.executor = executor

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    @grpc_errors
    async def Verify(self, request: target_pb2.VerifyRequest, context):
        params = sampling_from_pb(request.sampling)
        draft_tokens = list(request.draft_tokens)
        q = probs_from_bytes(request.draft_probs, len(draft_tokens), self.info.vocab_size)
        result = await self._run(self.verifier.verify, request.session_id, list(request.history),
                                 draft_tokens, q, params, request.seed)
        return target_pb2.VerifyResponse(
            num_accepted=result.verdict.num_accepted, token_id=result.verdict.token,
            bonus=result.verdict.bonus, compute_ns=result.compute_ns, prefill_tokens=result.prefill_tokens,
        )

    @grpc_errors
    async def Rollback(self, request, context):
        length = await self._run(self.verifier.caches.rollback, request.session_id, request.length)
        return common_pb2.RollbackResponse(length=length)

    @grpc_errors
    async def Release(self, request, context):
        released = await self._run(self.verifier.caches.release, request.session_id)
        return common_pb2.ReleaseResponse(released=released)

    @grpc_errors
    async def GetInfo(self, request, context):
        info = common_pb2.ModelInfo()
        info.CopyFrom(self.info)
        info.cached_sessions = len(self.verifier.caches)
        return info
