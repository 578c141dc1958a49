"""Block formats (`specdec.core.quant`): de-quantization bit for bit what the `gguf` package computes
(transformers' GGUF loader), exhaustively over the values a block can hold; the int4/int8 quantizer."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specdec.core import quant

gguf_quants = pytest.importorskip("gguf.quants")

SPECIAL = np.array([0.0, -0.0, 1.0, -1.5, 6.1e-05, 6e-08, -6e-08, 65504.0, -65504.0, np.inf, -np.inf, np.nan, 0.0123],
                   dtype=np.float16)
"""Scales and minimums a block can store: signed zeros, subnormals, the largest, infinities, NaN."""


def same_bits(ours: torch.Tensor, theirs: np.ndarray) -> bool:
    a, b = ours.numpy(), np.asarray(theirs, dtype=np.float32).reshape(ours.shape)
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


def reference(raw: np.ndarray, fmt: quant.BlockFormat) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf_quants.dequantize(raw, gguf_quants.GGMLQuantizationType(fmt.ggml))


def blocks_4bit(fmt: quant.BlockFormat) -> np.ndarray:
    """Every pair of special (d, m) with every nibble value in every position (two bytes a value)."""
    nibbles = np.arange(256, dtype=np.uint8)  # low and high nibble: all 16 x 16
    rows = []
    pairs = itertools.product(SPECIAL, SPECIAL if fmt.kind == "asym4" else SPECIAL[:1])
    for d, m in pairs:
        for start in range(0, 256, 16):
            head = [np.array([d], dtype=np.float16).view(np.uint8)]
            if fmt.kind == "asym4":
                head.append(np.array([m], dtype=np.float16).view(np.uint8))
            rows.append(np.concatenate([*head, np.roll(nibbles, start)[:16]]))
    return np.stack(rows)


@pytest.mark.parametrize("fmt", [quant.Q4_0, quant.Q4_1], ids=lambda f: f.name)
def test_4bit_blocks_dequantize_as_gguf_for_every_nibble_and_special_scale(fmt):
    raw = blocks_4bit(fmt)
    assert raw.shape[1] == fmt.nbytes
    ours = quant.dequantize(raw, fmt, (raw.shape[0], 32))
    assert same_bits(ours, reference(raw, fmt))
    assert torch.isnan(ours).any() and torch.isinf(ours).any()  # the special scales were exercised


def test_q8_0_dequantizes_as_gguf_for_every_value_and_special_scale():
    values = np.arange(256, dtype=np.uint8).reshape(8, 32)
    raw = np.stack([np.concatenate([np.array([d], dtype=np.float16).view(np.uint8), row])
                    for d in SPECIAL for row in values])
    assert same_bits(quant.dequantize(raw, quant.Q8_0, (raw.shape[0], 32)), reference(raw, quant.Q8_0))


@pytest.mark.parametrize("fmt", [quant.Q4_K, quant.Q6_K], ids=lambda f: f.name)
def test_k_quants_dequantize_as_gguf(fmt):
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(64, fmt.nbytes), dtype=np.uint8)
    scale_at = (0, 2) if fmt.kind == "q4_k" else (208,)
    for at in scale_at:  # half the blocks with sane scales, the rest random bits (NaN, inf included)
        raw[:32, at:at + 2] = rng.uniform(-1, 1, (32, 1)).astype(np.float16).view(np.uint8)
    ours = quant.dequantize(raw, fmt, (4, 16 * fmt.group))
    assert same_bits(ours, reference(raw.reshape(4, -1), fmt))


def test_grouped_formats_are_q4_1_and_q8_0_at_32_and_repeat_their_runs_beyond():
    assert quant.int4_format(32) is quant.Q4_1 and quant.int8_format(32) is quant.Q8_0
    assert quant.format_named("int4g128").nbytes == 4 + 64 and quant.format_named("int8g64").nbytes == 2 + 64
    rng = np.random.default_rng(2)
    g64 = quant.int4_format(64)
    raw = rng.integers(0, 256, size=(5, g64.nbytes), dtype=np.uint8)
    raw[:, :4] = rng.uniform(-1, 1, (5, 2)).astype(np.float16).view(np.uint8)
    # the same block as two q4_1 blocks with the same d and m
    halves = np.concatenate([raw[:, :4], raw[:, 4:20], raw[:, :4], raw[:, 20:36]], axis=1)
    assert torch.equal(quant.dequantize(raw, g64, (5, 64)), quant.dequantize(halves, quant.Q4_1, (5, 64)))
    for bad in (0, 16, 48, 33, -32):
        with pytest.raises(ValueError):
            quant.int4_format(bad)
    with pytest.raises(ValueError, match="unknown block format"):
        quant.format_named("int3g32")


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="whole number of blocks"):
        quant.Q4_1.row_bytes(48)
    with pytest.raises(ValueError, match="takes 40 bytes"):
        quant.dequantize(np.zeros(41, dtype=np.uint8), quant.Q4_1, (2, 32))


@pytest.mark.parametrize("shape", [(3, 32), (7, 96), (1, 576)])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_quantizer_stores_what_it_reconstructs_and_beats_min_max(shape, group):
    if shape[1] % group:
        pytest.skip("not a whole number of groups")
    gen = torch.Generator().manual_seed(shape[0] * group)
    w = torch.randn(shape, generator=gen) * 0.05 + torch.randn(shape[0], 1, generator=gen) * 0.01
    fmt = quant.int4_format(group)
    raw = quant.quantize_int4(w, group)
    assert raw.dtype == torch.uint8 and tuple(raw.shape) == (shape[0], fmt.row_bytes(shape[1]))
    back = quant.dequantize(raw, fmt, shape)
    err = float(((back - w) ** 2).sum())
    plain = w.reshape(-1, group)  # q4_1 as ggml quantizes it: min/max, no search
    d = (plain.max(1, keepdim=True).values - plain.min(1, keepdim=True).values) / 15
    q = torch.clamp(torch.round((plain - plain.min(1, keepdim=True).values) / d), 0, 15)
    naive = float(((q * d + plain.min(1, keepdim=True).values - plain) ** 2).sum())
    assert err <= naive * 1.01
    assert float((back - w).abs().max()) <= float(d.max()) * 0.6 + 1e-3


def test_int8_quantizer_error_is_half_a_step():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(9, 128, generator=gen)
    raw = quant.quantize_int8(w, 64)
    back = quant.dequantize(raw, quant.int8_format(64), (9, 128))
    step = w.reshape(-1, 64).abs().max(1, keepdim=True).values / 127
    assert ((back - w).reshape(-1, 64).abs() <= step * 0.5 + step * 2e-3).all()


def test_quantizers_take_constant_groups_and_refuse_what_fp16_cannot_hold():
    w = torch.zeros(2, 64)
    w[1] = 0.25
    for bits, fmt in (("int4", quant.Q4_1), ("int8", quant.Q8_0)):
        quantize = quant.quantize_int4 if bits == "int4" else quant.quantize_int8
        back = quant.dequantize(quantize(w), fmt, (2, 64))
        if bits == "int4":  # a constant group is its minimum, exactly
            assert torch.equal(back, w)
        else:
            torch.testing.assert_close(back, w, rtol=2e-3, atol=0)
        for bad in (float("inf"), float("nan")):
            with pytest.raises(ValueError, match="finite"):
                quantize(torch.full((1, 32), bad))
        with pytest.raises(ValueError, match="fp16"):
            quantize(torch.full((1, 32), 1e5))
        with pytest.raises(ValueError, match="multiple of"):
            quantize(torch.zeros(2, 48))
