"""The draft sources: a causal LM, model-free prompt lookup or suffix speculation, and a hybrid of a
causal LM and suffix speculation; each one `Proposer` (`specdec.runtime.drafting`).

Each also proposes synchronously in process (`propose`: up to k `DraftToken`s after a history), the
form the offline tools and the equivalence tests use. With sampling, a model proposer yields the
processed draft distribution q of each position; a deterministic proposer (prompt lookup, suffix
speculation) yields none, which the verifier reads as a one-hot q at the proposed token.

In the draft service a model proposer drafts through its `Batcher` instead: each decoding step of
every session in a batch is one forward pass (`DraftJob`), and each token is handed to its
session's stream as soon as its step ends. A job samples with the same per-session generator as
`propose`, so batching does not change what is proposed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from specdec.core.grammar import GrammarState
from specdec.core.ngram import propose_ngram
from specdec.core.processors import process_block
from specdec.core.sampling import DRAFT_STREAM, SamplingParams, derive_generator, logits_to_probs, sample
from specdec.core.suffix import NOTHING, Corpora, SuffixIndex, best_speculation, followers
from specdec.runtime.batching import Batcher, Job
from specdec.runtime.drafting import (
    MODEL,
    NGRAM,
    SOURCES,
    SUFFIX,
    Block,
    DraftEnv,
    DraftRequest,
    DraftToken,
    ProposeFn,
    Proposer,
)
from specdec.runtime.kv import Scored, ScoreRequest, SessionCaches
from specdec.runtime.latency import LatencyProfile

__all__ = ["SOURCES", "DraftJob", "DraftToken", "HostProposer", "HybridProposer", "LocalProposer", "ModelProposer",
           "NgramProposer", "Proposer", "ProposerBase", "SuffixProposer", "draft_token"]


class LocalProposer(Protocol):
    """The in-process form of the proposers here (the offline tools', the tests'): propose in the
    caller's thread, forget a session there."""

    def propose(self, session_id: str, history: list[int], k: int, params: SamplingParams,
                seed: int) -> Iterator[DraftToken]: ...

    def forget(self, session_id: str, learn: bool = True) -> bool: ...

    def add_output(self, tokens: list[int], group: str = "") -> None: ...


class ProposerBase:
    """The optional parts of a `Proposer`: no corpus of outputs, nothing held per session."""

    learns_outputs = False

    def forget(self, session_id: str, learn: bool = True) -> bool:
        """Drop what is held for the session, in the caller's thread; True if anything was."""
        return False

    async def release(self, session_id: str, learn: bool = True, sent_unix_ns: int = 0) -> bool:
        return self.forget(session_id, learn)

    def add_output(self, tokens: list[int], group: str = "") -> None:
        """A proposer without a corpus of outputs has nothing to add them to."""


def draft_token(logits: torch.Tensor, context: list[int], params: SamplingParams, generator: torch.Generator | None,
                grammar: GrammarState | None = None) -> tuple[int, np.ndarray | None]:
    """The next draft token after `context` from the last row of `logits [n, V]`, and its q row when
    sampling. The logits processors see `context`, and `grammar` (at the end of `context`) masks the
    row, exactly as the target's row for this position will be; `grammar` then takes the token."""
    allowed = None if grammar is None else grammar.allowed()[None, :logits.shape[1]]  # [1, V]
    last = process_block(logits[-1:], context, [], params, allowed)  # [1, V]
    token, q = _pick(last, params, generator)
    if grammar is not None:
        with contextlib.suppress(ValueError):  # after an end of sequence nothing follows: the state stays there
            grammar.advance([token])
    return token, q


def _pick(last: torch.Tensor, params: SamplingParams,
          generator: torch.Generator | None) -> tuple[int, np.ndarray | None]:
    if params.greedy:
        return int(torch.argmax(last[0])), None
    if generator is None:
        raise ValueError("sampling draws from the session's generator: pass one")
    # The sampling maths runs on the host in float64, so a seed draws the same tokens on any device.
    q64 = logits_to_probs(last.cpu(), params)[0]  # [V]
    return sample(q64, generator), q64.to(torch.float32).numpy()


class DraftJob(Job):
    """Up to `k` draft tokens for one session, one batched step per token."""

    def __init__(self, session_id: str, history: list[int], k: int, params: SamplingParams, seed: int,
                 deadline: float | None = None, grammar: GrammarState | None = None) -> None:
        super().__init__(session_id, deadline)
        self.grammar = grammar  # a private state at the end of `history`, advanced along the proposal
        self.context = list(history)
        self.target_length = len(history) + k
        self.params = params
        self.generator = None if params.greedy else derive_generator(seed, len(history), DRAFT_STREAM)

    def request(self) -> ScoreRequest:
        return ScoreRequest(self.session_id, self.context, [])

    def advance(self, scored: Scored, caches: SessionCaches) -> tuple[DraftToken, bool]:
        token, q = draft_token(scored.logits, self.context, self.params, self.generator, self.grammar)
        self.context.append(token)
        return DraftToken(token, q, 0, scored.prefilled, MODEL), len(self.context) >= self.target_length


