"""Batching many sessions' scoring work into shared forward passes.

A request becomes a `Job`: one or more scoring steps on one session's KV cache (a verify is one
step: score `k + 1` positions; a draft of `k` tokens is `k` steps of one token each). The
`Batcher` owns the model thread. It runs one step of every job in the batch as ONE forward pass
(`SessionCaches.score_batch`), hands each job its slice of the result, and repeats. Jobs with
more steps stay in the batch; new jobs join it at the next step boundary (continuous batching),
so a long draft never holds a short one back by more than one step.

When the batch is empty, the next one starts as soon as the sessions of the previous batch are
waiting again (all but one in eight; their clients run closed loops: each sends its next request
a little after its answer), or `max_batch` jobs wait, or the wait since the previous step ended
(or since the oldest job arrived, if later) reaches the larger of three times the measured
turnaround of returning sessions and half the previous pass's compute time (a second pass for the
latecomers would cost a whole pass), capped at `window_s`. Without that rule closed-loop clients
settle into alternating partial passes (each group arrives while the other computes); with it
they share passes, and a lone client never waits at all. Between the passes of jobs that go on
(a long prompt fed in chunks), the sessions the previous pass answered are waited for too, when
they are expected back within a tenth of a pass (`_gather_returning`).

Each batch holds a session at most once (a second job for the same session waits for the first
to finish), so every session's cache sees its requests in order. Before each step, jobs whose
deadline has passed are failed with DEADLINE_EXCEEDED and cancelled jobs are dropped: neither
costs any compute.

A job for a session without a cache here, whose cache Redis may hold (a snapshot, other
replicas' prefix blocks: `SessionCaches.wants_fetch`), has it fetched on the batcher's I/O thread
when it is submitted (or when it is admitted, if its session's cache was evicted meanwhile), and
joins a pass only once that fetch is done, so the model thread never waits on the network: its
pass installs what was fetched, or prefills what was not.

Everything about asyncio happens on the event loop; the worker thread only runs `step`, which
touches the model, the caches and the jobs' own per-step logic (`Job.advance`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from specdec.errors import Cancelled, DeadlineExceeded
from specdec.runtime.kv import PREFILL_ALONE_ABOVE, Scored, ScoreRequest, SessionCaches
from specdec.runtime.latency import LatencyProfile
from specdec.runtime.native import Parking

log = logging.getLogger(__name__)


MAX_STEP_TOKENS = 64
"""New tokens a decode or verify step brings at most (the most draft tokens `verifier.Verifier`
takes): a row with no more, and no more than `PREFILL_ALONE_ABOVE` history tokens to (re-)prefill,
runs whole in any pass; the prefill budget is for longer feeds."""
MAX_SCORED_POSITIONS = 512
"""Most positions whose logits a job asks for in one pass (see `BatchConfig.score_positions`): their
logits are `[positions, V]` float32, 100 MB at a 49k vocabulary."""


@dataclass(frozen=True)
class BatchConfig:
    max_batch: int = 16
    """Most jobs in one forward pass; 1 disables batching."""
    window_s: float = 0.05
    """The longest a waiting job waits for the sessions of the previous batch to come back."""
    prefill_chunk_tokens: int = 512
    """Most prefill tokens one pass feeds, over all its rows (0: no limit). A longer prefill is fed
    in chunks over several passes, each shared with the other sessions' decode and verify rows, so
    a long prompt's arrival delays the running sessions by a bounded amount per pass."""

    @property
    def score_positions(self) -> int:
        """Most positions a job scores in one pass when it wants the logits of many (a prompt scored for
        its log-probabilities): the prefill budget, at most `MAX_SCORED_POSITIONS`."""
        return min(self.prefill_chunk_tokens or MAX_SCORED_POSITIONS, MAX_SCORED_POSITIONS)

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0, got {self.prefill_chunk_tokens}")
        if self.window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {self.window_s}")


@dataclass(frozen=True)
class StepInfo:
    """What one batched step cost, as every job in it sees it."""

    batch_size: int
    compute_ns: int  # the whole step: forward pass plus every job's per-step logic
    queue_ns: int  # this job's wait from submission to its first step (0 on later steps)
    positions: int = 0  # positions its decoding pass computed, all rows together (0: a long prefill ran too)


