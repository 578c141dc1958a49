"""The session store on a highly available Redis: a real Redis Cluster (three masters, one
replica each) and a real master + replica behind a Sentinel, with the master that holds the
session killed (SIGKILL) mid-use.

First the flags (one Redis mode at a time), then the store alone riding through a failover, then
a whole greedy generation of the tiny float64 pipeline riding through one: the client ends up
with exactly the target's own greedy output and Redis with exactly the tokens the client got.
"""

from __future__ import annotations

import signal
import sys
import time

import pytest
import redis
from pydantic import ValidationError

from orchestrator.config import OrchestratorConfig
from orchestrator.server import session_store
from orchestrator.store import RedisSessionStore, SessionState
from specdec.client import Client
from specdec.errors import Aborted
from specdec.keys import session_meta_key, session_tokens_key
from specdec.launcher import free_port
from specdec.runtime.models import load_tokenizer
from specdec.server.redis import RedisSettings
from tests.cluster import HOST, Cluster
from tests.redis_ha import LocalCluster, LocalSentinel
from tests.reference import Reference

PROMPT = "The quick brown fox"
MAX_NEW = 48
SLOW = ("--emulate-verify-ms", "40")  # a labelled simulation: the stream lasts long enough to be interrupted


# -- configuration ---------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (dict(redis_url="redis://h:1/0", redis_cluster_nodes="h:1"), "--redis-url and --redis-cluster-nodes"),
    (dict(redis_cluster_nodes="h:1", redis_sentinels="h:2", redis_sentinel_master="m"),
     "--redis-cluster-nodes and --redis-sentinels"),
    (dict(redis_sentinels="h:2"), "--redis-sentinels and --redis-sentinel-master go together"),
    (dict(redis_sentinel_master="m"), "--redis-sentinels and --redis-sentinel-master go together"),
    (dict(redis_cluster_nodes="h:1,nohost"), "HOST:PORT"),
    (dict(redis_tls=True), "a single Redis uses a rediss:// --redis-url"),
    (dict(redis_failover_s=5.0), "--redis-failover-s is for --redis-cluster-nodes or --redis-sentinels"),
])
def test_one_redis_mode_at_a_time(flags, message):
    with pytest.raises(ValidationError, match=message):
        OrchestratorConfig(**flags)


def test_the_flags_choose_the_client(tmp_path, capsys):
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    cluster = OrchestratorConfig.from_args(["--redis-cluster-nodes", "127.0.0.1:7000, 127.0.0.1:7001", "--redis-tls",
                                            "--redis-tls-ca", __file__, "--redis-password-file", str(password)])
    assert cluster.redis_mode == "cluster" and cluster.redis_addresses == [(HOST, 7000), (HOST, 7001)]
    assert cluster.session_redis().options() == {"password": "s3cret", "ssl": True, "ssl_ca_certs": __file__,
                                                 "socket_connect_timeout": 5.0, "socket_timeout": 10.0}
    assert isinstance(session_store(cluster).redis, redis.asyncio.RedisCluster)  # connects lazily
    sentinel = OrchestratorConfig(redis_sentinels="127.0.0.1:26379", redis_sentinel_master="mymaster")
    store = session_store(sentinel)
    assert sentinel.redis_mode == "sentinel" and "'mymaster' of sentinels 127.0.0.1:26379" in store.where
    assert store.failover_s == sentinel.redis_failover_s
    assert session_store(OrchestratorConfig()).failover_s == 0  # a single Redis has nothing to fail over to
    with pytest.raises(SystemExit):
        OrchestratorConfig.from_args(["--redis-url", "redis://127.0.0.1:6379/0", "--redis-sentinels", "h:1",
                                      "--redis-sentinel-master", "m"])
    assert "--redis-url and --redis-sentinels are different Redis modes" in capsys.readouterr().err


# -- the store alone --------------------------------------------------------------------------

@pytest.fixture
def redis_cluster(tmp_path):
    cluster = LocalCluster(tmp_path)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def redis_sentinel(tmp_path):
    sentinel = LocalSentinel(tmp_path)
    try:
        yield sentinel.start()
    finally:
        sentinel.stop()


async def rides_through(store: RedisSessionStore, kill_master) -> float:
    """Write a session, kill the master holding it, write again: the write waits for the promotion
    and lands once. Returns how long that write took."""
    state = SessionState(session_id="ha", seed=1, tokens=[1, 2, 3])
    await store.save(state, [1, 2, 3])
    kill_master()
    start = time.monotonic()
    state.tokens.append(4)
    await store.save(state, [4])
    took = time.monotonic() - start
    assert await store.load("ha") == state and state.version == 2
    await store.save_prior({"k": 3})
    assert await store.load_prior() == {"k": 3}
    assert await store.delete("ha")
    await store.close()
    return took


