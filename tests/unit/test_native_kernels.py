"""The native kernels' library (`specdec.runtime.native`): the linear kernel equals exact products and
gives a row the same bits whatever shares its pass; prebuilt libraries load without a compiler; and
`--kernels native` is refused where the kernels cannot run.

CI installs a C compiler, so the kernels are built here (the attention kernel's own tests are in
test_native_attention)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from specdec.runtime import native, packed, projection
from specdec.runtime.engine_options import EngineOptions
from specdec.runtime.engine_plan import plan_engine
from specdec.runtime.kv import ScoreRequest, SessionCaches


def forward(model, **options) -> packed.PackedForward:
    """The packed pass of `model` as `EngineOptions(**options)` plan it here."""
    return packed.PackedForward(model, plan_engine(model, EngineOptions(**options)))


@pytest.fixture
def fresh_library(monkeypatch):
    """The library looked up again from the environment this test sets, and forgotten after it."""
    monkeypatch.delenv("SPECDEC_PREBUILT_KERNELS", raising=False)
    native.library.cache_clear()
    yield
    native.library.cache_clear()


@pytest.mark.parametrize("n, k", [(960, 576), (12, 64), (7, 13), (5, 24), (3, 8)])
def test_linear_equals_exact_products_and_a_row_does_not_depend_on_its_neighbours(n, k, kernel_build):
    """n not a multiple of 4 leaves rows to the plain loop, k not a multiple of 8 sends all there
    (k = 24: AVX2 blocks where AVX-512 ones run otherwise); every count of rows up to the limit
    (passes of 6 to 1 rows), in every build of the kernels this CPU runs."""
    gen = torch.Generator().manual_seed(n * k)
    weights = [torch.randn(n, k, generator=gen), torch.randn(max(1, n // 3), k, generator=gen)]
    exact_w = torch.cat(weights).double()
    alone = {}
    for m in range(1, native.LINEAR_MAX_ROWS + 1):
        x = torch.randn(m, k, generator=gen)
        x[-1] = torch.linspace(-1, 1, k)  # the same last row at every m
        out = torch.full((m, exact_w.shape[0]), float("nan"))
        native.linear(x, weights, out)
        torch.testing.assert_close(out.double(), x.double() @ exact_w.T, rtol=0, atol=2e-5 * k**0.5)
        alone.setdefault("row", out[-1].clone())
        assert torch.equal(out[-1], alone["row"]), f"the last row changed with {m} rows in the pass"


def test_linear_refuses_what_it_does_not_take():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=f"at most {native.LINEAR_MAX_ROWS} rows"):
        native.linear(torch.randn(native.LINEAR_MAX_ROWS + 1, 16), [w], torch.empty(native.LINEAR_MAX_ROWS + 1, 8))
    with pytest.raises(ValueError, match="contiguous float32 weights"):
        native.linear(torch.randn(2, 16), [w.double()], torch.empty(2, 8))
    with pytest.raises(ValueError, match="contiguous float32 weights"):
        native.linear(torch.randn(2, 16), [torch.randn(16, 8).T], torch.empty(2, 8))


def test_float32_decode_logits_are_the_same_bits_alone_or_with_other_sessions(tiny_model, monkeypatch):
    """With the native kernels every step of a pass of up to 48 rows computes a row from that row
    alone: a session's logits do not depend on who shares its pass. The linear kernel is what
    makes the projections so (the count below fails if the pass stops calling it)."""
    lm = copy.deepcopy(tiny_model).float()
    rng, vocab = random.Random(5), lm.config.vocab_size
    histories = {sid: [rng.randrange(3, vocab) for _ in range(rng.randrange(20, 90))] for sid in "abcdefg"}
    caches = SessionCaches(lm, 512, engine=EngineOptions(kernels="native"))
    for sid, history in histories.items():
        caches.score(sid, history, [])
    calls = []
    linear = native.linear
    monkeypatch.setattr(native, "linear", lambda *a: calls.append(a[0].shape[0]) or linear(*a))
    step = {sid: [rng.randrange(3, vocab)] for sid in histories}
    batched = caches.score_batch([ScoreRequest(sid, histories[sid], step[sid]) for sid in histories])
    assert len(calls) == 1 + 4 * lm.config.num_hidden_layers  # every projection of the pass (and the head)
    for sid, together in zip(histories, batched):
        caches.rollback(sid, len(histories[sid]))
        alone, _ = caches.score(sid, histories[sid], step[sid])
        assert torch.equal(alone, together.logits), sid


def test_native_linear_scores_as_onednn_within_float32_rounding(tiny_model):
    """Decode, verify and prefill rows in one float32 pass: the native linear kernel (with the native
    attention) against torch's operators, to float32 rounding, the same argmax."""
    lm = copy.deepcopy(tiny_model).float()
    rng = random.Random(6)
    requests = [ScoreRequest("a", [rng.randrange(3, 100) for _ in range(30)], []),
                ScoreRequest("b", [rng.randrange(3, 100) for _ in range(5)], [4, 5, 6, 7]),
                ScoreRequest("c", [rng.randrange(3, 100) for _ in range(70)], [9])]
    fast, ref = (SessionCaches(lm, 512, engine=EngineOptions(kernels=way)) for way in ("native", "torch"))
    assert fast.forward.head.parts and not ref.forward.head.parts
    for _ in range(2):  # the prefills (more rows than the kernel takes), then a pass of short rows
        for one, other in zip(ref.score_batch(requests), fast.score_batch(requests)):
            torch.testing.assert_close(other.logits, one.logits, rtol=1e-4, atol=1e-4)
            assert torch.equal(other.logits.argmax(-1), one.logits.argmax(-1))
        requests = [ScoreRequest(r.session_id, r.history + r.new_tokens + [3], [8, 9]) for r in requests]


