"""Each session's grammar state on one model service, kept in step with the request's history.

As with the KV cache, the history decides: every call names the session's output so far (the
history after `SamplingParams.output_start`), and the session's state is rolled back to the
common prefix with what it consumed, then advanced along the rest. A failover, a rejected
block or an overlapped draft that guessed wrong is therefore just another history. Compiling
a grammar and building the tokenizer's index (~2 s for a 49k vocabulary, once per service)
happen on first use.

All calls take the lock: the target's batcher thread and the draft's executor may call at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from specdec.core.grammar import GrammarCompiler, GrammarSpec, GrammarState, cut_proposal
from specdec.core.sampling import SamplingParams
from specdec.errors import InvalidArgument

_REBUILD_AFTER = 256  # rolling back further than this replays the output from the start instead


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def grammar_of(params: SamplingParams) -> GrammarSpec | None:
    return GrammarSpec(params.grammar_kind, params.grammar_text) if params.grammar_kind else None


class SessionGrammars:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], max_sessions: int = 4096) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._states: OrderedDict[str, GrammarState] = OrderedDict()
        self._max_sessions = max_sessions
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._states)

    def _compile(self, spec: GrammarSpec):
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos)
        try:
            return self._compiler.compile(spec)
        except ValueError as exc:
            raise InvalidArgument(f"grammar: {exc}") from exc

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
        state.rollback(state.num_tokens - common)
        try:
            state.advance(output[common:])
        except ValueError as exc:
            raise InvalidArgument(f"the session's output does not follow its grammar: {exc}") from exc
        self._states[session_id] = state
        while len(self._states) > self._max_sessions:
            self._states.popitem(last=False)
        return state

    def block_masks(self, session_id: str, spec: GrammarSpec, output: Sequence[int],
                    block: Sequence[int]) -> torch.Tensor:
        """`[len(block) + 1, V]`: row i allows what the grammar allows after output + block[:i]."""
        with self._lock:
            return self._synced(session_id, spec, output).block_masks(list(block))

    def fork(self, session_id: str, spec: GrammarSpec, output: Sequence[int]) -> GrammarState:
        """A private copy of the state after `output` (a draft advances it along its proposal)."""
        with self._lock:
            return self._synced(session_id, spec, output).fork()

    def forced(self, session_id: str, spec: GrammarSpec, output: Sequence[int], max_tokens: int) -> list[int]:
        """Tokens the grammar forces after `output` (see `GrammarState.forced`), at most `max_tokens`."""
        with self._lock:
            return self._synced(session_id, spec, output).forced(max_tokens)

    def cut(self, session_id: str, spec: GrammarSpec, output: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """The longest prefix of a model-free proposal the grammar allows after `output`."""
        with self._lock:
            return cut_proposal(self._synced(session_id, spec, output), tokens)

    def release(self, session_id: str) -> bool:
        with self._lock:
            return self._states.pop(session_id, None) is not None
