"""A generation request from validation to the last chunk: sessions, stop conditions, stats."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from orchestrator.backends import DraftBackend, TargetBackend
from orchestrator.config import OrchestratorConfig
from orchestrator.loop import Speculator
from orchestrator.store import RedisSessionStore, SessionState
from orchestrator.text import TextStream
from specdec.core.policy import (
    Observation, PolicyConfig, PolicyState, choose_k, initial_state, merge_prior, next_k,
)
from specdec.core.sampling import SamplingParams
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound
from specdec.v1 import common_pb2, orchestrator_pb2 as pb

log = logging.getLogger("specdec.orchestrator")
MAX_SEED = 2**63 - 1
AUTO = -1  # draft_length value that selects the controller


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


@dataclass
class Totals:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    fallbacks: int = 0
    overlapped: int = 0
    tokens: list[int] = field(default_factory=list)


def observation(stats: pb.RoundStats) -> Observation:
    """What the controller learns from one round."""
    return Observation(
        k=stats.draft_length if not stats.draft_fallback else 0, proposed=stats.proposed, accepted=stats.accepted,
        draft_wall_s=stats.draft_ns / 1e9, draft_compute_s=stats.draft_compute_ns / 1e9,
        verify_wall_s=stats.verify_ns / 1e9, verify_compute_s=stats.verify_compute_ns / 1e9,
        draft_failed=stats.draft_fallback,
    )


class Generator:
    """Owns the loop for every request; the servicer only translates to and from gRPC."""

    def __init__(self, config: OrchestratorConfig, store: RedisSessionStore, target: TargetBackend,
                 draft: DraftBackend | None, tokenizer, target_info: common_pb2.ModelInfo) -> None:
        self.config = config
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
        out: list[tuple[str, object]] = [("target", self.target)]
        if self.draft is not None:
            out.append(("draft", self.draft))
        return out

    # -- validation -------------------------------------------------------------------------

    def parse(self, request: pb.GenerateRequest) -> GenerationSpec:
        cfg = self.config
        max_new = request.max_new_tokens if request.HasField("max_new_tokens") else cfg.default_max_new_tokens
        if not 1 <= max_new <= cfg.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens must be between 1 and {cfg.max_new_tokens_limit}, got {max_new}")
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
            raise InvalidArgument(f"at most {cfg.max_stop_strings} stop strings are allowed, got {len(stop)}")
        for s in stop:
            if not s or len(s) > cfg.max_stop_length:
                raise InvalidArgument(f"each stop string must have 1 to {cfg.max_stop_length} characters, got {len(s)}")
        input_ids = self._tokenize(request, continuing=bool(request.session_id))
        return GenerationSpec(
            input_ids=input_ids, max_new_tokens=max_new,
            params=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
            seed=request.seed if request.HasField("seed") else None,
            stop=stop, draft_length=k, session_id=request.session_id,
        )

    def _tokenize(self, request: pb.GenerateRequest, continuing: bool) -> list[int]:
        which = request.WhichOneof("input")
        if which == "prompt":
            if not request.prompt:
                raise InvalidArgument("prompt is empty: send the text to continue, or use messages")
            ids = self.tokenizer(request.prompt, add_special_tokens=not continuing)["input_ids"]
        elif which == "messages":
            messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            if not messages:
                raise InvalidArgument("messages is empty: send at least one message")
            for i, m in enumerate(messages):
                if m["role"] not in ("system", "user", "assistant"):
                    raise InvalidArgument(f"messages[{i}].role must be system, user or assistant, got {m['role']!r}")
            if not getattr(self.tokenizer, "chat_template", None):
                raise FailedPrecondition("the model has no chat template; send a raw prompt instead")
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            raise InvalidArgument("set either prompt or messages")
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
        if spec.session_id:
            state = await self.store.load(spec.session_id)
            if state is None:
                raise NotFound(f"session {spec.session_id!r} does not exist or has expired; "
                               "start a new one by leaving session_id empty")
            if len(state.tokens) + len(spec.input_ids) >= self.max_context:
                raise InvalidArgument(
                    f"session {spec.session_id!r} holds {len(state.tokens)} tokens; with {len(spec.input_ids)} "
                    f"more it would fill the model's context of {self.max_context}; start a new session"
                )
            if spec.seed is not None:
                state.seed = spec.seed
        else:
            seed = spec.seed if spec.seed is not None else secrets.randbelow(MAX_SEED)
            state = SessionState(session_id=uuid.uuid4().hex, seed=seed)
        state.tokens.extend(spec.input_ids)
        state.sampling = {"temperature": spec.params.temperature, "top_k": spec.params.top_k,
                          "top_p": spec.params.top_p}
        state.draft_length = spec.draft_length
        await self.store.save(state, spec.input_ids)
        return state

    async def close_session(self, session_id: str) -> bool:
        closed = await self.store.delete(session_id)
        await self._release_caches(session_id)
        return closed

    async def _release_caches(self, session_id: str) -> None:
        backends = [b for b in (self.target, self.draft) if b is not None]
        results = await asyncio.gather(*(b.release(session_id) for b in backends), return_exceptions=True)
        for backend, result in zip(backends, results):
            if isinstance(result, Exception):
                log.warning("release of %s on %s failed: %s", session_id, backend.address, result)

    # -- the loop ---------------------------------------------------------------------------

    async def generate(self, spec: GenerationSpec) -> AsyncIterator[pb.GenerateChunk]:
        start = time.perf_counter()
        state = await self._open(spec)
        prompt_tokens = len(state.tokens)
        text = TextStream(self.tokenizer, spec.stop)
        totals = Totals()
        first_token_s = 0.0
        finish = pb.FINISH_REASON_UNSPECIFIED
        auto = spec.draft_length == AUTO and self.draft is not None
        policy = await self._policy(state) if auto else None
        speculator = Speculator(state.session_id, spec.params, state.seed, self.draft, self.target,
                                self.fingerprint, overlap=self.config.overlap)
        try:
            while finish == pb.FINISH_REASON_UNSPECIFIED:
                remaining = min(spec.max_new_tokens - len(totals.tokens), self.max_context - len(state.tokens))
                wanted = policy.k if policy is not None else max(spec.draft_length, 0)
                k = max(0, min(wanted, remaining - 1)) if self.draft is not None else 0
                # With overlap, the next block is drafted during this verify: as long as the
                # controller would choose now (so a probe after k = 0 rounds also runs in the
                # shadow of a verify, catching the draft's cache up for free), and no longer than
                # the tokens still wanted if this whole block is accepted.
                # While the controller holds k = 0, one token is still drafted in that shadow so
                # the draft's KV cache keeps up and a later probe costs no catch-up prefill.
                upcoming = choose_k(policy, self.policy_config) if policy is not None else wanted
                if self.config.overlap and policy is not None:
                    upcoming = max(upcoming, 1)
                k_next = max(0, min(upcoming, remaining - k - 2)) if self.draft is not None else 0
                rnd = await speculator.round(state.tokens, k, k_next)
                if policy is not None:
                    _, policy = next_k(policy, observation(rnd.stats), self.policy_config)
                    state.policy = policy.to_dict()
                kept, finish = self._apply_stops(rnd.emitted, remaining, text)
                totals.rounds += 1
                totals.draft_tokens += rnd.stats.proposed
                totals.accepted_tokens += rnd.stats.accepted
                totals.fallbacks += rnd.stats.draft_fallback
                totals.overlapped += rnd.stats.overlapped
                totals.tokens.extend(kept)
                state.tokens.extend(kept)
                state.rounds += 1
                state.draft_tokens += rnd.stats.proposed
                state.accepted_tokens += rnd.stats.accepted
                state.generated_tokens += len(kept)
                await self.store.save(state, kept)
                if not first_token_s:
                    first_token_s = time.perf_counter() - start
                chunk = pb.GenerateChunk(session_id=state.session_id, token_ids=kept, round=rnd.stats,
                                         finish_reason=finish)
                if finish != pb.FINISH_REASON_UNSPECIFIED:
                    if policy is not None:
                        await self._merge_prior(policy)
                    chunk.text = text.release(final=True)
                    chunk.stats.CopyFrom(self._stats(prompt_tokens, totals, start, first_token_s, state.seed))
                else:
                    chunk.text = text.release()
                yield chunk
        except asyncio.CancelledError:
            # The client went away: free the services' caches for this session (the record stays).
            asyncio.get_running_loop().create_task(self._release_caches(state.session_id))
            raise
        finally:
            speculator.close()

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
    def _stats(prompt_tokens: int, totals: Totals, start: float, first_token_s: float, seed: int) -> pb.GenerationStats:
        elapsed = time.perf_counter() - start
        n = len(totals.tokens)
        return pb.GenerationStats(
            prompt_tokens=prompt_tokens, completion_tokens=n, rounds=totals.rounds,
            draft_tokens=totals.draft_tokens, accepted_tokens=totals.accepted_tokens,
            acceptance_rate=totals.accepted_tokens / totals.draft_tokens if totals.draft_tokens else 0.0,
            mean_accepted_length=n / totals.rounds if totals.rounds else 0.0,
            elapsed_s=elapsed, tokens_per_second=n / elapsed if elapsed > 0 else 0.0,
            time_to_first_token_s=first_token_s, seed=seed, draft_fallbacks=totals.fallbacks,
            overlapped_rounds=totals.overlapped,
        )
