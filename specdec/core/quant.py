"""Block-quantized weights as data: the formats, their exact de-quantization, and a quantizer.

A quantized matrix `[n, k]` is `n` rows of `k / G` blocks laid end to end, each block `G` weights
in `nbytes` bytes. What every format stores, per block (fp16 little-endian scales, converted to
float32 exactly, as the `gguf` package and ggml do):

    q4_0   G = 32, 18 bytes: d, 16 bytes of nibbles       w = d * (q - 8),        q in 0..15
    q4_1   G = 32, 20 bytes: d, m, 16 bytes of nibbles    w = d * q + m,          q in 0..15
    q8_0   G = 32, 34 bytes: d, 32 int8                   w = d * q,              q in -128..127
    q4_k   G = 256, 144 bytes (ggml's K-quant)            de-quantization only
    q6_k   G = 256, 210 bytes (ggml's K-quant)            de-quantization only
    int4gG G = 32 j, 4 + G/2 bytes: d, m, nibbles         w = d * q + m  (q4_1 with groups of G)
    int8gG G = 32 j, 2 + G bytes: d, G int8               w = d * q      (q8_0 with groups of G)

Nibbles: within each 32 weights of a block, byte j holds weight j in its low four bits and weight
j + 16 in its high four (ggml's order). `int4g32` and `int8g32` are byte for byte `q4_1` and `q8_0`.

`dequantize` computes exactly what `gguf.quants.dequantize` (transformers' GGUF loader) computes,
in float32, bit for bit, including the sign of zeros and non-finite scales: every product `d * q`
here is exact in float32 (an 11-bit scale times a 4- or 8-bit integer), so the only rounding is
q4_1's one addition, which a fused multiply-add reproduces too.

`quantize_int4` / `quantize_int8`: the weight-only quantizer behind `--quantize int4|int8`. Why
asymmetric int4 (a scale and a minimum, like q4_1) with fp16 scales: the kernel's cost per weight
is one multiply-add either way (`d * q + m` against `d * (q - 8)`), fp16 scales halve the bytes
the scales add (a read of weights is what a decode step costs), and at group 32 the result is
q4_1, the format the packaged model ships and the kernel runs fastest. The minimum and scale are
chosen per group by a small search of clipped ranges, rounding to what is stored (fp16), for the
least squared error: see `quantize_int4`. Relative RMS error, 512 x 1536 Gaussian weights
(Student-t(4) in brackets): int4g32 0.075 (0.090), q4_1 as ggml quantizes it (min/max) 0.078
(0.094); at 0.5625 bytes a weight, int4g64 0.086 (0.112) against q4_0 0.086 (0.115); int4g128
0.094 (0.136); int8g32 0.0053 (0.0074), int8g128 0.0065 (0.011).

Pure: numpy and torch, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

SUB = 32
"""Weights per nibble run: the nibble order repeats every 32 weights whatever the group size."""


@dataclass(frozen=True)
class BlockFormat:
    """One way of storing a matrix's rows in blocks.

    `kind`: how a block is decoded ("sym4": d then nibbles, w = d (q - 8); "asym4": d, m then
    nibbles, w = d q + m; "sym8": d then int8, w = d q; "q4_k", "q6_k": ggml's K-quants).
    `ggml`: the GGUF tensor type this format is (None for groups other than ggml's).
    `native`: whether `quant.c`'s linear kernel runs it (the K-quants are de-quantized at load)."""

    name: str
    kind: str
    group: int  # weights per block
    nbytes: int  # bytes per block
    ggml: int | None
    native: bool

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of `k` weights (k a multiple of the group)."""
        if k % self.group:
            raise ValueError(f"{self.name}: a row of {k} weights is not a whole number of blocks of {self.group}")
        return k // self.group * self.nbytes


# ggml's type numbers (gguf.GGMLQuantizationType), kept here so the formats need no gguf import.
GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_Q4_K, GGML_Q6_K = 2, 3, 8, 12, 14

Q4_0 = BlockFormat("q4_0", "sym4", 32, 18, GGML_Q4_0, True)
Q4_1 = BlockFormat("q4_1", "asym4", 32, 20, GGML_Q4_1, True)
Q8_0 = BlockFormat("q8_0", "sym8", 32, 34, GGML_Q8_0, True)
Q4_K = BlockFormat("q4_k", "q4_k", 256, 144, GGML_Q4_K, False)
Q6_K = BlockFormat("q6_k", "q6_k", 256, 210, GGML_Q6_K, False)
GGUF_FORMATS = {f.ggml: f for f in (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)}
"""The GGUF block types this module reads, by ggml type number."""


def int4_format(group: int) -> BlockFormat:
    """Asymmetric 4-bit groups of `group` weights (a multiple of 32): `q4_1` at 32."""
    _check_group(group)
    return Q4_1 if group == SUB else BlockFormat(f"int4g{group}", "asym4", group, 4 + group // 2, None, True)


def int8_format(group: int) -> BlockFormat:
    """Symmetric 8-bit groups of `group` weights (a multiple of 32): `q8_0` at 32."""
    _check_group(group)
    return Q8_0 if group == SUB else BlockFormat(f"int8g{group}", "sym8", group, 2 + group, None, True)


def format_named(name: str) -> BlockFormat:
    """A format from its name: q4_0, q4_1, q8_0, q4_k, q6_k, int4gG, int8gG."""
    for f in GGUF_FORMATS.values():
        if f.name == name:
            return f
    match = re.fullmatch(r"int([48])g(\d+)", name)
    if match is None:
        raise ValueError(f"unknown block format {name!r}: q4_0, q4_1, q8_0, q4_k, q6_k, int4gG or int8gG")
    return (int4_format if match[1] == "4" else int8_format)(int(match[2]))


def _check_group(group: int) -> None:
    if not isinstance(group, int) or group < SUB or group % SUB:
        raise ValueError(f"a group is a positive multiple of {SUB} weights, not {group!r}")


# --------------------------------------------------------------------------- de-quantization


def _blocks(raw: np.ndarray | torch.Tensor, fmt: BlockFormat, shape: tuple[int, int]) -> np.ndarray:
    """`raw` as `[n * k / G, nbytes]` uint8, checked against `shape`."""
    data = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    data = data.reshape(-1).view(np.uint8)
    n, k = shape
    if data.size != n * fmt.row_bytes(k):
        raise ValueError(f"{fmt.name} {list(shape)} takes {n * fmt.row_bytes(k)} bytes, not {data.size}")
    return data.reshape(-1, fmt.nbytes)


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block, as float32 `[blocks, 1]`."""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """`[blocks, G / 2]` bytes -> `[blocks, G]` nibble values in weight order (uint8)."""
    runs = qs.reshape(qs.shape[0], -1, 1, SUB // 2)  # [blocks, runs, 1, 16]
    q = runs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)  # low nibbles, then high
    return (q & np.uint8(0x0F)).reshape(qs.shape[0], -1)


def scales(raw: np.ndarray | torch.Tensor, fmt: BlockFormat, shape: tuple[int, int]) -> np.ndarray:
    """Every block's stored fp16 scales as float32 `[blocks, 1 or 2]` (d, and m for asym4; d and
    dmin for q4_k; d for q6_k): what a loader checks for non-finite values."""
    blocks = _blocks(raw, fmt, shape)
    if fmt.kind == "q6_k":
        return _half(blocks, 208)
    if fmt.kind in ("asym4", "q4_k"):
        return np.concatenate([_half(blocks, 0), _half(blocks, 2)], axis=1)
    return _half(blocks, 0)


def dequantize(raw: np.ndarray | torch.Tensor, fmt: BlockFormat, shape: tuple[int, int]) -> torch.Tensor:
    """The float32 matrix `[n, k]` that `raw` (the blocks of `shape`, row after row) stores; bit for
    bit what `gguf.quants.dequantize` computes for the ggml formats."""
    blocks = _blocks(raw, fmt, shape)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite scales give what gguf gives
        w = _dequantize_blocks(blocks, fmt)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(shape))


def _dequantize_blocks(blocks: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    if fmt.kind == "sym4":
        q = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
        w = _half(blocks, 0) * q.astype(np.float32)
    elif fmt.kind == "asym4":
        w = _half(blocks, 0) * _nibbles(blocks[:, 4:]).astype(np.float32) + _half(blocks, 2)
    elif fmt.kind == "sym8":
        w = blocks[:, 2:].view(np.int8).astype(np.float32) * _half(blocks, 0)
    elif fmt.kind == "q4_k":
        w = _dequantize_q4_k(blocks)
    elif fmt.kind == "q6_k":
        w = _dequantize_q6_k(blocks)
    else:
        raise ValueError(f"no de-quantization for {fmt.name}")
    return w


def _dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """ggml's Q4_K: super-blocks of 256 = 8 runs of 32, 6-bit scales and minimums per run."""
    n = blocks.shape[0]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    lo, hi, mix = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    scale = (d * sc.astype(np.float32)).reshape(n, -1, 1)
    low = (dmin * mn.astype(np.float32)).reshape(n, -1, 1)
    qs = blocks[:, 16:].reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(n, -1, 32).astype(np.float32)
    return (scale * q - low).reshape(n, 256)


def _dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """ggml's Q6_K: super-blocks of 256, 4 low and 2 high bits per weight, int8 scales per 16."""
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scale = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = (_half(blocks, 208) * scale).reshape(n, 16, 1)
    low = ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low & np.uint8(0x0F)).reshape(n, -1, 32)
    high = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & np.uint8(0x03)).reshape(n, -1, 32)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return (d * q.reshape(n, 16, -1).astype(np.float32)).reshape(n, 256)


