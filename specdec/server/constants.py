"""Each session's request-constant sampling state on a model service: received once, kept.

A generation's logit_bias and grammar stay the same for all its calls and may be large (a bias
per token of the vocabulary, a JSON schema of many kilobytes). The orchestrator sends them with
their digest (`SamplingParams.constants_digest`) the first time it calls a replica for the
session, and the digest alone after that. `SessionConstants.resolve` turns either form into the
full `SamplingParams`; a digest it does not hold for the session (this replica restarted, evicted
them, or never saw the session) raises `MissingConstants` (NOT_FOUND), and the orchestrator sends
the call again with them. They are kept per session, never looked up by digest alone, so no
session can use, or learn about, another's. Memory is bounded by `max_bytes` (least recently
used first).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass

from specdec.core.sampling import SamplingParams
from specdec.errors import InvalidArgument, NotFound
from specdec.server.wire import constants_digest, sampling_from_pb
from specdec.v1 import common_pb2

DEFAULT_MAX_BYTES = 64 * 1024 * 1024


class MissingConstants(NotFound):
    """The call named the session's sampling constants by digest, and this service does not hold
    them: the caller sends the call again with them (the only NOT_FOUND of Propose, Verify and
    ScoreTokens)."""


@dataclass(frozen=True)
class _Held:
    digest: bytes
    logit_bias: tuple[tuple[int, float], ...]
    grammar_kind: str
    grammar_text: str

    @property
    def size(self) -> int:
        return 64 + 16 * len(self.logit_bias) + len(self.grammar_kind) + len(self.grammar_text.encode())


class SessionConstants:
    """The logit_bias and grammar of each session's generation, as last received."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # servicers call from the event loop; tests and tools may not

    def __len__(self) -> int:
        return len(self._held)

    @property
    def bytes(self) -> int:
        return self._bytes

    def resolve(self, session_id: str, msg: common_pb2.SamplingParams, vocab_size: int | None = None) -> SamplingParams:
        """The call's full parameters (validated, as `sampling_from_pb`), keeping or filling in the
        session's constants; MissingConstants for a digest this service does not hold."""
        params = sampling_from_pb(msg, vocab_size)
        if not msg.constants_digest:
            return params  # none, or a caller that sends them every time
        if params.logit_bias or params.grammar_kind or params.grammar_text:
            if constants_digest(params) != msg.constants_digest:
                raise InvalidArgument("sampling.constants_digest does not match its logit_bias and grammar")
            self._keep(session_id, _Held(msg.constants_digest, params.logit_bias, params.grammar_kind,
                                         params.grammar_text))
            return params
        with self._lock:
            held = self._held.get(session_id)
            if held is not None and held.digest == msg.constants_digest:
                self._held.move_to_end(session_id)
        if held is None or held.digest != msg.constants_digest:
            raise MissingConstants(f"this service holds no logit_bias and grammar for session {session_id!r} under "
                                   "that digest: send them with the call")
        return dataclasses.replace(params, logit_bias=held.logit_bias, grammar_kind=held.grammar_kind,
                                   grammar_text=held.grammar_text)

    def _keep(self, session_id: str, held: _Held) -> None:
        with self._lock:
            old = self._held.pop(session_id, None)
            if old is not None:
                self._bytes -= old.size
            self._held[session_id] = held
            self._bytes += held.size
            while self._bytes > self.max_bytes and len(self._held) > 1:
                _, evicted = self._held.popitem(last=False)
                self._bytes -= evicted.size

    def release(self, session_id: str) -> None:
        with self._lock:
            held = self._held.pop(session_id, None)
            if held is not None:
                self._bytes -= held.size
