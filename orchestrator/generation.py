"""The request path: admit a validated request, open or resume its session, run its rounds.

Validation lives in orchestrator.requests, the session and its lease in orchestrator.sessions
(a round's counters and stop conditions are the session record's own, orchestrator.store), the
draft length in orchestrator.draft_length (the controller picked by orchestrator.sources), the
rounds themselves (draft, verify, overlap) in orchestrator.loop. The design: docs/orchestrator.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from orchestrator.config import OrchestratorConfig
from orchestrator.corpus import CorpusGroups
from orchestrator.detokenizer import Detokenizer
from orchestrator.draft_length import DraftLengthController, continues_at_k0, within_budget
from orchestrator.loop import Round, Speculator
from orchestrator.replicas import Drafts, Pool, Targets
from orchestrator.requests import GenerationSpec, RequestParser
from orchestrator.sessions import Sessions
from orchestrator.sources import controller_for
from orchestrator.status import BackendProbes, Counters
from orchestrator.store import GenerationRecord, SessionState, SessionStore
from specdec.core.policy import PolicyConfig, guess_ahead_pays
from specdec.errors import SpecdecError
from specdec.runtime.grammars import check_grammar
from specdec.server.admission import Admission
from specdec.server.limits import check_session_id
from specdec.server.metrics import OrchestratorMetrics, SpecDecodingStats
from specdec.v1 import common_pb2, orchestrator_pb2 as pb

log = logging.getLogger("specdec.orchestrator")


class Orchestrator:
    """Owns the loop for every request; the servicer only translates to and from gRPC."""

    def __init__(self, config: OrchestratorConfig, store: SessionStore, target: Targets,
                 draft: Drafts | None, tokenizer, target_info: common_pb2.ModelInfo,
                 metrics: OrchestratorMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else OrchestratorMetrics()
        self.counters = Counters()  # what GetStatus reports; fed the same round stats as the metrics
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
        self.requests = RequestParser(config, tokenizer, self.max_context, self.eos_ids, target_info.vocab_size,
                                      learns_outputs=lambda: self.draft is not None and self.draft.learns_outputs)
        self.sessions = Sessions(store, config.session_lease_s, self.max_context, self.eos_ids, spawn=self._spawn)
        self.policy_config = PolicyConfig(k_max=config.max_draft_length, ewma=config.policy_ewma,
                                          explore_every=config.policy_explore_every, overlap=config.overlap,
                                          decode_steps=config.decode_steps)
        self.corpus_groups = CorpusGroups.parse(config.corpus_groups)  # whose outputs may draft whose requests
        self.probes = BackendProbes(self.backends, config.status_cache_s)  # GetStatus's look at the replicas

    def parse(self, request: pb.GenerateRequest, principal: str = "") -> GenerationSpec:
        return self.requests.parse(request, principal)

    def backends(self) -> list[tuple[str, object]]:
        """Every draft and target replica as (role, backend); each has `.address` and `info()`."""
        return [(pool.role, backend) for pool in self._pools() for backend in pool.members()]

    # -- the loop ---------------------------------------------------------------------------

    async def generate(self, spec: GenerationSpec, deadline: float | None = None,
                       context=None) -> AsyncIterator[pb.GenerateChunk]:
        """Admit the request (or refuse it at once), then stream its generation.

        `deadline` (time.monotonic()) bounds every downstream call; `context` receives the retry
        hint of a refusal as trailing metadata.
        """
        with self.counters.generation():
            async with self.admission.slot(deadline=deadline, context=context):
                with self.metrics.start_request() as timer:
                    async with contextlib.aclosing(self._generate(spec, deadline, timer)) as chunks:
                        async for chunk in chunks:  # closed with this one: a client that leaves frees at once
                            yield chunk

    async def _generate(self, spec: GenerationSpec, deadline: float | None, timer) -> AsyncIterator[pb.GenerateChunk]:
        start = time.perf_counter()
        await check_grammar(spec.params, self.requests.grammar_limits)  # compiled off the event loop, time-bounded
        state = await (self.sessions.resume(spec) if spec.resume_from is not None else self.sessions.open(spec))
        owner = state.generation.owner
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
                self._spawn(self._interrupted(state.session_id, owner, True))
            raise
        except Exception:
            if finish == pb.FINISH_REASON_UNSPECIFIED:
                await self._interrupted(state.session_id, owner, False)
            raise

    async def _stream(self, spec: GenerationSpec, state: SessionState, deadline: float | None, timer,
                      start: float) -> AsyncIterator[pb.GenerateChunk]:
        """The chunks of a generation whose session is open and leased: the header, what a resume
        lacks (or the input's log-probabilities), then one chunk per round until it finishes."""
        gen, sent = state.generation, spec.resume_from or 0
        yield pb.GenerateChunk(session_id=state.session_id, offset=sent)  # header: the session is recorded
        text = Detokenizer(self.tokenizer, gen.stop)
        if spec.resume_from is not None:
            for chunk in await self._catch_up(state, text, sent, timer, deadline):
                yield chunk
                sent = len(state.tokens) - gen.start
            if gen.finish:
                return
        elif spec.prompt_logprobs:
            yield await self._prompt_chunk(state, spec.top_logprobs, deadline)
            if gen.max_new_tokens == 0:  # scoring only
                yield await self._score_only_end(state, timer)
                return
        async with contextlib.aclosing(self._rounds(state, text, sent, deadline, timer, start)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _rounds(self, state: SessionState, text: Detokenizer, sent: int, deadline: float | None, timer,
                      start: float) -> AsyncIterator[pb.GenerateChunk]:
        """One chunk per round, from the `sent`-th token of the generation on, until it finishes."""
        gen, drafting = state.generation, self.draft is not None
        lengths = await controller_for(state, self.store, self.policy_config, drafting,
                                       self.draft.sources if self.draft is not None else ())
        speculator = Speculator(state.session_id, state.sampling_params(), state.seed, self.draft,
                                self.target, self.fingerprint, overlap=self.config.overlap, deadline=deadline,
                                top_logprobs=gen.top_logprobs, corpus_group=self.corpus_groups.of(state.principal))
        first, round_end = True, None
        # With --save-behind, the next round's calls go out as soon as the current round's tokens are known,
        # while its save runs; its chunk is streamed only once the save succeeded, so the client never
        # holds a token the store lacks. `ahead`: that next round, and when it started.
        ahead: tuple[asyncio.Future, int] | None = None
        try:
            while not gen.finish:
                if ahead is None:
                    planned = self._round(speculator, state, lengths, drafting, first)
                    round_start, first = time.perf_counter_ns(), False
                    rnd = await planned
                else:
                    (pending, round_start), ahead = ahead, None
                    rnd = await pending
                remaining = state.remaining(self.max_context)
                between_ns = round_start - round_end if round_end is not None else 0
                round_end = time.perf_counter_ns()
                lengths.observe(state, rnd.stats, between_ns / 1e9, rnd.source, rnd.asked)
                kept, finish = gen.apply_stops(rnd.emitted, remaining, text, self.eos_ids)
                stopped = time.perf_counter_ns()
                state.record_round(rnd.stats, kept, finish, self.config.session_lease_s, time.perf_counter() - start)
                if self.config.save_behind and not finish:
                    # the next round's task first: it runs (and sends its calls) before the save's encoding
                    ahead = self._next_round(speculator, state, lengths, drafting)
                    saving = asyncio.ensure_future(self.store.save(state, kept))
                    try:
                        await saving  # the next round's calls are in flight meanwhile
                    except BaseException:
                        _drop(ahead[0])  # the current round was not saved: it is not streamed, and nothing follows it
                        ahead = None
                        raise
                else:
                    await self.store.save(state, kept)
                rnd.stats.between_ns, rnd.stats.save_ns = between_ns, time.perf_counter_ns() - stopped
                rnd.stats.detokenize_ns = stopped - round_end
                yield await self._round_chunk(state, rnd, kept, sent, text, timer, lengths)
                sent += len(kept)
        finally:
            if ahead is not None:
                _drop(ahead[0])
            speculator.close()

    def _next_round(self, speculator: Speculator, state: SessionState, lengths: DraftLengthController,
                    drafting: bool) -> tuple[asyncio.Future, int]:
        """Start the round after the one whose save is running (the history already holds its
        tokens), with when it started."""
        return asyncio.ensure_future(self._round(speculator, state, lengths, drafting, False)), time.perf_counter_ns()

    def _round(self, speculator: Speculator, state: SessionState, lengths: DraftLengthController, drafting: bool,
               first: bool) -> Coroutine[Any, Any, Round]:
        """The next round, as the controller plans it within the tokens still wanted; with
        --verify-ahead it tells the target when the round after it follows at k = 0."""
        remaining = state.remaining(self.max_context)
        k, k_next = within_budget(lengths.wanted, lengths.upcoming, remaining, first, drafting)
        if speculator.promised:
            # The previous request told the target that the next one is at k = 0, and the target verifies it
            # ahead: a block sent now (the controller changed its mind on the new measures) would wait for
            # that pass, then run its own.
            k = 0
        # At k = 0 a round may emit several tokens, one pass each, within the tokens still wanted and before
        # the controller's next exploration round, unless the controller wants a block next; the first
        # round's one (its prefill) is the time to first token.
        several = k == 0 and k_next == 0 and not first
        steps = min(self.config.decode_steps, remaining, lengths.room) if several else 1
        # The round after one of several passes that takes all the room is the controller's exploration round
        # (it may draft: nothing is verified ahead of it); `upcoming` priced the round after one pass.
        ahead = self.config.verify_ahead and not 1 < steps == lengths.room
        continues = ahead and continues_at_k0(k, k_next, remaining, drafting, steps=steps)
        # Kept whatever the request emits: the controller's own k = 0. The budget's k = 0 holds only if every
        # draft token is accepted; emitting fewer leaves room for a block after all.
        speculator.promised = continues and lengths.upcoming == 0
        follow = ahead and continues_at_k0(k, k_next, remaining, drafting, guess=True)  # a round may follow
        # A guess bets on the share of asked rounds the draft answers empty; a round that asks it nothing
        # makes none: the first asked round after it comes when the controller expects a block.
        guess = (follow and k > 0 and speculator.params.greedy and lengths.policy is not None
                 and guess_ahead_pays(lengths.policy))
        return speculator.round(state.tokens, k, k_next, continues, lengths.sources, guess, follow, steps)

    async def _prompt_chunk(self, state: SessionState, top: int, deadline: float | None) -> pb.GenerateChunk:
        """The input's log-probabilities (raw), scored in one target pass that also prefills its cache."""
        gen = state.generation
        first = gen.start - gen.input_tokens
        start = max(first, 1)
        reply = await self.target.score(state.session_id, state.tokens[:gen.start], start, top, None,
                                        timeout=None if deadline is None else deadline - time.monotonic())
        entries = list(reply.logprobs)
        if first == 0:  # nothing precedes a session's first token: rank 0, no log-probability
            entries.insert(0, common_pb2.TokenLogprobs(token_id=state.tokens[0]))
        # A whole prompt's tokens and their alternatives: decoded off the event loop.
        named = await asyncio.to_thread(lambda: [self._named(e) for e in entries])
        return pb.GenerateChunk(session_id=state.session_id, prompt_logprobs=named)

    async def _score_only_end(self, state: SessionState, timer) -> pb.GenerateChunk:
        """The end of a request that asked for no new tokens (max_new_tokens 0 with prompt_logprobs)."""
        gen = state.generation
        gen.finish, gen.lease_until = pb.FINISH_REASON_LENGTH, 0.0
        await self.store.save(state, [])
        chunk = pb.GenerateChunk(session_id=state.session_id, finish_reason=gen.finish,
                                 stats=gen.stats(0, state.seed))
        timer.observe_finish(gen.finish_label, gen.prompt_tokens, 0)
        return chunk

    async def _catch_up(self, state: SessionState, text: Detokenizer, sent: int, timer,
                        deadline: float | None) -> list[pb.GenerateChunk]:
        """A resume: catch the detokenizer up to what the client holds, then send what it lacks
        (nothing when it holds all of a generation still running), with log-probabilities when the
        generation asked for them (the target scores the tokens again: the rounds' are not kept).
        The whole generation so far is decoded here, off the event loop."""
        gen = state.generation
        produced = state.tokens[gen.start:]
        await asyncio.to_thread(text.replay, produced[:sent], self.eos_ids)
        text.release()
        if sent == len(produced) and not gen.finish:
            return []
        await asyncio.to_thread(text.replay, produced[sent:], self.eos_ids)
        chunk = pb.GenerateChunk(session_id=state.session_id, token_ids=produced[sent:], offset=sent,
                                 finish_reason=gen.finish, text=text.release(final=bool(gen.finish)))
        if gen.top_logprobs is not None:
            reply = await self.target.score(state.session_id, state.tokens, gen.start + sent, gen.top_logprobs,
                                            state.sampling_params(),
                                            timeout=None if deadline is None else deadline - time.monotonic())
            chunk.logprobs.extend(await asyncio.to_thread(lambda: [self._named(e) for e in reply.logprobs]))
        if gen.finish:
            chunk.stats.CopyFrom(gen.stats(len(produced), state.seed))
            timer.observe_finish(gen.finish_label, gen.prompt_tokens, len(produced) - sent)
        timer.observe_chunk(len(produced) - sent)
        return [chunk]

    async def _round_chunk(self, state: SessionState, rnd: Round, kept: list[int], offset: int, text: Detokenizer,
                           timer, lengths: DraftLengthController) -> pb.GenerateChunk:
        """A round's chunk; the last one also ends the generation (prior, snapshots, stats)."""
        gen, sent = state.generation, offset + len(kept)
        released = time.perf_counter_ns()
        piece = text.release() if not gen.finish else ""
        rnd.stats.detokenize_ns += time.perf_counter_ns() - released
        chunk = pb.GenerateChunk(session_id=state.session_id, token_ids=kept, round=rnd.stats,
                                 finish_reason=gen.finish, offset=offset, text=piece,
                                 logprobs=[self._named(entry) for entry in rnd.logprobs[:len(kept)]])
        self.observe_round(SpecDecodingStats.of_round(rnd.stats, len(kept), rnd.source))
        timer.observe_chunk(len(kept))
        if not gen.finish:
            return chunk
        await lengths.finish(self.store)
        if self.config.kv_snapshots:
            self._save_snapshots(state.session_id)
        if self._shareable(gen) and sent and self.draft is not None and self.draft.reads_shared_outputs:
            self._spawn(self._publish(state.tokens[gen.start:], self.corpus_groups.of(state.principal)))
        chunk.text = text.release(final=True)
        chunk.stats.CopyFrom(gen.stats(sent, state.seed))
        timer.observe_finish(gen.finish_label, chunk.stats.prompt_tokens, sent)
        return chunk

    def observe_round(self, stats: SpecDecodingStats) -> None:
        """Count a round once, in every sink: the Prometheus metrics and GetStatus's counters."""
        for sink in (self.metrics, self.counters):
            sink.observe_round(stats)

    def _named(self, entry: common_pb2.TokenLogprobs) -> common_pb2.TokenLogprobs:
        """A log-probability entry with the text of its tokens (each decoded alone)."""
        decode = self.tokenizer.decode
        entry.token = decode([entry.token_id])
        entry.top_tokens[:] = [decode([t]) for t in entry.top_token_ids]
        return entry

    # -- sessions and caches ----------------------------------------------------------------

    async def close_session(self, session_id: str, principal: str = "") -> bool:
        """Free the session's caches on every replica, then delete it; False (and no call to any
        replica) for a session that does not exist, or is another identity's. The caches go first:
        once the delete lands, a client's retry (after a lost reply, or on another orchestrator
        after this one died) finds no session and frees nothing, so nothing may be left to free."""
        check_session_id(session_id)
        state = await self.sessions.closable(session_id, principal)
        if state is None:
            return False
        await self._release_caches(session_id, forget_output=not self._shareable(state.generation))
        return await self.store.delete(session_id)

    def _shareable(self, gen: GenerationRecord | None) -> bool:
        """Whether a generation's output may join the suffix drafts' corpus: finished, and allowed by
        both the orchestrator (--share-outputs) and the request (share_output)."""
        return self.config.share_outputs and gen is not None and gen.share_output and gen.finish != 0

    async def _interrupted(self, session_id: str, owner: str, release_caches: bool) -> None:
        """A request stopped before its generation's end: free its lease (the generation stays
        resumable) and the caches; unless another request has taken the generation over."""
        owned = await self.sessions.free_lease(session_id, owner)
        if release_caches and owned:
            await self._release_caches(session_id)

    def _pools(self) -> list[Pool]:
        return [self.target] + ([self.draft] if self.draft is not None else [])

    async def _release_caches(self, session_id: str, forget_output: bool = True) -> None:
        """Free the session's caches; only a finished generation that may be shared (`forget_output`
        False) may join the corpus of a suffix draft that learns from released sessions."""
        await asyncio.gather(*(pool.release(session_id, forget_output) for pool in self._pools()))

    def _save_snapshots(self, session_id: str) -> None:
        """--kv-snapshots: the target and draft replicas holding the session write its caches to
        Redis, in the background (the client is not kept waiting; a failure is only logged)."""
        for pool in self._pools():
            self._spawn(pool.save_snapshot(session_id))

    async def _publish(self, output: list[int], group: str) -> None:
        """--share-outputs: offer the output to the suffix corpus of its corpus group (`group`, from the
        session's principal: orchestrator.corpus) in the draft replicas that read the outputs stream (best
        effort; with no such replica nothing is written: no tenant's output sits in Redis for nobody)."""
        try:
            await self.store.publish_output(output, group)
        except SpecdecError as exc:
            log.info("could not share a finished output: %s", exc)

    def _spawn(self, work) -> None:
        """Run `work` in the background, holding a reference until it is done."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _drop(task: asyncio.Future) -> None:
    """Cancel a round started ahead whose result is not wanted (its error, if any, is not one)."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
