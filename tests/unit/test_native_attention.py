"""The native attention kernel: every short row of a pass at one layer, in one call, equals exact attention.

CI installs a C compiler, so the kernel is built here; a machine without one runs torch's path
(`--kernels auto`), which test_engine_packed covers.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.runtime import native_attention
from specdec.runtime.engine_options import EngineOptions
from specdec.runtime.kv import ScoreRequest, SessionCaches
from specdec.runtime.kv_buffer import SessionKV
from specdec.runtime.prefix_cache import PrefixCache
from tests.reference import full_logits

LAYERS = 3


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float) -> torch.Tensor:
    """q `[n, H, D]` against k, v `[Hkv, past + n, D]`, heads repeated, causal: `[n, H, D]`."""
    n, heads, _ = q.shape
    groups = heads // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)  # [H, past + n, D]
    scores = torch.einsum("nhd,htd->hnt", q, k) * scale
    visible = torch.arange(past + n)[None, :] <= (past + torch.arange(n))[:, None]
    return torch.einsum("hnt,htd->nhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def _session(gen: torch.Generator, past: int, n: int, hkv: int, d: int, dtype: torch.dtype,
             prefix_widths: tuple[int, ...]) -> SessionKV:
    """A session holding `past` positions (the first ones in shared prefix views of `prefix_widths`),
    with room for `n` more; random keys/values everywhere."""
    prefix = []
    for width in prefix_widths:  # views into a larger buffer: strides differ from the own buffer's
        store = torch.randn(2, LAYERS, hkv, width + 5, d, generator=gen, dtype=dtype)
        prefix.append(store[:, :, :, 2:2 + width])
    kv = SessionKV(LAYERS, hkv, d, 100_000, dtype, prefix=prefix, capacity=past + n - sum(prefix_widths) + 3)
    kv.data.copy_(torch.randn(kv.data.shape, generator=gen, dtype=dtype))
    kv.length = past
    return kv


CASES = [  # (past, n, shared prefix widths) per row: chunk edges at 1024, prefix edges inside chunks
    [(0, 1, ()), (5, 3, ()), (1023, 1, ()), (1024, 2, ()), (1025, 9, ()), (2046, 3, ())],
    [(700, 5, (100, 300)), (40, 4, (40,)), (511, 1, (256,)), (1030, 3, (1,)), (2100, 2, (1500, 100))],
]


@pytest.mark.parametrize("hkv, groups, d", [(2, 3, 8), (3, 3, 64), (1, 4, 32), (2, 1, 48)])
@pytest.mark.parametrize("rows", CASES)
def test_one_call_over_uneven_rows_equals_exact_attention_in_float64(hkv, groups, d, rows):
    """d = 64 and 32 take the machine's vector loops where it has them, 8 and 48 the plain ones."""
    gen = torch.Generator().manual_seed(d)
    sessions = [_session(gen, past, n, hkv, d, torch.float64, widths) for past, n, widths in rows]
    t, heads, layer, scale = sum(n for _, n, _ in rows), hkv * groups, 1, d**-0.5
    qkv = torch.randn(t, heads + 2 * hkv, d, generator=gen, dtype=torch.float64)  # q as a strided view, as in a pass
    q = qkv[:, :heads]
    out = torch.full((t, heads, d), float("nan"), dtype=torch.float64)
    described, start = [], 0
    for kv, (past, n, _) in zip(sessions, rows):
        described.append((kv, start, n, past))
        start += n
    native_attention.attend(native_attention.AttentionPlan(described), layer, q, out, hkv, scale)
    start = 0
    for kv, (past, n, _) in zip(sessions, rows):
        keys, values = kv.joined(layer, past + n)
        expected = _exact(q[start:start + n], keys, values, past, scale)
        torch.testing.assert_close(out[start:start + n], expected, rtol=0, atol=1e-12)
        start += n


