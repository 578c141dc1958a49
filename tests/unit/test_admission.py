"""Admission control: bounded slots, a bounded FIFO queue, immediate refusal with a retry hint."""

from __future__ import annotations

import asyncio
import time

import pytest

from specdec.errors import DeadlineExceeded
from specdec.server.admission import RETRY_AFTER_KEY, Admission, Overloaded, deadline_of, retry_after_ms


async def hold(admission: Admission, release: asyncio.Event, log: list, name: str, deadline=None) -> None:
    async with admission.slot(deadline):
        log.append(name)
        await release.wait()


async def test_slots_then_queue_then_immediate_refusal_with_a_retry_hint():
    admission = Admission(max_concurrent=2, max_queued=1)
    release, log = asyncio.Event(), []
    tasks = [asyncio.ensure_future(hold(admission, release, log, n)) for n in "abc"]
    await asyncio.sleep(0.01)
    assert log == ["a", "b"] and admission.running == 2 and admission.waiting == 1
    start = time.monotonic()
    with pytest.raises(Overloaded) as refused:
        async with admission.slot():
            pass
    assert time.monotonic() - start < 0.05  # refused at once, not queued
    assert refused.value.code == "RESOURCE_EXHAUSTED"
    assert retry_after_ms(refused.value) >= 1 and "--max-queued 1" in str(refused.value)
    assert admission.rejected == 1
    release.set()
    await asyncio.gather(*tasks)
    assert log == ["a", "b", "c"] and admission.running == 0 and admission.waiting == 0


async def test_queue_is_first_in_first_out():
    admission = Admission(max_concurrent=1, max_queued=5)
    gate, log = asyncio.Event(), []
    first = asyncio.ensure_future(hold(admission, gate, log, "first"))
    await asyncio.sleep(0.01)
    others = []
    for name in "abcd":
        others.append(asyncio.ensure_future(hold(admission, asyncio.Event(), log, name)))
        await asyncio.sleep(0.001)
    gate.set()
    await first
    for task, _ in zip(others, "abcd"):  # each holder of the slot is released in turn
        await asyncio.sleep(0.01)
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    assert log == ["first", "a", "b", "c", "d"]
    assert admission.running == 0


async def test_deadline_passes_while_queued():
    admission = Admission(max_concurrent=1, max_queued=1)
    gate = asyncio.Event()
    holder = asyncio.ensure_future(hold(admission, gate, [], "holder"))
    await asyncio.sleep(0.01)
    with pytest.raises(DeadlineExceeded, match="queued"):
        async with admission.slot(deadline=time.monotonic() + 0.05):
            pass
    assert admission.waiting == 0
    gate.set()
    await holder
    assert admission.running == 0


async def test_a_cancelled_waiter_gives_its_place_up():
    admission = Admission(max_concurrent=1, max_queued=1)
    gate, log = asyncio.Event(), []
    holder = asyncio.ensure_future(hold(admission, gate, log, "holder"))
    await asyncio.sleep(0.01)
    waiter = asyncio.ensure_future(hold(admission, asyncio.Event(), log, "waiter"))
    await asyncio.sleep(0.01)
    waiter.cancel()
    await asyncio.sleep(0.01)
    assert admission.waiting == 0
    nxt = asyncio.ensure_future(hold(admission, asyncio.Event(), log, "next"))  # the queue has room again
    await asyncio.sleep(0.01)
    gate.set()
    await holder
    await asyncio.sleep(0.01)
    assert log == ["holder", "next"] and admission.running == 1
    nxt.cancel()
    await asyncio.gather(nxt, return_exceptions=True)
    assert admission.running == 0


async def test_refusal_sets_the_retry_hint_as_trailing_metadata():
    class Context:
        trailing = ()

        def set_trailing_metadata(self, md):
            self.trailing = md

    admission = Admission(max_concurrent=1, max_queued=0)
    gate = asyncio.Event()
    holder = asyncio.ensure_future(hold(admission, gate, [], "holder"))
    await asyncio.sleep(0.01)
    context = Context()
    with pytest.raises(Overloaded) as refused:
        async with admission.slot(context=context):
            pass
    assert context.trailing == ((RETRY_AFTER_KEY, str(refused.value.retry_after_ms)),)
    gate.set()
    await holder


def test_limits_are_validated():
    with pytest.raises(ValueError):
        Admission(0, 1)
    with pytest.raises(ValueError):
        Admission(1, -1)


class _Context:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


def test_a_requests_own_time_limit_cuts_the_calls_deadline():
    """A request on a long-lived call carries its own limit (`timeout_ms`, from its arrival): its
    deadline is the earlier of that and the call's."""
    now = time.monotonic()
    assert deadline_of(_Context(None)) is None
    assert deadline_of(_Context(None), 250, arrived=now) == pytest.approx(now + 0.25)
    assert deadline_of(_Context(10.0), 250, arrived=now) == pytest.approx(now + 0.25)
    assert deadline_of(_Context(0.1), 250, arrived=now) == pytest.approx(now + 0.1, abs=0.05)
    assert deadline_of(_Context(5.0)) == pytest.approx(now + 5.0, abs=0.05)