# --------------------------------------------------------------------------- quantization

CLIPS = (1.0, 0.975, 0.95, 0.925, 0.9, 0.875, 0.85, 0.8)
"""The fractions of a group's range `quantize_int4` tries (shrunk around its centre)."""


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """`[blocks, G]` values 0..15 in weight order -> `[blocks, G / 2]` bytes (ggml's order)."""
    runs = q.reshape(q.shape[0], -1, 2, SUB // 2).astype(np.uint8)
    return (runs[:, :, 0] | (runs[:, :, 1] << np.uint8(4))).reshape(q.shape[0], -1)


def _finite_weights(weight: torch.Tensor, group: int) -> np.ndarray:
    """`weight` `[n, k]` as float32 groups `[n * k / group, group]`; refuses what cannot be stored."""
    if weight.dim() != 2 or weight.shape[1] % group:
        raise ValueError(f"quantizing takes a matrix [n, k] with k a multiple of {group}, not {list(weight.shape)}")
    w = weight.detach().to(torch.float32).cpu().numpy()
    if not np.isfinite(w).all():
        raise ValueError("quantizing takes finite weights")
    if np.abs(w).max(initial=0.0) > 60000.0:
        raise ValueError("weights beyond +-60000 do not fit fp16 scales and minimums")
    return w.reshape(-1, group)


def quantize_int4(weight: torch.Tensor, group: int = SUB) -> torch.Tensor:
    """`weight` `[n, k]` -> the raw blocks of `int4_format(group)` (uint8, `[n, row_bytes]`).

    Per group: for each clip fraction in `CLIPS`, the range [lo, hi] shrunk by it around its
    centre gives d = fp16((hi - lo) / 15), m = fp16(lo) (rounded as stored), q = clamp(round((w -
    m) / d), 0, 15); the fraction whose de-quantized group is closest (squared error) is kept. A
    constant group stores d = 0, m = fp16(w)."""
    fmt = int4_format(group)
    w = _finite_weights(weight, group)
    lo, hi = w.min(axis=1, keepdims=True), w.max(axis=1, keepdims=True)
    centre, half = (lo + hi) / 2, (hi - lo) / 2
    best_err = np.full((w.shape[0], 1), np.inf, dtype=np.float64)
    best_q = np.zeros(w.shape, dtype=np.uint8)
    best_d = np.zeros((w.shape[0], 1), dtype=np.float16)
    best_m = np.zeros((w.shape[0], 1), dtype=np.float16)
    for clip in CLIPS:
        m = (centre - half * clip).astype(np.float16)
        d = (2 * half * clip / 15).astype(np.float16)
        d32, m32 = d.astype(np.float32), m.astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(d32 > 0, np.rint((w - m32) / d32), 0)
        q = np.clip(q, 0, 15).astype(np.uint8)
        err = ((d32 * q.astype(np.float32) + m32 - w).astype(np.float64) ** 2).sum(axis=1, keepdims=True)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_q = np.where(better, q, best_q)
        best_d, best_m = np.where(better, d, best_d), np.where(better, m, best_m)
    out = np.concatenate([best_d.view(np.uint8), best_m.view(np.uint8), _pack_nibbles(best_q)], axis=1)
    assert out.shape[1] == fmt.nbytes
    return torch.from_numpy(np.ascontiguousarray(out).reshape(weight.shape[0], -1))


def quantize_int8(weight: torch.Tensor, group: int = SUB) -> torch.Tensor:
    """`weight` `[n, k]` -> the raw blocks of `int8_format(group)`: d = fp16(max |w| / 127),
    q = clamp(round(w / d), -127, 127) against the stored d."""
    fmt = int8_format(group)
    w = _finite_weights(weight, group)
    d = (np.abs(w).max(axis=1, keepdims=True) / 127).astype(np.float16)
    d32 = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d32 > 0, np.rint(w / d32), 0)
    q = np.clip(q, -127, 127).astype(np.int8)
    out = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=1)
    assert out.shape[1] == fmt.nbytes
    return torch.from_numpy(np.ascontiguousarray(out).reshape(weight.shape[0], -1))
