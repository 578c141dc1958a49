"""Batched drafting: one call per step of an engine that runs many requests at once (vLLM's proposer).

The engine sends, each step, every running request's new tokens and the draft length it wants for
it, and gets one block per request back. Unlike `Propose`, a request does not resend its whole
history each time: `SessionHistories` keeps it here (bounded, least recently used dropped first),
and an entry whose `start` is past what this replica holds comes back `history_missing` (a replica
that just took over, or an evicted session): the caller sends the whole history next step.

A draft model's first block of a session would prefill the whole prompt while the engine's step
waits (hundreds of ms on a CPU, several engine steps). With `warm_tokens`, a session first seen with
a longer history is prefilled in the background instead, and answered `warming` (no block) until
that is done; its later blocks catch up on the few tokens generated meanwhile.

Finished requests come in the same call: their output (the history from `output_start` on) goes
to the `OutputSink` (the shared corpus stream when the service reads one, else the proposer's own
corpus), in the corpus group their entries named, unless the caller said to forget it.

Every bound is checked before anything is done (`check_batch`): the call is refused as a whole
with `InvalidArgument` naming the field, e.g. `entries[3].num_tokens`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.core.sampling import SamplingParams
from specdec.errors import InvalidArgument
from specdec.runtime.drafting import Drafter

log = logging.getLogger("specdec.draft")

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as the services' session ids
MAX_ENTRIES = 1024  # requests per call (vLLM's max_num_seqs is 256 by default on GPUs)
MAX_FINISHED = 1024  # finished requests per call
MAX_DRAFT = 64  # draft length per entry
MAX_GROUP_CHARS = 128  # a corpus group is a hash, never a token
MAX_HISTORY = 1 << 20  # tokens of one session's history
MAX_CALL_TOKENS = 1 << 22  # tokens in one call, over all its entries and finished sessions

OutputSink = Callable[[list[int], str], None]
"""Where a finished request's output goes: (tokens, corpus group)."""


@dataclass(frozen=True)
class BatchItem:
    """One running request of a call: `tokens` are its history from position `start` on; `k` tokens wanted."""

    session_id: str
    start: int
    tokens: list[int]
    k: int
    output_start: int = 0
    group: str = ""


@dataclass(frozen=True)
class FinishedItem:
    """A finished request: the tail of its history the service has not seen (from `start`)."""

    session_id: str
    start: int = 0
    tokens: list[int] = field(default_factory=list)
    forget: bool = False
    output_start: int = 0  # for a session this replica does not hold (start 0, the whole history)
    group: str = ""


@dataclass(frozen=True)
class BlockResult:
    """One entry's answer: its tokens, or `history_missing` (then no tokens)."""

    tokens: list[int]
    source: str = ""
    compute_ns: int = 0
    history_missing: bool = False
    prefill_tokens: int = 0  # history tokens the draft (re-)prefilled for it
    warming: bool = False  # no block: the session's history is being prefilled in the background


def _check_tokens(name: str, start: int, tokens: list[int], vocab_size: int) -> None:
    if start + len(tokens) > MAX_HISTORY:
        raise InvalidArgument(f"{name}: start + len(tokens) = {start + len(tokens)} is past the longest history "
                              f"kept ({MAX_HISTORY} tokens)")
    if vocab_size and tokens and max(tokens) >= vocab_size:
        raise InvalidArgument(f"{name}.tokens: id {max(tokens)} is outside the vocabulary (ids below {vocab_size})")


def _check_session_id(name: str, session_id: str, seen: set[str]) -> None:
    if not SESSION_ID.fullmatch(session_id):
        raise InvalidArgument(f"{name}.session_id is not a session id (letters, digits, '-' or '_', at most 64)")
    if session_id in seen:
        raise InvalidArgument(f"{name}.session_id {session_id!r} appears twice in the call")
    seen.add(session_id)


