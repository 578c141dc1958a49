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


class LostReplyStore(InMemorySessionStore):
    """Applies a write, then fails as a store whose reply never came back does (a Redis that stalled
    past the caller's timeout and ran the command when it woke): `lose` names the call ("open": the
    write that opens a session; "delete")."""

    def __init__(self, lose: str) -> None:
        super().__init__()
        self.lose = lose

    async def save(self, state, new_tokens) -> None:
        opening = state.version == 0
        await super().save(state, new_tokens)
        if opening and self.lose == "open":
            raise Unavailable("session store unavailable (in memory, the reply was lost)")

    async def delete(self, session_id: str) -> bool:
        removed = await super().delete(session_id)
        if self.lose == "delete":
            raise Unavailable("session store unavailable (in memory, the reply was lost)")
        return removed


async def test_a_new_session_whose_opening_write_failed_but_landed_is_deleted_again():
    """Its id never reached the client, so nobody could resume or close it: without the cleanup it
    would sit in the store for the session TTL."""
    store, target, draft = LostReplyStore("open"), FakeTarget(REFERENCE), FakeDraft(REFERENCE)
    orch = orchestrator(store, target, draft, draft_length=4)
    with pytest.raises(Unavailable, match="reply was lost"):
        [c async for c in orch.generate(orch.parse(request(max_new_tokens=4)))]
    assert len(store._sessions) == 1 and orch._background  # landed; the cleanup is under way
    await settle(orch)
    assert store._sessions == {} and target.calls == [] and target.released == []
    store.lose = ""  # the next request opens its session as usual, and nothing deletes it
    chunks = [c async for c in orch.generate(orch.parse(request(max_new_tokens=4)))]
    await settle(orch)
    assert generated(chunks) == REFERENCE[START:START + 4] and list(store._sessions) == [chunks[0].session_id]


async def test_a_continued_session_whose_write_failed_is_not_deleted():
    store, target, draft = InMemorySessionStore(), FakeTarget(REFERENCE), FakeDraft(REFERENCE)
    orch = orchestrator(store, target, draft, draft_length=4)
    session = [c async for c in orch.generate(orch.parse(request(max_new_tokens=4)))][0].session_id
    store.down = True
    with pytest.raises(Unavailable):
        [c async for c in orch.generate(orch.parse(request(session_id=session, prompt=PROMPT)))]
    assert not orch._background
    store.down = False
    assert (await store.load(session)).tokens == REFERENCE[:START + 4]


async def test_a_close_whose_delete_failed_still_frees_the_caches():
    """The delete may have landed: the client's retry then finds no session and frees nothing, so the
    first attempt frees the caches before it deletes."""
    store, target, draft = LostReplyStore("delete"), FakeTarget(REFERENCE), FakeDraft(REFERENCE)
    orch = orchestrator(store, target, draft, draft_length=4)
    session = [c async for c in orch.generate(orch.parse(request(max_new_tokens=4)))][0].session_id
    with pytest.raises(Unavailable, match="reply was lost"):
        await orch.close_session(session)
    assert not orch._background  # freed in the call, not after it
    assert store._sessions == {} and target.released == [session] and draft.released == [session]
    store.lose = ""
    assert await orch.close_session(session) is False  # the retry: gone already, no second release
    assert target.released == [session] and draft.released == [session]


async def test_a_close_interrupted_before_its_delete_frees_the_caches_on_the_retry():
    """An orchestrator killed while it frees the caches (or before the delete) leaves the session in
    the store: the retry, on any orchestrator, frees them again and deletes it."""
    store, target, draft = InMemorySessionStore(), FakeTarget(REFERENCE), FakeDraft(REFERENCE)
    orch = orchestrator(store, target, draft, draft_length=4)
    session = [c async for c in orch.generate(orch.parse(request(max_new_tokens=4)))][0].session_id
    deleting = asyncio.Event()
    real_delete = store.delete

    async def killed(session_id: str) -> bool:
        deleting.set()
        await asyncio.Event().wait()  # never answers: the process is gone
        return await real_delete(session_id)

    store.delete = killed
    call = asyncio.ensure_future(orch.close_session(session))
    await deleting.wait()
    call.cancel()
    assert target.released == [session] and draft.released == [session]  # freed before the delete
    store.delete = real_delete
    assert await orch.close_session(session) is True
    assert store._sessions == {} and target.released == [session] * 2 and draft.released == [session] * 2


class HeldStore(InMemorySessionStore):
    """Holds every save of a round's tokens until `release` is set (`saving` tells one waits);
    `failing`: the n-th such save is held, then fails as an unreachable store does (writing nothing)
    while the others go through."""

    def __init__(self, failing: int = 0) -> None:
        super().__init__()
        self.release, self.saving = asyncio.Event(), asyncio.Event()
        self.round_saves, self.failing = 0, failing

    async def save(self, state, new_tokens) -> None:
        if new_tokens and state.generation.rounds:  # not the write that opens the session
            self.round_saves += 1
            if not self.failing or self.round_saves == self.failing:
                self.saving.set()
                await self.release.wait()
            if self.round_saves == self.failing:
                raise Unavailable("session store unavailable (in memory, failed this write)")
        await super().save(state, new_tokens)


@pytest.mark.parametrize("save_behind", [True, False])
async def test_the_next_round_is_sent_during_a_save_but_a_round_is_streamed_only_once_saved(save_behind):
    store, target = HeldStore(), FakeTarget(REFERENCE)
    orch = orchestrator(store, target, None, draft_length=0, save_behind=save_behind)
    stream = orch.generate(orch.parse(request(max_new_tokens=6)))
    await anext(stream)  # the header
    first = asyncio.ensure_future(anext(stream))
    await store.saving.wait()
    for _ in range(20):
        await asyncio.sleep(0)
    assert not first.done()  # the first round's chunk waits for its save
    # Behind the save, the second round's verify is already out (its history holds the first
    # round's token); without --save-behind it waits for the save.
    assert [n for n, _ in target.calls] == ([START, START + 1] if save_behind else [START])
    store.release.set()
    chunks = [await first] + [chunk async for chunk in stream]
    assert generated(chunks) == REFERENCE[START:START + 6] and "".join(c.text for c in chunks) == TEXT[:6]
    assert (await store.load(chunks[0].session_id)).tokens == REFERENCE[:START + 6]


async def test_a_round_whose_save_failed_is_never_streamed_and_the_round_sent_ahead_is_dropped():
    store, target = HeldStore(failing=3), FakeTarget(REFERENCE)
    orch = orchestrator(store, target, None, draft_length=0, decode_steps=1)
    stream = orch.generate(orch.parse(request(max_new_tokens=8)))
    session = (await anext(stream)).session_id
    held: list[int] = []

    async def consume() -> None:
        async for chunk in stream:
            held.extend(chunk.token_ids)

    consumer = asyncio.ensure_future(consume())
    await store.saving.wait()  # the third round's save
    for _ in range(100):
        await asyncio.sleep(0)
    assert len(target.calls) == 4  # the fourth round went out during it
    store.release.set()
    with pytest.raises(Unavailable):
        await consumer
    assert held == REFERENCE[START:START + 2]  # the third round's token was verified, never streamed
    await settle(orch)
    state = await store.load(session)
    assert state.tokens == REFERENCE[:START + 2] and state.generation.lease_until == 0  # nothing beyond the client
    rest = await resume(orch, session, len(held))
    assert held + generated(rest) == REFERENCE[START:START + 8]
