"""The KV caches' Redis sources through the batcher, with a real Redis: a fresh replica restores a
session's snapshot and fetches another replica's prefix blocks, an evicted session is snapshotted in
the background and restored elsewhere, and every row scores as a plain forward does. Throughout,
no Redis command is sent from the model thread or from inside `SessionCaches.score_batch`."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import torch
from redis.connection import AbstractConnection

from specdec.runtime.batching import BatchConfig, Batcher
from specdec.runtime.kv import ScoreRequest, SessionCaches
from specdec.runtime.prefix_cache import PrefixCache
from specdec.runtime.prefix_store import RedisPrefixStore
from specdec.runtime.snapshot_codec import SnapshotIdentity
from specdec.runtime.snapshot_store import RedisSnapshotStore, SnapshotPolicy
from specdec.server.model_service import save_snapshot
from specdec.server.redis import RedisSettings, connect
from tests.reference import OnePassJob as ScoreJob, full_logits

BLOCK = 8
MIN_TOKENS = 32




@pytest.fixture
def redis_calls(monkeypatch) -> list[tuple[int, bool]]:
    """Every command sent to any Redis while the test runs: (the sending thread, whether it was sent
    from inside `SessionCaches.score_batch`)."""
    calls: list[tuple[int, bool]] = []
    inside = threading.local()
    send, score_batch = AbstractConnection.send_packed_command, SessionCaches.score_batch

    def sent(self, command, check_health=True):
        calls.append((threading.get_ident(), getattr(inside, "depth", 0) > 0))
        return send(self, command, check_health)

    def watched(self, requests):
        inside.depth = getattr(inside, "depth", 0) + 1
        try:
            return score_batch(self, requests)
        finally:
            inside.depth -= 1

    monkeypatch.setattr(AbstractConnection, "send_packed_command", sent)
    monkeypatch.setattr(SessionCaches, "score_batch", watched)
    return calls


def replica(model, redis_url: str) -> SessionCaches:
    identity = SnapshotIdentity(model="tiny", dtype="float64", fingerprint="fp", layers=model.config.num_hidden_layers)
    client = connect(RedisSettings(url=redis_url, timeout_s=5))
    return SessionCaches(model, 512, snapshots=SnapshotPolicy(RedisSnapshotStore(client, "target", 60), identity,
                                                              MIN_TOKENS),
                         prefix_cache=PrefixCache(BLOCK),
                         prefix_store=RedisPrefixStore(client, "target", identity, 60, min_tokens=MIN_TOKENS))


async def scored(model, batcher: Batcher, session_id: str, history: list[int], new: list[int]) -> int:
    """Score through the batcher, check the logits against a plain forward; tokens re-prefilled."""
    result, _ = await batcher.run(ScoreJob(session_id, history, new))
    torch.testing.assert_close(result.logits, full_logits(model, history + new)[len(history) - 1:], rtol=0,
                               atol=1e-9)
    return result.prefilled


async def test_no_redis_call_runs_on_the_model_thread(tiny_model, redis_url, redis_calls):
    redis.Redis.from_url(redis_url).flushdb()
    rng, vocab = random.Random(0), tiny_model.config.vocab_size
    history = [rng.randrange(3, vocab) for _ in range(100)]
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
    model_ident = model_thread.submit(threading.get_ident).result()
    first, fresh, third = (replica(tiny_model, redis_url) for _ in range(3))
    batchers = [Batcher(caches, BatchConfig(4, 0.0), executor=model_thread) for caches in (first, fresh, third)]

    # One replica computes a session (publishing its prefix blocks) and snapshots it.
    assert await scored(tiny_model, batchers[0], "s", history, []) == 99
    assert (await save_snapshot(batchers[0], "s"))[0] == 100
    first.flush(timeout=30)

    # A fresh replica restores the session, and fetches the prefix for a new one.
    assert await scored(tiny_model, batchers[1], "s", history + [5], [6]) == 0
    assert fresh.snapshots is not None and fresh.snapshots.restores == 1
    assert await scored(tiny_model, batchers[1], "t", history[:96] + [7, 7, 7], []) == 98 - 96
    assert fresh.prefix_store is not None and fresh.prefix_store.fetched_tokens == 96

    # Out of room, it evicts the least recently used session, whose snapshot is written in the
    # background; when the session comes back, its fetch waits for that write and restores it.
    fresh.budget_bytes = fresh.used_bytes
    assert await scored(tiny_model, batchers[1], "u", [rng.randrange(3, vocab) for _ in range(40)], []) == 39
    assert "s" not in fresh.table.entries and fresh.evictions >= 1
    fresh.budget_bytes *= 4
    assert await scored(tiny_model, batchers[1], "s", history + [5, 6], [2]) == 0
    assert fresh.snapshots.saves == 1 and fresh.snapshots.restores == 2

    # A third replica restores what the background writer wrote.
    assert await scored(tiny_model, batchers[2], "s", history + [5, 6, 2], [3]) == 0
    assert third.snapshots is not None and third.snapshots.restores == 1

    for batcher in batchers:
        await batcher.close()
    model_thread.shutdown()
    assert redis_calls, "the test sent nothing to Redis: it tests nothing"
    assert not [call for call in redis_calls if call[0] == model_ident], "Redis called from the model thread"
    assert not [call for call in redis_calls if call[1]], "Redis called from inside score_batch"


async def test_a_failing_redis_means_a_prefill_not_an_error(tiny_model, redis_calls):
    """Nothing listens: the fetch fails on the I/O thread, the session is prefilled, the eviction's
    save fails in the background; the request never sees any of it."""
    caches = replica(tiny_model, "redis://127.0.0.1:1/0")
    batcher = Batcher(caches, BatchConfig(4, 0.0))
    rng, vocab = random.Random(1), tiny_model.config.vocab_size
    history = [rng.randrange(3, vocab) for _ in range(60)]
    assert await scored(tiny_model, batcher, "a", history, []) == 59
    caches.budget_bytes = caches.used_bytes
    assert await scored(tiny_model, batcher, "b", history[:40] + [9], []) >= 0
    caches.flush(timeout=30)
    assert caches.snapshots is not None and caches.snapshots.saves == 0 and caches.snapshots.restores == 0
    await batcher.close()


async def test_fetched_caches_waiting_for_their_pass_are_bounded_in_bytes(tiny_model, redis_url):
    """What a fetch decoded waits outside the KV budget until its session's pass: at most
    `max_staged_bytes` of it (`SessionCaches` gives half its budget); beyond, the oldest goes, and its
    session prefills."""
    redis.Redis.from_url(redis_url).flushdb()
    rng = random.Random(1)
    writer = replica(tiny_model, redis_url)
    batcher = Batcher(writer, BatchConfig(4, 0.0))
    histories = {sid: [rng.randrange(3, 100) for _ in range(60)] for sid in ("a", "b")}
    for sid, history in histories.items():
        await batcher.run(ScoreJob(sid, history, []))
        await save_snapshot(batcher, sid)
    await batcher.close()
    reader = replica(tiny_model, redis_url)
    sources = reader.sources
    assert sources is not None
    assert reader.prefetch(ScoreRequest("a", histories["a"] + [1], []))
    one = sources.staged_bytes
    assert one > 0
    sources.max_staged_bytes = one * 3 // 2
    assert reader.prefetch(ScoreRequest("b", histories["b"] + [1], []))
    assert sources.staged_bytes == one and sources.covers("a", histories["a"]) == 0  # "a" went
    assert sources.covers("b", histories["b"]) == len(histories["b"])
    sources.max_staged_bytes = one // 2  # one alone is too much: nothing is kept
    assert not reader.prefetch(ScoreRequest("a", histories["a"] + [1], []))
    assert sources.staged_bytes == 0
    reader.release("a")
