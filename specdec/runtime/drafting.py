"""Serving a proposer's drafts: which requests it takes, and where its tokens are computed.

A model proposer drafts through the `Batcher` (the blocks of concurrent requests share one forward
pass per token); a model-free one (prompt lookup) runs on a thread of its own. Either way each
token comes with a `StepInfo`, so a caller streams both kinds alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from specdec.core.sampling import SamplingParams
from specdec.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from specdec.runtime.batching import Batcher, StepInfo
from specdec.runtime.proposers import DraftToken, ModelProposer, Proposer


class Drafter:
    """Streams the drafts of `proposer` (a `ModelProposer` needs `batcher`) for a model whose tokenizer
    has `fingerprint`; `model` names it in errors."""

    def __init__(self, proposer: Proposer, fingerprint: str, model: str, batcher: Batcher | None = None,
                 executor: ThreadPoolExecutor | None = None) -> None:
        if isinstance(proposer, ModelProposer) and batcher is None:
            raise ValueError("a model proposer needs a batcher")
        self.proposer = proposer
        self.fingerprint = fingerprint
        self.model = model
        self.batcher = batcher
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")

    def check(self, history: list[int], k: int, fingerprint: str) -> None:
        """Refuse a request this drafter cannot serve; `fingerprint` is the caller's tokenizer's ("" skips it)."""
        if k < 1:
            raise InvalidArgument("num_tokens must be >= 1 (use the target alone for k = 0)")
        if not history:
            raise InvalidArgument("history is empty: send at least one token")
        if fingerprint and fingerprint != self.fingerprint:
            raise FailedPrecondition(
                f"tokenizer mismatch: caller has {fingerprint}, draft model {self.model!r} has "
                f"{self.fingerprint}; start the draft with a model that shares the target's tokenizer"
            )

    async def stream(self, session_id: str, history: list[int], k: int, params: SamplingParams, seed: int,
                     deadline: float | None, arrived: float,
                     sent_unix_ns: int = 0) -> AsyncIterator[tuple[DraftToken, StepInfo]]:
        """Up to `k` draft tokens as each is made. `arrived`: when the request reached the service
        (`time.monotonic()`), so that the queue wait counts from there; `sent_unix_ns`: when its caller
        sent it (see `Batcher.cancel_session`)."""
        proposer = self.proposer
        if self.batcher is not None and isinstance(proposer, ModelProposer):
            job = proposer.job(session_id, history, k, params, seed, deadline)
            job.enqueued = arrived
            job.sent_unix_ns = sent_unix_ns
            async for draft, step in self.batcher.stream(job):
                yield draft, step
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceeded("the request's deadline passed while it was queued; dropped before compute")
        loop = asyncio.get_running_loop()
        proposals = proposer.propose(session_id, history, k, params, seed)
        first = True
        while (draft := await loop.run_in_executor(self.executor, next, proposals, None)) is not None:
            queue_ns = int((time.monotonic() - arrived) * 1e9) if first else 0
            yield draft, StepInfo(batch_size=0, compute_ns=draft.compute_ns, queue_ns=queue_ns)
            first = False
