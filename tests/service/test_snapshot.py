"""KV snapshots: a restored cache continues exactly like the original, through a real Redis."""

from __future__ import annotations

import pytest
import redis
import torch
from transformers import DynamicCache

from specdec.errors import FailedPrecondition
from specdec.keys import snapshot_chunk_key, snapshot_meta_key
from specdec.runtime.models import load_model
from specdec.runtime.snapshot_codec import SnapshotIdentity, decode, encode
from specdec.runtime.snapshot_store import RedisSnapshotStore


@pytest.fixture(scope="module")
def model(tiny_models):
    return load_model(str(tiny_models["target"]), dtype="float64", progress=False).model


def _identity(lm, **changes) -> SnapshotIdentity:
    fields = dict(model="tiny", dtype="float64", fingerprint="fp", layers=lm.config.num_hidden_layers)
    return SnapshotIdentity(**{**fields, **changes})


def _prefill(model, tokens: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.tensor([tokens]), cache=cache, use_cache=True)
    return cache


def _next_logits(model, cache: DynamicCache, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens]), cache=cache, use_cache=True).logits[0]


def test_restored_cache_continues_like_the_original(model):
    history = list(range(5, 45))
    blob = encode(_prefill(model, history), history, _identity(model))
    tokens, restored = decode(blob, _identity(model), model.config)
    assert tokens == history
    assert restored.get_seq_length() == len(history)
    original = _next_logits(model, _prefill(model, history), [50, 51, 52])
    assert torch.equal(_next_logits(model, restored, [50, 51, 52]), original)


@pytest.mark.parametrize("field,value", [("model", "other"), ("dtype", "float32"), ("fingerprint", "x")])
def test_snapshot_of_another_model_is_refused(model, field, value):
    history = [5, 6, 7]
    blob = encode(_prefill(model, history), history, _identity(model))
    with pytest.raises(FailedPrecondition, match=f"{field} is"):
        decode(blob, _identity(model, **{field: value}), model.config)


def test_cache_that_does_not_cover_the_tokens_is_refused(model):
    with pytest.raises(ValueError, match="covers 3 tokens, not 4"):
        encode(_prefill(model, [5, 6, 7]), [5, 6, 7, 8], _identity(model))


def test_store_chunks_replaces_and_deletes(model, redis_url):
    store = RedisSnapshotStore(redis.Redis.from_url(redis_url), "target", ttl_s=120, chunk_bytes=1000)
    r = redis.Redis.from_url(redis_url)
    long_history = list(range(5, 65))
    blob = encode(_prefill(model, long_history), long_history, _identity(model))
    store.put("s1", blob, len(long_history))
    chunks = int(r.hget(snapshot_meta_key("s1", "target"), "chunks"))
    assert chunks == -(-len(blob) // 1000) > 1
    assert store.get("s1") == blob and store.tokens("s1") == len(long_history)
    assert 0 < r.ttl(snapshot_meta_key("s1", "target")) <= 120
    assert 0 < r.ttl(snapshot_chunk_key("s1", "target", 0)) <= 120
    short = encode(_prefill(model, [5, 6]), [5, 6], _identity(model))
    store.put("s1", short, 2)  # a shorter snapshot leaves no stale chunks behind
    assert store.get("s1") == short
    assert not r.exists(snapshot_chunk_key("s1", "target", chunks - 1))
    assert not r.keys("*tmp-*")
    store.delete("s1")
    assert store.get("s1") is None and not r.keys("*{s1}*")
