"""Sessions on the orchestrator's request path, over fake pools and the in-memory store: resume,
takeover, cancellation, failures, closing."""

from __future__ import annotations

import asyncio

import pytest

from specdec.errors import Aborted, InvalidArgument, NotFound, Unavailable
from specdec.v1 import orchestrator_pb2 as pb
from tests.unit.fakes import FakeDraft, FakeTarget, InMemorySessionStore, orchestrator
from tests.unit.test_orchestrator_loop import PROMPT, REFERENCE, START, TEXT, generated, request


def setup(**config):
    store, target, draft = InMemorySessionStore(), FakeTarget(REFERENCE), FakeDraft(REFERENCE)
    return store, target, draft, orchestrator(store, target, draft, **{"draft_length": 4, **config})


async def settle(orch) -> None:
    """Wait for the background cleanups and snapshots."""
    while orch._background:
        await asyncio.gather(*orch._background)


async def resume(orch, session: str, held: int, principal: str = "") -> list[pb.GenerateChunk]:
    spec = orch.parse(pb.GenerateRequest(session_id=session, resume_from=held), principal=principal)
    return [chunk async for chunk in orch.generate(spec)]


async def test_a_stream_closed_at_a_yield_frees_the_lease_and_caches_and_resumes_with_the_rest():
    store, target, draft, orch = setup()
    stream = orch.generate(orch.parse(request(max_new_tokens=30)))
    session = (await anext(stream)).session_id
    held = [t for _ in range(2) for t in (await anext(stream)).token_ids]  # 1, then 5 tokens
    await stream.aclose()  # as gRPC does when the client leaves at a write
    await settle(orch)
    gen = (await store.load(session)).generation
    assert gen.lease_until == 0 and gen.finish == 0  # free, and resumable
    assert target.released == [session] and draft.released == [session]
    rest = await resume(orch, session, len(held))
    assert rest[0].offset == len(held) and not rest[0].token_ids  # the header: nothing to catch up
    assert held + generated(rest) == REFERENCE[START:START + 30]
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and rest[-1].stats.completion_tokens == 30
    assert "".join(c.text for c in rest) == TEXT[len(held):30]


async def test_a_resume_sends_what_the_client_lacks_then_goes_on():
    store, target, draft, orch = setup()
    stream = orch.generate(orch.parse(request(max_new_tokens=20)))
    session = (await anext(stream)).session_id
    for _ in range(2):
        await anext(stream)
    await stream.aclose()
    await settle(orch)
    rest = await resume(orch, session, 3)  # the client lost the last 3 of 6 tokens
    assert list(rest[1].token_ids) == REFERENCE[START + 3:START + 6] and rest[1].offset == 3
    assert rest[1].text == TEXT[3:6]
    assert generated(rest) == REFERENCE[START + 3:START + 20]
    assert [c.offset for c in rest[2:]] == [6 + sum(len(c.token_ids) for c in rest[2:i]) for i in range(2, len(rest))]