def check_batch(items: list[BatchItem], finished: list[FinishedItem], vocab_size: int) -> None:
    """Refuse a call past any bound, naming the field (`InvalidArgument`); nothing is done before."""
    if len(items) > MAX_ENTRIES:
        raise InvalidArgument(f"entries: {len(items)} entries, at most {MAX_ENTRIES} in one call")
    if len(finished) > MAX_FINISHED:
        raise InvalidArgument(f"finished: {len(finished)} sessions, at most {MAX_FINISHED} in one call")
    total = sum(len(i.tokens) for i in items) + sum(len(f.tokens) for f in finished)
    if total > MAX_CALL_TOKENS:
        raise InvalidArgument(f"entries.tokens: {total} tokens in one call, at most {MAX_CALL_TOKENS}")
    seen: set[str] = set()
    for n, item in enumerate(items):
        name = f"entries[{n}]"
        _check_session_id(name, item.session_id, seen)
        if item.k > MAX_DRAFT:
            raise InvalidArgument(f"{name}.num_tokens: {item.k}, at most {MAX_DRAFT}")
        if item.start == 0 and not item.tokens:
            raise InvalidArgument(f"{name}.tokens: empty with start 0 (send at least one token)")
        _check_tokens(name, item.start, item.tokens, vocab_size)
        _check_output(name, item.output_start, item.start + len(item.tokens), item.group)
    seen = set()
    for n, done in enumerate(finished):
        name = f"finished[{n}]"
        _check_session_id(name, done.session_id, seen)
        _check_tokens(name, done.start, done.tokens, vocab_size)
        _check_output(name, done.output_start, done.start + len(done.tokens), done.group)


def _check_output(name: str, output_start: int, end: int, group: str) -> None:
    if output_start > end:
        raise InvalidArgument(f"{name}.output_start: {output_start} is past the history's end ({end})")
    if len(group) > MAX_GROUP_CHARS:
        raise InvalidArgument(f"{name}.corpus_group: {len(group)} characters, at most {MAX_GROUP_CHARS}")


@dataclass
class _History:
    tokens: list[int]
    output_start: int
    group: str


class SessionHistories:
    """The histories of the sessions batched calls draft, at most `max_sessions` of them and `max_tokens`
    tokens over all (least recently used dropped first)."""

    def __init__(self, max_sessions: int = 4096, max_tokens: int = 1 << 24) -> None:
        self.max_sessions, self.max_tokens = max_sessions, max_tokens
        self._held: OrderedDict[str, _History] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._held)

    def extend(self, session_id: str, start: int, tokens: list[int], output_start: int = 0,
               group: str = "") -> list[int] | None:
        """The session's history once `tokens` are written from position `start` (what was past it is
        replaced); None when this replica holds fewer than `start` tokens of it."""
        held = self._held.get(session_id)
        if start and (held is None or len(held.tokens) < start):
            return None
        if held is None:
            held = self._held[session_id] = _History([], output_start, group)
        self._tokens -= len(held.tokens)
        held.tokens[start:] = tokens
        held.output_start, held.group = output_start, group
        self._tokens += len(held.tokens)
        self._held.move_to_end(session_id)
        while self._held and (len(self._held) > self.max_sessions or self._tokens > self.max_tokens):
            _, old = self._held.popitem(last=False)
            self._tokens -= len(old.tokens)
        return held.tokens if session_id in self._held else None

    def pop(self, session_id: str) -> _History | None:
        held = self._held.pop(session_id, None)
        if held is not None:
            self._tokens -= len(held.tokens)
        return held


