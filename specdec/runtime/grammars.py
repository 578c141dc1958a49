"""Each session's grammar state on one model service, kept in step with the request's history, and
the worker that compiles grammars.

As with the KV cache, the history decides: every call names the session's output so far (the
history after `SamplingParams.output_start`), and the session's state is rolled back to the
common prefix with what it consumed, then advanced along the rest. A failover, a rejected
block or an overlapped draft that guessed wrong is therefore just another history.

Compiling a grammar (and, on first use, building the tokenizer's index: ~2 s for a 49k
vocabulary, once per service) runs on a `GrammarWorker`: one thread of its own with a large stack,
never the event loop or the model thread, and a compile that runs past its time limit is answered
`INVALID_ARGUMENT` (`prepare`). The calls below then find the grammar compiled; if one does not
(evicted meanwhile), it compiles where it is called, under the same size and engine limits.

All calls take the lock: the target's batcher thread and the draft's executor may call at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import torch

from specdec.core.grammar import (
    SERVICE_LIMITS,
    GrammarCompiler,
    GrammarFailed,
    GrammarLimits,
    GrammarSpec,
    GrammarState,
    cut_proposal,
)
from specdec.core.sampling import SamplingParams
from specdec.errors import InvalidArgument

T = TypeVar("T")

_REBUILD_AFTER = 256  # rolling back further than this replays the output from the start instead
STACK_BYTES = 256 << 20  # the worker's stack: llguidance recurses along nested rules and $ref chains


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def grammar_of(params: SamplingParams) -> GrammarSpec | None:
    return GrammarSpec(params.grammar_kind, params.grammar_text) if params.grammar_kind else None


class GrammarWorker:
    """Runs grammar compiles, one at a time, on a thread of its own with a `STACK_BYTES` stack (the
    8 MiB of a main thread overflow at a few thousand nested rules, and an overflow kills the
    process), off the event loop and the model thread.

    `run` waits for the work to start and then at most `timeout_s` for it to finish; past that it
    raises `InvalidArgument` naming the limit. The compile itself cannot be interrupted (native
    code): it runs on while the thread is busy, and the spec is remembered, so that sending it
    again is refused at once. The engine's own limits keep such a compile short.
    """

    def __init__(self, timeout_s: float = SERVICE_LIMITS.compile_timeout_s, remember: int = 256) -> None:
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._too_slow: OrderedDict[object, None] = OrderedDict()
        self._remember = remember

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            previous = threading.stack_size(STACK_BYTES)
            try:
                self._thread = threading.Thread(target=self._serve, name="grammar-compile", daemon=True)
                self._thread.start()
            finally:
                threading.stack_size(previous)

    def _serve(self) -> None:
        while True:
            fn, future, started = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            started.append(time.monotonic())
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the caller, who raises it
                future.set_exception(exc)

    def submit(self, fn: Callable[[], T]) -> Future:
        """`fn()` on the worker thread, with no time limit (one-time set-up, e.g. a tokenizer's index)."""
        self._start()
        future: Future = Future()
        self._jobs.put((fn, future, []))
        return future

    async def run(self, key: object, fn: Callable[[], T], what: str = "grammar") -> T:
        """`fn()` on the worker thread, within `timeout_s` once it starts; `key` names the work (a
        spec) so that one that ran too long is refused at once next time."""
        if key in self._too_slow:
            raise InvalidArgument(f"{what}: compiling it took over {self.timeout_s:g} s before (the limit); "
                                  "simplify it")
        self._start()
        future: Future = Future()
        started: list[float] = []  # the worker appends when it starts the work
        self._jobs.put((fn, future, started))
        wrapped = asyncio.wrap_future(future)
        try:
            while True:
                left = None if not started else started[0] + self.timeout_s - time.monotonic()
                done, _ = await asyncio.wait({wrapped}, timeout=0.05 if left is None else max(left, 0.0))
                if done:
                    return wrapped.result()
                if started and time.monotonic() - started[0] >= self.timeout_s:
                    self._too_slow[key] = None
                    while len(self._too_slow) > self._remember:
                        self._too_slow.popitem(last=False)
                    raise InvalidArgument(f"{what}: compiling it took over {self.timeout_s:g} s (the limit); "
                                          "simplify it")
        except asyncio.CancelledError:
            wrapped.cancel()  # its caller left: work not started yet is dropped
            raise


_WORKER: GrammarWorker | None = None


def worker() -> GrammarWorker:
    """The process's grammar worker (one thread, started on first use)."""
    global _WORKER
    if _WORKER is None:
        _WORKER = GrammarWorker()
    return _WORKER


async def check_grammar(params: SamplingParams, limits: GrammarLimits) -> None:
    """`InvalidArgument` (naming the grammar field) unless the request's grammar is valid within
    `limits`: the cheap checks here, the compile without a tokenizer on the `GrammarWorker` (the
    orchestrator's check: the services compile it for their tokenizer)."""
    spec = grammar_of(params)
    if spec is None or (spec, limits) in _CHECKED:
        return
    try:
        spec.check(limits)
        await worker().run(spec, lambda: spec.validate(limits))
    except ValueError as exc:
        raise InvalidArgument(f"grammar: {exc}") from None
    _CHECKED[spec, limits] = None  # the same schema comes again and again: checked once
    while len(_CHECKED) > 256:
        _CHECKED.popitem(last=False)


_CHECKED: OrderedDict[tuple[GrammarSpec, GrammarLimits], None] = OrderedDict()  # used from the event loop only


async def prepare(grammars: SessionGrammars | None, params: SamplingParams | None) -> None:
    """Compile the request's grammar (if any) on the `GrammarWorker` before its work is queued, so
    the model thread never compiles it; `InvalidArgument` if it is invalid or too costly."""
    spec = None if params is None else grammar_of(params)
    if spec is not None and grammars is not None:
        await grammars.prepare(spec)


class SessionGrammars:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], max_sessions: int = 4096) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._states: OrderedDict[str, GrammarState] = OrderedDict()
        self._max_sessions = max_sessions
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()  # building the compiler (once) takes seconds: not under _lock

    def __len__(self) -> int:
        return len(self._states)

    def _compiler_ready(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos)
            return self._compiler

    def _compile(self, spec: GrammarSpec):
        try:
            return self._compiler_ready().compile(spec)
        except ValueError as exc:
            raise InvalidArgument(f"grammar: {exc}") from exc

    async def prepare(self, spec: GrammarSpec) -> None:
        """Compile `spec` on the `GrammarWorker` (a cache hit returns at once); `InvalidArgument` if it
        is invalid, over the limits, or takes over the worker's time limit. The tokenizer's index,
        built on first use, is not counted against that limit."""
        if self._compiler is not None and self._compiler.cached(spec) is not None:
            return
        try:
            spec.check(SERVICE_LIMITS)
        except ValueError as exc:
            raise InvalidArgument(f"grammar: {exc}") from None
        work = worker()
        if self._compiler is None:
            await asyncio.wrap_future(work.submit(self._compiler_ready))
        await work.run(spec, lambda: self._compile(spec))

    def _synced(self, session_id: str, spec: GrammarSpec, output: Sequence[int]) -> GrammarState:
        """The session's state, moved to the end of `output` (InvalidArgument if the grammar
        does not allow it: the history was not made under this grammar)."""
        compiled = self._compile(spec)
        state = self._states.pop(session_id, None)
        if state is None or state.compiled is not compiled:
            state = compiled.state()
        output = [int(t) for t in output]
        common = _common_prefix(state.tokens, output)
        if state.num_tokens - common > _REBUILD_AFTER:
            state, common = compiled.state(), 0
        try:
            state.rollback(state.num_tokens - common)
            state.advance(output[common:])
        except GrammarFailed as exc:
            raise InvalidArgument(f"grammar: {exc}") from exc
        except ValueError as exc:
            raise InvalidArgument(f"the session's output does not follow its grammar: {exc}") from exc
        self._states[session_id] = state
        while len(self._states) > self._max_sessions:
            self._states.popitem(last=False)
        return state

    def block_masks(self, session_id: str, spec: GrammarSpec, output: Sequence[int],
                    block: Sequence[int]) -> torch.Tensor:
        """`[len(block) + 1, V]`: row i allows what the grammar allows after output + block[:i]."""
        with self._lock, _engine_limits():
            return self._synced(session_id, spec, output).block_masks(list(block))

    def fork(self, session_id: str, spec: GrammarSpec, output: Sequence[int]) -> GrammarState:
        """A private copy of the state after `output` (a draft advances it along its proposal)."""
        with self._lock, _engine_limits():
            return self._synced(session_id, spec, output).fork()

    def forced(self, session_id: str, spec: GrammarSpec, output: Sequence[int], max_tokens: int) -> list[int]:
        """Tokens the grammar forces after `output` (see `GrammarState.forced`), at most `max_tokens`."""
        with self._lock, _engine_limits():
            return self._synced(session_id, spec, output).forced(max_tokens)

    def cut(self, session_id: str, spec: GrammarSpec, output: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """The longest prefix of a model-free proposal the grammar allows after `output`."""
        with self._lock, _engine_limits():
            return cut_proposal(self._synced(session_id, spec, output), tokens)

    def release(self, session_id: str) -> bool:
        with self._lock:
            return self._states.pop(session_id, None) is not None


@contextlib.contextmanager
def _engine_limits():
    """A grammar the engine gave up on mid-way (`GrammarFailed`) is the request's error."""
    try:
        yield
    except GrammarFailed as exc:
        raise InvalidArgument(f"grammar: {exc}") from exc
