"""Shared prefix blocks and the KV byte budget of `SessionCaches`, in float64 against plain transformers."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.errors import ResourceExhausted
from specdec.runtime import packed
from specdec.runtime.engine_options import EngineOptions
from specdec.runtime.kv import ScoreRequest, SessionCaches
from specdec.runtime.prefix_cache import PrefixCache
from specdec.runtime.snapshot_codec import SnapshotIdentity, decode_layers, encode_layers
from tests.reference import full_logits

BLOCK = 8


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _check(model, caches: SessionCaches, sid: str, history: list[int], new: list[int]) -> int:
    logits, prefilled = caches.score(sid, history, new)
    expected = full_logits(model, history + new)[len(history) - 1:]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-9)
    return prefilled


def _caches(model, **kwargs) -> SessionCaches:
    return SessionCaches(model, max_context=512, prefix_cache=PrefixCache(BLOCK), **kwargs)


def test_a_second_session_views_the_first_ones_prefix_and_computes_only_the_rest(model):
    rng, vocab = random.Random(0), model.config.vocab_size
    caches = _caches(model)
    system = _tokens(rng, 100, vocab)
    first = system + _tokens(rng, 20, vocab)
    assert _check(model, caches, "a", first, _tokens(rng, 3, vocab)) == len(first) - 1
    prefix = caches.prefix
    assert prefix.blocks == len(first) // BLOCK  # the history's whole blocks are published
    assert caches.table.entries["a"].cache.offset == 120  # and the first session now views them too

    second = system + _tokens(rng, 30, vocab)
    prefilled = _check(model, caches, "b", second, _tokens(rng, 4, vocab))
    assert prefilled == len(second) - 1 - 96  # the 12 whole blocks of the shared 100 tokens were not computed
    assert prefix.hits == 96 and prefix.queries == len(first) - 1 + len(second) - 1
    a, b = caches.table.entries["a"].cache, caches.table.entries["b"].cache
    assert b.prefix[0].data_ptr() == a.prefix[0].data_ptr()  # the same storage: shared by reference
    assert prefix.shared_blocks >= 12

    # both go on decoding correctly, with their own blocks after the shared ones
    for sid, history in (("a", first), ("b", second)):
        history = history + [5]
        _check(model, caches, sid, history, _tokens(rng, 2, vocab))


def test_sessions_publishing_the_same_prompt_in_one_pass_end_up_on_one_copy(model):
    rng, vocab = random.Random(1), model.config.vocab_size
    caches = _caches(model)
    prompt = _tokens(rng, 70, vocab)
    requests = [ScoreRequest(sid, prompt, _tokens(rng, 2, vocab)) for sid in ("a", "b", "c")]
    for request, result in zip(requests, caches.score_batch(requests)):
        expected = full_logits(model, request.history + request.new_tokens)[len(request.history) - 1:]
        torch.testing.assert_close(result.logits, expected, rtol=0, atol=1e-9)
    views = [caches.table.entries[sid].cache.prefix[0].data_ptr() for sid in "abc"]
    assert len(set(views)) == 1
    assert caches.prefix.shared_blocks == 64 // BLOCK


def test_a_history_that_diverges_inside_the_shared_prefix_starts_over_and_stays_exact(model):
    rng, vocab = random.Random(2), model.config.vocab_size
    caches = _caches(model)
    prompt = _tokens(rng, 50, vocab)
    _check(model, caches, "a", prompt, [])
    _check(model, caches, "b", prompt + [7], [])
    assert caches.table.entries["b"].cache.offset == 48
    changed = prompt[:20] + _tokens(rng, 30, vocab)  # the same session, a history that differs at 20
    _check(model, caches, "b", changed, _tokens(rng, 2, vocab))
    assert caches.rollback("a", 10) == 0  # cut inside the prefix: nothing of the cache is left
    _check(model, caches, "a", prompt[:30], [])


def test_unused_prefixes_go_before_idle_sessions_and_nothing_leaks(model):
    rng, vocab = random.Random(3), model.config.vocab_size
    caches = _caches(model)
    for sid in "abc":
        _check(model, caches, sid, _tokens(rng, 90, vocab), [])
    used = caches.used_bytes
    assert used == caches.table.own_bytes + caches.prefix.nbytes > 0
    for sid in "abc":
        assert caches.release(sid)
    assert caches.table.own_bytes == 0 and caches.prefix.nbytes > 0  # unused prefixes stay until room is needed
    assert len(caches.prefix.idle()) == 3
    oldest = caches.prefix.idle()[0]
    caches.budget_bytes = caches.prefix.nbytes  # full: a new session needs room
    _check(model, caches, "d", _tokens(rng, 40, vocab), [])
    assert oldest not in caches.prefix.idle() and caches.prefix.idle()  # the LRU prefix went, not all
    assert caches.used_bytes <= caches.budget_bytes and len(caches) == 1


def test_a_full_budget_evicts_idle_sessions_lru_then_refuses_and_keeps_the_others(model):
    rng, vocab = random.Random(4), model.config.vocab_size
    caches = SessionCaches(model, max_context=512)  # no prefix sharing
    _check(model, caches, "old", _tokens(rng, 100, vocab), [])
    _check(model, caches, "new", _tokens(rng, 100, vocab), [])
    one = caches.table.entries["old"].cache.nbytes
    caches.budget_bytes = caches.used_bytes  # exactly full
    _check(model, caches, "third", _tokens(rng, 60, vocab), [])  # evicts the least recently used
    assert "old" not in caches.table.entries and "new" in caches.table.entries and caches.evictions == 1
    assert caches.used_bytes <= caches.budget_bytes

    # a pass whose own sessions fill the budget: the row that does not fit is refused, the rest served
    caches.budget_bytes = caches.used_bytes + one // 4
    requests = [ScoreRequest("new", caches.table.entries["new"].tokens + [3], [4, 5]),
                ScoreRequest("third", caches.table.entries["third"].tokens + [3], []),
                ScoreRequest("huge", _tokens(rng, 400, vocab), [])]
    results = caches.score_batch(requests)
    assert not isinstance(results[0], Exception) and not isinstance(results[1], Exception)
    assert isinstance(results[2], ResourceExhausted) and "--kv-cache-bytes" in str(results[2])
    assert "huge" not in caches.table.entries  # a refused new session leaves nothing behind
    assert set(caches.table.entries) == {"new", "third"}


def test_growth_stops_doubling_at_the_budget(model):
    rng, vocab = random.Random(5), model.config.vocab_size
    caches = SessionCaches(model, max_context=512)
    _check(model, caches, "a", _tokens(rng, 70, vocab), [])
    per_position = caches.table.entries["a"].cache.bytes_for(1)
    caches.budget_bytes = caches.used_bytes + 10 * per_position  # doubling 70 -> 140 would not fit
    history = caches.table.entries["a"].tokens + _tokens(rng, 75 - len(caches.table.entries["a"].tokens), vocab)
    _check(model, caches, "a", history, [])
    assert caches.used_bytes <= caches.budget_bytes


def test_a_snapshot_of_a_session_with_a_shared_prefix_holds_every_position(model):
    rng, vocab = random.Random(6), model.config.vocab_size
    caches = _caches(model)
    prompt = _tokens(rng, 64, vocab)
    _check(model, caches, "a", prompt, [])
    history = prompt + _tokens(rng, 10, vocab)
    _check(model, caches, "b", history, [])
    entry = caches.table.entries["b"]
    assert entry.cache.offset > 0
    identity = SnapshotIdentity("tiny", "float64", "x", model.config.num_hidden_layers)
    layers = [(layer.keys, layer.values) for layer in entry.cache.layers]
    tokens, restored = decode_layers(encode_layers(layers, entry.tokens, identity), identity)
    assert tokens == entry.tokens and restored[0][0].shape[-2] == len(tokens)
    fresh = SessionCaches(model, max_context=512)
    fresh_entry = fresh._new_cache(capacity=len(tokens))
    fresh_entry.load(restored, len(tokens))
    torch.testing.assert_close(fresh_entry.joined(0, len(tokens))[0], entry.cache.joined(0, len(tokens))[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_attention_over_segments_equals_attention_over_one_tensor(dtype):
    gen = torch.Generator().manual_seed(0)
    hkv, g, n, past, d = 2, 3, 5, 37, 8
    q = torch.randn(hkv, g, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(hkv, past + n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    whole = packed.attend(q, [(k, v)], past, d**-0.5)
    cuts = [0, 16, 24, past + n]
    segments = [(k[:, a:b].to(dtype), v[:, a:b].to(dtype)) for a, b in zip(cuts, cuts[1:])]
    split = packed.attend(q.to(dtype), segments, past, d**-0.5)
    tolerance = 1e-12 if dtype == torch.float64 else 3e-2
    torch.testing.assert_close(split.double(), whole, rtol=0, atol=tolerance)


@pytest.mark.parametrize("fields,message", [
    (dict(proposer="ngram", kv_cache_bytes=1 << 20), "--kv-cache-bytes configure a draft model's KV caches"),
    (dict(proposer="suffix", prefill_chunk_tokens=64, prepack_weights="off", compile="on", kernels="native"),
     "--prefill-chunk-tokens, --prepack-weights, --compile, --kernels"),
    (dict(prefix_cache=False, prefix_block_tokens=16), "--prefix-block-tokens sizes the prefix cache's blocks"),
    (dict(prefix_ttl_s=60), "--prefix-ttl-s configure sharing prefixes through Redis"),
    (dict(prefix_cache=False, prefix_redis_url="redis://127.0.0.1:1/0"), "drop --no-prefix-cache"),
])
def test_engine_options_that_would_have_no_effect_are_refused(fields, message):
    from pydantic import ValidationError

    from draft_service.config import DraftConfig

    with pytest.raises(ValidationError, match=message):
        DraftConfig(**{"proposer": "model", **fields})
    DraftConfig(proposer="model", kv_cache_bytes=1 << 20, prefix_block_tokens=16, prefill_chunk_tokens=64,
                compile="on", kernels="torch")


def test_prepacked_weights_asked_for_a_model_the_packed_pass_does_not_run_are_refused(model, monkeypatch):
    from specdec.runtime import engine_plan

    monkeypatch.setattr(engine_plan, "supports", lambda _: False)
    with pytest.raises(ValueError, match="pre-packed weights"):
        SessionCaches(model, max_context=64, engine=EngineOptions(prepack="on"))
    SessionCaches(model, max_context=64, engine=EngineOptions(prepack="auto"))  # auto: the generic path, quietly
    with pytest.raises(ValueError, match="compiled pass"):
        SessionCaches(model, max_context=64, engine=EngineOptions(torch_compile="on"))
    assert not SessionCaches(model, max_context=64, engine=EngineOptions(torch_compile="auto")).compiled