class ModelProposer(ProposerBase):
    """Autoregressive proposals from a causal LM with a per-session KV cache.

    Served, it drafts through `batcher` (which runs the model on `caches`), masked by a fork of the
    session's grammar state, and releases a session's cache on the batcher's thread; `propose` runs
    the model in the caller's thread, one step per token, without a grammar.
    """

    sources = (MODEL,)

    def __init__(self, caches: SessionCaches, profile: LatencyProfile = LatencyProfile(),
                 batcher: Batcher | None = None) -> None:
        if batcher is not None and batcher.caches is not caches:
            raise ValueError("the batcher must run the proposer's own caches")
        self.caches = caches
        self.profile = profile
        self.batcher = batcher

    @classmethod
    def batched(cls, batcher: Batcher, profile: LatencyProfile = LatencyProfile()) -> ModelProposer:
        """The proposer of the model `batcher` runs."""
        return cls(batcher.caches, profile, batcher)

    def propose(self, session_id: str, history: list[int], k: int, params: SamplingParams,
                seed: int) -> Iterator[DraftToken]:
        if params.grammar_kind:
            raise ValueError("grammars are applied on the batched path (job): pass a GrammarState there")
        generator = None if params.greedy else derive_generator(seed, len(history), DRAFT_STREAM)
        context = list(history)
        for _ in range(k):
            start = time.perf_counter_ns()
            logits, prefilled = self.caches.score(session_id, context, [])  # [1, V]
            token, q = draft_token(logits, context, params, generator)
            context.append(token)
            self.profile.pad(start, 1)
            yield DraftToken(token, q, time.perf_counter_ns() - start, prefilled, MODEL)

    def job(self, session_id: str, history: list[int], k: int, params: SamplingParams, seed: int,
            deadline: float | None = None, grammar: GrammarState | None = None) -> DraftJob:
        """The same proposals as `propose`, as a job for the batcher (with a grammar: masked by it)."""
        return DraftJob(session_id, history, k, params, seed, deadline, grammar)

    async def block(self, request: DraftRequest, env: DraftEnv) -> Block:
        if self.batcher is None:
            raise ValueError("a model proposer drafts through a batcher: build it with one (ModelProposer.batched)")
        q_width = 0 if request.params.greedy else self.caches.vocab_size
        if request.k == 0:
            return Block.empty(MODEL, q_width)
        grammar = await env.fork(request)
        job = self.job(request.session_id, request.history, request.k, request.params, request.seed,
                       request.deadline, grammar)
        job.enqueued = request.arrived
        job.sent_unix_ns = request.sent_unix_ns
        return Block(MODEL, self.batcher.stream(job), q_width)

    def forget(self, session_id: str, learn: bool = True) -> bool:
        return self.caches.release(session_id)

    async def release(self, session_id: str, learn: bool = True, sent_unix_ns: int = 0) -> bool:
        """The session's KV cache goes (and its snapshot); its queued and running work stops."""
        if self.batcher is None:
            return self.forget(session_id)
        self.batcher.cancel_session(session_id, sent_unix_ns)
        released = await self.batcher.call(self.caches.release, session_id)
        if self.caches.snapshots is not None:
            await asyncio.to_thread(self.caches.snapshots.store.delete, session_id)
        return released


class HostProposer(ProposerBase):
    """A proposer computed on the host, with no model (prompt lookup, suffix speculation): `propose`
    runs on the drafter's worker thread, and its proposal is cut at the first token the grammar refuses."""

    source = ""

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,)

    def propose(self, session_id: str, history: list[int], k: int, params: SamplingParams,
                seed: int) -> Iterator[DraftToken]:
        raise NotImplementedError

    async def block(self, request: DraftRequest, env: DraftEnv) -> Block:
        if request.k == 0:
            return Block.empty(self.source)
        return Block.listed(self.source, await env.proposal(self.propose, request), request.arrived)


