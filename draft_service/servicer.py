"""gRPC translation for the draft service; the logic lives in specdec.runtime (drafting, proposers, batching)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from specdec.rpc_errors import grpc_errors
from specdec.runtime.batch_drafting import BatchDrafter, BatchItem, FinishedItem, check_batch
from specdec.runtime.batching import Batcher
from specdec.runtime.drafting import Answer, Drafter
from specdec.server.admission import Admission, deadline_of
from specdec.server.model_service import ModelServicer
from specdec.server.wire import followers_to_pb, probs_to_bytes
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

# `DraftToken.source` on the wire (`Proposal.source`).
SOURCES = {"model": draft_pb2.DRAFT_SOURCE_MODEL, "ngram": draft_pb2.DRAFT_SOURCE_NGRAM,
           "suffix": draft_pb2.DRAFT_SOURCE_SUFFIX}


class DraftServicer(ModelServicer, draft_pb2_grpc.DraftServiceServicer):
    """Propose, ProposeStream, ProposeBatch and Release; SaveSnapshot and GetInfo: `ModelServicer`
    (`batcher`: the one running the draft model, if the proposer has one)."""

    def __init__(self, drafter: Drafter, info: common_pb2.ModelInfo, admission: Admission,
                 batcher: Batcher | None = None, batched: BatchDrafter | None = None) -> None:
        super().__init__(info, admission, batcher)
        self.drafter = drafter
        self.batched = batched or BatchDrafter(drafter)

    @grpc_errors
    async def Propose(self, request: draft_pb2.ProposeRequest, context):
        async for proposal in self._proposals(request, context):
            yield proposal

    @grpc_errors
    async def ProposeStream(self, requests: AsyncIterator[draft_pb2.ProposeRequest], context):
        """Propose, request after request on one call, each block in one message; an error ends the
        call with its status (see `requests_of` for a stop while the call waits)."""
        async for request in self.requests_of(requests):
            answer = Answer()
            block = draft_pb2.ProposeBlock(proposals=[p async for p in self._proposals(request, context, answer)])
            if answer.followers is not None:
                followers_to_pb(block, answer.followers)
            yield block

    async def _proposals(self, request: draft_pb2.ProposeRequest, context,
                         answer: Answer | None = None) -> AsyncIterator[draft_pb2.Proposal]:
        """The request's proposals as each is made (its checks, admission and deadline included);
        then `answer` holds what the block says besides its tokens."""
        arrived = time.monotonic()
        params = self.constants.resolve(request.session_id, request.sampling, self.info.vocab_size)
        history = list(request.history)
        self.drafter.check(history, request.num_tokens, request.tokenizer_fingerprint)
        sources = self.drafter.check_sources(request.sources)
        deadline = deadline_of(context, request.timeout_ms, arrived)
        async with self.admission.slot(deadline, context):
            drafts = self.drafter.stream(request.session_id, history, request.num_tokens, params, request.seed,
                                         deadline, arrived, request.sent_unix_ns, request.corpus_group, sources,
                                         answer)
            index = 0
            async for draft, step in drafts:
                yield draft_pb2.Proposal(
                    token_id=draft.token_id, index=index, compute_ns=step.compute_ns,
                    prefill_tokens=draft.prefill_tokens, batch_size=step.batch_size, queue_ns=step.queue_ns,
                    probs=b"" if draft.probs is None else probs_to_bytes(draft.probs),
                    source=SOURCES.get(draft.source, draft_pb2.DRAFT_SOURCE_UNSPECIFIED),
                )
                index += 1

    @grpc_errors
    async def Release(self, request: common_pb2.ReleaseRequest, context) -> common_pb2.ReleaseResponse:
        self.constants.release(request.session_id)
        released = await self.drafter.release(request.session_id, learn=not request.forget_output,
                                              sent_unix_ns=request.sent_unix_ns)
        return common_pb2.ReleaseResponse(released=released)

    @grpc_errors
    async def ProposeBatch(self, request: draft_pb2.ProposeBatchRequest, context) -> draft_pb2.ProposeBatchResponse:
        arrived = time.monotonic()
        items = [BatchItem(e.session_id, e.start, list(e.tokens), e.num_tokens, e.output_start, e.corpus_group)
                 for e in request.entries]
        finished = [FinishedItem(f.session_id, f.start, list(f.tokens), f.forget_output, f.output_start, f.corpus_group)
                    for f in request.finished]
        check_batch(items, finished, self.info.vocab_size)
        self.drafter.check_fingerprint(request.tokenizer_fingerprint)
        deadline = deadline_of(context)
        async with self.admission.slot(deadline, context):
            blocks, learned = await self.batched.propose(items, finished, deadline, arrived)
        return draft_pb2.ProposeBatchResponse(
            blocks=[draft_pb2.DraftBlock(token_ids=b.tokens, history_missing=b.history_missing, compute_ns=b.compute_ns,
                                         source=SOURCES.get(b.source, draft_pb2.DRAFT_SOURCE_UNSPECIFIED),
                                         prefill_tokens=b.prefill_tokens, warming=b.warming)
                    for b in blocks],
            compute_ns=int((time.monotonic() - arrived) * 1e9), outputs_learned=learned)
