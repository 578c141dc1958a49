"""gRPC translation for the draft service; the logic lives in specdec.runtime.proposers."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from specdec.errors import FailedPrecondition, InvalidArgument, grpc_errors
from specdec.runtime.proposers import Proposer
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.wire import probs_to_bytes, sampling_from_pb


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, proposer: Proposer, info: common_pb2.ModelInfo, executor: ThreadPoolExecutor) -> None:
        self.proposer = proposer
        self.info = info
        self.executor = executor

    @grpc_errors
    async def Propose(self, request: draft_pb2.ProposeRequest, context):
        params = sampling_from_pb(request.sampling)
        if request.num_tokens < 1:
            raise InvalidArgument("num_tokens must be >= 1 (use the target alone for k = 0)")
        if not request.history:
            raise InvalidArgument("history is empty: send at least one token")
        fingerprint = request.tokenizer_fingerprint
        if fingerprint and fingerprint != self.info.tokenizer_fingerprint:
            raise FailedPrecondition(
                f"tokenizer mismatch: caller has {fingerprint}, draft model {self.info.model!r} has "
                f"{self.info.tokenizer_fingerprint}; start the draft with a model that shares the target's tokenizer"
            )
        loop = asyncio.get_running_loop()
        proposals = self.proposer.propose(request.session_id, list(request.history), request.num_tokens,
                                          params, request.seed)
        index = 0
        while (draft := await loop.run_in_executor(self.executor, next, proposals, None)) is not None:
            yield draft_pb2.Proposal(
                token_id=draft.token_id, index=index, compute_ns=draft.compute_ns,
                prefill_tokens=draft.prefill_tokens,
                probs=b"" if draft.probs is None else probs_to_bytes(draft.probs),
            )
            index += 1

    @grpc_errors
    async def Rollback(self, request, context):
        loop = asyncio.get_running_loop()
        length = await loop.run_in_executor(self.executor, self.proposer.rollback, request.session_id, request.length)
        return common_pb2.RollbackResponse(length=length)

    @grpc_errors
    async def Release(self, request, context):
        loop = asyncio.get_running_loop()
        released = await loop.run_in_executor(self.executor, self.proposer.release, request.session_id)
        return common_pb2.ReleaseResponse(released=released)

    @grpc_errors
    async def GetInfo(self, request, context):
        info = common_pb2.ModelInfo()
        info.CopyFrom(self.info)
        info.cached_sessions = self.proposer.cached_sessions()
        return info
