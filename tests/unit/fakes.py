"""In-process stand-ins for the orchestrator's collaborators: a session store, draft and target
pools, a tokenizer. No processes, no gRPC, no Redis."""

from __future__ import annotations

import asyncio
import json

from orchestrator.backends import DraftReleased, DraftReply, DraftUnavailable, VerifyReply
from orchestrator.config import OrchestratorConfig
from orchestrator.generation import Orchestrator
from orchestrator.store import SessionState
from specdec.errors import Aborted, Unavailable
from specdec.v1 import common_pb2

EOS = 2
WRONG = 1  # the token a draft proposes where it is made to be wrong


class InMemorySessionStore:
    """`SessionStore` with the Redis store's semantics: versions checked on save (Aborted when
    another writer came first), tokens appended, a fresh copy on every load. `down` makes every
    call fail as an unreachable store does."""

    def __init__(self) -> None:
        self._sessions: dict[str, tuple[int, str, list[int], str]] = {}  # id -> (version, record, tokens, constants)
        self._prior: str | None = None
        self.published: list[list[int]] = []
        self.published_groups: list[str] = []  # the corpus group of each published output
        self.owed: dict[str, dict[str, bool]] = {}  # releases owed: address -> session -> forget_output
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise Unavailable("session store unavailable (in memory, down)")

    async def ping(self) -> None:
        self._check()

    async def load(self, session_id: str) -> SessionState | None:
        self._check()
        if session_id not in self._sessions:
            return None
        version, record, tokens, constants = self._sessions[session_id]
        return SessionState.from_record(session_id, version, list(tokens), record.encode(),
                                        constants.encode() if constants else None)

    async def save(self, state: SessionState, new_tokens: list[int]) -> None:
        self._check()
        version, _, tokens, constants = self._sessions.get(state.session_id, (0, "", [], ""))
        if version != state.version:
            raise Aborted(f"session {state.session_id} was changed by another request; retry")
        written = state.constants_arg()  # as the Redis store's script: "" unchanged, "-" none
        constants = constants if written == "" else "" if written == "-" else written
        self._sessions[state.session_id] = (version + 1, state.record(), tokens + list(new_tokens), constants)
        state.version, state.constants_changed = version + 1, False

    async def delete(self, session_id: str) -> bool:
        self._check()
        return self._sessions.pop(session_id, None) is not None

    async def load_prior(self) -> dict | None:
        self._check()
        return json.loads(self._prior) if self._prior else None

    async def save_prior(self, prior: dict) -> None:
        self._check()
        self._prior = json.dumps(prior)

    async def publish_output(self, tokens: list[int], group: str = "") -> None:
        self._check()
        self.published.append(list(tokens))
        self.published_groups.append(group)

    async def owe_release(self, address: str, session_id: str, forget_output: bool) -> None:
        self._check()
        self.owed.setdefault(address, {})[session_id] = forget_output

    async def owed_releases(self, address: str, limit: int) -> dict[str, bool]:
        self._check()
        return dict(list(self.owed.get(address, {}).items())[:limit])

    async def paid_releases(self, address: str, session_ids: list[str]) -> None:
        self._check()
        for session_id in session_ids:
            self.owed.get(address, {}).pop(session_id, None)

    async def close(self) -> None:
        pass


class _FakePool:
    """What both fakes share: releases and snapshots are recorded."""

    role = "replica"

    def __init__(self, reference: list[int]) -> None:
        self.reference = reference  # the prompt and the text the target model would write after it
        self.released: list[str] = []
        self.forget_output: list[bool] = []  # each release's flag
        self.snapshots: list[str] = []

    def members(self) -> list:
        return [self]

    async def release(self, session_id: str, forget_output: bool = True) -> None:
        self.released.append(session_id)
        self.forget_output.append(forget_output)

    async def save_snapshot(self, session_id: str) -> int:
        self.snapshots.append(session_id)
        return 0

    def expected(self, position: int) -> int:
        return self.reference[position] if position < len(self.reference) else EOS