class NgramProposer(HostProposer):
    """Prompt lookup: propose the tokens that followed the latest earlier match of the suffix."""

    source = NGRAM

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, session_id: str, history: list[int], k: int, params: SamplingParams,
                seed: int) -> Iterator[DraftToken]:
        start = time.perf_counter_ns()
        tokens = propose_ngram(history, k, self.max_ngram, self.min_ngram)
        elapsed = time.perf_counter_ns() - start
        for token in tokens:
            yield DraftToken(token, None, elapsed // max(len(tokens), 1), source=NGRAM)


AT_ONCE_TOKENS = 16  # new history tokens a suffix look-up indexes on the event loop (more: on the worker thread)
MAX_FOLLOWERS = 64  # followers a suffix block lists (`ProposeBlock.followers`); more: not listed


class SuffixProposer(HostProposer):
    """Suffix speculation: the most frequent continuation of the longest match of the history's end,
    in the session's own history or in its corpus group's earlier outputs (`specdec.core.suffix`).

    A session's index follows its history: each request carries the whole history and only what
    is new gets indexed (a history that does not extend the indexed one is indexed afresh). At most
    `max_sessions` are kept, least recently used dropped first. Earlier outputs are kept per corpus
    group (`Corpora`: a group is a tenant, or the tenants an operator groups; "" the anonymous one),
    and a request drafts only from its own group's: another tenant's outputs would show through the
    round statistics. `add_output` feeds a group's corpus (the draft service's reader of the shared
    Redis stream, or this proposer itself on `release` when `learn_on_release`, into the group the
    session's requests named). At most `max_tokens` tokens are indexed over all groups (and in each
    session), in at most `max_groups` groups. Thread-safe: one lock guards the indexes.
    """

    source = SUFFIX
    learns_outputs = True

    def __init__(self, max_depth: int = 32, min_match: int = 2, min_prob: float = 0.1,
                 max_tokens: int = 1_000_000, max_sessions: int = 256, learn_on_release: bool = False,
                 max_groups: int = 1024, spec_factor: float = 0.0) -> None:
        self._new_index = lambda: SuffixIndex(max_depth, min_match, max_tokens)
        self.min_prob = min_prob
        self.spec_factor = spec_factor
        self.max_sessions = max_sessions
        self.learn_on_release = learn_on_release
        self.corpora = Corpora(max_depth, min_match, max_tokens, max_groups)
        self._sessions: OrderedDict[str, _SuffixSession] = OrderedDict()
        self._lock = threading.RLock()

    def propose(self, session_id: str, history: list[int], k: int, params: SamplingParams,
                seed: int, group: str = "") -> Iterator[DraftToken]:
        """Up to `k` tokens after `history`, from the session's own history or `group`'s corpus."""
        start = time.perf_counter_ns()
        with self._lock:
            session = self._session(session_id, history, params.output_start, group)
            own = session.index.speculate(history, k, self.min_prob, own=True, spec_factor=self.spec_factor)
            corpus = self.corpora.get(group)
            shared = (corpus.speculate(history, k, self.min_prob, spec_factor=self.spec_factor) if corpus is not None
                      else NOTHING)
        tokens = best_speculation(own, shared).tokens
        elapsed = time.perf_counter_ns() - start
        for token in tokens:
            yield DraftToken(token, None, elapsed // max(len(tokens), 1), source=SUFFIX)

    def for_group(self, group: str) -> ProposeFn:
        """`propose` for the requests of corpus group `group`."""
        return functools.partial(self.propose, group=group)

    def propose_at_once(self, request: DraftRequest) -> list[DraftToken] | None:
        """The proposal, made on the caller's thread when it is a look-up and little else: the session
        is indexed up to at most `AT_ONCE_TOKENS` new tokens, and no other thread holds the indexes.
        None otherwise (a new session's whole history to index, a corpus being fed): the worker
        thread makes it, so that the event loop never waits for either."""
        if not self._lock.acquire(blocking=False):
            return None
        try:  # (reentrant: `propose` takes it again)
            session = self._sessions.get(request.session_id)
            if (session is None or session.group != request.corpus_group or not session.extended_by(request.history)
                    or len(request.history) - session.indexed > AT_ONCE_TOKENS):
                return None
            return list(self.propose(request.session_id, request.history, request.k, request.params, request.seed,
                                     request.corpus_group))
        finally:
            self._lock.release()

    async def proposal(self, request: DraftRequest, env: DraftEnv) -> list[DraftToken]:
        """Up to `request.k` tokens (k >= 1), at once when it is cheap (`propose_at_once`), else on
        the worker thread; cut by the grammar either way."""
        request.check_deadline()
        drafts = self.propose_at_once(request)
        if drafts is None:
            return await env.proposal(self.for_group(request.corpus_group), request)
        return await env.cut(request, drafts)

    async def block(self, request: DraftRequest, env: DraftEnv) -> Block:
        if request.k == 0:
            return Block.empty(self.source)
        drafts = await self.proposal(request, env)
        return Block.listed(self.source, drafts, request.arrived, self.followers(request, drafts))

    def followers(self, request: DraftRequest, drafts: list[DraftToken]) -> tuple[int, ...] | None:
        """The tokens after which `request.history` and `drafts` could be drafted anything (at most
        `MAX_FOLLOWERS`, `specdec.core.suffix.followers`), from the session's index as the proposal
        left it; None when another thread holds the indexes (never waited for on the event loop),
        the session is not indexed up to the history, or there are more."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            session = self._sessions.get(request.session_id)
            history = request.history
            if (session is None or session.group != request.corpus_group or session.indexed != len(history)
                    or not history or session.last != history[-1]):
                return None
            return followers(history + [d.token_id for d in drafts], session.indexed, session.index,
                             self.corpora.get(request.corpus_group), MAX_FOLLOWERS)
        finally:
            self._lock.release()

    def _session(self, session_id: str, history: list[int], output_start: int, group: str) -> _SuffixSession:
        session = self._sessions.get(session_id)
        if session is None or session.group != group or not session.extended_by(history):
            session = self._sessions[session_id] = _SuffixSession(self._new_index(), group=group)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        session.index.extend(history[session.indexed:])
        session.indexed, session.last = len(history), history[-1] if history else -1
        session.output = history[output_start:]
        return session

    def add_output(self, tokens: list[int], group: str = "") -> None:
        """A finished generation's output joins its corpus group's corpus."""
        if tokens:
            with self._lock:
                self.corpora.add(group, tokens)

    def forget(self, session_id: str, learn: bool = True) -> bool:
        """Drop the session's index (its output joins its group's corpus first when `learn_on_release`
        and `learn`)."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is not None and self.learn_on_release and learn:
            self.add_output(session.output or [], session.group)
        return session is not None


@dataclass
class _SuffixSession:
    index: SuffixIndex  # of the session's history
    indexed: int = 0  # history tokens indexed
    last: int = -1  # the last of them: a cheap check that a new history extends the indexed one
    output: list[int] | None = None  # the current output (history[output_start:]), for the corpus on release
    group: str = ""  # the corpus group its requests name: its output joins that group's corpus on release

    def extended_by(self, history: list[int]) -> bool:
        return len(history) >= self.indexed and (self.indexed == 0 or history[self.indexed - 1] == self.last)


class HybridProposer(ProposerBase):
    """A causal LM and suffix speculation: each call takes the suffix proposal when it is confident
    and the model's otherwise.

    Suffix speculation is asked first, on every call, so that the session's suffix index follows
    the history whichever source drafts. It proposes nothing unless the history's end matches
    (`min_match`) and the continuation is frequent enough (`min_prob`), and chooses how many tokens
    from the match and its frequencies; any proposal it makes is taken, deterministic (q one-hot,
    no probs on the wire, as prompt lookup's), and costs no forward pass. Otherwise the model
    drafts the block as a `ModelProposer` does (through the batcher in the draft service).

    Skipping the model for a round leaves its KV cache behind the history: its cache is keyed by
    the history each call names (`specdec.runtime.kv`), so the next model round re-prefills the
    tokens it missed (reported as `prefill_tokens`) and proposes exactly what a model that had
    drafted every round would.
    """

    sources = (MODEL, SUFFIX)  # the model drafts whatever suffix speculation does not
    learns_outputs = True

    def __init__(self, model: ModelProposer, suffix: SuffixProposer) -> None:
        self.model = model
        self.suffix = suffix

    def propose(self, session_id: str, history: list[int], k: int, params: SamplingParams,
                seed: int) -> Iterator[DraftToken]:
        drafts = list(self.suffix.propose(session_id, history, k, params, seed))
        yield from drafts or self.model.propose(session_id, history, k, params, seed)

    async def block(self, request: DraftRequest, env: DraftEnv) -> Block:
        """The suffix proposal if it makes one (and may: `DraftRequest.sources`), else the model's
        block, or nothing when the request names the suffix alone."""
        if request.k > 0 and request.allows(SUFFIX):
            drafts = await self.suffix.proposal(request, env)
            if drafts:
                return Block.listed(SUFFIX, drafts, request.arrived)
        if not request.allows(MODEL):
            return Block.empty(SUFFIX)
        return await self.model.block(request, env)

    def add_output(self, tokens: list[int], group: str = "") -> None:
        """A finished generation's output joins its corpus group's suffix corpus."""
        self.suffix.add_output(tokens, group)

    def forget(self, session_id: str, learn: bool = True) -> bool:
        suffix = self.suffix.forget(session_id, learn)
        return self.model.forget(session_id) or suffix

    async def release(self, session_id: str, learn: bool = True, sent_unix_ns: int = 0) -> bool:
        suffix = await self.suffix.release(session_id, learn, sent_unix_ns)
        return await self.model.release(session_id, learn, sent_unix_ns) or suffix
