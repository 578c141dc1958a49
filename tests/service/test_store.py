"""The session stores: Redis against a real redis-server and against a real Redis Cluster (three
masters with replicas), and the in-memory one the unit tests use, held to the same semantics."""

from __future__ import annotations

import dataclasses
import json

import pytest
import pytest_asyncio
import redis

from orchestrator.store import GenerationRecord, RedisSessionStore, SessionState
from specdec.core.sampling import SamplingParams
from specdec.errors import Aborted, Unavailable
from specdec.keys import owed_releases_key, session_meta_key, session_tokens_key
from specdec.server.redis import RedisSettings
from tests.redis_ha import LocalCluster
from tests.unit.fakes import InMemorySessionStore


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def redis_store(request, kind: str, ttl_s: int) -> tuple[RedisSessionStore, redis.Redis | redis.RedisCluster]:
    """A store on a single Redis or on the cluster, and a plain client to look behind it."""
    if kind == "cluster":
        nodes = request.getfixturevalue("redis_cluster").nodes
        raw = redis.RedisCluster(startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in nodes])
        return RedisSessionStore(RedisSettings(cluster_nodes=tuple(nodes)), ttl_s, failover_s=5.0), raw
    url = request.getfixturevalue("redis_url")
    return RedisSessionStore(url, ttl_s), redis.Redis.from_url(url)


@pytest_asyncio.fixture(params=["redis", "cluster", "memory"], loop_scope="function")
async def store(request):
    store = InMemorySessionStore() if request.param == "memory" else redis_store(request, request.param, 60)[0]
    yield store
    await store.close()


@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_save_load_round_trip_with_ttl_and_hash_tag(request, kind):
    store, raw = redis_store(request, kind, 120)
    state = SessionState(session_id="rt", seed=42, sampling={"temperature": 0.5, "top_k": 0, "top_p": 0.9})
    state.tokens.extend([1, 2, 3])
    await store.save(state, [1, 2, 3])
    state.tokens.extend([4, 5])
    state.rounds = 1
    await store.save(state, [4, 5])
    assert state.version == 2
    loaded = await store.load("rt")
    assert loaded == state
    assert session_meta_key("rt") == "specdec:v1:{rt}:meta" and session_tokens_key("rt") == "specdec:v1:{rt}:tokens"
    assert 0 < raw.ttl(session_meta_key("rt")) <= 120 and 0 < raw.ttl(session_tokens_key("rt")) <= 120
    record = json.loads(raw.hget(session_meta_key("rt"), "state"))  # plain JSON, never pickle
    assert record["seed"] == 42 and "tokens" not in record
    assert await store.delete("rt") and await store.load("rt") is None
    await store.close()
    raw.close()


@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_a_retried_write_that_had_landed_is_not_a_conflict(request, kind):
    """A write whose reply was lost (a failover, a timeout) is sent again: the store recognises its
    own write instead of reporting a conflict, and applies it only once."""
    store, raw = redis_store(request, kind, 60)
    state = SessionState(session_id="again", seed=1, tokens=[1, 2])
    await store.save(state, [1, 2])
    state.version -= 1  # as if the reply of that write never came back
    await store.save(state, [])
    assert state.version == 1 and (await store.load("again")) == state
    state.version -= 1
    state.rounds = 7  # not the same write: a conflict
    with pytest.raises(Aborted):
        await store.save(state, [])
    assert await store.delete("again")
    await store.close()
    raw.close()


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


# -- request-constant sampling state: stored once per generation ----------------------------------------


BIG = SamplingParams(temperature=0.7, logit_bias=tuple((t, -5.0) for t in range(1000)), grammar_kind="regex",
                     grammar_text="(" + "|".join(f"word{i}" for i in range(4000)) + ")")


async def test_a_rounds_record_holds_no_logit_bias_or_grammar_however_large(store):
    """The record rewritten every round keeps the generation's logit_bias and grammar out: they are
    written once when the generation opens, so a round costs the same with or without them."""
    plain = SessionState(session_id="small", seed=1, tokens=[1])
    big = SessionState(session_id="big", seed=1, tokens=[1])
    plain.set_sampling(SamplingParams(temperature=0.7))
    big.set_sampling(BIG)
    for state in (plain, big):
        await store.save(state, [1])
    assert len(big.record()) < len(plain.record()) + 100  # the digest, not the constants
    loaded = await store.load("big")
    assert loaded.sampling_params() == BIG  # and they come back whole, on any replica
    loaded.tokens.append(2)
    loaded.rounds += 1
    await store.save(loaded, [2])  # a round: the constants are not written again, and stay
    assert (await store.load("big")).sampling_params() == BIG
    again = await store.load("big")
    again.set_sampling(SamplingParams(temperature=0.2))  # a new generation without them
    await store.save(again, [])
    reloaded = await store.load("big")
    assert reloaded.sampling_params() == SamplingParams(temperature=0.2) and reloaded.constants is None
    for sid in ("small", "big"):
        assert await store.delete(sid)


