"""A generation request from validation to the last chunk: sessions, stop conditions, stats."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from orchestrator.chat import first_turn, next_turn
from orchestrator.config import OrchestratorConfig
from orchestrator.loop import Speculator
from orchestrator.replicas import DraftPool, TargetPool
from orchestrator.store import GenerationRecord, RedisSessionStore, SessionState
from orchestrator.text import TextStream
from specdec.server.admission import Admission
from specdec.core.policy import (
    Observation,
    PolicyConfig,
    PolicyState,
    choose_k,
    initial_state,
    merge_prior,
    step,
)
from specdec.core.sampling import SamplingParams
from specdec.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    SpecdecError,
)
from specdec.server.limits import check_session_id
from specdec.server.metrics import OrchestratorMetrics
from specdec.v1 import common_pb2
from specdec.v1 import orchestrator_pb2 as pb

log = logging.getLogger("specdec.orchestrator")
MAX_SEED = 2**63 - 1
AUTO = -1  # draft_length value that selects the controller
FINISH_NAMES = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_EOS: "stop", pb.FINISH_REASON_STOP: "stop"}


@dataclass(frozen=True)
class GenerationSpec:
    """A validated request."""

    input_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    draft_length: int  # AUTO (-1) lets the controller choose k every round
    session_id: str
    resume_from: int | None = None  # resume the session's latest generation; the client holds this many
    # A chat turn that continues a session: the input to use when the history ends with an
    # end-of-sequence token, and when it does not (the end-of-turn marker is then added first).
    chat_after_eos: list[int] | None = None
    principal: str = ""  # who sends it (specdec.server.auth.principal_of): only they may continue its session


def observation(stats: pb.RoundStats, loop_s: float = 0.0) -> Observation:
    """What the controller learns from one round (`loop_s`: the orchestrator's own time since
    the previous round)."""
    return Observation(
        k=stats.draft_length if not stats.draft_fallback else 0, proposed=stats.proposed, accepted=stats.accepted,
        draft_wall_s=stats.draft_ns / 1e9, draft_compute_s=stats.draft_compute_ns / 1e9,
        verify_wall_s=stats.verify_ns / 1e9, verify_compute_s=stats.verify_compute_ns / 1e9,
        draft_failed=stats.draft_fallback, verify_queue_s=min(stats.verify_queue_ns, stats.verify_ns) / 1e9,
        batch_size=max(1, stats.verify_batch_size), batch_positions=stats.verify_batch_positions,
        drafted=stats.drafted, draft_prefill_tokens=stats.draft_prefill_tokens,
        verify_prefill_tokens=stats.verify_prefill_tokens, loop_s=max(0.0, loop_s),
    )


class Generator:
    """Owns the loop for every request; the servicer only translates to and from gRPC."""

    def __init__(self, config: OrchestratorConfig, store: RedisSessionStore, target: TargetPool,
                 draft: DraftPool | None, tokenizer, target_info: common_pb2.ModelInfo,
                 metrics: OrchestratorMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else OrchestratorMetrics()
        self._background: set[asyncio.Task] = set()
        self.admission = Admission(config.max_concurrent, config.max_queued, name="orchestrator")
        self.metrics.track_admission(self.admission)
        self.store = store
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.fingerprint = target_info.tokenizer_fingerprint
        self.max_context = target_info.max_context
        self.eos_ids = set(target_info.eos_token_ids)
        self.policy_config = PolicyConfig(k_max=config.max_draft_length, ewma=config.policy_ewma,
                                          explore_every=config.policy_explore_every, overlap=config.overlap)

    def backends(self) -> list[tuple[str, object]]:
        """Every draft and target replica as (role, backend); each has `.address` and `info()`."""
        return [(pool.role, backend) for pool in self._pools() for backend in pool.members()]

    # -- validation -------------------------------------------------------------------------

    def parse(self, request: pb.GenerateRequest, principal: str = "") -> GenerationSpec:
        cfg = self.config
        if request.session_id:
            check_session_id(request.session_id)
        if request.HasField("resume_from"):
            return replace(self._parse_resume(request), principal=principal)
        max_new = request.max_new_tokens if request.HasField("max_new_tokens") else cfg.default_max_new_tokens
        if not 1 <= max_new <= cfg.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens must be between 1 and {cfg.max_new_tokens_limit}, got {max_new} "
                                  "(the limit is --max-new-tokens-limit)")
        temperature = request.temperature if request.HasField("temperature") else 0.0
        top_p = request.top_p if request.HasField("top_p") else 1.0
        top_k = request.top_k if request.HasField("top_k") else 0
        if not math.isfinite(temperature) or temperature < 0:
            raise InvalidArgument(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
        if not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise InvalidArgument(f"top_p must lie in (0, 1] (1 disables it), got {top_p}")
        if top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 disables it), got {top_k}")
        default_k = AUTO if cfg.draft_length == "auto" else cfg.draft_length
        k = request.draft_length if request.HasField("draft_length") else default_k
        if not (k == AUTO or 0 <= k <= cfg.max_draft_length):
            raise InvalidArgument(
                f"draft_length must be -1 (auto) or between 0 and {cfg.max_draft_length}, got {k}"
            )
        stop = tuple(request.stop)
        if len(stop) > cfg.max_stop_strings:
            raise InvalidArgument(f"at most {cfg.max_stop_strings} stop strings are allowed, got {len(stop)} "
                                  "(the limit is --max-stop-strings)")
        for s in stop:
            if not s or len(s) > cfg.max_stop_length:
                raise InvalidArgument(f"each stop string must have 1 to {cfg.max_stop_length} characters, got {len(s)} "
                                      "(the limit is --max-stop-length)")
        continuing = bool(request.session_id)
        chat_after_eos = None
        which = request.WhichOneof("input")
        if which == "prompt":
            if not request.prompt:
                raise InvalidArgument("prompt is empty: send the text to continue, or use messages")
            input_ids = self._check_length(self.tokenizer(request.prompt, add_special_tokens=not continuing)["input_ids"])
        elif which == "messages":
            messages = self._messages(request)
            if continuing:
                input_ids, chat_after_eos = next_turn(self.tokenizer, messages, self.eos_ids)
                self._check_length(chat_after_eos)
            else:
                input_ids = first_turn(self.tokenizer, messages)
            self._check_length(input_ids)
        else:
            raise InvalidArgument("set either prompt or messages")
        if cfg.max_prompt_tokens is not None and len(input_ids) > cfg.max_prompt_tokens:
            raise InvalidArgument(f"the input has {len(input_ids)} tokens; the limit is "
                                  f"--max-prompt-tokens={cfg.max_prompt_tokens}")
        return GenerationSpec(
            input_ids=input_ids, max_new_tokens=max_new,
            params=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
            seed=request.seed if request.HasField("seed") else None,
            stop=stop, draft_length=k, session_id=request.session_id, chat_after_eos=chat_after_eos,
            principal=principal,
        )

    @staticmethod
    def _parse_resume(request: pb.GenerateRequest) -> GenerationSpec:
        if not request.session_id:
            raise InvalidArgument("resume_from needs the session_id of the generation to resume")
        if request.WhichOneof("input") is not None:
            raise InvalidArgument("a resume continues the session's latest generation: leave prompt and "
                                  "messages unset (its settings are the original request's)")
        return GenerationSpec(input_ids=[], max_new_tokens=0, params=SamplingParams(), seed=None, stop=(),
                              draft_length=0, session_id=request.session_id, resume_from=request.resume_from)

    def _messages(self, request: pb.GenerateRequest) -> list[dict[str, str]]:
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        if not messages:
            raise InvalidArgument("messages is empty: send at least one message")
        for i, m in enumerate(messages):
            if m["role"] not in ("system", "user", "assistant"):
                raise InvalidArgument(f"messages[{i}].role must be system, user or assistant, got {m['role']!r}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise FailedPrecondition("the model has no chat template; send a raw prompt instead")
        return messages

    def _check_length(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidArgument("the input tokenizes to nothing; send some text")
        if len(ids) >= self.max_context:
            raise InvalidArgument(
                f"the input has {len(ids)} tokens but the model's context holds {self.max_context}; "
                "shorten the prompt"
            )
        return list(ids)

    # -- sessions ---------------------------------------------------------------------------

    async def _open(self, spec: GenerationSpec) -> SessionState:
        """Record a new generation: in a new session, or appended to an idle existing one."""
        input_ids = spec.input_ids
        if spec.session_id:
            state = await self.store.load(spec.session_id)
            if state is None or state.principal != spec.principal:  # another's session looks missing
                raise NotFound(f"session {spec.session_id!r} does not exist or has expired; "
                               "start a new one by leaving session_id empty")
            if state.generation is not None and state.generation.leased():
                raise Aborted(
                    f"session {spec.session_id!r} is busy with generation {state.generation.id}; wait for it to "
                    "finish or cancel it (a client that lost its stream resumes it with resume_from)"
                )
            if spec.chat_after_eos is not None and state.tokens and state.tokens[-1] in self.eos_ids:
                input_ids = spec.chat_after_eos
            if len(state.tokens) + len(input_ids) >= self.max_context:
                raise InvalidArgument(
                    f"session {spec.session_id!r} holds {len(state.tokens)} tokens; with {len(input_ids)} "
                    f"more it would fill the model's context of {self.max_context}; start a new session"
                )
            if spec.seed is not None:
                state.seed = spec.seed
        else:
            seed = spec.seed if spec.seed is not None else secrets.randbelow(MAX_SEED)
            state = SessionState(session_id=uuid.uuid4().hex, seed=seed, principal=spec.principal)
        state.tokens.extend(input_ids)
        state.sampling = {"temperature": spec.params.temperature, "top_k": spec.params.top_k,
                          "top_p": spec.params.top_p}
        state.draft_length = spec.draft_length
        state.generation = GenerationRecord(
            id=uuid.uuid4().hex, start=len(state.tokens), prompt_tokens=len(state.tokens),
            max_new_tokens=spec.max_new_tokens, stop=list(spec.stop),
            lease_until=time.time() + self.config.session_lease_s, owner=uuid.uuid4().hex,
        )
        await self.store.save(state, input_ids)
        return state

    async def _resume(self, spec: GenerationSpec) -> SessionState:
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
            gen.lease_until = time.time() + self.config.session_lease_s
            gen.owner = uuid.uuid4().hex
            try:
                await self.store.save(state, [])
                return state
            except Aborted:
                await asyncio.sleep(0.01 * (attempt + 1))
        raise Aborted(f"session {spec.session_id!r} keeps changing under the resume; retry")

    async def close_session(self, session_id: str, principal: str = "") -> bool:
        check_session_id(session_id)
        state = await self.store.load(session_id)
        if state is not None and state.principal != principal:
            return False  # another identity's session: as if it did not exist
        closed = await self.store.delete(session_id)
        await self._release_caches(session_id)
        return closed

    def _pools(self) -> list[TargetPool | DraftPool]:
        return [self.target] + ([self.draft] if self.draft is not None else [])

    async def _release_caches(self, session_id: str) -> None:
        await asyncio.gather(*(pool.release(session_id) for pool in self._pools()))

    def _save_snapshots(self, session_id: str) -> None:
        """--kv-snapshots: the target and draft replicas holding the session write its caches to
        Redis, in the background (the client is not kept waiting; a failure is only logged)."""
        for pool in self._pools():
            self._spawn(pool.save_snapshot(session_id))

    def _spawn(self, work) -> None:
        """Run `work` in the background, holding a reference until it is done."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _interrupted(self, session_id: str, owner: str, release_caches: bool) -> None:
        """A request stopped before its generation's end: free its lease (the generation stays
        resumable) and the caches; unless another request has taken the generation over."""
        owned = True
        try:
            state = await self.store.load(session_id)
            gen = state.generation if state is not None else None
            owned = gen is not None and gen.owner == owner
            if owned and gen.finish == 0:
                gen.lease_until = 0.0
                await self.store.save(state, [])
        except SpecdecError as exc:  # Redis is down, or another replica took the session over
            log.info("could not release the lease of %s: %s", session_id, exc)
        if release_caches and owned:
            await self._release_caches(session_id)

    # -- the loop ---------------------------------------------------------------------------

    async def generate(self, spec: GenerationSpec, deadline: float | None = None,
                       context=None) -> AsyncIterator[pb.GenerateChunk]:
        """Admit the request (or refuse it at once), then stream its generation.

        `deadline` (time.monotonic()) bounds every downstream call; `context` receives the retry
        hint of a refusal as trailing metadata.
        """
        async with self.admission.slot(deadline=deadline, context=context):
            with self.metrics.start_request() as timer:
                async with contextlib.aclosing(self._generate(spec, deadline, timer)) as chunks:
                    async for chunk in chunks:  # closed with this one: a client that leaves frees at once
                        yield chunk

    async def _generate(self, spec: GenerationSpec, deadline: float | None, timer) -> AsyncIterator[pb.GenerateChunk]:
        start = time.perf_counter()
        state = await (self._resume(spec) if spec.resume_from is not None else self._open(spec))
        gen = state.generation
        finish = pb.FINISH_REASON_UNSPECIFIED
        try:
            async with contextlib.aclosing(self._stream(spec, state, deadline, timer, start)) as chunks:
                async for chunk in chunks:
                    finish = chunk.finish_reason
                    yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away (the task was cancelled at an await, or the stream was closed
            # while suspended at a yield): the generation stays resumable, the lease and the
            # services' caches for the session are freed, in a task of their own so that a second
            # cancellation cannot cut the cleanup short.
            if finish == pb.FINISH_REASON_UNSPECIFIED:
                self._spawn(self._interrupted(state.session_id, gen.owner, True))
            raise
        except Exception:
            if finish == pb.FINISH_REASON_UNSPECIFIED:
                await self._interrupted(state.session_id, gen.owner, False)
            raise

    async def _stream(self, spec: GenerationSpec, state: SessionState, deadline: float | None, timer,
                      start: float) -> AsyncIterator[pb.GenerateChunk]:
        """The chunks of a generation whose session is open and leased: the header, what a resume
        lacks, then one chunk per round until the generation finishes."""
        gen = state.generation
        sent = spec.resume_from or 0
        yield pb.GenerateChunk(session_id=state.session_id, offset=sent)  # header: the session is recorded
        text = TextStream(self.tokenizer, gen.stop)
        produced = state.tokens[gen.start:]
        if spec.resume_from is not None:
            # Catch the detokenizer up to what the client holds, then send what it lacks.
            self._push_text(text, produced[:sent])
            text.release()
            if sent < len(produced) or gen.finish:
                self._push_text(text, produced[sent:])
                chunk = pb.GenerateChunk(session_id=state.session_id, token_ids=produced[sent:], offset=sent,
                                         finish_reason=gen.finish, text=text.release(final=bool(gen.finish)))
                if gen.finish:
                    chunk.stats.CopyFrom(self._stats(gen, len(produced), state.seed))
                    timer.observe_finish(FINISH_NAMES[gen.finish], gen.prompt_tokens, len(produced) - sent)
                timer.observe_chunk(len(produced) - sent)
                yield chunk
                sent = len(produced)
            if gen.finish:
                return
        params = SamplingParams(**state.sampling)
        finish = pb.FINISH_REASON_UNSPECIFIED
        auto = state.draft_length == AUTO and self.draft is not None
        policy = await self._policy(state) if auto else None
        speculator = Speculator(state.session_id, params, state.seed, self.draft, self.target,
                                self.fingerprint, overlap=self.config.overlap, deadline=deadline)
        first, round_end = True, None
        upcoming = choose_k(policy, self.policy_config) if policy is not None else None
        try:
            while finish == pb.FINISH_REASON_UNSPECIFIED:
                generated = len(state.tokens) - gen.start
                remaining = min(gen.max_new_tokens - generated, self.max_context - len(state.tokens))
                wanted = policy.k if policy is not None else max(state.draft_length, 0)
                k = max(0, min(wanted, remaining - 1)) if self.draft is not None else 0
                # A request's first round verifies no draft: its first token comes from the
                # target's prefill alone (the shortest time to first token), and with overlap the
                # draft prefills the new turn and drafts the next block meanwhile, instead of
                # both prefills running one after the other.
                k, first = (0 if first else k), False
                # With overlap, the next block is drafted during this verify: as long as the
                # controller would choose now (so a probe after k = 0 rounds also runs in the
                # shadow of a verify, catching the draft's cache up there), and no longer than
                # the tokens still wanted if this whole block is accepted. While the controller
                # holds k = 0 the draft is left alone: drafting in every shadow kept its cache
                # warm but cost each plain round a second call (3-6 % of plain decoding's pace
                # in the GPU-class profile on this CPU).
                ahead = upcoming if policy is not None else wanted
                k_next = max(0, min(ahead, remaining - k - 2)) if self.draft is not None else 0
                round_start = time.perf_counter()
                rnd = await speculator.round(state.tokens, k, k_next)
                loop_s = round_start - round_end if round_end is not None else 0.0
                round_end = time.perf_counter()
                if policy is not None:
                    _, upcoming, policy = step(policy, observation(rnd.stats, loop_s),
                                                           self.policy_config)
                    state.policy = policy.to_dict()
                kept, finish = self._apply_stops(rnd.emitted, remaining, text)
                gen.rounds += 1
                gen.draft_tokens += rnd.stats.proposed
                gen.accepted_tokens += rnd.stats.accepted
                gen.fallbacks += rnd.stats.draft_fallback
                gen.overlapped += rnd.stats.overlapped
                if not gen.first_token_s:
                    gen.first_token_s = time.perf_counter() - start
                gen.finish = finish
                gen.lease_until = 0.0 if finish else time.time() + self.config.session_lease_s
                state.tokens.extend(kept)
                state.rounds += 1
                state.draft_tokens += rnd.stats.proposed
                state.accepted_tokens += rnd.stats.accepted
                state.generated_tokens += len(kept)
                await self.store.save(state, kept)
                chunk = pb.GenerateChunk(session_id=state.session_id, token_ids=kept, round=rnd.stats,
                                         finish_reason=finish, offset=sent)
                sent += len(kept)
                self.metrics.observe_round(rnd.stats)
                timer.observe_chunk(len(kept))
                if finish != pb.FINISH_REASON_UNSPECIFIED:
                    if policy is not None:
                        await self._merge_prior(policy)
                    if self.config.kv_snapshots:
                        self._save_snapshots(state.session_id)
                    chunk.text = text.release(final=True)
                    chunk.stats.CopyFrom(self._stats(gen, sent, state.seed))
                    timer.observe_finish(FINISH_NAMES[finish], chunk.stats.prompt_tokens, sent)
                else:
                    chunk.text = text.release()
                yield chunk
        finally:
            speculator.close()

    def _push_text(self, text: TextStream, tokens: list[int]) -> None:
        for token in tokens:
            if token not in self.eos_ids and not text.stopped:
                text.push(token)

    async def _policy(self, state: SessionState) -> PolicyState:
        """The session's controller state, or a fresh one started from the global prior."""
        if state.policy:
            return PolicyState.from_dict(state.policy)
        prior = await self.store.load_prior()
        return initial_state(self.policy_config, PolicyState.from_dict(prior) if prior else None)

    async def _merge_prior(self, policy: PolicyState) -> None:
        """Fold a finished session's estimates into the prior new sessions start from."""
        raw = await self.store.load_prior()
        prior = merge_prior(PolicyState.from_dict(raw) if raw else None, policy)
        await self.store.save_prior(prior.to_dict())

    def _apply_stops(self, emitted: list[int], remaining: int, text: TextStream) -> tuple[list[int], int]:
        kept: list[int] = []
        for token in emitted[:remaining]:
            kept.append(token)
            if token in self.eos_ids:
                return kept, pb.FINISH_REASON_EOS
            text.push(token)
            if text.stopped:
                return kept, pb.FINISH_REASON_STOP
        return kept, (pb.FINISH_REASON_LENGTH if len(kept) == remaining else pb.FINISH_REASON_UNSPECIFIED)

    @staticmethod
    def _stats(gen: GenerationRecord, completion_tokens: int, seed: int) -> pb.GenerationStats:
        elapsed = max(time.time() - gen.started_at, 0.0)
        n = completion_tokens
        return pb.GenerationStats(
            prompt_tokens=gen.prompt_tokens, completion_tokens=n, rounds=gen.rounds,
            draft_tokens=gen.draft_tokens, accepted_tokens=gen.accepted_tokens,
            acceptance_rate=gen.accepted_tokens / gen.draft_tokens if gen.draft_tokens else 0.0,
            mean_accepted_length=n / gen.rounds if gen.rounds else 0.0,
            elapsed_s=elapsed, tokens_per_second=n / elapsed if elapsed > 0 else 0.0,
            time_to_first_token_s=gen.first_token_s, seed=seed, draft_fallbacks=gen.fallbacks,
            overlapped_rounds=gen.overlapped,
        )