class FakeTarget(_FakePool):
    """Greedy verification against `reference`: the history sent must be a prefix of it. With
    `gate`, each verify waits for the event (a test holds a round in flight); with `error` set,
    it fails."""

    role = "target"

    def __init__(self, reference: list[int], gate: asyncio.Event | None = None) -> None:
        super().__init__(reference)
        self.calls: list[tuple[int, list[int]]] = []  # (len(history), draft tokens)
        self.steps: list[int] = []  # each call's `decode_steps`
        self.continues: list[bool] = []  # each call's `continues`
        self.followers: list[frozenset[int] | None] = []  # each call's `followers`
        self.gate = gate
        self.error: Exception | None = None  # raised by every verify when set

    async def verify(self, session_id, history, proposal, params, seed, timeout=None,
                     top_logprobs=None, continues=False, followers=None, decode_steps=1) -> VerifyReply:
        assert history == self.reference[:len(history)], "the loop sent a history the target did not write"
        assert decode_steps == 1 or not proposal.tokens, "decode_steps with draft tokens"
        self.calls.append((len(history), list(proposal.tokens)))
        self.steps.append(decode_steps)
        self.continues.append(continues)
        self.followers.append(followers)
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        accepted = 0
        for token in proposal.tokens:
            if token != self.expected(len(history) + accepted):
                break
            accepted += 1
        token = self.expected(len(history) + accepted)
        decoded = []  # the further passes' tokens, up to an end of sequence
        while len(decoded) + 1 < decode_steps and (decoded or [token])[-1] != EOS:
            decoded.append(self.expected(len(history) + 1 + len(decoded)))
        return VerifyReply(accepted, token, accepted == len(proposal.tokens), wall_ns=1000, compute_ns=500,
                           decoded=decoded)


class FakeDraft(_FakePool):
    """Proposes `reference`, except WRONG at the positions in `wrong_at`; streams token by token
    into `into`. `fail` makes every call fail: True as a broken draft does (DraftUnavailable),
    "released" as a call cut by a release of the session does (DraftReleased)."""

    role = "draft"

    def __init__(self, reference: list[int], wrong_at: frozenset[int] | set[int] = frozenset(),
                 fail: bool | str = False, available: bool = True, reads_shared_outputs: bool = False,
                 learns_outputs: bool | None = None, sources: tuple[str, ...] = ("model",),
                 followers: frozenset[int] | None = None) -> None:
        super().__init__(reference)
        self.followers = followers  # listed with every block (ProposeBlock.followers)
        self.sources = sources  # as DraftPool's: the sources the drafts' proposals may name
        self.reads_shared_outputs = reads_shared_outputs  # as DraftPool's: a replica reads the outputs stream
        self.learns_outputs = reads_shared_outputs if learns_outputs is None else learns_outputs  # a suffix corpus
        self.wrong_at = set(wrong_at)
        self.fail = fail
        self.available = available
        self.calls: list[tuple[int, int]] = []  # (len(history), k)
        self.corpus_groups: list[str] = []  # the corpus group of each call

    async def propose(self, session_id, history, k, params, seed, fingerprint, into=None, progress=None,
                      timeout=None, corpus_group="", sources=()) -> DraftReply:
        self.calls.append((len(history), k))
        self.corpus_groups.append(corpus_group)
        if self.fail == "released":
            raise DraftReleased("the session's caches were released")
        if self.fail:
            raise DraftUnavailable("UNAVAILABLE: the draft is down")
        reply = into if into is not None else DraftReply()
        for position in range(len(history), len(history) + k):
            await asyncio.sleep(0)  # streamed: the loop may look in between
            reply.tokens.append(WRONG if position in self.wrong_at else self.expected(position))
            if progress is not None:
                progress.set()
        reply.wall_ns, reply.drafted, reply.followers = 2000, len(reply.tokens), self.followers
        return reply


class CharTokenizer:
    """One token per character (its code point); EOS decodes to nothing."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(chr(i) for i in ids if i != EOS)


def tokens(text: str) -> list[int]:
    return [ord(c) for c in text]


def orchestrator(store: InMemorySessionStore, target: FakeTarget, draft: FakeDraft | None, max_context: int = 4096,
                 **config) -> Orchestrator:
    """An orchestrator over the fakes (config: OrchestratorConfig fields)."""
    info = common_pb2.ModelInfo(tokenizer_fingerprint="fp", max_context=max_context, eos_token_ids=[EOS])
    return Orchestrator(OrchestratorConfig(target="fake:1", **config), store, target, draft, CharTokenizer(), info)