async def test_the_store_rides_through_a_cluster_failover(redis_cluster):
    store = RedisSessionStore(RedisSettings(cluster_nodes=tuple(redis_cluster.nodes)), 60, failover_s=30)
    victim = redis_cluster.master_for(session_meta_key("ha"))

    def kill_master() -> None:
        redis_cluster.wait_replicated(victim)
        redis_cluster.kill(victim)

    took = await rides_through(store, kill_master)
    assert 0.5 < took < 30  # it did wait for the replica's promotion
    assert redis_cluster.master_for(session_meta_key("ha")) != victim


async def test_the_store_follows_a_sentinel_failover(redis_sentinel):
    store = RedisSessionStore(RedisSettings(sentinels=((HOST, redis_sentinel.sentinel),),
                                            sentinel_master=LocalSentinel.NAME), 60, failover_s=30)
    victim = redis_sentinel.master

    def kill_master() -> None:
        redis_sentinel.wait_replicated(victim)
        redis_sentinel.kill(victim)

    took = await rides_through(store, kill_master)
    assert 0.5 < took < 30
    assert redis_sentinel.master_port() == redis_sentinel.replica


async def test_a_write_the_failover_lost_is_refused_never_overwritten(redis_sentinel):
    """Asynchronous replication: the master acknowledges a write its replica never gets, dies, and
    the replica is promoted. The session is back at the older version; the writer that still
    holds the lost one is refused (ABORTED), so nothing is appended to a history it did not read."""
    ha = redis_sentinel
    store = RedisSessionStore(RedisSettings(sentinels=((HOST, ha.sentinel),), sentinel_master=ha.NAME), 60,
                              failover_s=30)
    state = SessionState(session_id="lost", seed=1, tokens=[1, 2])
    await store.save(state, [1, 2])  # version 1: on both
    ha.wait_replicated(ha.master)
    ha.signal(ha.replica, signal.SIGSTOP)  # the replica hears nothing more from its master
    ha.client(ha.master).client_kill_filter(_type="replica")
    state.tokens.append(3)
    await store.save(state, [3])  # version 2: acknowledged by the master alone
    ha.kill(ha.master)
    ha.signal(ha.replica, signal.SIGCONT)
    assert ha.wait_failover(ha.master) == ha.replica
    again = await store.load("lost")
    assert (again.version, again.tokens) == (1, [1, 2])  # what the promoted replica had
    state.tokens.append(4)
    with pytest.raises(Aborted, match="changed by another request"):
        await store.save(state, [4])
    again.tokens.append(5)
    await store.save(again, [5])  # a writer that read the surviving version goes on: version 2 again
    assert (await store.load("lost")).tokens == [1, 2, 5]
    await store.close()


# -- a whole generation -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def expected(tiny_models) -> list[int]:
    return Reference(str(tiny_models["target"])).greedy(PROMPT, MAX_NEW)


def store_flags(ha: LocalCluster | LocalSentinel) -> list[str]:
    if isinstance(ha, LocalCluster):
        return ["--redis-cluster-nodes", ",".join(f"{h}:{p}" for h, p in ha.nodes)]
    return ["--redis-sentinels", f"{HOST}:{ha.sentinel}", "--redis-sentinel-master", ha.NAME]


def stored_tokens(ha: LocalCluster | LocalSentinel, session: str) -> list[int]:
    key = session_tokens_key(session)
    return [int(t) for t in ha.client(ha.master_for(key)).lrange(key, 0, -1)]


@pytest.mark.parametrize("mode", ["cluster", "sentinel"])
def test_a_generation_rides_through_a_redis_failover(mode, tiny_models, tmp_path, expected):
    (tmp_path / "redis").mkdir()
    ha = LocalCluster(tmp_path / "redis") if mode == "cluster" else LocalSentinel(tmp_path / "redis")
    procs = Cluster(tmp_path, tiny_models)
    try:
        ha.start()
        target, draft = procs.target("target", *SLOW), procs.draft("draft", "poor_draft")
        port = free_port()
        cmd = [sys.executable, "-m", "orchestrator", "--host", HOST, "--port", str(port),
               "--target", target, "--draft", draft, "--model", str(tiny_models["target"]), "--draft-length", "4",
               "--redis-failover-s", "30", *store_flags(ha)]
        address = procs.start("orchestrator", cmd, f"{HOST}:{port}")
        tokens, victim = [], None
        with Client(address) as client:
            stream = client.stream(PROMPT, max_new_tokens=MAX_NEW, draft_length=4, timeout=120)
            for chunk in stream:
                tokens.extend(chunk.token_ids)
                if victim is None and len(tokens) >= 4:
                    key = session_meta_key(stream.session_id)
                    victim = ha.master_for(key)
                    ha.kill(victim)
                    killed = time.monotonic()
            rode = time.monotonic() - killed
        assert tokens == expected  # nothing lost, nothing duplicated
        assert stream.resumes == 0  # the stream itself rode through: the store waited for the promotion
        assert rode > 1.0  # the failover happened while the generation ran (the node timeout is 1 s)
        prompt_ids = list(load_tokenizer(str(tiny_models["target"]))(PROMPT)["input_ids"])
        assert stored_tokens(ha, stream.session_id) == prompt_ids + tokens
    finally:
        procs.stop()
        ha.stop()
