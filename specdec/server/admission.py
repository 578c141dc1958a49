"""Admission control: bounded concurrency and a bounded queue, refusing the rest at once.

`Admission(max_concurrent, max_queued)` hands out slots. A request gets a slot at once while
fewer than `max_concurrent` are held; otherwise it waits in a FIFO queue of at most `max_queued`
(and no longer than its deadline); beyond that it is refused immediately with `Overloaded`
(RESOURCE_EXHAUSTED) carrying a retry hint. There is never an unbounded queue. The counter is
our own: grpc's `maximum_concurrent_rpcs` is not reliable under asyncio and knows nothing of
queues or retry hints.

Usage (a servicer method, or any asyncio code)::

    async with admission.slot(deadline=deadline_of(context), context=context):
        ...  # the work

With `context`, a refusal also sets the trailing metadata `retry-after-ms` before the error
reaches the interceptor that maps it to a status (`specdec.rpc_errors.grpc_errors`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from specdec.errors import DeadlineExceeded, ResourceExhausted

RETRY_AFTER_KEY = "retry-after-ms"
"""Trailing metadata key of the retry hint on a RESOURCE_EXHAUSTED refusal (milliseconds, decimal)."""


class Overloaded(ResourceExhausted):
    """Admission refused: every slot is held and the queue is full. Retry after `retry_after_ms`."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


def deadline_of(context, timeout_ms: int = 0, arrived: float = 0.0) -> float | None:
    """The `time.monotonic()` at which a gRPC call's deadline passes, or None if it has none; with a
    request's own `timeout_ms` (a request on a long-lived call), the earlier of the call's deadline
    and `arrived` (when the request came) + that limit."""
    remaining = context.time_remaining() if context is not None else None
    deadline = None if remaining is None else time.monotonic() + remaining
    if timeout_ms:
        own = arrived + timeout_ms / 1e3
        deadline = own if deadline is None else min(deadline, own)
    return deadline


def retry_after_ms(error: BaseException) -> int | None:
    """The server's retry hint on a refused call (an `Overloaded`, or a client-side RpcError)."""
    if isinstance(error, Overloaded):
        return error.retry_after_ms
    trailing = getattr(error, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == RETRY_AFTER_KEY:
            return int(value)
    return None


class Admission:
    """Slots for at most `max_concurrent` requests, plus a queue of at most `max_queued`."""

    def __init__(self, max_concurrent: int, max_queued: int, name: str = "service", observer=None) -> None:
        """`observer` (optional) gets `on_reject()` and `on_dropped(reason)`, e.g. a `ServiceMetrics`."""
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.name = name
        self.running = 0  # slots held
        self.rejected = 0  # refusals so far
        self._waiters: deque[asyncio.Future] = deque()
        self._hold_s = 0.05  # EWMA of how long a slot is held (seeds the retry hint)
        self.observer = observer

    @property
    def waiting(self) -> int:
        """Requests queued for a slot (safe to read from another thread, e.g. a metrics scrape)."""
        return len(self._waiters)  # only live waiters are kept: abandoned ones leave at once

    @asynccontextmanager
    async def slot(self, deadline: float | None = None, context=None) -> AsyncIterator[None]:
        """Hold a slot for the body; refuse (Overloaded) or time out (DeadlineExceeded) otherwise."""
        await self._acquire(deadline, context)
        started = time.monotonic()
        try:
            yield
        finally:
            self._hold_s += 0.1 * (time.monotonic() - started - self._hold_s)
            self._release()

    def retry_hint_ms(self) -> int:
        """A guess at when a slot frees up: the queue ahead, served at the measured hold time."""
        rounds = (self.waiting + 1) / self.max_concurrent
        return max(1, min(60_000, round(1000 * self._hold_s * max(rounds, 1.0))))

    async def _acquire(self, deadline: float | None, context) -> None:
        if self.running < self.max_concurrent and not self.waiting:
            self.running += 1
            return
        if self.waiting >= self.max_queued:
            self.rejected += 1
            if self.observer is not None:
                self.observer.on_reject()
            hint = self.retry_hint_ms()
            if context is not None:
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(hint)),))
            raise Overloaded(
                f"{self.name} overloaded: {self.running} requests running and {self.waiting} queued "
                f"(limits: --max-concurrent {self.max_concurrent}, --max-queued {self.max_queued}); "
                f"retry in about {hint} ms", hint)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except asyncio.TimeoutError:
            if not self._abandon(waiter):
                return  # the slot was handed over just as the deadline passed: keep it
            self._dropped("deadline")
            raise DeadlineExceeded(f"the request's deadline passed while queued for admission to {self.name}") from None
        except asyncio.CancelledError:
            if not self._abandon(waiter):
                self._release()  # handed over, but nobody will use it: pass it on
            # gRPC cancels a call whose deadline passed: count that as the deadline it is
            self._dropped("deadline" if deadline is not None and time.monotonic() >= deadline else "cancelled")
            raise

    def _dropped(self, reason: str) -> None:
        if self.observer is not None:
            self.observer.on_dropped(reason)

    def _abandon(self, waiter: asyncio.Future) -> bool:
        """Leave the queue; False if the waiter had already been handed a slot."""
        if waiter.done():
            return False
        waiter.cancel()
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        return True

    def _release(self) -> None:
        """Hand the slot straight to the first live waiter, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot changes hands: `running` stays the same
                return
        self.running -= 1
