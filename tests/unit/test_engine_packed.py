"""The packed engine: one pass over sessions of different lengths equals plain transformers, in float64."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.errors import FailedPrecondition
from specdec.runtime import packed
from specdec.runtime.engine_options import EngineOptions
from specdec.runtime.kv import ScoreRequest, SessionCaches
from specdec.runtime.kv_buffer import SessionKV
from specdec.runtime.snapshot_codec import SnapshotIdentity, decode_layers, encode_layers
from specdec.runtime.snapshot_store import SnapshotPolicy
from tests.reference import full_logits


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _reference(model, request: ScoreRequest) -> torch.Tensor:
    return full_logits(model, request.history + request.new_tokens)[len(request.history) - 1:]


@pytest.mark.parametrize("chunk", [packed.QUERY_CHUNK, 3])  # 3: long blocks attend in several chunks
def test_one_pass_over_uneven_sessions_equals_a_plain_forward(model, monkeypatch, chunk):
    """Past lengths 0..120, blocks of 1..9 positions, a first prefill in the same pass as decode steps."""
    monkeypatch.setattr(packed, "QUERY_CHUNK", chunk)
    rng, vocab = random.Random(1), model.config.vocab_size
    caches = SessionCaches(model, max_context=512)
    pasts = {"a": 1, "b": 7, "c": 40, "d": 120}
    for sid, n in pasts.items():  # warm the caches to different lengths
        caches.score(sid, _tokens(rng, n, vocab), [])
    histories = {sid: caches.table.entries[sid].tokens + _tokens(rng, 1, vocab) for sid in pasts}
    requests = [ScoreRequest(sid, histories[sid], _tokens(rng, width, vocab))
                for sid, width in zip(pasts, (0, 2, 4, 8))]
    requests.append(ScoreRequest("fresh", _tokens(rng, 60, vocab), _tokens(rng, 3, vocab)))  # a first prefill
    results = caches.score_batch(requests)
    for request, result in zip(requests, results):
        assert result.logits.shape == (len(request.new_tokens) + 1, vocab)
        torch.testing.assert_close(result.logits, _reference(model, request), rtol=0, atol=1e-9)
    assert [r.prefilled for r in results] == [0, 0, 0, 0, 59]


def test_attend_equals_repeated_heads_with_a_causal_mask():
    """GQA without repeating K/V: the same as repeating each K/V head G times and masking causally."""
    gen = torch.Generator().manual_seed(0)
    hkv, g, n, past, d = 2, 3, 5, 11, 8
    q = torch.randn(hkv, g, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(hkv, past + n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    scores = torch.einsum("hgnd,htd->hgnt", q, k) * d**-0.5
    visible = torch.arange(past + n)[None, :] <= (past + torch.arange(n))[:, None]  # [n, past + n]
    expected = torch.einsum("hgnt,htd->hgnd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(packed.attend(q, [(k, v)], past, d**-0.5), expected, rtol=0, atol=1e-12)


def test_rollback_then_refeed_equals_a_fresh_pass(model):
    rng, vocab = random.Random(2), model.config.vocab_size
    history = _tokens(rng, 30, vocab)
    caches, fresh = SessionCaches(model, 512), SessionCaches(model, 512)
    caches.score("s", history, _tokens(rng, 6, vocab))  # the cache covers history + 6 drafted tokens
    assert caches.rollback("s", len(history) + 2) == len(history) + 2  # two accepted
    buffer = caches.table.entries["s"].cache.data.data_ptr()
    retry = history + caches.table.entries["s"].tokens[len(history):] + _tokens(rng, 1, vocab)
    block = _tokens(rng, 4, vocab)
    logits, prefilled = caches.score("s", retry, block)
    assert prefilled == 0 and caches.table.entries["s"].cache.data.data_ptr() == buffer  # written in place
    torch.testing.assert_close(logits, fresh.score("s", retry, block)[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(logits, _reference(model, ScoreRequest("s", retry, block)), rtol=0, atol=1e-9)


def test_greedy_decoding_through_the_caches_equals_generate(model):
    prompt = [5, 9, 14, 3, 22, 7]
    steps = 40
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                             min_new_tokens=steps, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    caches, history = SessionCaches(model, 512), list(prompt)
    while len(history) < len(prompt) + steps:
        logits, _ = caches.score("s", history, [])
        history.append(int(logits[-1].argmax()))
    assert history[len(prompt):] == expected


def test_the_buffer_grows_geometrically_and_a_rollback_moves_only_a_length():
    kv = SessionKV(layers=2, kv_heads=1, head_dim=4, max_length=1000, dtype=torch.float64, capacity=8)
    keys = torch.arange(2 * 8 * 4, dtype=torch.float64).view(2, 8, 4)[:1]  # [1, 8, 4]
    kv.write(0, 0, keys, -keys)
    kv.length = 8
    kv.reserve(9)
    assert kv.capacity == 16 and torch.equal(kv.keys(0, 8), keys) and torch.equal(kv.values(0, 8), -keys)
    kv.reserve(100)
    assert kv.capacity == 100
    ptr = kv.data.data_ptr()
    kv.crop(3)
    assert kv.length == 3 and kv.data.data_ptr() == ptr
    kv.reserve(1000)
    assert kv.capacity == 1000
    with pytest.raises(ValueError, match="exceed"):
        kv.reserve(1001)


def test_the_generic_path_equals_the_packed_one(model):
    rng, vocab = random.Random(3), model.config.vocab_size
    requests = [ScoreRequest(f"s{i}", _tokens(rng, n, vocab), _tokens(rng, k, vocab))
                for i, (n, k) in enumerate([(1, 0), (12, 3), (40, 5)])]
    fast, generic = SessionCaches(model, 512), SessionCaches(model, 512)
    generic.forward = packed.GenericForward(model)  # as for an architecture the packed pass does not know
    for _ in range(2):
        for request, a, b in zip(requests, fast.score_batch(requests), generic.score_batch(requests)):
            torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-9)
            torch.testing.assert_close(a.logits, _reference(model, request), rtol=0, atol=1e-9)
        requests = [ScoreRequest(r.session_id, r.history + r.new_tokens, [7, 8]) for r in requests]


class _MemoryStore:
    def __init__(self) -> None:
        self.blobs: dict[str, tuple[bytes, int]] = {}

    def put(self, session_id: str, blob: bytes, tokens: int) -> None:
        self.blobs[session_id] = (blob, tokens)

    def get(self, session_id: str) -> bytes | None:
        return self.blobs.get(session_id, (None, 0))[0]

    def tokens(self, session_id: str) -> int:
        return self.blobs.get(session_id, (b"", 0))[1]

    def delete(self, session_id: str) -> None:
        self.blobs.pop(session_id, None)


def _policy(model) -> SnapshotPolicy:
    identity = SnapshotIdentity(model="tiny", dtype="float64", fingerprint="fp", layers=model.config.num_hidden_layers)
    return SnapshotPolicy(store=_MemoryStore(), identity=identity, min_tokens=4)


def test_a_snapshot_round_trip_continues_exactly(model):
    rng, vocab = random.Random(4), model.config.vocab_size
    policy = _policy(model)
    writer = SessionCaches(model, 512, snapshots=policy)
    history = _tokens(rng, 50, vocab)
    writer.score("s", history, [])
    covered, blob = writer.snapshot("s")
    assert covered == len(history)
    policy.store.put("s", blob, covered)
    reader = SessionCaches(model, 512, snapshots=policy)  # another replica: no cache, the snapshot
    block = _tokens(rng, 3, vocab)
    logits, prefilled = reader.score("s", history + [9], block)
    assert policy.restores == 1 and prefilled == 0
    assert torch.equal(logits, writer.score("s", history + [9], block)[0])


def test_a_snapshot_in_another_format_is_refused_and_the_session_reprefills(model):
    rng, vocab = random.Random(5), model.config.vocab_size
    policy = _policy(model)
    writer = SessionCaches(model, 512, snapshots=policy)
    history = _tokens(rng, 20, vocab)
    writer.score("s", history, [])
    layers = [(layer.keys, layer.values) for layer in writer.table.entries["s"].cache.layers]
    blob = encode_layers(layers, history, policy.identity)
    old = blob.replace(b'"format":"1"', b'"format":"0"')  # same length: the header stays valid
    assert old != blob
    with pytest.raises(FailedPrecondition, match="format '0'"):
        decode_layers(old, policy.identity)
    policy.store.put("s", old, len(history))
    reader = SessionCaches(model, 512, snapshots=policy)
    logits, prefilled = reader.score("s", history + [9], [])
    assert policy.restores == 0 and prefilled == len(history)
    torch.testing.assert_close(logits, full_logits(model, history + [9])[-1:], rtol=0, atol=1e-9)


def test_attend_in_half_precision_stays_close_to_float64():
    gen = torch.Generator().manual_seed(1)
    hkv, g, n, past, d = 3, 3, 4, 50, 64
    q = torch.randn(hkv, g, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(hkv, past + n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    exact = packed.attend(q, [(k, v)], past, d**-0.5)
    half = packed.attend(q.bfloat16(), [(k.bfloat16(), v.bfloat16())], past, d**-0.5)
    torch.testing.assert_close(half.double(), exact, rtol=0, atol=3e-2)


def test_a_buffer_grown_inside_inference_mode_stays_writable_outside_it():
    kv = SessionKV(layers=1, kv_heads=1, head_dim=2, max_length=64, dtype=torch.float32, capacity=1)
    with torch.inference_mode():
        kv.reserve(10)
    assert not kv.data.is_inference()
    kv.write(0, 0, torch.ones(1, 10, 2), torch.ones(1, 10, 2))


def test_prepacked_weights_score_as_the_models_own_modules(model):
    """float32 on a CPU: the fused, oneDNN-packed projections give the plain path's logits (to float32
    rounding) for decode, verify and prefill rows in one pass; float64 cannot be packed ("on" refuses)."""
    import copy

    rng = random.Random(4)
    lm = copy.deepcopy(model).float()
    plain = SessionCaches(lm, 512, engine=EngineOptions(prepack="off", kernels="torch"))  # projections: oneDNN or MKL
    fast = SessionCaches(lm, 512, engine=EngineOptions(prepack="on", kernels="torch"))
    assert fast.forward.prepacked and not plain.forward.prepacked
    requests = [ScoreRequest("a", _tokens(rng, 30, 100), []), ScoreRequest("b", _tokens(rng, 5, 100), [4, 5, 6, 7]),
                ScoreRequest("c", _tokens(rng, 70, 100), [9])]
    for one, other in zip(plain.score_batch(requests), fast.score_batch(requests)):
        torch.testing.assert_close(other.logits, one.logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(other.logits.argmax(-1), one.logits.argmax(-1))
    with pytest.raises(ValueError, match="float32"):
        SessionCaches(model, 512, engine=EngineOptions(prepack="on"))
    assert not SessionCaches(model, 512, engine=EngineOptions(prepack="auto")).forward.prepacked  # float64: plain


def test_bfloat16_weights_are_prepacked_where_the_cpu_multiplies_bf16(model, monkeypatch):
    """bfloat16 on a CPU with AVX512-BF16 or AMX: oneDNN's pre-packed bf16 weights (its AMX kernels),
    scoring as the model's own bf16 modules to bf16 rounding; elsewhere "auto" leaves them unpacked
    (oneDNN would convert every call) and "on" refuses, naming bfloat16."""
    import copy

    from specdec.runtime import engine_plan

    rng = random.Random(5)
    lm = copy.deepcopy(model).to(torch.bfloat16)
    requests = [ScoreRequest("a", _tokens(rng, 30, 100), []), ScoreRequest("b", _tokens(rng, 5, 100), [4, 5, 6])]
    plain = SessionCaches(lm, 512, engine=EngineOptions(prepack="off", kernels="torch"))
    if engine_plan.bf16_instructions():
        fast = SessionCaches(lm, 512, engine=EngineOptions(prepack="auto"))
        assert fast.forward.prepacked and not plain.forward.prepacked
        for one, other in zip(plain.score_batch(requests), fast.score_batch(requests)):
            torch.testing.assert_close(other.logits.float(), one.logits.float(), rtol=0.05, atol=0.1)
    monkeypatch.setattr(engine_plan, "bf16_instructions", lambda: False)
    assert not SessionCaches(lm, 512, engine=EngineOptions(prepack="auto")).forward.prepacked
    with pytest.raises(ValueError, match="bfloat16"):
        SessionCaches(lm, 512, engine=EngineOptions(prepack="on"))