def test_prebuilt_kernels_load_without_a_compiler_and_only_for_their_own_source(tmp_path, monkeypatch,
                                                                                fresh_library):
    built = native.prebuild(tmp_path / "kernels")
    assert [p.name for p in built] == [f"kernels-{native.source_hash()}-{isa}.so" for isa in native.portable_isas()]
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("SPECDEC_PREBUILT_KERNELS", str(tmp_path / "kernels"))
    assert native.unavailable(torch.device("cpu"), torch.float32) == ""
    x, w = torch.randn(3, 40), torch.randn(9, 40)
    torch.testing.assert_close(native.linear(x, [w], torch.empty(3, 9)), x @ w.T, rtol=1e-5, atol=1e-5)
    for path in built:  # libraries of another source are never loaded
        path.rename(path.with_name(path.name.replace(native.source_hash(), "0" * 16)))
    native.library.cache_clear()
    assert "no C compiler" in native.unavailable(torch.device("cpu"), torch.float32)


def test_native_kernels_are_refused_where_they_cannot_run(tiny_model, monkeypatch, fresh_library):
    with pytest.raises(ValueError, match="run float32, float64 and bfloat16, not float16"):
        forward(copy.deepcopy(tiny_model).to(torch.float16), kernels="native")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="--kernels native: no C compiler"):
        forward(tiny_model, kernels="native")
    auto = forward(copy.deepcopy(tiny_model).float(), kernels="auto")  # auto: torch's path, logged
    assert not auto.native and not any(p.parts for layer in auto.layers for p in layer)


def test_fixed_linear_rows_are_refused_where_the_linear_kernel_does_not_run(tiny_model, monkeypatch,
                                                                            fresh_library):
    """An explicit count would do nothing there; 0 (oneDNN only) and auto are what happens anyway."""
    lm = copy.deepcopy(tiny_model).float()
    with pytest.raises(ValueError, match=r"--native-linear-rows 4: .* --kernels torch"):
        EngineOptions(kernels="torch", linear_rows=4)
    with monkeypatch.context() as without_compiler:
        without_compiler.setenv("CC", "/nonexistent/cc")
        without_compiler.setenv("PATH", "/nonexistent")
        with pytest.raises(ValueError, match=r"--native-linear-rows 8: .* \(no C compiler"):
            SessionCaches(lm, 512, engine=EngineOptions(kernels="auto", linear_rows=8))
        for rows in (0, "auto", None):
            assert not SessionCaches(lm, 512, engine=EngineOptions(kernels="auto", linear_rows=rows)).forward.native
    native.library.cache_clear()
    with pytest.raises(ValueError, match="--native-linear-rows 8: the native linear kernel does not run here "
                                         r"\(the model runs float64\)"):
        forward(copy.deepcopy(tiny_model).double(), kernels="auto", linear_rows=8)
    assert forward(lm, kernels="auto", linear_rows=8).linear_rows == 8


