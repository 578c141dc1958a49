"""Prefix blocks shared across replicas through a real Redis: one replica computes a prompt, another
fetches its blocks instead of prefilling them, and scores exactly as a plain forward does."""

from __future__ import annotations

import random

import pytest
import redis
import torch

from specdec.runtime.kv import SessionCaches
from specdec.runtime.prefix_cache import PrefixCache
from specdec.runtime.prefix_store import RedisPrefixStore
from specdec.runtime.snapshot_codec import SnapshotIdentity
from specdec.server.redis import RedisSettings, connect
from tests.reference import full_logits

BLOCK = 8


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def _identity(model, **changes) -> SnapshotIdentity:
    fields = dict(model="tiny", dtype="float64", fingerprint="fp", layers=model.config.num_hidden_layers)
    return SnapshotIdentity(**{**fields, **changes})


def _replica(model, redis_url: str, identity: SnapshotIdentity, min_tokens: int = 32) -> SessionCaches:
    store = RedisPrefixStore(connect(RedisSettings(url=redis_url, timeout_s=2)), "target", identity, ttl_s=60,
                             min_tokens=min_tokens)
    return SessionCaches(model, max_context=512, prefix_cache=PrefixCache(BLOCK), prefix_store=store)


def _score(model, caches: SessionCaches, sid: str, history: list[int]) -> int:
    logits, prefilled = caches.score(sid, history, [4, 5])
    torch.testing.assert_close(logits, full_logits(model, history + [4, 5])[len(history) - 1:], rtol=0, atol=1e-9)
    return prefilled


def test_a_fresh_replica_fetches_a_published_prefix_instead_of_prefilling_it(model, redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    rng, vocab = random.Random(0), model.config.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(100)]
    first = _replica(model, redis_url, _identity(model))
    assert _score(model, first, "a", system + [9, 9, 9]) == 102  # computed all of it
    first.prefix_store.flush(timeout=30)
    assert first.prefix_store.uploads == 1

    fresh = _replica(model, redis_url, _identity(model))
    prefilled = _score(model, fresh, "b", system + [7, 7, 7, 7, 7, 7])
    assert prefilled == 106 - 1 - 96  # 12 whole blocks (96 tokens) of the 106-token history came from Redis
    assert fresh.prefix_store.fetches == 1 and fresh.prefix_store.fetched_tokens == 96
    assert fresh.prefix.blocks >= 12
    # and they are shared locally from then on: a second session on the fresh replica hits them
    assert _score(model, fresh, "c", system + [8]) == 100 - 96
    assert fresh.prefix.hits >= 96


def test_another_model_or_a_short_prefix_is_not_fetched(model, redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    rng, vocab = random.Random(1), model.config.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(100)]
    first = _replica(model, redis_url, _identity(model))
    _score(model, first, "a", system)
    first.prefix_store.flush(timeout=30)

    other_dtype = _replica(model, redis_url, _identity(model, dtype="float32"))
    assert _score(model, other_dtype, "b", system + [1]) == 100  # other identity: other keys, prefilled
    assert other_dtype.prefix_store.fetches == 0

    picky = _replica(model, redis_url, _identity(model), min_tokens=200)  # fetching 96 tokens does not pay
    assert _score(model, picky, "c", system + [1]) == 100
    assert picky.prefix_store.fetches == 0


def test_redis_down_means_a_prefill_not_an_error(model):
    rng, vocab = random.Random(2), model.config.vocab_size
    history = [rng.randrange(3, vocab) for _ in range(80)]
    caches = _replica(model, "redis://127.0.0.1:1/0", _identity(model))
    assert _score(model, caches, "a", history) == 79
    caches.prefix_store.flush(timeout=30)  # the upload failed and was logged, nothing raised here
    assert caches.prefix_store.uploads == 0