async def test_resuming_a_finished_generation_sends_its_end_only():
    store, target, draft, orch = setup()
    chunks = [c async for c in orch.generate(orch.parse(request(max_new_tokens=8)))]
    session, calls = chunks[0].session_id, len(target.calls)
    again = await resume(orch, session, 8)
    assert generated(again) == [] and again[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert again[-1].stats.completion_tokens == 8 and len(target.calls) == calls  # no round ran
    tail = await resume(orch, session, 5)
    assert generated(tail) == REFERENCE[START + 5:START + 8] and tail[-1].text == TEXT[5:8]
    with pytest.raises(InvalidArgument, match="has produced 8 tokens"):
        await resume(orch, session, 9)
    with pytest.raises(NotFound):  # another identity's session looks missing
        await resume(orch, session, 8, principal="mallory")
    with pytest.raises(InvalidArgument, match="leave prompt"):
        orch.parse(pb.GenerateRequest(session_id=session, resume_from=1, prompt="x"))


async def test_a_resume_takes_the_generation_over_and_the_displaced_request_stops_at_its_next_write():
    store, target, draft, orch = setup()
    stream = orch.generate(orch.parse(request(max_new_tokens=20)))
    session = (await anext(stream)).session_id
    held = list((await anext(stream)).token_ids)
    # The client moved: a second request takes the generation over and is mid-way when the first wakes.
    taker = orch.generate(orch.parse(pb.GenerateRequest(session_id=session, resume_from=len(held))))
    taken = [await anext(taker), await anext(taker)]
    with pytest.raises(Aborted, match="changed by another request"):
        await anext(stream)
    await settle(orch)
    assert (await store.load(session)).generation.leased()  # the new owner's lease stands
    assert target.released == [] and draft.released == []  # and so do the caches it uses
    rest = taken + [c async for c in taker]
    assert held + generated(rest) == REFERENCE[START:START + 20]
    state = await store.load(session)
    assert state.generation.finish == pb.FINISH_REASON_LENGTH and state.tokens == REFERENCE[:START + 20]


async def test_a_displaced_request_that_is_closed_leaves_the_new_owner_alone():
    store, target, draft, orch = setup()
    stream = orch.generate(orch.parse(request(max_new_tokens=20)))
    session = (await anext(stream)).session_id
    held = list((await anext(stream)).token_ids)
    taker = orch.generate(orch.parse(pb.GenerateRequest(session_id=session, resume_from=len(held))))
    taken = [await anext(taker), await anext(taker)]
    await stream.aclose()  # the first client leaves after the takeover
    await settle(orch)
    assert (await store.load(session)).generation.leased()
    assert target.released == [] and draft.released == []
    assert held + generated(taken + [c async for c in taker]) == REFERENCE[START:START + 20]


async def test_cancelling_a_request_mid_round_frees_the_lease_and_releases_the_caches():
    store, target, draft, orch = setup()
    target.gate = asyncio.Event()  # every verify waits
    stream = orch.generate(orch.parse(request(max_new_tokens=20)))
    session = (await anext(stream)).session_id
    waiting = asyncio.ensure_future(anext(stream))
    for _ in range(100):  # until its first round is waiting for the target
        if target.calls:
            break
        await asyncio.sleep(0)
    waiting.cancel()  # the client went away: the handler's task is cancelled at an await
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await settle(orch)
    gen = (await store.load(session)).generation
    assert gen.lease_until == 0 and gen.finish == 0 and orch.admission is not None
    assert target.released == [session] and draft.released == [session]
    assert orch.metrics.registry.get_sample_value(
        "specdec_request_success_total", {"finish_reason": "cancelled", "service": "orchestrator"}) == 1


async def test_a_failed_round_frees_the_lease_but_keeps_the_caches():
    store, target, draft, orch = setup()
    stream = orch.generate(orch.parse(request(max_new_tokens=20)))
    session = (await anext(stream)).session_id
    await anext(stream)
    target.error = Unavailable("no healthy target replica")
    with pytest.raises(Unavailable):
        await anext(stream)
    gen = (await store.load(session)).generation
    assert gen.lease_until == 0 and gen.finish == 0
    assert target.released == [] and draft.released == []
    target.error = None
    rest = await resume(orch, session, 1)
    assert generated(rest) == REFERENCE[START + 1:START + 20]


async def test_a_failure_with_the_store_down_raises_the_failure_itself():
    store, target, draft, orch = setup()
    stream = orch.generate(orch.parse(request(max_new_tokens=20)))
    await anext(stream)
    target.error, store.down = Unavailable("no healthy target replica"), True
    with pytest.raises(Unavailable, match="no healthy target replica"):  # not the store's error
        await anext(stream)


async def test_closing_a_session_deletes_it_and_releases_its_caches_for_its_owner_only():
    store, target, draft, orch = setup(kv_snapshots=True)
    chunks = [c async for c in orch.generate(orch.parse(request(max_new_tokens=5), principal="alice"))]
    session = chunks[0].session_id
    await settle(orch)
    assert target.snapshots == [session] and draft.snapshots == [session]  # --kv-snapshots, after the end
    assert await orch.close_session(session, principal="bob") is False
    assert target.released == [] and await store.load(session) is not None
    assert await orch.close_session(session, principal="alice") is True
    assert target.released == [session] and draft.released == [session] and await store.load(session) is None
    assert await orch.close_session(session, principal="alice") is False
    with pytest.raises(NotFound):
        [c async for c in orch.generate(orch.parse(request(session_id=session, prompt=PROMPT), principal="alice"))]


def test_a_record_from_another_version_loads_with_known_fields_only():
    """Rolling upgrade: a field a newer replica wrote is ignored, one an older replica never wrote
    takes its default; the session continues either way."""
    import json

    from orchestrator.store import GenerationRecord, SessionState

    state = SessionState(session_id="s", seed=3, tokens=[1, 2, 3],
                         generation=GenerationRecord(id="g", start=2, prompt_tokens=2, max_new_tokens=4, finish=1))
    record = json.loads(state.record())
    record["from_the_future"] = 1
    record["generation"]["also_new"] = [1]
    del record["generation"]["share_output"]  # as an older replica wrote it
    loaded = SessionState.from_record("s", 7, [1, 2, 3], json.dumps(record).encode())
    assert loaded.seed == 3 and loaded.version == 7 and loaded.generation.finish == 1
    assert loaded.generation.share_output is True


async def test_a_resume_decodes_the_generation_so_far_off_the_event_loop():
    """A resume replays every token the client holds through the detokenizer (and names every
    log-probability it resends): work that grows with the generation runs in a worker thread."""
    import threading

    store, target, draft, orch = setup()
    chunks = [c async for c in orch.generate(orch.parse(request(max_new_tokens=20)))]
    session = chunks[0].session_id
    threads: list[str] = []
    decode = orch.tokenizer.decode

    def recording(ids, **kwargs):
        threads.append(threading.current_thread().name)
        return decode(ids, **kwargs)

    orch.tokenizer.decode = recording
    rest = await resume(orch, session, 12)
    assert generated(rest) == REFERENCE[START + 12:START + 20] and rest[-1].text == TEXT[12:20]
    assert threads and threading.main_thread().name not in threads


async def test_closing_a_session_that_does_not_exist_sends_no_release():
    """CloseSession fans a Release out to every replica of both pools: only for a session that exists."""
    store, target, draft, orch = setup()
    assert await orch.close_session("f" * 32) is False
    assert target.released == [] and draft.released == []
    chunks = [c async for c in orch.generate(orch.parse(request(max_new_tokens=4)))]
    session = chunks[0].session_id
    assert await orch.close_session(session, principal="mallory") is False  # another's: as if missing
    assert target.released == [] and draft.released == []
    assert await orch.close_session(session) is True
    assert target.released == [session] and draft.released == [session]
