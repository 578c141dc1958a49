"""Serving a proposer's drafts: one interface for every draft source, and the `Drafter` that drives it.

Every draft source (a causal LM, prompt lookup, suffix speculation, a hybrid of two, or anything
added later) is a `Proposer`: asked for a block, it names the block's source and hands back its
tokens as each is made, each with its q row when it has one (a model sampling) and a `StepInfo`;
asked to release a session, it frees what it holds for it. The `Drafter` takes a request, checks
it, proposes what the grammar forces itself, asks the proposer for the rest of the block, and
streams the lot, without knowing which kind of proposer it drives.

Where a proposer computes is its own business. A model drafts through the `Batcher` (the blocks of
concurrent requests share one forward pass per token); a host-computed one (prompt lookup, suffix
speculation) runs on the drafter's worker thread through `DraftEnv.proposal`, which also cuts its
proposal at the first token the grammar refuses (suffix speculation makes a steady session's
look-up at once instead, where the thread hop would cost more than the look-up:
`SuffixProposer.propose_at_once`); a model forks the session's grammar state (`DraftEnv.fork`) and
masks every position with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import numpy as np

from specdec.core.grammar import GrammarSpec, GrammarState
from specdec.core.sampling import SamplingParams
from specdec.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from specdec.runtime.batching import StepInfo
from specdec.runtime.grammars import SessionGrammars, grammar_of

T = TypeVar("T")

MODEL, NGRAM, SUFFIX = "model", "ngram", "suffix"
SOURCES = (MODEL, NGRAM, SUFFIX)
"""The draft sources a proposal may name (`Proposal.source` on the wire)."""


@dataclass(frozen=True)
class DraftToken:
    token_id: int
    probs: np.ndarray | None  # [V] float32 q after temperature/top-k/top-p; None if greedy/deterministic
    compute_ns: int
    prefill_tokens: int = 0
    source: str = ""  # the source that drafted it (`SOURCES`)


Drafted = tuple[DraftToken, StepInfo]
ProposeFn = Callable[[str, list[int], int, SamplingParams, int], Iterator[DraftToken]]
"""A host-computed proposal: (session_id, history, k, params, seed) -> up to k draft tokens."""


@dataclass(frozen=True)
class DraftRequest:
    """One call for up to `k` draft tokens after `history`. `arrived`: when it reached the service
    (`time.monotonic()`), so that the queue wait counts from there; `sent_unix_ns`: when its caller sent
    it (see `Batcher.cancel_session`); `deadline`: `time.monotonic()` past which it is dropped;
    `corpus_group`: whose earlier outputs may draft it (a proposer with a corpus drafts from that
    group's alone; "" is the anonymous group)."""

    session_id: str
    history: list[int]
    k: int
    params: SamplingParams
    seed: int
    deadline: float | None = None
    arrived: float = 0.0
    sent_unix_ns: int = 0
    corpus_group: str = ""
    sources: tuple[str, ...] = ()  # the sources that may draft it (empty: any)

    def allows(self, source: str) -> bool:
        """Whether `source` may draft this request's block."""
        return not self.sources or source in self.sources

    @property
    def grammar(self) -> GrammarSpec | None:
        return grammar_of(self.params)

    @property
    def output(self) -> list[int]:
        """The session's output so far: what its grammar state follows."""
        return self.history[self.params.output_start:]

    def after(self, tokens: list[int]) -> DraftRequest:
        """The rest of this request once `tokens` are proposed."""
        return replace(self, history=self.history + tokens, k=self.k - len(tokens))

    def check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise DeadlineExceeded("the request's deadline passed while it was queued; dropped before compute")


@dataclass
class Block:
    """A proposer's answer to a request: its tokens as they are made, all of one `source`.

    `q_width` is the width V of the q rows its tokens carry (a model sampling), 0 when they carry
    none (deterministic: the verifier reads q as one-hot). Tokens the grammar forces before the block
    take its source and its form, so that a block is all q rows or none. `followers`: the tokens
    after which the history and this block could be drafted anything, when the proposer knows
    (`ProposeBlock.followers`; None: any token may be).
    """

    source: str
    tokens: AsyncIterator[Drafted]
    q_width: int = 0
    followers: tuple[int, ...] | None = None

    @classmethod
    def listed(cls, source: str, drafts: list[DraftToken], arrived: float,
               followers: tuple[int, ...] | None = None) -> Block:
        """A block computed at once on the host: the queue wait (since `arrived`) goes on its first token."""
        return cls(source, _listed(drafts, arrived), followers=followers)

    @classmethod
    def empty(cls, source: str, q_width: int = 0) -> Block:
        """Nothing to draft (the grammar forced the whole block): only its source and form count."""
        return cls(source, _listed([], 0.0), q_width)

    def forced(self, token: int) -> Drafted:
        """A token the grammar forces, in this block's form (a one-hot q row when it carries rows)."""
        q = None
        if self.q_width:
            q = np.zeros(self.q_width, dtype=np.float32)
            q[token] = 1.0
        return DraftToken(token, q, 0, source=self.source), StepInfo(batch_size=0, compute_ns=0, queue_ns=0)


@dataclass
class Answer:
    """What an answer says besides its tokens, known once they are all made (`Drafter.stream`):
    the block's `followers`, None with a grammar (it may force tokens whatever the proposer holds)
    or where the proposer cannot tell."""

    followers: tuple[int, ...] | None = None


async def _listed(drafts: list[DraftToken], arrived: float) -> AsyncIterator[Drafted]:
    queue_ns = int((time.monotonic() - arrived) * 1e9)
    for draft in drafts:
        yield draft, StepInfo(batch_size=0, compute_ns=draft.compute_ns, queue_ns=queue_ns)
        queue_ns = 0


class Proposer(Protocol):
    """A draft source, as the `Drafter` drives it (`ProposerBase` gives the optional parts)."""

    @property
    def sources(self) -> tuple[str, ...]:
        """The sources its blocks may name (`SOURCES`), the one that drafts when the others propose
        nothing first. The orchestrator keeps one draft-length controller state per source."""

    @property
    def learns_outputs(self) -> bool:
        """Whether it keeps a corpus of finished outputs (fed by `add_output`, or on `release`)."""

    async def block(self, request: DraftRequest, env: DraftEnv) -> Block:
        """Up to `request.k` draft tokens after `request.history` (`k` may be 0: the grammar forced the
        whole block; the block then only names its source and form)."""

    async def release(self, session_id: str, learn: bool = True, sent_unix_ns: int = 0) -> bool:
        """Free what it holds for the session; True if it held anything. `learn`: the session's output
        may join a corpus of earlier outputs; `sent_unix_ns`: when the release was sent (work sent
        before it stops)."""

    def add_output(self, tokens: list[int], group: str = "") -> None:
        """A finished generation's output joins the corpus of its corpus group `group` (a proposer
        without a corpus ignores it); it may draft only requests of that group."""


class DraftEnv:
    """What a proposer drafts with besides itself: the drafter's worker thread and the sessions'
    grammar states (None: a service without a tokenizer refuses grammars)."""

    def __init__(self, executor: ThreadPoolExecutor, grammars: SessionGrammars | None) -> None:
        self.executor = executor
        self.grammars = grammars

    async def run(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _grammars(self) -> SessionGrammars:
        if self.grammars is None:
            raise FailedPrecondition("this draft service has no tokenizer to apply grammars with")
        return self.grammars

    async def forced(self, request: DraftRequest) -> list[int]:
        """The tokens the request's grammar forces (none without one), at most `k`. The grammar is
        compiled first, on the grammar worker (`SessionGrammars.prepare`): never on this worker
        thread, where it would hold up every other session's proposals."""
        spec = request.grammar
        if spec is None:
            return []
        await self._grammars().prepare(spec)
        return await self.run(self._grammars().forced, request.session_id, spec, request.output, request.k)

    async def fork(self, request: DraftRequest) -> GrammarState | None:
        """A private copy of the session's grammar state at the end of the history, for a model to
        advance along its proposal (None without a grammar)."""
        spec = request.grammar
        if spec is None:
            return None
        return await self.run(self._grammars().fork, request.session_id, spec, request.output)

    async def cut(self, request: DraftRequest, drafts: list[DraftToken]) -> list[DraftToken]:
        """A host-computed proposal up to its first token the grammar refuses (all of it without one)."""
        spec = request.grammar
        if spec is None or not drafts:
            return drafts
        allowed = await self.run(self._grammars().cut, request.session_id, spec, request.output,
                                 [d.token_id for d in drafts])
        return drafts[:len(allowed)]

    async def proposal(self, propose: ProposeFn, request: DraftRequest) -> list[DraftToken]:
        """A host-computed proposal for `request`, made on the worker thread and cut by the grammar."""
        request.check_deadline()
        r = request
        drafts = await self.run(lambda: list(propose(r.session_id, r.history, r.k, r.params, r.seed)))
        return await self.cut(request, drafts)


class Drafter:
    """Streams the drafts of `proposer` for a model whose tokenizer has `fingerprint`; `model` names it
    in errors. `executor`: the worker thread of host-computed proposals and grammar calls."""

    def __init__(self, proposer: Proposer, fingerprint: str, model: str, executor: ThreadPoolExecutor | None = None,
                 grammars: SessionGrammars | None = None) -> None:
        self.proposer = proposer
        self.fingerprint = fingerprint
        self.model = model
        self.grammars = grammars
        self.env = DraftEnv(executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft"), grammars)

    def check(self, history: list[int], k: int, fingerprint: str) -> None:
        """Refuse a request this drafter cannot serve; `fingerprint` is the caller's tokenizer's ("" skips it)."""
        if k < 1:
            raise InvalidArgument("num_tokens must be >= 1 (use the target alone for k = 0)")
        if not history:
            raise InvalidArgument("history is empty: send at least one token")
        self.check_fingerprint(fingerprint)

    def check_fingerprint(self, fingerprint: str) -> None:
        """Refuse a caller whose tokenizer differs from the draft model's ("" skips the check)."""
        if fingerprint and fingerprint != self.fingerprint:
            raise FailedPrecondition(
                f"tokenizer mismatch: caller has {fingerprint}, draft model {self.model!r} has "
                f"{self.fingerprint}; start the draft with a model that shares the target's tokenizer"
            )

    def check_sources(self, sources: Sequence[str]) -> tuple[str, ...]:
        """The sources a request names, refused if this draft lacks one of them."""
        unknown = sorted(set(sources) - set(self.proposer.sources))
        if unknown:
            raise InvalidArgument(f"sources names {', '.join(repr(s[:32]) for s in unknown[:4])}, which this draft "
                                  f"does not have (it has: {', '.join(self.proposer.sources)}); name those or none")
        return tuple(dict.fromkeys(sources))

    async def stream(self, session_id: str, history: list[int], k: int, params: SamplingParams, seed: int,
                     deadline: float | None, arrived: float, sent_unix_ns: int = 0,
                     corpus_group: str = "", sources: tuple[str, ...] = (),
                     answer: Answer | None = None) -> AsyncIterator[Drafted]:
        """Up to `k` draft tokens as each is made: those the grammar forces (proposed without the
        proposer), then the proposer's block (see `DraftRequest` for the arguments); then `answer`
        holds what the block says besides (its followers only without a grammar)."""
        request = DraftRequest(session_id, history, k, params, seed, deadline, arrived, sent_unix_ns, corpus_group,
                               sources)
        forced = await self.env.forced(request)
        block = await self.proposer.block(request.after(forced), self.env)
        for token in forced:
            yield block.forced(token)
        async for drafted in block.tokens:
            yield drafted
        if answer is not None and request.grammar is None:
            answer.followers = block.followers

    async def release(self, session_id: str, learn: bool = True, sent_unix_ns: int = 0) -> bool:
        """Free everything held for the session: its grammar state and the proposer's (see `Proposer.release`)."""
        if self.grammars is not None:
            self.grammars.release(session_id)
        return await self.proposer.release(session_id, learn, sent_unix_ns)
