"""Sessions and the lease on their latest generation: open, resume, free, close.

A running generation holds a lease (`GenerationRecord.lease_until`, `owner`): another request
on the session is refused until it ends, unless it resumes that very generation, taking the
lease over. Every change goes through the store's optimistic `save`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import replace

from orchestrator.requests import GenerationSpec
from orchestrator.store import GenerationRecord, SessionState, SessionStore
from specdec.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, SpecdecError

log = logging.getLogger("specdec.orchestrator")
MAX_SEED = 2**63 - 1
# A new session whose opening write failed is deleted again (the write may have landed after its
# caller gave up on it): attempts this far apart, and until a delete finds nothing this long after
# the first one that ran.
FORGET_PAUSES_S = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
FORGET_SETTLE_S = 1.0


class Sessions:
    def __init__(self, store: SessionStore, lease_s: float, max_context: int, eos_ids: set[int],
                 spawn: Callable[[Coroutine], None] | None = None) -> None:
        """`spawn(coroutine)`: runs background work (the orchestrator's; None: asyncio's own tasks)."""
        self.store = store
        self.lease_s = lease_s
        self.max_context = max_context
        self.eos_ids = eos_ids
        self._spawn = spawn or (lambda work: asyncio.get_running_loop().create_task(work))

    async def open(self, spec: GenerationSpec) -> SessionState:
        """Record a new generation: in a new session, or appended to an idle existing one."""
        if spec.session_id:
            state, input_ids = await self._continued(spec)
        else:
            seed = spec.seed if spec.seed is not None else secrets.randbelow(MAX_SEED)
            state = SessionState(session_id=uuid.uuid4().hex, seed=seed, principal=spec.principal)
            input_ids = spec.input_ids
        state.tokens.extend(input_ids)
        # The penalties count the output from here on (a continued session's earlier turns are context).
        state.set_sampling(replace(spec.params, output_start=len(state.tokens)))
        state.draft_length = spec.draft_length
        state.generation = GenerationRecord(
            id=uuid.uuid4().hex, start=len(state.tokens), prompt_tokens=len(state.tokens),
            max_new_tokens=spec.max_new_tokens, stop=list(spec.stop), stop_token_ids=list(spec.stop_token_ids),
            ignore_eos=spec.ignore_eos, top_logprobs=spec.top_logprobs if spec.logprobs else None,
            input_tokens=len(input_ids), share_output=spec.share_output,
            lease_until=time.time() + self.lease_s, owner=uuid.uuid4().hex,
        )
        try:
            await self.store.save(state, input_ids)
        except BaseException:
            if not spec.session_id:
                # Nobody was told this session's id, but its write may still land (a Redis that
                # stalled past our timeout runs the command when it wakes): delete it in the
                # background, or it would sit in Redis for the session TTL.
                self._spawn(self._forget_unannounced(state.session_id))
            raise
        return state

    async def _forget_unannounced(self, session_id: str) -> None:
        """Delete a new session whose opening write failed; retried while the store is down, and
        repeated until a delete at least FORGET_SETTLE_S after the first that ran finds nothing
        (a write that was late lands before that). Given up after the lease: the TTL then does it."""
        deadline, first, attempt = time.monotonic() + self.lease_s, None, 0
        while time.monotonic() < deadline:
            await asyncio.sleep(FORGET_PAUSES_S[min(attempt, len(FORGET_PAUSES_S) - 1)])
            attempt += 1
            try:
                removed = await self.store.delete(session_id)
            except SpecdecError:
                continue
            now = time.monotonic()
            if removed:
                log.info("session %s, whose opening write failed, was written after all: deleted", session_id)
            first = first if first is not None else now
            if not removed and now - first >= FORGET_SETTLE_S:
                return
        log.info("session %s, whose opening write failed, may be left in the store until its TTL", session_id)

    async def _continued(self, spec: GenerationSpec) -> tuple[SessionState, list[int]]:
        """The idle session a request continues, and the input it appends."""
        state = await self.store.load(spec.session_id)
        if state is None or state.principal != spec.principal:  # another's session looks missing
            raise NotFound(f"session {spec.session_id!r} does not exist or has expired; "
                           "start a new one by leaving session_id empty")
        if state.generation is not None and state.generation.leased():
            raise Aborted(
                f"session {spec.session_id!r} is busy with generation {state.generation.id}; wait for it to "
                "finish or cancel it (a client that lost its stream resumes it with resume_from)"
            )
        input_ids = spec.input_ids
        if spec.chat_after_eos is not None and state.tokens and state.tokens[-1] in self.eos_ids:
            input_ids = spec.chat_after_eos
        if len(state.tokens) + len(input_ids) >= self.max_context:
            raise InvalidArgument(
                f"session {spec.session_id!r} holds {len(state.tokens)} tokens; with {len(input_ids)} "
                f"more it would fill the model's context of {self.max_context}; start a new session"
            )
        if spec.seed is not None:
            state.seed = spec.seed
        return state, input_ids

    async def resume(self, spec: GenerationSpec) -> SessionState:
        """Take over the session's latest generation (its lease too: the client moved here).

        If the generation is still running elsewhere, its rounds race with this takeover; a lost
        race is retried on the fresh record, and the displaced request stops at its next write.
        """
        for attempt in range(8):
            state = await self.store.load(spec.session_id)
            if state is None or state.principal != spec.principal:  # another's session looks missing
                raise NotFound(f"session {spec.session_id!r} does not exist or has expired; nothing to resume")
            gen = state.generation
            if gen is None:
                raise FailedPrecondition(f"session {spec.session_id!r} has no generation to resume")
            produced = len(state.tokens) - gen.start
            if spec.resume_from > produced:
                raise InvalidArgument(f"resume_from is {spec.resume_from} but generation {gen.id} of session "
                                      f"{spec.session_id!r} has produced {produced} tokens")
            if gen.finish:
                return state
            gen.lease_until = time.time() + self.lease_s
            gen.owner = uuid.uuid4().hex
            try:
                await self.store.save(state, [])
                return state
            except Aborted:
                await asyncio.sleep(0.01 * (attempt + 1))
        raise Aborted(f"session {spec.session_id!r} keeps changing under the resume; retry")

    async def free_lease(self, session_id: str, owner: str) -> bool:
        """Free the lease of a generation stopped before its end (it stays resumable). False when
        another request has taken the generation over since (it is theirs now)."""
        owned = True
        try:
            state = await self.store.load(session_id)
            gen = state.generation if state is not None else None
            owned = gen is not None and gen.owner == owner
            if owned and gen.finish == 0:
                gen.lease_until = 0.0
                await self.store.save(state, [])
        except SpecdecError as exc:  # the store is down, or another replica took the session over
            log.info("could not release the lease of %s: %s", session_id, exc)
        return owned

    async def closable(self, session_id: str, principal: str) -> SessionState | None:
        """The session `principal` may close: theirs; None when it does not exist or is another
        identity's (which looks as if it did not exist)."""
        state = await self.store.load(session_id)
        return state if state is not None and state.principal == principal else None