@pytest.mark.parametrize("hkv, groups, d", [(3, 3, 64), (1, 4, 32), (2, 1, 8), (1, 64, 16)])
def test_rows_longer_than_the_kernel_takes_attend_in_pieces_as_exact_attention(hkv, groups, d):
    """Prefill chunks (more positions than MAX_QUERIES // groups), beside short rows, with shared
    prefixes and across the 1024-key chunk edge, their new keys and values stored by the same call:
    each piece sees the pieces before it, as exact attention over the whole row does, in float64."""
    gen = torch.Generator().manual_seed(groups)
    rows = [(0, 200, ()), (5, 3, ()), (37, 130, (20,)), (1000, 70, (300,)), (60, native_attention.MAX_QUERIES, ())]
    sessions = [_session(gen, past, n, hkv, d, torch.float64, widths) for past, n, widths in rows]
    t, heads, layer, scale = sum(n for _, n, _ in rows), hkv * groups, 2, d**-0.5
    qkv = torch.randn(t, heads + 2 * hkv, d, generator=gen, dtype=torch.float64)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + hkv], qkv[:, heads + hkv:]
    described, start = [], 0
    for kv, (past, n, _) in zip(sessions, rows):
        described.append((kv, start, n, past))
        start += n
    plan = native_attention.AttentionPlan(described, groups)
    assert plan.count == sum(-(-n // (native_attention.MAX_QUERIES // groups)) for _, n, _ in rows)
    out = torch.full((t, heads, d), float("nan"), dtype=torch.float64)
    native_attention.attend(plan, layer, q, out, hkv, scale, new=(k, v))
    for kv, (past, n, _), (_, first, _, _) in zip(sessions, rows, described):
        keys, values = kv.joined(layer, past + n)
        assert torch.equal(keys[:, past:], k[first:first + n].transpose(0, 1))
        expected = _exact(q[first:first + n], keys, values, past, scale)
        torch.testing.assert_close(out[first:first + n], expected, rtol=0, atol=1e-12)


def test_a_plan_for_more_query_heads_a_key_value_head_than_the_kernel_takes_is_refused():
    gen = torch.Generator().manual_seed(0)
    kv = _session(gen, 4, 2, 1, 8, torch.float64, ())
    with pytest.raises(ValueError, match="query heads per key/value head"):
        native_attention.AttentionPlan([(kv, 0, 2, 4)], native_attention.MAX_QUERIES + 1)


@pytest.mark.parametrize("d", [64, 32, 48])
@pytest.mark.parametrize("n", [1, 3, 5, 7])
def test_float32_stays_within_rounding_of_exact(n, d, kernel_build):
    """The register-blocked float32 loops of every build (key counts not a multiple of 8 or 4, query
    counts not a multiple of 5, 3 or 2; d = 32 and 48 mix the wide loops with narrower ones) against
    the float64 result."""
    gen = torch.Generator().manual_seed(n)
    rows = [(1 + 97 * i, n, ()) for i in range(5)]
    sessions = [_session(gen, past, n, 3, d, torch.float64, ()) for past, n, _ in rows]
    q = torch.randn(5 * n, 9, d, generator=gen, dtype=torch.float64)
    exact = torch.empty_like(q)
    native_attention.attend(native_attention.AttentionPlan([(kv, i * n, n, p) for i, (kv, (p, _, _)) in
                                                   enumerate(zip(sessions, rows))]), 0, q, exact, 3, 0.125)
    for kv in sessions:
        kv.data = kv.data.float()
    out = torch.empty_like(q, dtype=torch.float32)
    native_attention.attend(native_attention.AttentionPlan([(kv, i * n, n, p) for i, (kv, (p, _, _)) in
                                                   enumerate(zip(sessions, rows))]), 0, q.float(), out, 3, 0.125)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=2e-6)


@pytest.mark.parametrize("d", [64, 32, 48, 8])
def test_bfloat16_widens_exactly_and_rounds_once_in_every_build(d, kernel_build):
    """bfloat16 queries, keys and values (stored by the kernel, or in shared prefixes) are widened to
    float32 and attended in float32: within a bfloat16 rounding of exact attention in every build, and
    in the builds with vector loops (d = 64, 32, 48 take them, 8 the plain ones) bit for bit the float32
    kernel's result on the widened values, rounded once."""
    gen = torch.Generator().manual_seed(d)
    hkv, groups, layer, scale = 3, 3, 1, d**-0.5
    rows = CASES[0] + CASES[1]
    sessions = [_session(gen, past, n, hkv, d, torch.bfloat16, widths) for past, n, widths in rows]
    t = sum(n for _, n, _ in rows)
    qkv = torch.randn(t, hkv * groups + 2 * hkv, d, generator=gen).bfloat16()
    q, k, v = qkv[:, :hkv * groups], qkv[:, hkv * groups:-hkv], qkv[:, -hkv:]
    described, start = [], 0
    for kv, (past, n, _) in zip(sessions, rows):
        described.append((kv, start, n, past))
        start += n
    out = torch.full((t, hkv * groups, d), float("nan"), dtype=torch.bfloat16)
    native_attention.attend(native_attention.AttentionPlan(described), layer, q, out, hkv, scale, new=(k, v))
    wide = []
    for kv, (past, n, _), (_, first, _, _) in zip(sessions, rows, described):
        keys, values = kv.joined(layer, past + n)
        assert torch.equal(keys[:, past:], k[first:first + n].transpose(0, 1))  # stored as given
        assert torch.equal(values[:, past:], v[first:first + n].transpose(0, 1))
        exact = _exact(q[first:first + n].double(), keys.double(), values.double(), past, scale)
        torch.testing.assert_close(out[first:first + n].double(), exact, rtol=2**-8, atol=1e-6)
        kv.data, kv.prefix = kv.data.float(), [p.float() for p in kv.prefix]
        wide.append((kv, first, n, past))
    out32 = torch.empty((t, hkv * groups, d))
    native_attention.attend(native_attention.AttentionPlan(wide), layer, q.float(), out32, hkv, scale)
    if kernel_build in ("x86-64-v4", "x86-64-v3") and d != 8:
        assert torch.equal(out, out32.bfloat16())


@pytest.mark.parametrize("rows", CASES)
def test_the_kernel_stores_the_new_keys_and_values_it_is_given_as_a_write_would(rows):
    """`new=(k, v)`: the kernel writes each row's keys/values at its positions in its own buffer
    (strided views, as a pass hands them over) and attends as after `SessionKV.write`."""
    hkv, groups, d, layer = 3, 3, 64, 2
    pairs = []
    for _ in range(2):  # the same sessions twice: one written by SessionKV.write, one by the kernel
        gen = torch.Generator().manual_seed(7)
        pairs.append([_session(gen, past, n, hkv, d, torch.float64, widths) for past, n, widths in rows])
    t = sum(n for _, n, _ in rows)
    qkv = torch.randn(t, hkv * groups + 2 * hkv, d, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    q, k, v = qkv[:, :hkv * groups], qkv[:, hkv * groups:-hkv], qkv[:, -hkv:]
    outs = []
    for sessions, store in zip(pairs, (False, True)):
        described, start = [], 0
        for kv, (past, n, _) in zip(sessions, rows):
            if not store:
                kv.write(layer, past, k[start:start + n].transpose(0, 1), v[start:start + n].transpose(0, 1))
            described.append((kv, start, n, past))
            start += n
        out = torch.full((t, hkv * groups, d), float("nan"), dtype=torch.float64)
        native_attention.attend(native_attention.AttentionPlan(described), layer, q, out, hkv, d**-0.5,
                                new=(k, v) if store else None)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    for written, stored in zip(*pairs):
        assert torch.equal(written.data, stored.data)


def _a_row_in_a_shared_prefix(gen):
    """A fine decode row, then one whose new position lies inside its shared prefix."""
    fine, shared = (_session(gen, 40, 1, 1, 8, torch.float64, widths) for widths in ((), (40,)))
    return [(fine, 0, 1, 40), (shared, 1, 1, 39)]


def _a_block_too_long(gen):
    """A fine decode row, then a 30-position block (more queries than the kernel takes)."""
    fine, long = _session(gen, 10, 1, 1, 8, torch.float64, ()), _session(gen, 10, 30, 1, 8, torch.float64, ())
    return [(fine, 0, 1, 10), (long, 1, 30, 10)]


@pytest.mark.parametrize("rows, refusal", [(_a_row_in_a_shared_prefix, "shared prefix"),
                                           (_a_block_too_long, "at most 64 queries")])
def test_a_refused_call_stores_no_new_keys_in_any_row(rows, refusal):
    plan = rows(torch.Generator().manual_seed(0))
    before = [kv.data.clone() for kv, *_ in plan]
    queries = sum(n for _, _, n, _ in plan)
    q, k = torch.zeros(queries, 3, 8, dtype=torch.float64), torch.ones(queries, 1, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=refusal):
        native_attention.attend(native_attention.AttentionPlan(plan), 0, q, torch.empty_like(q), 1, 1.0, new=(k, k))
    for (kv, *_), data in zip(plan, before):
        assert torch.equal(kv.data, data)


def test_a_block_longer_than_the_kernel_takes_is_refused():
    kv = _session(torch.Generator().manual_seed(0), 10, 30, 1, 8, torch.float64, ())
    q = torch.zeros(30, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="at most 64 queries"):
        native_attention.attend(native_attention.AttentionPlan([(kv, 0, 30, 10)]), 0, q, torch.empty_like(q), 1, 1.0)


def test_a_pass_mixing_decode_rows_and_a_prefill_equals_torchs_path_and_a_plain_forward(tiny_model):
    """Short rows and the prefill (in pieces) through the kernel, with shared prefixes: the same
    logits as torch's attention (`attend`) and as transformers, in float64."""
    rng, vocab = random.Random(3), tiny_model.config.vocab_size
    engines = {way: SessionCaches(tiny_model, 2048, prefix_cache=PrefixCache(16), engine=EngineOptions(kernels=way))
               for way in ("native", "torch")}
    assert engines["native"].forward.native and not engines["torch"].forward.native
    system = [rng.randrange(3, vocab) for _ in range(300)]  # a shared prompt head: prefix segments
    histories = {sid: system + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 400))] for sid in "abc"}
    requests = [ScoreRequest(sid, history, [rng.randrange(3, vocab) for _ in range(width)])
                for (sid, history), width in zip(histories.items(), (0, 2, 4))]
    requests.append(ScoreRequest("fresh", system + [5] * 40, [7] * 40))  # a prefill beside the steps
    assert 41 * engines["native"].forward.groups > native_attention.MAX_QUERIES  # in pieces
    results = {}
    for way, caches in engines.items():
        for sid, history in histories.items():
            caches.score(sid, history, [])
        results[way] = caches.score_batch(requests)
    for request, native, torch_way in zip(requests, results["native"], results["torch"]):
        expected = full_logits(tiny_model, request.history + request.new_tokens)[len(request.history) - 1:]
        torch.testing.assert_close(native.logits, expected, rtol=0, atol=1e-9)
        torch.testing.assert_close(native.logits, torch_way.logits, rtol=0, atol=1e-12)


