"""Verifying a session's next round ahead of its request (`VerifyRequest.continues`).

At k = 0 and one client, a round is the target's pass plus the trip around it: the answer to the
orchestrator, its bookkeeping, the next request back, and the hops into and out of the batcher
(about 1.6 ms a round on a CPU, beside a 10-15 ms pass). The next request is known before it
comes: the history extended by the tokens this answer emits, with the same sampling, seed and
logprobs request, no draft tokens. When the caller says that request follows (`continues`), the
batcher submits it the moment the request's own pass ends (`Job.follow`: before the answer is
even sent), so the session's passes run back to back while answers and requests travel. The real
request, when it comes, is answered from that pass if it is exactly the request guessed; any
other request is verified as usual (the guess is dropped, the session's cache cut back to the
common prefix as for any request; if the guess's pass is running, the request waits for it, as
it would behind any pass). Nothing is inferred: the guessed job is the very job the request
would have made, so its answer is the one the request would have had.

A guess is not made when the batcher has other work (other sessions' jobs come first), after a
token that ends the text (the model's end of sequence, the request's end tokens), or beyond
`MAX_GUESSES` sessions; a Release drops its session's guess with the rest of its work.

A request may instead name the draft's followers of its block (`VerifyRequest.followers`): the
tokens after which the history and its draft tokens could be drafted anything. When its pass
accepts every draft token and emits a token not among them, the caller's next request is certain
to draft nothing, and its round is verified ahead as for `continues`; otherwise nothing is.

A greedy request that brings draft tokens after the guessed history (the caller asked a draft
that may propose nothing, and it proposed a block) is settled by the guess too when the guess's
token is not the block's first: greedy verification rejects that first draft token and emits the
target's argmax after the history, which is the guess's token, with the same log-probabilities.
The answer is the block's verdict (nothing accepted, that token), and the cache holds the history,
as the block's own pass would have left it. Otherwise the block is verified as usual. Sampled
requests with drafts never take a guess: their seeded draws are the block's own.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from specdec.core.acceptance import Verdict
from specdec.core.sampling import SamplingParams
from specdec.errors import SpecdecError
from specdec.runtime.batching import Batcher, StepInfo
from specdec.runtime.verifier import LogprobRequest, Verified, Verifier, VerifyJob

MAX_GUESSES = 64  # sessions with a round verified ahead (the oldest is dropped beyond)


@dataclass(frozen=True)
class _Request:
    """What a verify request's answer depends on, besides the session."""

    history: tuple[int, ...]
    params: SamplingParams
    seed: int
    logprobs: LogprobRequest | None


