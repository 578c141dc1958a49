"""Serving a proposer's drafts: which requests it takes, and where its tokens are computed.

A model proposer drafts through the `Batcher` (the blocks of concurrent requests share one forward
pass per token); a model-free one (prompt lookup, suffix speculation) runs on a thread of its own.
A hybrid proposer asks suffix speculation first (on that thread) and the model, through the
batcher, only when suffix speculation proposed nothing. Either way each token comes with a
`StepInfo` and names its source (`DraftToken.source`), so a caller streams every kind alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from specdec.core.sampling import SamplingParams
from specdec.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from specdec.runtime.batching import Batcher, StepInfo
from specdec.runtime.grammars import SessionGrammars, grammar_of
from specdec.runtime.proposers import DraftToken, HybridProposer, Proposer, model_of


class Drafter:
    """Streams the drafts of `proposer` (a model or hybrid proposer needs `batcher`) for a model whose
    tokenizer has `fingerprint`; `model` names it in errors."""

    def __init__(self, proposer: Proposer, fingerprint: str, model: str, batcher: Batcher | None = None,
                 executor: ThreadPoolExecutor | None = None, grammars: SessionGrammars | None = None) -> None:
        if model_of(proposer) is not None and batcher is None:
            raise ValueError(f"a {proposer.kind} proposer needs a batcher")
        self.proposer = proposer
        self.fingerprint = fingerprint
        self.model = model
        self.batcher = batcher
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
        self.grammars = grammars

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
        spec = grammar_of(params)
        grammar = None
        loop = asyncio.get_running_loop()
        forced: list[int] = []
        if spec is not None:
            if self.grammars is None:
                raise FailedPrecondition("this draft service has no tokenizer to apply grammars with")
            # What the grammar forces is proposed without the model (q one-hot), then the proposer goes on.
            forced = await loop.run_in_executor(self.executor, self.grammars.forced, session_id, spec,
                                                history[params.output_start:], k)
        if isinstance(proposer, HybridProposer):
            # Suffix speculation first: a confident proposal drafts the block, the model only otherwise.
            drafts = []
            if k > len(forced):
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlineExceeded("the request's deadline passed while it was queued; dropped before compute")
                drafts = await loop.run_in_executor(self.executor, proposer.suffix_proposal, session_id,
                                                    history + forced, k - len(forced), params, seed)
                drafts = await self._cut(drafts, session_id, spec, history + forced, params)
            if drafts:
                async for item in self._deterministic(forced, drafts, arrived):
                    yield item
                return
        free = StepInfo(batch_size=0, compute_ns=0, queue_ns=0)
        model = model_of(proposer)
        source = "model" if model is not None else proposer.kind
        for token in forced:
            yield DraftToken(token, self._one_hot(token, params), 0, source=source), free
        history, k = history + forced, k - len(forced)
        if k == 0:
            return
        if spec is not None and model is not None and self.grammars is not None:
            grammar = await loop.run_in_executor(self.executor, self.grammars.fork, session_id, spec,
                                                 history[params.output_start:])
        if self.batcher is not None and model is not None:
            job = model.job(session_id, history, k, params, seed, deadline, grammar)
            job.enqueued = arrived
            job.sent_unix_ns = sent_unix_ns
            async for draft, step in self.batcher.stream(job):
                yield draft, step
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceeded("the request's deadline passed while it was queued; dropped before compute")
        proposals = proposer.propose(session_id, history, k, params, seed)
        if spec is not None:  # a model-free proposal stops at its first refused token
            drafts = await loop.run_in_executor(self.executor, list, proposals)
            proposals = iter(await self._cut(drafts, session_id, spec, history, params))
        first = True
        while (draft := await loop.run_in_executor(self.executor, next, proposals, None)) is not None:
            queue_ns = int((time.monotonic() - arrived) * 1e9) if first else 0
            yield draft, StepInfo(batch_size=0, compute_ns=draft.compute_ns, queue_ns=queue_ns)
            first = False

    async def _cut(self, drafts: list[DraftToken], session_id: str, spec, history: list[int],
                   params: SamplingParams) -> list[DraftToken]:
        """A model-free proposal up to its first token the grammar refuses (all of it without a grammar)."""
        if spec is None or self.grammars is None or not drafts:
            return drafts
        allowed = await asyncio.get_running_loop().run_in_executor(
            self.executor, self.grammars.cut, session_id, spec, history[params.output_start:],
            [d.token_id for d in drafts])
        return drafts[:len(allowed)]

    async def _deterministic(self, forced: list[int], drafts: list[DraftToken],
                             arrived: float) -> AsyncIterator[tuple[DraftToken, StepInfo]]:
        """A hybrid's suffix-drafted block: the forced tokens, then the suffix proposal, q one-hot for all
        (no probs: the block must be all rows or none)."""
        source = drafts[0].source
        queue_ns = int((time.monotonic() - arrived) * 1e9)
        for token in forced:
            yield DraftToken(token, None, 0, source=source), StepInfo(batch_size=0, compute_ns=0, queue_ns=queue_ns)
            queue_ns = 0
        for draft in drafts:
            yield draft, StepInfo(batch_size=0, compute_ns=draft.compute_ns, queue_ns=queue_ns)
            queue_ns = 0

    def _one_hot(self, token: int, params: SamplingParams):
        """q of a forced token when the other drafts carry their q rows (a model sampling); else None."""
        if params.greedy or model_of(self.proposer) is None or self.batcher is None:
            return None
        q = np.zeros(self.batcher.caches.vocab_size, dtype=np.float32)
        q[token] = 1.0
        return q