def test_a_bfloat16_pass_takes_the_kernel_and_scores_as_torchs_path(tiny_model, monkeypatch):
    """A bfloat16 model's short rows go through the kernel (its projections stay on oneDNN or torch),
    decode and verify rows beside a prefill, with shared prefixes: its logits are as close to the
    float64 model's as those of torch's bfloat16 attention (they differ from each other by bfloat16
    roundings: the kernel rounds once, after float32 sums)."""
    import copy

    lm = copy.deepcopy(tiny_model).to(torch.bfloat16)
    rng, vocab = random.Random(4), lm.config.vocab_size
    engines = {way: SessionCaches(lm, 2048, prefix_cache=PrefixCache(16), engine=EngineOptions(kernels=way))
               for way in ("native", "torch")}
    assert engines["native"].forward.native and not engines["torch"].forward.native
    calls = []
    attend = native_attention.attend
    monkeypatch.setattr(native_attention, "attend",
                        lambda plan, *a, **kw: calls.append(plan.dtype) or attend(plan, *a, **kw))
    system = [rng.randrange(3, vocab) for _ in range(200)]
    histories = {sid: system + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 300))] for sid in "abc"}
    requests = [ScoreRequest(sid, history, [rng.randrange(3, vocab) for _ in range(width)])
                for (sid, history), width in zip(histories.items(), (0, 2, 4))]
    requests.append(ScoreRequest("fresh", system + [5] * 40, [7] * 40))
    results = {}
    for way, caches in engines.items():
        for sid, history in histories.items():
            caches.score(sid, history, [])
        calls.clear()
        results[way] = caches.score_batch(requests)
        assert calls == ([torch.bfloat16] * lm.config.num_hidden_layers if way == "native" else [])
    for request, native, torch_way in zip(requests, results["native"], results["torch"]):
        exact = full_logits(tiny_model, request.history + request.new_tokens)[len(request.history) - 1:]
        off, torch_off = ((r.logits.double() - exact).abs() for r in (native, torch_way))
        assert off.max() < 0.4, off.max()
        assert off.mean() <= 1.1 * torch_off.mean() + 1e-3, (off.mean(), torch_off.mean())