async def test_a_record_an_earlier_version_wrote_keeps_its_sampling_inline(store):
    """Rolling upgrade: a record whose sampling holds logit_bias and the grammar inline (as written
    before they moved out) loads with them."""
    old = SessionState(session_id="old", seed=1, tokens=[1], sampling=dataclasses.asdict(BIG))
    await store.save(old, [1])
    loaded = await store.load("old")
    assert loaded.sampling_params() == BIG
    assert await store.delete("old")


@pytest.mark.parametrize("kind", ["redis"])
async def test_the_constants_live_in_the_sessions_meta_hash_with_its_ttl(request, kind):
    store, raw = redis_store(request, kind, 120)
    state = SessionState(session_id="meta", seed=1, tokens=[1])
    state.set_sampling(BIG)
    await store.save(state, [1])
    meta = raw.hgetall(session_meta_key("meta"))
    assert set(meta) == {b"version", b"state", b"constants"} and len(meta[b"state"]) < 1000
    assert json.loads(meta[b"constants"])["grammar_text"] == BIG.grammar_text
    assert 0 < raw.ttl(session_meta_key("meta")) <= 120
    assert await store.delete("meta") and not raw.exists(session_meta_key("meta"))
    await store.close()
    raw.close()


# -- a Redis with a memory cap --------------------------------------------------------------------------


@pytest.fixture
def capped_redis(tmp_path):
    """A redis-server capped at 3 MB that evicts nothing when full (as the chart's)."""
    import subprocess

    from specdec.launcher import _wait_redis, free_port, redis_server_binary

    port = free_port()
    with open(tmp_path / "redis.log", "wb") as log:
        proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--maxmemory", "3mb", "--maxmemory-policy", "noeviction"],
                                stdout=log, stderr=subprocess.STDOUT)
    _wait_redis("127.0.0.1", port, proc, timeout_s=20)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


async def test_a_full_store_refuses_new_writes_clearly_and_loses_no_session(capped_redis):
    from prometheus_client import CollectorRegistry

    from orchestrator.store import SessionStoreMetrics
    from specdec.errors import ResourceExhausted

    store = RedisSessionStore(capped_redis, 60)
    registry = CollectorRegistry()
    registry.register(SessionStoreMetrics(store))
    saved = []
    with pytest.raises(ResourceExhausted, match=r"session store \(redis at .*\) is full: .*maxmemory"):
        for i in range(10_000):
            state = SessionState(session_id=f"s{i}", seed=1, tokens=list(range(4000)))
            await store.save(state, state.tokens)
            saved.append(state)
    assert len(saved) > 10
    for state in saved:  # every session written before is still whole: nothing was evicted to make room
        assert (await store.load(state.session_id)).tokens == state.tokens
    await store.refresh_memory()
    def value(name):
        return registry.get_sample_value(name, {"service": "orchestrator"})

    assert value("specdec_session_store_full_refusals_total") == 1
    assert value("specdec_session_store_max_bytes") == 3 * 1024 * 1024
    assert value("specdec_session_store_used_bytes") > 0.9 * 3 * 1024 * 1024
    assert await store.delete(saved[0].session_id)  # closing a session frees room, also when full
    await store.close()


async def test_owed_releases_round_trip(store):
    """A release one orchestrator could not deliver, read back by any other, gone once paid."""
    assert await store.owed_releases("10.0.0.7:50053", 64) == {}
    await store.owe_release("10.0.0.7:50053", "s1", True)
    await store.owe_release("10.0.0.7:50053", "s2", False)
    await store.owe_release("10.0.0.8:50053", "s3", True)
    assert await store.owed_releases("10.0.0.7:50053", 64) == {"s1": True, "s2": False}
    await store.paid_releases("10.0.0.7:50053", ["s1"])
    assert await store.owed_releases("10.0.0.7:50053", 64) == {"s2": False}
    assert await store.owed_releases("10.0.0.8:50053", 64) == {"s3": True}


@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_owed_releases_expire_and_a_hostile_entry_is_dropped_never_sent(request, kind):
    store, raw = redis_store(request, kind, 120)
    try:
        await store.owe_release("t:1", "s1", False)
        key = owed_releases_key("t:1")
        assert 0 < raw.ttl(key) <= 120
        raw.hset(key, mapping={"not a session id!": "1", "s2": "yes", "s3": "1"})
        assert await store.owed_releases("t:1", 64) == {"s1": False, "s3": True}
        assert sorted(raw.hkeys(key)) == [b"s1", b"s3"]  # the malformed ones are deleted
    finally:
        raw.delete(owed_releases_key("t:1"))
        await store.close()