class BatchObserver(Protocol):
    """Hooks for metrics (e.g. `specdec.server.metrics.ServiceMetrics`)."""

    def on_step(self, batch_size: int, compute_s: float) -> None: ...

    def on_start(self, queue_s: float) -> None: ...

    def on_dropped(self, reason: str) -> None: ...


class _Unobserved:
    """The observer of a batcher nobody watches."""

    def on_step(self, batch_size: int, compute_s: float) -> None:
        pass

    def on_start(self, queue_s: float) -> None:
        pass

    def on_dropped(self, reason: str) -> None:
        pass


class Job:
    """One request's share of the batched work. Subclasses define `request` and `advance`.

    `request` and `advance` run on the worker thread; `deliver` and `finish` on the event loop.
    """

    def __init__(self, session_id: str, deadline: float | None = None) -> None:
        self.session_id = session_id
        self.deadline = deadline  # time.monotonic() after which the caller has given up, or None
        self.enqueued = time.monotonic()
        self.sent_unix_ns = 0  # when its caller sent it (its clock), 0 if unknown
        self.started = False
        self.cancelled = False
        self.done = False
        self.fetching: asyncio.Future | None = None  # its cache's fetch from Redis, until done
        # Called on the event loop with the job's last item when it finishes with one, once the pass's
        # jobs are settled and before the next pass is scheduled: it may submit the job that follows
        # (`Batcher.start`), which then joins that very pass (set while the job waits or runs).
        self.follow: Callable[[Any], None] | None = None
        self._items: asyncio.Queue = asyncio.Queue()

    # -- worker thread -----------------------------------------------------------------------

    def request(self) -> ScoreRequest:
        """What this job needs scored next (its first request is also asked for at submission, on the
        event loop, to fetch its cache: it must not depend on the worker thread's state)."""
        raise NotImplementedError

    def advance(self, scored: Scored, caches: SessionCaches) -> tuple[Any, bool]:
        """Consume one step's logits; return (item for the caller, whether the job is finished)."""
        raise NotImplementedError

    # -- event loop ----------------------------------------------------------------------------

    def deliver(self, item: Any, step: StepInfo) -> None:
        self._items.put_nowait((item, step))

    def finish(self, error: BaseException | None = None) -> None:
        if not self.done:
            self.done = True
            self._items.put_nowait(error)

    def finish_cancelled(self) -> None:
        self.finish(Cancelled(f"the request for session {self.session_id!r} was cancelled"))

    async def results(self) -> AsyncIterator[tuple[Any, StepInfo]]:
        """The job's items as they are produced; raises the job's error, if any, at the end."""
        while True:
            got = await self._items.get()
            if got is None:
                return
            if isinstance(got, BaseException):
                raise got
            yield got

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    @property
    def ready(self) -> bool:
        """Whether it may join a pass: no fetch of its cache is still running."""
        return self.fetching is None or self.fetching.done()


