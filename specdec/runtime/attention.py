"""Attention of one row's new block to its keys and values, through torch's operators.

The packed pass (`packed.PackedForward`) sends its rows here when the native kernel does not run
(`native_attention`: no kernels built here, `--kernels torch`, a GPU). A row's
keys and values lie in segments (shared prefix views, then its own buffer), read in place; grouped
query heads share their key/value head without repeating it.

`attend` cuts a long block into chunks of `QUERY_CHUNK` queries (bounding the score matrix) and
sends each chunk down the path that is fastest for its shape, one small function each:

- one segment, one query (a decode step): `scaled_dot_product_attention` with its grouped heads
  (one call instead of five; measured on the CPU for 30 layers of SmolLM2-135M: 0.7 ms against 2.8
  ms at context 64, 23 against 24 ms at 4096);
- one segment, half precision: `scaled_dot_product_attention`, which accumulates in float32 as
  transformers' own path does;
- a block of at least `FLASH_FROM` positions in float32/float64 (a prefill chunk):
  `scaled_dot_product_attention` with a boolean mask and grouped heads, whose flash kernel never
  writes the score matrix to memory; several segments are joined first (a copy of the keys and
  values, small beside the arithmetic of a chunk). Measured for 30 layers of SmolLM2-135M on 2
  cores: a 512-position chunk after 2,488 positions 2,221 -> 976 ms against the matmuls below (with
  a 1,000-position shared prefix 1,742 -> 762), a 3,000-token prefill in 512-token chunks 8.1 -> 4.6 s;
- one segment and a shorter block, in float32/float64: plain matmuls (they beat
  `scaled_dot_product_attention` there, 13 against 21 ms for 3 queries at 4096, and take strided
  views without a copy);
- several segments (a shared prefix): the scores of every segment side by side, one softmax over
  them (exact, no copy of any key or value; the score matrix is the only thing joined), and the
  output summed segment by segment; in half precision the softmax runs in float32.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

QUERY_CHUNK = 256
"""A row's new positions attend in chunks of at most this many (bounds the score matrix)."""
FLASH_FROM = 8
"""Blocks of at least this many positions (prefill chunks) attend through `scaled_dot_product_attention`'s
flash kernel in float32/float64."""
_HALF = (torch.float16, torch.bfloat16)

Segment = tuple[torch.Tensor, torch.Tensor]  # keys, values [Hkv, m, D]


def attend(q: torch.Tensor, segments: list[Segment], past: int, scale: float) -> torch.Tensor:
    """Causal attention of one row's new block without repeating K/V heads (see the module docstring).

    q `[Hkv, G, n, D]` (query j is position past + j); `segments`: the row's keys and values
    `[Hkv, m_i, D]` in position order (shared prefix segments, then the row's own buffer: views,
    read in place) covering positions 0 .. past + n - 1; returns `[Hkv, G, n, D]`. Query j sees
    keys 0 .. past + j, so only the last n key columns (in the last segment) need a mask.
    """
    hkv, g, n, d = q.shape
    own_k, own_v = segments[-1]
    assert sum(k.shape[1] for k, _ in segments) == past + n and own_k.shape[1] >= n, (q.shape, past)
    before_own = past + n - own_k.shape[1]  # positions the shared segments hold
    out = q.new_empty(q.shape)
    for lo in range(0, n, QUERY_CHUNK):
        hi = min(n, lo + QUERY_CHUNK)
        cut = past + hi - before_own  # own-buffer keys the chunk's last query sees
        seen = [*segments[:-1], (own_k[:, :cut], own_v[:, :cut])]
        out[:, :, lo:hi] = _attend_chunk(q[:, :, lo:hi], seen, scale).view(hkv, g, hi - lo, d)
    return out


