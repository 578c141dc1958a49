"""The attention kernel for short blocks (`csrc/attend.c`), called per layer.

Decode and verify rows bring 1-21 new positions each, against pasts of thousands. Attention there
is a read of every key and value of the past: bytes, not arithmetic. torch's operators do it one
row and one call at a time, and read at 5-7 GB/s here (`scaled_dot_product_attention` for a
decode row; two matmuls and a softmax for a block): over half of a pass at 8 sessions x 4096
positions. The kernel attends all short rows of a pass at one layer in ONE call: the work is
split over (row, key/value head, chunk of 1024 positions) and spread on torch's OpenMP threads,
each key/value row is read once for the G query heads that share it, and partial softmaxes are
merged as flash-decoding does. Measured on 2 cores (bench/engine.py; attention of 30 layers):
8 rows x 4096 past x 3 positions 278 -> 128 ms, 16 rows x 2000 x 1 243 -> 89 ms.

The library is built or found by `specdec.runtime.native`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from specdec.runtime import native

MAX_QUERIES = 64
"""Most queries (query heads per key/value head x new positions) a row may bring to the kernel;
longer blocks (prefill chunks) are matmul-shaped and take torch's path."""


class _Segment(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("kv_stride", ctypes.c_int64), ("layer_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64), ("pos_stride", ctypes.c_int64), ("start", ctypes.c_int64),
                ("width", ctypes.c_int64)]


class _Row(ctypes.Structure):
    _fields_ = [("first_segment", ctypes.c_int32), ("segments", ctypes.c_int32), ("first_query", ctypes.c_int32),
                ("queries", ctypes.c_int32), ("past", ctypes.c_int64)]


class AttentionPlan:
    """The kernel's description of a pass's short rows (built once per pass, used at every layer).

    `rows`: per row, its `SessionKV`, where its block starts in the packed queries, its length and
    its past. Every segment must be a view with a contiguous head_dim (`SessionKV`'s buffers are)."""

    def __init__(self, rows: Sequence[tuple[Any, int, int, int]]) -> None:
        segments: list[_Segment] = []
        described = []
        for kv, first_query, n, past in rows:
            first = len(segments)
            start = 0
            for view in (*kv.prefix, kv.data):
                width = view.shape[3] if view is not kv.data else past + n - kv.offset
                stride = view.stride()
                if stride[4] != 1:
                    raise ValueError("the attention kernel reads keys/values with a contiguous head_dim")
                segments.append(_Segment(view.data_ptr(), *stride[:4], start, width))
                start += width
            described.append(_Row(first, len(segments) - first, first_query, n, past))
        self.count = len(described)
        self.rows = (_Row * self.count)(*described)
        self.segments = (_Segment * len(segments))(*segments)


def attend(plan: AttentionPlan, layer: int, q: torch.Tensor, out: torch.Tensor, kv_heads: int, scale: float,
           new: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Attention of the plan's rows at `layer`: queries `q` `[T, H, D]` (any strides, D contiguous;
    query head h belongs to key/value head h // (H / kv_heads)) into `out` `[T, H, D]` (same), at
    the rows' positions. `new`: the pass's new keys and values `[T, kv_heads, D]` (any strides, D
    contiguous), which the kernel first stores at the rows' positions in their own buffers
    (a call for all rows, where `SessionKV.write` is two copies a row); without it they must be
    written already."""
    lib, why = native.library()
    if lib is None:
        raise RuntimeError(why)
    _, heads, dim = q.shape
    if q.stride(2) != 1 or out.stride(2) != 1 or q.dtype != out.dtype:
        raise ValueError("the attention kernel needs q and out with a contiguous head_dim and one dtype")
    stored: tuple[Any, ...] = (None, 0, 0, None, 0, 0)  # keys, their strides, values, theirs: none to store
    if new is not None:
        k, v = new
        if k.stride(2) != 1 or v.stride(2) != 1 or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError("the attention kernel stores new keys and values with a contiguous D, in q's dtype")
        stored = (k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1))
    fn = getattr(lib, f"specdec_attend_{native.KINDS[q.dtype]}")
    rc = fn(plan.count, ctypes.addressof(plan.rows), ctypes.addressof(plan.segments), layer, kv_heads,
            heads // kv_heads, dim, q.data_ptr(), q.stride(0), q.stride(1), *stored, out.data_ptr(),
            out.stride(0), out.stride(1), scale, torch.get_num_threads())
    status = native.KernelStatus(rc)
    if status == native.KernelStatus.BAD_SHAPE:
        raise ValueError(f"the attention kernel takes head_dim <= 256 and at most {MAX_QUERIES} queries a row")
    if status == native.KernelStatus.PREFIX_WRITE:
        raise ValueError("a row's new positions lie in its shared prefix (read-only)")
    if status == native.KernelStatus.NO_MEMORY:
        raise MemoryError("the attention kernel could not allocate its scratch memory")