def _decode_rows(caches: SessionCaches, histories: dict[str, list[int]], sessions: str) -> list:
    """One decode step of `sessions` in one pass (their histories prefilled), rolled back after."""
    batched = caches.score_batch([ScoreRequest(sid, histories[sid], [7]) for sid in sessions])
    for sid in sessions:
        caches.rollback(sid, len(histories[sid]))
    return batched


def test_passes_above_linear_rows_take_onednn(tiny_model, monkeypatch):
    """`linear_rows=4`: a pass of 4 rows (2 sessions: each feeds its last token and a new one) runs
    every projection through the kernel, one of 6 none, and both score as the pass with the kernel
    for every row does (float32 rounding)."""
    lm = copy.deepcopy(tiny_model).float()
    rng, vocab = random.Random(7), lm.config.vocab_size
    histories = {sid: [rng.randrange(3, vocab) for _ in range(30)] for sid in "abc"}
    two, everyone = (SessionCaches(lm, 512, engine=EngineOptions(prepack="on", kernels="native", linear_rows=rows))
                     for rows in (4, 48))
    for caches in (two, everyone):
        for sid, history in histories.items():
            caches.score(sid, history, [])
    calls: list[int] = []
    linear = native.linear
    monkeypatch.setattr(native, "linear", lambda *a: calls.append(a[0].shape[0]) or linear(*a))
    _decode_rows(two, histories, "ab")
    assert calls == [4] * (1 + 4 * lm.config.num_hidden_layers)
    calls.clear()
    three = _decode_rows(two, histories, "abc")
    assert calls == []
    for one, other in zip(three, _decode_rows(everyone, histories, "abc")):
        torch.testing.assert_close(one.logits, other.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("native_wins_up_to, expected, tried", [
    (48, 48, [1, 2, 4, 8, 16, 24, 32, 48]), (8, 8, [1, 2, 4, 8, 16]), (3, 2, [1, 2, 4]), (0, 0, [1])])
def test_linear_rows_auto_is_the_most_rows_the_kernel_wins_counting_up(tiny_model, monkeypatch, caplog,
                                                                       native_wins_up_to, expected, tried):
    """The decision, on scripted timings: the kernel takes 1.0 where it wins, 3.0 where it loses;
    oneDNN always 2.0. Measured at `warm_up`, applied to every projection, logged."""
    lm = copy.deepcopy(tiny_model).float()
    caches = SessionCaches(lm, 512, engine=EngineOptions(prepack="on", kernels="native", linear_rows="auto"))
    forward = caches.forward
    assert forward.linear_rows == native.LINEAR_MAX_ROWS  # until measured
    asked = []

    def timed(projections, inputs, rows):
        m = next(iter(inputs.values())).shape[0]
        asked.append((m, rows))
        return 2.0 if rows == 0 else 1.0 if m <= native_wins_up_to else 3.0

    monkeypatch.setattr(projection, "_time_projections", timed)
    with caplog.at_level("INFO", logger="specdec.runtime.packed"):
        caches.warm_up()
    assert forward.linear_rows == expected
    assert {p.rows for p in forward._projections()} == {expected}
    assert f"projections of up to {expected} rows through the native linear kernel" in caplog.text
    assert sorted({m for m, _ in asked}) == tried  # counting up, stopping where oneDNN wins
    caches.warm_up()  # measured once
    assert len(asked) == 2 * 4 * len(tried)  # both ways, a touch and 3 timed rounds each


def test_linear_rows_auto_measures_real_passes_and_fixed_rows_do_not(tiny_model):
    lm = copy.deepcopy(tiny_model).float()
    auto = SessionCaches(lm, 512, engine=EngineOptions(prepack="on", kernels="native", linear_rows="auto"))
    auto.warm_up()
    assert auto.forward.linear_rows in (0, *projection.LINEAR_ROW_CANDIDATES)
    fixed = SessionCaches(lm, 512, engine=EngineOptions(prepack="on", kernels="native", linear_rows=5))
    fixed.warm_up()
    assert fixed.forward.linear_rows == 5
    with pytest.raises(ValueError, match="--native-linear-rows must be auto or 0 to 48"):
        EngineOptions(kernels="native", linear_rows=49)


@pytest.mark.parametrize("args, error", [
    (["--native-linear-rows", "auto"], None),
    (["--native-linear-rows", "0"], None),
    (["--native-linear-rows", "49"], "--native-linear-rows"),
    (["--native-linear-rows", "some"], "--native-linear-rows"),
    (["--native-linear-rows", "8", "--kernels", "torch"], "drop --kernels torch"),
    (["--native-linear-rows", "8", "--dtype", "bfloat16"], "runs float32, not --dtype bfloat16"),
])
def test_the_native_linear_rows_flag(args, error, capsys):
    from target_service.config import TargetConfig

    if error is None:
        assert TargetConfig.from_args(args).native_linear_rows == (args[1] if args[1] == "auto" else int(args[1]))
        return
    with pytest.raises(SystemExit):
        TargetConfig.from_args(args)
    assert error in capsys.readouterr().err


def test_a_service_asked_for_what_its_machine_cannot_run_exits_with_the_reason(tiny_models):
    """No C compiler and no prebuilt kernels: `--native-linear-rows 8` would do nothing, so the
    target service does not start (exit 2, one line saying why, no traceback)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_PREBUILT_KERNELS"}
    env.update(CC="/nonexistent/cc", PATH=os.path.dirname(sys.executable))
    proc = subprocess.run([sys.executable, "-m", "target_service", "--port", "0", "--model", str(tiny_models["target"]),
                           "--native-linear-rows", "8"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "cannot start: --native-linear-rows 8: the native linear kernel does not run here (no C compiler" \
        in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("t", [1, 5, 17])  # 17: rows split over the OpenMP threads
def test_layer_ops_equal_the_llama_modules_within_float32_rounding(t):
    """RMSNorm (with the residual add before it), the rotary embedding of q and k in place and SiLU times
    up (`native.LayerOps`, csrc/layer.c) against transformers' Llama operations in float32."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(3)
    ops, n, heads, hkv, d = native.LayerOps(), 96, 3, 1, 16
    x, delta = torch.randn(t, n, generator=gen), torch.randn(t, n, generator=gen)
    norm = LlamaRMSNorm(n, eps=1e-5)
    norm.weight.data = torch.randn(n, generator=gen)
    expected_x = x + delta
    h = torch.empty(t, n)
    ops.rms_norm(x, norm.weight.data, 1e-5, h, delta)
    torch.testing.assert_close(x, expected_x, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(h, norm(expected_x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ops.rms_norm(x, norm.weight.data, 1e-5, torch.empty(t, n)), norm(x),
                                   rtol=1e-6, atol=1e-6)

    qk = torch.randn(t, (heads + hkv + 1) * d, generator=gen)  # q heads, k heads, then v (left alone)
    angles = torch.randn(t, d // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k = qk[:, :heads * d].view(t, heads, d), qk[:, heads * d:(heads + hkv) * d].view(t, hkv, d)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    v = qk[:, (heads + hkv) * d:].clone()
    ops.rope(qk, heads + hkv, d, cos, sin)
    torch.testing.assert_close(q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(qk[:, (heads + hkv) * d:], v)

    gate_up = torch.randn(t, 2 * n, generator=gen)
    out = ops.silu_mul(gate_up, torch.empty(t, n))
    torch.testing.assert_close(out, torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:], rtol=1e-6, atol=1e-6)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most bfloat16 steps between `a` and `b` (bfloat16 tensors of one shape), element by element."""
    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


@pytest.mark.parametrize("t", [1, 5, 17])  # 17: rows split over the OpenMP threads
def test_bfloat16_layer_ops_round_where_torchs_bfloat16_operators_round(t):
    """The bfloat16 layer ops against transformers' Llama operations on bfloat16 tensors: the residual
    sum, the rotation and SiLU times up round where torch rounds (each result one rounding of the
    same float32 value: the same bits but where torch's exp differs in the last float32 place), and
    RMSNorm, whose sum of squares is summed in another order, within one bfloat16 step."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(5)
    ops, n, heads, hkv, d = native.LayerOps(torch.bfloat16), 96, 3, 1, 16
    x, delta = (torch.randn(t, n, generator=gen) * 4).bfloat16(), (torch.randn(t, n, generator=gen) * 4).bfloat16()
    norm = LlamaRMSNorm(n, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = torch.randn(n, generator=gen).bfloat16()
    expected_x = x + delta
    h = torch.empty(t, n, dtype=torch.bfloat16)
    ops.rms_norm(x, norm.weight.data, 1e-5, h, delta)
    assert torch.equal(x, expected_x)
    with torch.no_grad():
        again = ops.rms_norm(x, norm.weight.data, 1e-5, torch.empty_like(x))
        for got, want in ((h, norm(expected_x)), (again, norm(x))):
            assert _bf16_ulps(got, want) <= 1 and int((got != want).sum()) <= 1 + got.numel() // 100

    qk = torch.randn(t, (heads + hkv + 1) * d, generator=gen).bfloat16()  # q heads, k heads, then v (left alone)
    angles = torch.randn(t, d // 2, generator=gen) * 3
    cos, sin = torch.cat([angles.cos()] * 2, -1).bfloat16(), torch.cat([angles.sin()] * 2, -1).bfloat16()
    q, k = qk[:, :heads * d].view(t, heads, d), qk[:, heads * d:(heads + hkv) * d].view(t, hkv, d)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    v = qk[:, (heads + hkv) * d:].clone()
    ops.rope(qk, heads + hkv, d, cos, sin)
    assert torch.equal(q, want_q[0].transpose(0, 1)) and torch.equal(k, want_k[0].transpose(0, 1))
    assert torch.equal(qk[:, (heads + hkv) * d:], v)

    gate_up = (torch.randn(t, 2 * n, generator=gen) * 4).bfloat16()
    out = ops.silu_mul(gate_up, torch.empty(t, n, dtype=torch.bfloat16))
    want = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    # exp differs from torch's in the last float32 place now and then: one bfloat16 step, and rarely
    # (a missed rounding of SiLU before the product would move about one element in ten)
    assert _bf16_ulps(out, want) <= 1 and int((out != want).sum()) <= 1 + out.numel() // 100

    poisoned = gate_up.clone()
    poisoned[0, 0], poisoned[0, n + 1] = float("nan"), float("inf")  # a NaN gate; an infinite up
    out = ops.silu_mul(poisoned, torch.empty(t, n, dtype=torch.bfloat16))
    want = torch.nn.functional.silu(poisoned[:, :n]) * poisoned[:, n:]
    assert out[0, 0].isnan() and want[0, 0].isnan() and out[0, 1] == want[0, 1]  # NaN stays NaN, inf stays inf

    with pytest.raises(ValueError, match="float16"):
        native.LayerOps(torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_passes_with_the_native_kernels_take_the_native_layer_ops(tiny_model, monkeypatch, dtype):
    """A float32 or bfloat16 pass runs its norms (the last one included), rotary embedding and MLP
    activation through `LayerOps` of its dtype, and the torch-operator pass does not; their logits
    agree to the dtype's rounding."""
    lm = copy.deepcopy(tiny_model).to(dtype)
    fast, ref = (SessionCaches(lm, 512, engine=EngineOptions(kernels=way)) for way in ("native", "torch"))
    assert fast.forward.ops is not None and fast.forward.ops.dtype == dtype and ref.forward.ops is None
    calls = []
    silu, norm = native.LayerOps.silu_mul, native.LayerOps.rms_norm
    monkeypatch.setattr(native.LayerOps, "silu_mul", lambda self, *a: calls.append("silu") or silu(self, *a))
    monkeypatch.setattr(native.LayerOps, "rms_norm", lambda self, *a: calls.append("norm") or norm(self, *a))
    history = [5, 6, 7, 8, 9, 10, 11]
    logits, _ = fast.score("a", history, [])
    layers = lm.config.num_hidden_layers
    assert calls.count("silu") == layers and calls.count("norm") == 2 * layers + 1
    want, _ = ref.score("a", history, [])
    scale = want.float().abs().max()
    assert (logits.float() - want.float()).abs().max() <= (1e-4 if dtype == torch.float32 else 0.05) * scale