def _attend_chunk(q: torch.Tensor, segments: list[Segment], scale: float) -> torch.Tensor:
    """Queries `q` `[Hkv, G, c, D]`, the last c positions of what `segments` hold, attended to them;
    a tensor of `Hkv * G * c * D` elements in that order."""
    c, low, one = q.shape[2], q.dtype in _HALF, len(segments) == 1
    if one and c == 1:
        return _decode_step(q, segments[0], scale)
    if one and low:
        return _half_block(q, segments[0], scale)
    if c >= FLASH_FROM and not low:
        return _flash_block(q, segments, scale)
    if one:
        return _matmul_block(q, segments[0], scale)
    return _segmented_block(q, segments, scale)


def _decode_step(q: torch.Tensor, segment: Segment, scale: float) -> torch.Tensor:
    """One query a head: one fused call, the K/V heads shared (no repeat)."""
    hkv, g, _, d = q.shape
    keys, values = segment
    return F.scaled_dot_product_attention(q.reshape(1, hkv * g, 1, d), keys[None], values[None], scale=scale,
                                          enable_gqa=True)


def _half_block(q: torch.Tensor, segment: Segment, scale: float) -> torch.Tensor:
    """A block in half precision over one segment (the kernel accumulates in float32)."""
    hkv, g, c, d = q.shape
    keys, values = segment
    chunk = q.reshape(hkv, g * c, d)
    full = None
    if c > 1:
        seen = keys.shape[1]
        full = chunk.new_zeros((g * c, seen))
        full[:, seen - c:] = _future_mask(c, g, torch.float32, q.device).to(chunk.dtype)
    return F.scaled_dot_product_attention(chunk, keys, values, attn_mask=full, scale=scale)


def _flash_block(q: torch.Tensor, segments: list[Segment], scale: float) -> torch.Tensor:
    """A long block (a prefill chunk): flash attention, no score matrix in memory."""
    hkv, g, c, d = q.shape
    keys = segments[0][0] if len(segments) == 1 else torch.cat([k for k, _ in segments], dim=1)
    values = segments[0][1] if len(segments) == 1 else torch.cat([v for _, v in segments], dim=1)
    seen = keys.shape[1]
    allowed = torch.ones(c, seen, dtype=torch.bool, device=q.device).tril(seen - c)
    return F.scaled_dot_product_attention(q.reshape(1, hkv * g, c, d), keys[None], values[None], attn_mask=allowed,
                                          scale=scale, enable_gqa=True)


def _matmul_block(q: torch.Tensor, segment: Segment, scale: float) -> torch.Tensor:
    """A short block over one segment: two matmuls on the strided views, no copy."""
    hkv, g, c, d = q.shape
    keys, values = segment
    scores = torch.matmul(q.reshape(hkv, g * c, d) * scale, keys.transpose(1, 2))  # [Hkv, G * c, seen]
    if c > 1:  # query i must not see the chunk's keys after its own
        scores[:, :, keys.shape[1] - c:] += _future_mask(c, g, q.dtype, q.device)
    return torch.matmul(scores.softmax(-1), values)


def _segmented_block(q: torch.Tensor, segments: list[Segment], scale: float) -> torch.Tensor:
    """A short block over several segments: one softmax over their scores side by side, the values
    summed segment by segment."""
    hkv, g, c, d = q.shape
    chunk = q.reshape(hkv, g * c, d)
    low = q.dtype in _HALF
    scores = torch.cat([torch.matmul(chunk * scale, k.transpose(1, 2)) for k, _ in segments], dim=-1)
    if low:
        scores = scores.float()
    if c > 1:
        scores[:, :, scores.shape[-1] - c:] += _future_mask(c, g, torch.float32 if low else q.dtype, q.device)
    probs = scores.softmax(-1).to(q.dtype).split([k.shape[1] for k, _ in segments], dim=-1)
    out = torch.matmul(probs[0], segments[0][1])
    for p, (_, v) in zip(probs[1:], segments[1:]):
        out.add_(torch.matmul(p, v))
    return out


@functools.lru_cache(maxsize=64)
def _future_mask(c: int, g: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[G * c, c]`: -inf where key j comes after query i (j > i) within a chunk, else 0."""
    upper = torch.ones((c, c), dtype=torch.bool, device=device).triu(1)
    return torch.zeros((c, c), dtype=dtype, device=device).masked_fill(upper, float("-inf")).repeat(g, 1)