class Batcher:
    """Runs jobs in shared forward passes on one worker thread (see the module docstring)."""

    def __init__(self, caches: SessionCaches, config: BatchConfig = BatchConfig(),
                 profile: LatencyProfile = LatencyProfile(), observer: BatchObserver | None = None,
                 executor: ThreadPoolExecutor | None = None, parking: Parking | None = None) -> None:
        """`executor`: the model thread (one worker); fetches from Redis run on an I/O thread of the
        batcher's own, started at the first one. `parking`: puts the model thread's OpenMP workers to
        sleep while it has nothing to run (`specdec.runtime.native.parking()`)."""
        self.caches = caches
        self.config = config
        self.profile = profile
        self.observer: BatchObserver = observer or _Unobserved()
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch")
        self._io: ThreadPoolExecutor | None = None
        self.parking = parking
        self._parked = False  # a park is on the model thread (or queued for it)
        self._pending: deque[Job] = deque()
        self._active: list[Job] = []
        self._wakeup = asyncio.Event()  # set when there is news for the scheduler
        self._task: asyncio.Task | None = None
        self._last_sessions: set[str] = set()  # the sessions of the previous step
        self._last_step_end = 0.0  # time.monotonic() when the previous step ended
        self._turnaround_s = 0.005  # EWMA: a session's job finished → its next job arrived
        self._last_pass_s = 0.0  # compute time of the previous step
        self._finished_at: dict[str, float] = {}  # session → when its last job finished (recent ones)
        # session → when it was released: a job that arrived before that is stale (its caller was
        # cancelled, but its RPC may reach the queue only after the release), and is dropped. The
        # same by the caller's clock: a job its caller sent before the release is stale too, even
        # if its RPC reaches the service after the release.
        self._released_at: dict[str, float] = {}
        self._released_sent: dict[str, int] = {}
        self.batches = 0  # forward passes run (for tests and GetInfo)

    @property
    def waiting(self) -> int:
        """Jobs submitted that have not started their first step."""
        return len(self._pending)

    @property
    def running(self) -> int:
        """Jobs in the current batch."""
        return len(self._active)

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds work has waited on the model thread with no pass completing: since the later of the
        last pass's end and the submission of the oldest job that is running or could run (not one
        still fetching its cache); 0 when none waits. A health check reads it (on the event loop)."""
        now = time.monotonic() if now is None else now
        waiting = [job.enqueued for job in (*self._active, *self._pending) if job.ready and not job.done]
        if not waiting:
            return 0.0
        return max(0.0, now - max(self._last_step_end, min(waiting)))

    @property
    def idle(self) -> bool:
        """No job queued or running (the event loop's view: a job submitted later is not counted)."""
        return not self._pending and not self._active

    # -- the API a servicer uses ----------------------------------------------------------------

    async def run(self, job: Job) -> tuple[Any, StepInfo]:
        """Submit a one-step job and wait for its result; cancelling the caller cancels the job."""
        self._submit(job)
        return await self._result(job)

    def start(self, job: Job) -> asyncio.Task:
        """`run(job)` as a task, the job submitted now rather than when the task first runs (it may
        join a pass that starts before then); cancelling the task cancels the job."""
        self._submit(job)
        return asyncio.ensure_future(self._result(job))

    async def stream(self, job: Job) -> AsyncIterator[tuple[Any, StepInfo]]:
        """Submit a job and yield its items as its steps complete."""
        self._submit(job)
        async for item in self._follow(job):
            yield item

    async def _result(self, job: Job) -> tuple[Any, StepInfo]:
        result = None
        async for item in self._follow(job):
            result = item
        if result is None:  # a cancelled job ends with Cancelled, a failed one with its error
            raise RuntimeError(f"job for session {job.session_id!r} finished without a result")
        return result

    async def _follow(self, job: Job) -> AsyncIterator[tuple[Any, StepInfo]]:
        """A submitted job's items as its steps complete."""
        try:
            async for item in job.results():
                yield item
        finally:
            if not job.done:
                job.cancelled = True  # the caller went away: drop it at the next step boundary
                self._kick()

    async def call(self, fn: Callable, *args) -> Any:
        """Run `fn(*args)` on the worker thread, between steps (release, snapshot)."""
        self._unpark()
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def cancel_session(self, session_id: str, sent_unix_ns: int = 0) -> int:
        """Cancel every queued or running job of a session (before its cache is released), and
        any job its caller sent before `sent_unix_ns` (the release's send time) that comes later."""
        now = time.monotonic()
        self._released_at[session_id] = now
        if sent_unix_ns:
            self._released_sent[session_id] = max(sent_unix_ns, self._released_sent.get(session_id, 0))
        if len(self._released_at) > 4096:  # forget releases old enough that nothing can be in flight
            self._released_at = {s: t for s, t in self._released_at.items() if now - t < 60.0}
            self._released_sent = {s: t for s, t in self._released_sent.items() if s in self._released_at}
        count = 0
        for job in [*self._pending, *self._active]:
            if job.session_id == session_id and not job.done:
                job.cancelled = True
                count += 1
        if count:
            self._kick()
        return count

    async def close(self) -> None:
        self._unpark()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for job in [*self._pending, *self._active]:
            job.finish(Cancelled("the service is shutting down"))
        if self._io is not None:
            self._io.shutdown(wait=False, cancel_futures=True)

    # -- scheduling -----------------------------------------------------------------------------

    def _submit(self, job: Job) -> None:
        finished_at = self._finished_at.pop(job.session_id, None)
        if finished_at is not None:
            sample = min(max(0.0, job.enqueued - finished_at), self.config.window_s)
            self._turnaround_s += 0.2 * (sample - self._turnaround_s)
        if not any(other.session_id == job.session_id for other in (*self._pending, *self._active)):
            self._fetch(job)  # (an earlier job of its session is here: that one's pass builds its cache)
        self._pending.append(job)
        self._kick()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    def _fetch(self, job: Job) -> bool:
        """Start fetching the job's cache from Redis on the I/O thread if the caches may find one
        (the job then joins a pass once that is done: `Job.ready`); whether it started."""
        request = job.request()
        if not self.caches.wants_fetch(request):
            return False
        if self._io is None:
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-io")
        job.fetching = asyncio.get_running_loop().run_in_executor(self._io, self.caches.prefetch, request)
        job.fetching.add_done_callback(self._fetched)
        return True

    def _fetched(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is not None:  # the job prefills instead
            log.warning("fetching a session's cache failed: %s", future.exception())
        self._kick()

    def _kick(self) -> None:
        self._unpark()
        self._wakeup.set()

    def _park(self) -> None:
        """Nothing to run: the model thread's workers sleep until news (`_kick`) or a `call`."""
        if self.parking is not None and not self._parked:
            self._parked = True
            self.executor.submit(self.parking.park, self.parking.ticket())

    def _unpark(self) -> None:
        if self._parked and self.parking is not None:
            self._parked = False
            self.parking.unpark()

    async def _loop(self) -> None:
        while True:
            try:
                await self._schedule()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug here must not leave callers waiting forever
                log.exception("batch scheduler failed; failing the queued and running jobs")
                for job in [*self._pending, *self._active]:
                    job.finish(exc)
                self._pending.clear()
                self._active = []

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._cull()
            if not self._active:
                if not self._admissible():  # none waiting, or all behind a fetch still running
                    self._wakeup.clear()
                    self._park()
                    await self._wakeup.wait()
                    continue
                await self._gather_window()
            elif self._missing():
                await self._gather_returning()
            self._admit()
            if not self._active:
                continue
            batch = list(self._active)
            started = time.monotonic()
            try:
                stepping = loop.run_in_executor(self.executor, self._step, batch)
                # Hand the GIL to the model thread now: it starts the pass's Python at once, where it
                # would otherwise wait until this thread next blocks, after sending the answers just
                # delivered (submit -> pass start 0.31-0.45 -> 0.07-0.08 ms, medians of 300 passes, k = 0).
                time.sleep(0)  # noqa: ASYNC251 - returns at once: a GIL yield, not a wait
                outcomes = await stepping
            except Exception as exc:  # the forward failed: every job of the batch fails with it
                log.exception("batched step of %d jobs failed", len(batch))
                for job in batch:
                    job.finish(exc)
                self._active = [j for j in self._active if j not in batch]
                continue
            follow_ups = []
            for job, item, finished, step in outcomes:
                if item is _PREFILLING and not job.cancelled:
                    continue  # fed a chunk of its prefill (or waited for the pass's prefill budget)
                if isinstance(item, BaseException):
                    job.finish(item)
                elif job.cancelled:  # during its step (its session released, or its caller gone)
                    job.finish_cancelled()
                else:
                    job.deliver(item, step)
                    if finished:
                        job.finish()
                        if job.follow is not None:
                            follow_ups.append((job.follow, item))
            self._active = [j for j in self._active if not j.done]
            self._last_sessions = {job.session_id for job in batch}
            self._last_step_end = time.monotonic()
            self._last_pass_s = self._last_step_end - started
            for job in batch:
                if job.done:
                    self._finished_at[job.session_id] = self._last_step_end
            while len(self._finished_at) > 4 * self.config.max_batch + 16:
                del self._finished_at[next(iter(self._finished_at))]  # sessions that did not come back
            for follow, item in follow_ups:
                try:
                    follow(item)
                except Exception:  # a follow-up is an optimisation: its failure must not stop the batcher
                    log.exception("a job's follow-up failed")

    def _missing(self) -> set[str]:
        """The sessions of the previous pass with no job queued or running now."""
        return self._last_sessions - {job.session_id for job in (*self._pending, *self._active)}

    async def _news(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for news (a job submitted or cancelled), then drop dead jobs;
        False if none came in time."""
        if timeout_s <= 0:
            return False
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        self._cull()
        return True

    async def _gather_window(self) -> None:
        """Wait until the previous batch's sessions are all back, `max_batch` jobs wait, or the window ends."""
        while len(self._pending) < self.config.max_batch:
            if len(self._missing()) <= len(self._last_sessions) // 8:
                return  # (nearly) everyone who shared the previous pass is here, or a lone client: go
            start = max(self._pending[0].enqueued, self._last_step_end)
            wait_s = min(self.config.window_s, max(0.002, 3 * self._turnaround_s, 0.5 * self._last_pass_s))
            if not await self._news(start + wait_s - time.monotonic()) or not self._pending:
                return

    async def _gather_returning(self) -> None:
        """Between the passes of jobs that go on (a prompt fed in chunks, a draft of several tokens):
        wait for the sessions whose jobs the previous pass finished, if they are expected back within
        a tenth of that pass (three measured turnarounds). A decoding session then joins the very next
        pass instead of sitting out one more: behind a prompt fed in chunks of a second each, every
        one of its tokens took two passes. Where sessions return slower than that (a draft service's
        sessions come back after a whole verify), nothing waits."""
        wait_s = min(self.config.window_s, max(0.002, 3 * self._turnaround_s))
        if wait_s > 0.1 * self._last_pass_s:
            return
        deadline = self._last_step_end + wait_s
        while len(self._pending) + len(self._active) < self.config.max_batch and self._missing():
            if not await self._news(deadline - time.monotonic()) or not self._active:
                return

    def _cull(self) -> None:
        """Drop cancelled jobs and fail expired ones, queued or running, before they cost compute."""
        now = time.monotonic()
        for queue_name in ("_pending", "_active"):
            jobs = getattr(self, queue_name)
            keep = [job for job in jobs if not self._drop_if_dead(job, now)]
            if len(keep) != len(jobs):
                setattr(self, queue_name, deque(keep) if queue_name == "_pending" else keep)

    def _drop_if_dead(self, job: Job, now: float) -> bool:
        if job.done:
            return True
        if job.expired(now):  # checked first: gRPC also cancels a call whose deadline passed
            job.finish(DeadlineExceeded(
                f"the request's deadline passed after {now - job.enqueued:.3f}s in the service "
                f"({'between steps' if job.started else 'while queued'}); it was dropped before compute"))
            self.observer.on_dropped("deadline")
            return True
        released = self._released_at.get(job.session_id)
        if released is not None and job.enqueued <= released:
            job.cancelled = True  # arrived before its session was released
        if job.sent_unix_ns and job.sent_unix_ns <= self._released_sent.get(job.session_id, 0):
            job.cancelled = True  # sent before its session was released, arrived after
        if job.cancelled:
            job.finish_cancelled()
            self.observer.on_dropped("cancelled")
            return True
        return False

    def _admissible(self) -> bool:
        """Whether `_admit` would move a pending job into the (empty) batch."""
        behind: set[str] = set()  # sessions with an earlier job still fetching
        for job in self._pending:
            if job.ready and job.session_id not in behind:
                return True
            behind.add(job.session_id)
        return False

    def _admit(self) -> None:
        """Move pending jobs into the batch, up to max_batch, one job per session, in order; a job
        still fetching its cache waits (and so do its session's later jobs). A job whose session's
        cache was there at submission but is gone now (evicted meanwhile) fetches it first."""
        busy = {job.session_id for job in self._active}
        skipped: deque[Job] = deque()
        while self._pending and len(self._active) < self.config.max_batch:
            job = self._pending.popleft()
            if job.session_id in busy or not job.ready or (job.fetching is None and self._fetch(job)):
                busy.add(job.session_id)
                skipped.append(job)  # the session's earlier job, or its fetch, comes first
                continue
            busy.add(job.session_id)
            self._active.append(job)
        skipped.extend(self._pending)
        self._pending = skipped

    # -- worker thread --------------------------------------------------------------------------

    def _chunk(self, requests: list[ScoreRequest]) -> list[ScoreRequest | None]:
        """What each row runs this pass under the prefill budget: its request as it is; a request for
        the next chunk of its history only (no logits wanted); or None (no budget left: it waits for
        the next pass). A row feeds its history's missing tokens (at least its last one) and its new
        ones: decode and verify steps (`MAX_STEP_TOKENS`) always run whole; the others take from the
        budget in order, whole where they fit, else the part of their history that fits. A row that
        cannot be cut (its new tokens alone exceed what is left: a prompt scored in steps, which its
        job bounds to the budget) waits, unless nothing took from the budget yet: the first always
        progresses."""
        budget = full = self.config.prefill_chunk_tokens
        if not budget:
            return list(requests)
        plan: list[ScoreRequest | None] = []
        for request in requests:
            covered = self.caches.covered(request.session_id, request.history)
            pending = len(request.history) - covered
            fed = max(1, pending) + len(request.new_tokens)
            if pending <= PREFILL_ALONE_ABOVE and len(request.new_tokens) <= MAX_STEP_TOKENS:
                plan.append(request)
            elif fed <= budget:
                budget -= fed
                plan.append(request)
            elif pending > 1 and budget > 0:
                take = min(budget, pending - 1)
                plan.append(ScoreRequest(request.session_id, request.history[: covered + take], []))
                budget -= take
            elif budget == full:
                budget = 0
                plan.append(request)
            else:
                plan.append(None)
        return plan

    def _step(self, batch: list[Job]) -> list[tuple[Job, Any, bool, StepInfo]]:
        start_ns = time.perf_counter_ns()
        now = time.monotonic()
        queue_ns = {}
        for job in batch:
            if not job.started:
                job.started = True
                queue_ns[id(job)] = int((now - job.enqueued) * 1e9)
                self.observer.on_start(now - job.enqueued)
        requests = [job.request() for job in batch]
        plan = self._chunk(requests)
        ran = [request for request in plan if request is not None]
        scored_ran = iter(self.caches.score_batch(ran))
        scored: list[Scored | Exception | None] = [None if r is None else next(scored_ran) for r in plan]
        self.batches += 1
        results: list[tuple[Job, Any, bool]] = []
        for job, request, run, one in zip(batch, requests, plan, scored):
            if isinstance(one, Exception):
                results.append((job, one, True))
                continue
            if run is not request or one is None:  # a chunk of its prefill, or none this pass
                results.append((job, _PREFILLING, False))
                continue
            try:
                item, finished = job.advance(one, self.caches)
            except Exception as exc:  # noqa: BLE001 - one job's bad input fails that job only
                item, finished = exc, True
            results.append((job, item, finished))
        positions = _pass_positions(ran, [one for one in scored if one is not None])
        self.profile.pad(start_ns, max((len(r.new_tokens) + 1 for r in ran), default=1))
        compute_ns = time.perf_counter_ns() - start_ns
        self.observer.on_step(len(batch), compute_ns / 1e9)
        return [(job, item, finished, StepInfo(len(batch), compute_ns, queue_ns.get(id(job), 0),
                                                    positions))
                for job, item, finished in results]


_PREFILLING = object()
"""A job's outcome for a pass that fed part of its prefill (nothing to deliver yet)."""


def _pass_positions(requests: list[ScoreRequest], scored: list[Scored | Exception]) -> int:
    """Positions the step's pass computed: its rows' widths added up (`SessionCaches.score_batch` packs them).

    0 (unknown) for a step that also re-prefilled a long prefix: a prefill's cost per position
    (long rows, alone) says little about what one more position of a decoding pass costs, which
    is what the draft-length controller fits on these figures.
    """
    if any(not isinstance(one, Exception) and one.prefilled > PREFILL_ALONE_ABOVE for one in scored):
        return 0
    widths = [len(r.new_tokens) + 1 + (0 if isinstance(one, Exception) else one.prefilled)
              for r, one in zip(requests, scored)]
    return sum(widths)