class DecodeAhead:
    """Each session's round verified ahead: planned on a request that `continues` (`plan`, or `take`
    for one answered from a guess), submitted by the batcher the moment that request's pass ends,
    and taken by the next request (`take`)."""

    def __init__(self, batcher: Batcher, verifier: Verifier, end_tokens: Sequence[int] = ()) -> None:
        self.batcher = batcher
        self.verifier = verifier
        self.end_tokens = frozenset(end_tokens)
        self._guesses: OrderedDict[str, tuple[_Request, VerifyJob, asyncio.Task]] = OrderedDict()
        self.used = 0  # requests (of no draft tokens) answered from a guess
        self.dropped = 0  # guesses dropped: the request differed, its session was released, or it never came
        self.refuted = 0  # blocks answered by a guess whose token refuted their first draft token

    def plan(self, job: VerifyJob, sent_unix_ns: int, unless: int | None = None,
             followers: frozenset[int] | None = None) -> None:
        """`job`'s request continues: when its pass ends, verify the round after it (`_guess`), unless
        the pass emits `unless` (a block whose first token that is will be verified by its own pass);
        with `followers` (its block's), only if the pass accepts the whole block and emits none of them."""
        job.follow = functools.partial(self._guess, job, sent_unix_ns, unless=unless, followers=followers)

    async def take(self, session_id: str, history: list[int], draft_tokens: list[int], params: SamplingParams,
                   seed: int, logprobs: LogprobRequest | None, continues: bool,
                   sent_unix_ns: int, followers: frozenset[int] | None = None) -> tuple[Verified, StepInfo] | None:
        """The answer to this request from its session's guess, if it is the request guessed and the
        guess ran to its end; None otherwise (the guess, if any, is dropped). `continues`: this
        request's own next round is then guessed in turn, with `followers` unless the guess emits one
        of them (a block answered from the guess accepted none of its tokens: then nothing is)."""
        if followers is not None and draft_tokens:
            continues = False
        entry = self._guesses.pop(session_id, None)
        if entry is None:
            return None
        guessed, job, task = entry
        if guessed != _Request(tuple(history), params, seed, logprobs) or (draft_tokens and not self._settles(
                params, draft_tokens)):
            self._drop_guess(task)
            return None
        first = draft_tokens[0] if draft_tokens else None  # the guess answers a block only if it refutes this
        ran_out = job.done  # its pass ended (and its follow-up time passed) before this request came
        if continues and not ran_out:
            self.plan(job, sent_unix_ns, unless=first, followers=followers)
        try:
            await asyncio.wait([task])
        except BaseException:  # the request itself was cancelled: nobody wants the guess
            self._drop_guess(task)
            raise
        if task.cancelled() or task.exception() is not None:  # released, or failed: verified as usual
            return None
        verified, step = task.result()
        if first is not None:
            if verified.verdict.token == first:  # the block's first token holds: its pass decides the rest
                self.dropped += 1
                return None
            self.refuted += 1
            verified = replace(verified, verdict=Verdict(0, verified.verdict.token, False))
        else:
            self.used += 1
        if continues and ran_out:
            self._guess(job, sent_unix_ns, verified, followers=followers)
        return verified, step

    def ends_text(self, token: int, params: SamplingParams) -> bool:
        """Whether `token` ends the text: the model's end of sequence or one of the request's end
        tokens (no round follows it)."""
        return token in self.end_tokens or token in params.end_token_ids

    def _settles(self, params: SamplingParams, draft_tokens: list[int]) -> bool:
        """Whether a guess may answer a request with these draft tokens: greedy, and tokens the
        vocabulary has (others are refused by the request's own pass)."""
        return params.greedy and all(0 <= t < self.verifier.vocab_size for t in draft_tokens)

    def cancel(self, session_id: str) -> None:
        """Drop the session's guess (its Release cancels the job with the session's other work)."""
        entry = self._guesses.pop(session_id, None)
        if entry is not None:
            self._drop_guess(entry[2])

    def _guess(self, job: VerifyJob, sent_unix_ns: int, verified: Verified, unless: int | None = None,
               followers: frozenset[int] | None = None) -> None:
        """Submit the k = 0 round after `job`, answered `verified`, if the batcher has nothing else to run
        (and the answer's token is not `unless`; with `followers`, if it accepted all of `job`'s draft
        tokens and emitted none of them)."""
        emitted = verified.verdict.emitted(job.draft_tokens)
        if job.cancelled or not self.batcher.idle or self.ends_text(emitted[-1], job.params) or emitted[-1] == unless:
            return
        whole = verified.verdict.num_accepted == len(job.draft_tokens)
        if followers is not None and (not whole or emitted[-1] in followers):
            return
        following = job.history + emitted
        try:
            after = self.verifier.job(job.session_id, following, [], None, job.params, job.seed, None, job.logprobs)
        except SpecdecError:  # (past the context, say): the request itself will be told
            return
        after.sent_unix_ns = sent_unix_ns  # a Release sent after the request drops it, as it would the request
        task = self.batcher.start(after)
        task.add_done_callback(_retrieved)
        self.cancel(job.session_id)
        self._guesses[job.session_id] = (_Request(tuple(following), job.params, job.seed, job.logprobs), after, task)
        while len(self._guesses) > MAX_GUESSES:
            self.cancel(next(iter(self._guesses)))

    def _drop_guess(self, task: asyncio.Task) -> None:
        if not task.done():
            task.cancel()  # its job leaves the batcher at the next step boundary
        self.dropped += 1


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # a failed guess is not an error of anyone's: the request is verified as usual
