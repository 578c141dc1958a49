"""The speculative rounds of one request: the draft proposes k tokens, the target verifies them
in one forward pass.

Every round yields between 1 and k + 1 tokens: the accepted draft tokens plus the target's own
token (recovered at the first rejection, or the bonus when all k were accepted). With k = 0, or
when the draft is down, the round is plain target decoding through the same verify call.

Hiding the draft (overlap): while the target verifies block i, the draft already extends
block i on the guess that it is fully accepted, proposing first its own guess for the bonus
token and then block i + 1. If the verdict accepts all of block i and the bonus equals that
guess, block i + 1 is ready when the verdict arrives; otherwise it is cancelled and drafted
afresh. Lossless either way: the kept proposals were sampled from the draft's q for exactly the
context they extend, with randomness independent of the target's acceptance test.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from orchestrator.backends import DraftReply, DraftUnavailable
from orchestrator.replicas import Drafts, Targets
from specdec.core.sampling import SamplingParams
from specdec.errors import DeadlineExceeded
from specdec.server.tracing import traced
from specdec.v1 import orchestrator_pb2


@dataclass
class Round:
    emitted: list[int]  # accepted draft tokens + the target's token
    stats: orchestrator_pb2.RoundStats
    logprobs: list = field(default_factory=list)  # common_pb2.TokenLogprobs per emitted token, when asked
    source: str = ""  # the proposer that drafted the block ("model", "ngram", "suffix"; "" when none was drafted)
    asked: tuple[str, ...] = ()  # the sources the draft was asked to draft it from (empty: any)


@dataclass
class _Ahead:
    """A draft running during a verify, on the guess that its block is fully accepted."""

    base_len: int  # len(history + block) it extends
    block: list[int]  # the block under verification
    asked: int  # draft tokens it was asked for beyond the guessed bonus token
    task: asyncio.Task
    proposal: DraftReply  # filled as tokens arrive
    progress: asyncio.Event  # set on every new token
    started_ns: int = field(default_factory=time.perf_counter_ns)


class Speculator:
    """Runs the rounds of one request against the draft and target replica sets."""

    def __init__(self, session_id: str, params: SamplingParams, seed: int, draft: Drafts | None,
                 target: Targets, fingerprint: str, overlap: bool = False,
                 deadline: float | None = None, top_logprobs: int | None = None, corpus_group: str = "") -> None:
        self.session_id = session_id
        self.corpus_group = corpus_group  # whose earlier outputs may draft it (orchestrator.corpus)
        self.params = params
        self.seed = seed
        self.draft = draft
        self.target = target
        self.fingerprint = fingerprint
        self.overlap = overlap
        self.deadline = deadline  # time.monotonic() of the request's deadline, carried by every call
        self.top_logprobs = top_logprobs  # None: no log-probabilities
        self._ahead: _Ahead | None = None
        self.promised = False  # set by the planner: the previous request told the target the next one is at k = 0

    def _remaining(self) -> float | None:
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the request's deadline passed; the tokens sent so far stay in the session")
        return left

    @traced("orchestrator.round", lambda self, history, k, k_next, continues=False, sources=(), guess=False,
            follow=False, steps=1: {"specdec.k": k, "specdec.history": len(history)})
    async def round(self, history: list[int], k: int, k_next: int, continues: bool = False,
                    sources: tuple[str, ...] = (), guess: bool = False, follow: bool = False, steps: int = 1) -> Round:
        """One round at draft length k; with overlap, start drafting the next block (of k_next).
        `steps`: at k = 0, the most tokens (one pass each) the target may emit in the one verify call;
        `continues`: the next round is at k = 0 (the target may verify it ahead); `guess`: it asks
        the draft, which proposes nothing often enough that verifying it ahead anyway pays; `follow`:
        the next round may be verified ahead on the draft's followers of this block when it lists
        them (they say for certain whether the next round drafts nothing, where a guess bets on it);
        `sources`: the draft's sources that may draft this block (empty: any)."""
        proposal, fallback, overlapped = DraftReply(), False, False
        if k > 0 and self.draft is not None:
            taken = await self._take_ahead(history, k)
            if taken is not None:
                # A block drafted ahead for a shorter k than chosen now stands for its own k.
                (proposal, k), overlapped = taken, True
            else:
                try:
                    if not self.draft.available:
                        raise DraftUnavailable("in back-off after a failure")
                    proposal = await self.draft.propose(self.session_id, history, k, self.params, self.seed,
                                                        self.fingerprint, timeout=self._remaining(),
                                                        corpus_group=self.corpus_group, sources=sources)
                except DraftUnavailable:
                    fallback = True  # the session goes on at k = 0; no client-visible error
        else:
            self.close()
        followers = proposal.followers if follow and not continues else None
        verifying = self.target.verify(self.session_id, history, proposal, self.params, self.seed,
                                       timeout=self._remaining(), top_logprobs=self.top_logprobs,
                                       continues=continues or (guess and followers is None), followers=followers,
                                       decode_steps=steps if k == 0 else 1)
        try:
            if self.overlap and k_next > 0 and self.draft is not None and self.draft.available:
                verify = asyncio.ensure_future(verifying)  # sent first: the next block is drafted meanwhile
                self._start_ahead(history, proposal.tokens, k_next)
                reply = await verify
            else:
                reply = await verifying  # in this task: a task of its own would cost two event-loop turns
        except BaseException:
            self.close()
            raise
        stats = orchestrator_pb2.RoundStats(
            draft_length=k, proposed=len(proposal.tokens), accepted=reply.num_accepted,
            draft_ns=proposal.wall_ns, draft_compute_ns=proposal.compute_ns,
            verify_ns=reply.wall_ns, verify_compute_ns=reply.compute_ns, draft_fallback=fallback,
            overlapped=overlapped, verify_queue_ns=reply.queue_ns, verify_batch_size=reply.batch_size,
            verify_batch_positions=reply.batch_positions, draft_prefill_tokens=proposal.prefill_tokens,
            verify_prefill_tokens=reply.prefill_tokens, drafted=proposal.drafted,
            verify_decoded_ahead=reply.decoded_ahead, verify_passes=1 + len(reply.decoded),
        )
        asked = sources if k > 0 and not overlapped else ()  # a block drafted ahead was asked of any source
        return Round(reply.emitted(proposal.tokens), stats, reply.logprobs,
                     proposal.source if proposal.tokens else "", asked)

    def _start_ahead(self, history: list[int], block: list[int], k_next: int) -> None:
        self.close()
        proposal, progress = DraftReply(), asyncio.Event()
        task = asyncio.ensure_future(self.draft.propose(
            self.session_id, history + block, k_next + 1, self.params, self.seed, self.fingerprint,
            into=proposal, progress=progress, timeout=self._remaining(), corpus_group=self.corpus_group))
        ahead = _Ahead(len(history) + len(block), list(block), k_next, task, proposal, progress)
        ahead.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "unretrieved"
        self._ahead = ahead

    async def _take_ahead(self, history: list[int], k: int) -> tuple[DraftReply, int] | None:
        """The overlapped draft's block if its guess held (history = guessed base + bonus), with
        the draft length it covers (`k`, or less when it was asked for fewer tokens)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        n, b = ahead.base_len, len(ahead.block)
        if len(history) != n + 1 or history[n - b:n] != ahead.block:
            ahead.task.cancel()
            return None  # a draft token was rejected: the guess failed
        tokens = ahead.proposal.tokens
        while not ahead.task.done() and len(tokens) < k + 1 and (not tokens or tokens[0] == history[-1]):
            ahead.progress.clear()
            waiter = asyncio.ensure_future(ahead.progress.wait())
            await asyncio.wait([waiter, ahead.task], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        if not tokens or tokens[0] != history[-1]:
            ahead.task.cancel()
            return None  # the bonus token differs from the draft's guess (or the draft failed)
        if not ahead.task.done():
            ahead.task.cancel()  # we have the k tokens we need: stop the draft here
        proposal, k = ahead.proposal, min(k, ahead.asked)
        return DraftReply(tokens=tokens[1:1 + k], probs=proposal.probs[1:1 + k],
                        wall_ns=proposal.wall_ns or time.perf_counter_ns() - ahead.started_ns,
                        compute_ns=proposal.compute_ns, prefill_tokens=proposal.prefill_tokens,
                        drafted=len(tokens), source=proposal.source), k

    def close(self) -> None:
        """Cancel an overlapped draft still in flight."""
        if self._ahead is not None:
            self._ahead.task.cancel()
            self._ahead = None
