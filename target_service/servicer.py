"""gRPC translation for the target service; the logic lives in specdec.runtime (verifier, batching)."""

from __future__ import annotations

import time

from specdec.server.admission import Admission, deadline_of
from specdec.errors import InvalidArgument, grpc_errors
from specdec.runtime.batching import Batcher
from specdec.runtime.snapshot import drop_snapshot, save_snapshot
from specdec.runtime.verifier import Verifier
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.server.wire import probs_from_bytes, sampling_from_pb


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, verifier: Verifier, info: common_pb2.ModelInfo, batcher: Batcher,
                 admission: Admission) -> None:
        self.verifier = verifier
        self.info = info
        self.batcher = batcher
        self.admission = admission

    @grpc_errors
    async def Verify(self, request: target_pb2.VerifyRequest, context):
        arrived = time.monotonic()
        params = sampling_from_pb(request.sampling)
        draft_tokens = list(request.draft_tokens)
        q = probs_from_bytes(request.draft_probs, len(draft_tokens), self.info.vocab_size)
        deadline = deadline_of(context)
        async with self.admission.slot(deadline, context):
            job = self.verifier.job(request.session_id, list(request.history), draft_tokens, q, params,
                                    request.seed, deadline)
            job.enqueued = arrived  # the queue wait includes the admission queue
            job.sent_unix_ns = request.sent_unix_ns
            (verdict, prefilled), step = await self.batcher.run(job)
        return target_pb2.VerifyResponse(
            num_accepted=verdict.num_accepted, token_id=verdict.token, bonus=verdict.bonus,
            compute_ns=step.compute_ns, prefill_tokens=prefilled, batch_size=step.batch_size,
            queue_ns=step.queue_ns, batch_positions=step.positions,
        )

    @grpc_errors
    async def Rollback(self, request, context):
        length = await self.batcher.call(self.verifier.caches.rollback, request.session_id, request.length)
        return common_pb2.RollbackResponse(length=length)

    @grpc_errors
    async def Release(self, request, context):
        self.batcher.cancel_session(request.session_id, request.sent_unix_ns)  # queued work of the session is dropped too
        released = await self.batcher.call(self.verifier.caches.release, request.session_id)
        await drop_snapshot(self.verifier.caches, request.session_id)  # everything held for the session goes
        return common_pb2.ReleaseResponse(released=released)

    @grpc_errors
    async def SaveSnapshot(self, request, context):
        if not request.session_id:
            raise InvalidArgument("session_id is empty")
        tokens, size = await save_snapshot(self.batcher, request.session_id)
        return common_pb2.SaveSnapshotResponse(tokens=tokens, bytes=size)

    @grpc_errors
    async def GetInfo(self, request, context):
        info = common_pb2.ModelInfo()
        info.CopyFrom(self.info)
        caches = self.verifier.caches
        info.cached_sessions = len(caches)
        info.cached_tokens = caches.cached_tokens
        if caches.snapshots is not None:
            info.snapshot_saves, info.snapshot_restores = caches.snapshots.saves, caches.snapshots.restores
        info.running_requests = self.batcher.running
        info.waiting_requests = self.admission.waiting + self.batcher.waiting
        return info
