"""gRPC translation for the draft service; the logic lives in specdec.runtime (proposers, batching)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from specdec.server.admission import Admission, deadline_of
from specdec.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, grpc_errors
from specdec.runtime.batching import Batcher
from specdec.runtime.proposers import ModelProposer, Proposer
from specdec.runtime.snapshot import drop_snapshot, save_snapshot
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.server.wire import probs_to_bytes, sampling_from_pb


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """A model proposer drafts through the batcher; a model-free one (n-gram) runs on `executor`."""

    def __init__(self, proposer: Proposer, info: common_pb2.ModelInfo, admission: Admission,
                 batcher: Batcher | None = None, executor: ThreadPoolExecutor | None = None) -> None:
        if isinstance(proposer, ModelProposer) and batcher is None:
            raise ValueError("a model proposer needs a batcher")
        self.proposer = proposer
        self.info = info
        self.admission = admission
        self.batcher = batcher
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")

    @grpc_errors
    async def Propose(self, request: draft_pb2.ProposeRequest, context):
        arrived = time.monotonic()
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
        deadline = deadline_of(context)
        history = list(request.history)
        async with self.admission.slot(deadline, context):
            if self.batcher is not None:
                job = self.proposer.job(request.session_id, history, request.num_tokens, params, request.seed, deadline)
                job.enqueued = arrived  # the queue wait includes the admission queue
                job.sent_unix_ns = request.sent_unix_ns
                index = 0
                async for draft, step in self.batcher.stream(job):
                    yield draft_pb2.Proposal(
                        token_id=draft.token_id, index=index, compute_ns=step.compute_ns,
                        prefill_tokens=draft.prefill_tokens, batch_size=step.batch_size, queue_ns=step.queue_ns,
                        probs=b"" if draft.probs is None else probs_to_bytes(draft.probs),
                    )
                    index += 1
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceeded("the request's deadline passed while it was queued; dropped before compute")
            loop = asyncio.get_running_loop()
            proposals = self.proposer.propose(request.session_id, history, request.num_tokens, params, request.seed)
            index = 0
            while (draft := await loop.run_in_executor(self.executor, next, proposals, None)) is not None:
                yield draft_pb2.Proposal(
                    token_id=draft.token_id, index=index, compute_ns=draft.compute_ns,
                    prefill_tokens=draft.prefill_tokens, queue_ns=int((time.monotonic() - arrived) * 1e9) if index == 0 else 0,
                    probs=b"" if draft.probs is None else probs_to_bytes(draft.probs),
                )
                index += 1

    async def _call(self, fn, *args):
        if self.batcher is not None:
            return await self.batcher.call(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    @grpc_errors
    async def Rollback(self, request, context):
        length = await self._call(self.proposer.rollback, request.session_id, request.length)
        return common_pb2.RollbackResponse(length=length)

    @grpc_errors
    async def Release(self, request, context):
        if self.batcher is not None:
            self.batcher.cancel_session(request.session_id, request.sent_unix_ns)  # queued or running drafts of the session stop
        released = await self._call(self.proposer.release, request.session_id)
        if self.batcher is not None:  # a model proposer: its snapshot goes too
            await drop_snapshot(self.batcher.caches, request.session_id)
        return common_pb2.ReleaseResponse(released=released)

    @grpc_errors
    async def SaveSnapshot(self, request, context):
        if not request.session_id:
            raise InvalidArgument("session_id is empty")
        if self.batcher is None:  # prompt lookup keeps no KV cache: nothing to save
            return common_pb2.SaveSnapshotResponse(tokens=0, bytes=0)
        tokens, size = await save_snapshot(self.batcher, request.session_id)
        return common_pb2.SaveSnapshotResponse(tokens=tokens, bytes=size)

    @grpc_errors
    async def GetInfo(self, request, context):
        info = common_pb2.ModelInfo()
        info.CopyFrom(self.info)
        info.cached_sessions = self.proposer.cached_sessions()
        info.cached_tokens = self.proposer.cached_tokens()
        snapshots = self.batcher.caches.snapshots if self.batcher is not None else None
        if snapshots is not None:
            info.snapshot_saves, info.snapshot_restores = snapshots.saves, snapshots.restores
        info.running_requests = self.batcher.running if self.batcher is not None else self.admission.running
        info.waiting_requests = self.admission.waiting + (self.batcher.waiting if self.batcher is not None else 0)
        return info
