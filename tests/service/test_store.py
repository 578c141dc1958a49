"""The session stores: Redis against a real redis-server, and the in-memory one the unit tests
use, held to the same semantics."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
import redis

from orchestrator.store import GenerationRecord, RedisSessionStore, SessionState
from specdec.errors import Aborted, Unavailable
from specdec.server.keys import session_meta_key, session_tokens_key
from tests.unit.fakes import InMemorySessionStore


@pytest_asyncio.fixture(params=["redis", "memory"], loop_scope="function")
async def store(request):
    store = RedisSessionStore(request.getfixturevalue("redis_url"), ttl_s=60) if request.param == "redis" \
        else InMemorySessionStore()
    yield store
    await store.close()


async def test_save_load_round_trip_with_ttl_and_hash_tag(redis_url):
    store = RedisSessionStore(redis_url, ttl_s=120)
    state = SessionState(session_id="rt", seed=42, sampling={"temperature": 0.5, "top_k": 0, "top_p": 0.9})
    state.tokens.extend([1, 2, 3])
    await store.save(state, [1, 2, 3])
    state.tokens.extend([4, 5])
    state.rounds = 1
    await store.save(state, [4, 5])
    assert state.version == 2
    loaded = await store.load("rt")
    assert loaded == state
    raw = redis.Redis.from_url(redis_url)
    assert session_meta_key("rt") == "specdec:v1:{rt}:meta" and session_tokens_key("rt") == "specdec:v1:{rt}:tokens"
    assert 0 < raw.ttl(session_meta_key("rt")) <= 120 and 0 < raw.ttl(session_tokens_key("rt")) <= 120
    record = json.loads(raw.hget(session_meta_key("rt"), "state"))  # plain JSON, never pickle
    assert record["seed"] == 42 and "tokens" not in record
    assert await store.delete("rt") and await store.load("rt") is None
    await store.close()


async def test_a_stale_writer_is_refused(store):
    state = SessionState(session_id="race", seed=1, tokens=[1])
    await store.save(state, [1])
    a, b = await store.load("race"), await store.load("race")
    a.tokens.append(2)
    await store.save(a, [2])
    b.tokens.append(3)
    with pytest.raises(Aborted, match="changed by another request"):
        await store.save(b, [3])
    assert (await store.load("race")).tokens == [1, 2]  # never interleaved
    assert await store.delete("race")


async def test_a_loaded_state_is_a_copy(store):
    state = SessionState(session_id="copy", seed=3, tokens=[1, 2],
                         generation=GenerationRecord(id="g", start=2, prompt_tokens=2, max_new_tokens=4))
    await store.save(state, [1, 2])
    loaded = await store.load("copy")
    assert loaded == state and loaded is not state
    loaded.tokens.append(9)
    loaded.generation.rounds = 5
    state.tokens.append(8)
    again = await store.load("copy")  # neither the loaded copy nor the saved object is stored state
    assert again.tokens == [1, 2] and again.generation.rounds == 0 and again.version == 1
    assert await store.delete("copy") and not await store.delete("copy") and await store.load("copy") is None


async def test_the_prior_round_trips(store):
    await store.save_prior({"k": 3, "moments": [0.5, 1.0]})
    assert await store.load_prior() == {"k": 3, "moments": [0.5, 1.0]}
    await store.ping()


async def test_redis_down_is_unavailable_with_the_url():
    store = RedisSessionStore("redis://127.0.0.1:1/0", ttl_s=60)
    with pytest.raises(Unavailable, match="redis at redis://127.0.0.1:1/0"):
        await store.load("x")
    await store.close()
