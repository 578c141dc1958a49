"""Parking the model thread's OpenMP workers while it is idle (`csrc/park.c`, `native.Parking`), and
the batcher parking them when it has nothing to run and waking them before it runs anything."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from specdec.core.sampling import SamplingParams
from specdec.runtime import native
from specdec.runtime.batching import BatchConfig, Batcher
from specdec.runtime.kv import SessionCaches
from specdec.runtime.verifier import Verifier

V = 100  # the tiny char tokenizer's vocabulary


@pytest.fixture(scope="module")
def lib():
    lib, why = native.library()
    if lib is None:
        pytest.skip(f"no native kernels here: {why}")
    return lib


def parked(lib, ticket: int, threads: int = 2, timeout_ms: int = 60_000) -> threading.Thread:
    thread = threading.Thread(target=lib.specdec_park, args=(ticket, threads, timeout_ms), daemon=True)
    thread.start()
    return thread


def test_a_park_sleeps_until_an_unpark_after_its_ticket(lib):
    park = parked(lib, lib.specdec_park_ticket())
    park.join(0.2)
    assert park.is_alive()
    lib.specdec_unpark()
    park.join(10)
    assert not park.is_alive()


def test_an_unpark_before_the_park_starts_is_not_missed(lib):
    ticket = lib.specdec_park_ticket()
    lib.specdec_unpark()  # the wake-up comes first: the park, handed over with the older ticket, returns at once
    park = parked(lib, ticket)
    park.join(10)
    assert not park.is_alive()


def test_a_park_ends_by_itself_at_its_timeout_and_refuses_bad_arguments(lib):
    start = time.monotonic()
    assert lib.specdec_park(lib.specdec_park_ticket(), 2, 50) == 0
    assert time.monotonic() - start >= 0.04
    assert lib.specdec_park(lib.specdec_park_ticket(), 0, 50) == native.KernelStatus.BAD_SHAPE
    assert lib.specdec_park(lib.specdec_park_ticket(), 2, -1) == native.KernelStatus.BAD_SHAPE


class Counted(native.Parking):
    """The real parking, counting its parks and unparks; a park lasts until woken (an hour at most)."""

    TIMEOUT_MS = 3_600_000

    def __init__(self, lib) -> None:
        super().__init__(lib)
        self.parks = self.unparks = 0

    def park(self, ticket: int) -> None:
        self.parks += 1
        super().park(ticket)

    def unpark(self) -> None:
        self.unparks += 1
        super().unpark()


async def test_the_batcher_parks_when_idle_and_wakes_the_thread_for_every_job_and_call(tiny_model, lib):
    """Each idle spell parks the model thread once; a job, a call on the model thread and closing
    each wake it (a park nobody woke would hold them up for an hour: the test would time out)."""
    caches = SessionCaches(tiny_model, 512)
    verifier = Verifier(caches, V)
    parking = Counted(lib)
    batcher = Batcher(caches, BatchConfig(max_batch=4, window_s=0), parking=parking)
    greedy = SamplingParams()
    for round_ in range(3):
        await asyncio.wait_for(batcher.run(verifier.job("s", [5, 6, 7 + round_], [], None, greedy, 0)), 30)
        await asyncio.sleep(0.05)  # idle: the thread parks
        assert parking.parks == round_ + 1 and parking.unparks == round_
    assert await asyncio.wait_for(batcher.call(threading.get_ident), 30) != threading.get_ident()
    assert parking.unparks == 3
    await asyncio.sleep(0.05)
    await batcher.close()
    assert parking.unparks == parking.parks
    batcher.executor.shutdown(wait=True)  # returns: nothing is left parked on the thread