class BatchDrafter:
    """Serves batched calls with a `Drafter` (its proposer, grammars, worker thread) and a sink for the
    outputs of finished sessions (None: nothing is learned)."""

    def __init__(self, drafter: Drafter, sink: OutputSink | None = None,
                 histories: SessionHistories | None = None, warm_tokens: int | None = None) -> None:
        """`warm_tokens`: a session first seen with a history longer than this is prefilled in the
        background and answered `warming` until that is done (None: every block is drafted at once;
        for a draft without a cache to fill)."""
        self.drafter = drafter
        self.sink = sink
        self.histories = histories or SessionHistories()
        self.warm_tokens = warm_tokens
        self._warming: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()  # releases and warm-ups under way

    async def finish(self, done: FinishedItem) -> bool:
        """Release a finished session; True when its output went to the sink. Its caches are freed in
        the background: a draft model frees them between passes, and the caller's call (its engine's
        step) does not wait behind another session's prefill for that."""
        held = self.histories.pop(done.session_id)
        self._background(self.drafter.release(done.session_id, learn=False),  # the sink learns it, once
                         f"releasing finished session {done.session_id}")
        if held is None and done.start == 0:  # not held here: the call carries the whole history
            held = _History([], done.output_start, done.group)
        if held is None or done.forget or self.sink is None:
            return False
        if done.tokens:
            if done.start > len(held.tokens):
                return False  # a tail after a gap: the output is not known whole
            held.tokens[done.start:] = done.tokens
        output = held.tokens[held.output_start:]
        if not output:
            return False
        self.sink(output, held.group)
        return True

    async def block(self, item: BatchItem, deadline: float | None, arrived: float) -> BlockResult:
        history = self.histories.extend(item.session_id, item.start, item.tokens, item.output_start, item.group)
        if history is None:
            return BlockResult([], history_missing=True)
        if item.k == 0:
            return BlockResult([])
        if item.session_id in self._warming:
            return BlockResult([], warming=True)
        if self.warm_tokens is not None and item.start == 0 and len(history) > self.warm_tokens:
            self._warm(item, list(history))
            return BlockResult([], warming=True)
        params = SamplingParams(output_start=item.output_start)
        tokens, source, compute_ns, prefilled = [], "", 0, 0
        async for draft, step in self.drafter.stream(item.session_id, list(history), item.k, params, 0, deadline,
                                                     arrived, 0, item.group):
            tokens.append(draft.token_id)
            source, compute_ns, prefilled = draft.source, compute_ns + step.compute_ns, prefilled + draft.prefill_tokens
        return BlockResult(tokens, source, compute_ns, prefill_tokens=prefilled)

    def _background(self, work, what: str, level: int = logging.WARNING) -> asyncio.Task:
        """Run `work` on the event loop, holding it until it is done; a failure is logged at `level`."""
        async def run() -> None:
            try:
                await work
            except Exception as exc:  # noqa: BLE001 (a failed release leaves the cache to eviction; a failed
                log.log(level, "%s failed: %s", what, exc)  # warm-up, to the next block's own prefill)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _warm(self, item: BatchItem, history: list[int]) -> None:
        """Prefill the session's cache in the background (by drafting one token, not returned): the
        caller's engine step does not wait for a whole prompt's prefill."""
        async def warm() -> None:
            try:
                params = SamplingParams(output_start=item.output_start)
                async for _ in self.drafter.stream(item.session_id, history, 1, params, 0, None, time.monotonic(),
                                                   0, item.group):
                    pass
            finally:
                self._warming.pop(item.session_id, None)

        self._warming[item.session_id] = self._background(warm(), f"warming session {item.session_id}",
                                                            logging.DEBUG)  # released meanwhile, say

    async def propose(self, items: list[BatchItem], finished: list[FinishedItem], deadline: float | None = None,
                      arrived: float | None = None) -> tuple[list[BlockResult], int]:
        """The finished sessions released (their outputs learned), then one block per item, in order;
        and how many outputs were learned."""
        arrived = time.monotonic() if arrived is None else arrived
        learned = 0
        for done in finished:
            learned += await self.finish(done)
        blocks = await asyncio.gather(*(self.block(item, deadline, arrived) for item in items))
        return list(blocks), learned
