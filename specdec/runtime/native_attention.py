"""The attention kernel (`csrc/attend.c`), called per layer for every row of a pass.

Decode and verify rows bring 1-21 new positions each, against pasts of thousands. Attention there
is a read of every key and value of the past: bytes, not arithmetic. torch's operators do it one
row and one call at a time, and read at 5-7 GB/s here (`scaled_dot_product_attention` for a
decode row; two matmuls and a softmax for a block): over half of a pass at 8 sessions x 4096
positions. The kernel attends all rows of a pass at one layer in ONE call: the work is
split over (row, key/value head, chunk of 1024 positions) and spread on torch's OpenMP threads,
each key/value row is read once for the G query heads that share it, and partial softmaxes are
merged as flash-decoding does. Measured on 2 cores (bench/engine.py; attention of 30 layers):
8 rows x 4096 past x 3 positions 278 -> 128 ms, 16 rows x 2000 x 1 243 -> 89 ms.

A prefill chunk goes through it too, as consecutive pieces of at most `MAX_QUERIES` queries
(`AttentionPlan`), each a short row whose past holds the pieces before it. Against torch's flash
kernel (`attention.attend`), a pass of the packaged model on 2 cores (bench/engine.py): 512
positions after 2,500 1.24 -> 0.80 s, 200 from nothing 0.21 -> 0.18 s; a bfloat16 model's 512
after 2,500 1.97 -> 0.55 s.

float32, float64 and bfloat16 keys and values; bfloat16 is computed in float32 (widened as loaded,
the output rounded once), where torch's bfloat16 attention is slow on a CPU without AMX.

The library is built or found by `specdec.runtime.native`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from specdec.runtime import native

MAX_QUERIES = 64
"""Most queries (query heads per key/value head x new positions) the kernel takes of a row at once;
`AttentionPlan` describes a longer row (a prefill chunk) as pieces of at most this many."""


class _Segment(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("kv_stride", ctypes.c_int64), ("layer_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64), ("pos_stride", ctypes.c_int64), ("start", ctypes.c_int64),
                ("width", ctypes.c_int64), ("layers", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("positions", ctypes.c_int64), ("dim", ctypes.c_int64), ("bytes", ctypes.c_int64)]


class _Row(ctypes.Structure):
    _fields_ = [("first_segment", ctypes.c_int32), ("segments", ctypes.c_int32), ("first_query", ctypes.c_int32),
                ("queries", ctypes.c_int32), ("past", ctypes.c_int64)]


class _Rows(ctypes.Structure):
    """q, out, new keys or values `[T, heads, D]` as the kernel reads them: base, strides, storage bytes."""

    _fields_ = [("base", ctypes.c_void_p), ("t_stride", ctypes.c_int64), ("h_stride", ctypes.c_int64),
                ("bytes", ctypes.c_int64)]

    @classmethod
    def of(cls, t: torch.Tensor) -> _Rows:
        return cls(t.data_ptr(), t.stride(0), t.stride(1), native.storage_bytes(t))


def _segment(view: torch.Tensor, start: int, width: int) -> _Segment:
    """A segment of the kernel's: `view` `[2, layers, heads, positions, D]` (any strides, D contiguous), of
    which the row reads `width` positions from absolute position `start` on."""
    stride = view.stride()
    if view.ndim != 5 or stride[4] != 1:
        raise ValueError("the attention kernel reads keys/values [2, layers, heads, positions, head_dim] with a "
                         "contiguous head_dim")
    return _Segment(view.data_ptr(), *stride[:4], start, width, *view.shape[1:], native.storage_bytes(view))


class AttentionPlan:
    """The kernel's description of a pass's rows (built once per pass, used at every layer).

    `rows`: per row, its `SessionKV`, where its block starts in the packed queries, its length and
    its past; `groups`: query heads per key/value head. A row of more than `MAX_QUERIES // groups`
    positions (a prefill chunk) is described as consecutive pieces of at most that many, each
    piece's past holding the pieces before it: a call stores every row's new keys and values
    before it attends, so each piece sees them. (Each piece reads its keys once for its queries, as
    a flash kernel's block of 64 queries does; the kernel's partial-softmax scratch grows with the
    pieces times their key chunks: ~10 MB for a 512-position chunk at 8,192 keys of the packaged
    model, whose keys and values there are 38 MB.) Every segment must be a view with a contiguous
    head_dim (`SessionKV`'s buffers are), of the session's own buffer's dtype, device and geometry:
    checked here (a shared prefix a session took from elsewhere is checked when it joins the
    session, `SessionKV`), and by the kernel once more against each view's sizes and storage, so a
    plan that got past this refuses to run (`KernelStatus.OUT_OF_BOUNDS`) rather than read past a
    buffer."""

    def __init__(self, rows: Sequence[tuple[Any, int, int, int]], groups: int = 1) -> None:
        if not 1 <= groups <= MAX_QUERIES:
            raise ValueError(f"the attention kernel takes 1 to {MAX_QUERIES} query heads per key/value head, "
                             f"not {groups}")
        most = MAX_QUERIES // groups
        segments: list[_Segment] = []
        described = []
        self.dtype: torch.dtype | None = None
        for kv, first_query, n, past in rows:
            own = kv.data
            self.dtype = self.dtype or own.dtype
            for view in (*kv.prefix, own):
                if view.dtype != self.dtype or view.device != own.device or view.ndim != 5 \
                        or view.shape[:3] != own.shape[:3] or view.shape[4] != own.shape[4]:
                    raise ValueError(f"a segment {view.dtype} {tuple(view.shape)} does not match the session's "
                                     f"keys/values {self.dtype} {tuple(own.shape)} (positions aside)")
            for lo in range(0, n, most):  # the segments cover exactly the keys a piece sees
                first, start, count = len(segments), 0, min(most, n - lo)
                for view in (*kv.prefix, own):
                    width = view.shape[3] if view is not own else past + lo + count - kv.offset
                    segments.append(_segment(view, start, width))
                    start += width
                described.append(_Row(first, len(segments) - first, first_query + lo, count, past + lo))
        self.count = len(described)
        self.rows = (_Row * self.count)(*described)
        self.segment_count = len(segments)
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
    t, heads, dim = q.shape
    if q.stride(2) != 1 or out.stride(2) != 1 or q.dtype != out.dtype or out.shape != q.shape:
        raise ValueError("the attention kernel needs q and out [T, H, D] with a contiguous head_dim and one dtype")
    if plan.dtype is not None and plan.dtype != q.dtype:
        raise ValueError(f"the plan's keys/values are {plan.dtype}, the queries {q.dtype}")
    stored: tuple[Any, Any] = (None, None)  # new keys and values: none to store
    if new is not None:
        k, v = new
        if k.stride(2) != 1 or v.stride(2) != 1 or k.dtype != q.dtype or v.dtype != q.dtype \
                or k.shape != (t, kv_heads, dim) or v.shape != (t, kv_heads, dim):
            raise ValueError("the attention kernel stores new keys and values [T, kv_heads, D] with a contiguous D, "
                             "in q's dtype")
        stored = (ctypes.byref(_Rows.of(k)), ctypes.byref(_Rows.of(v)))
    fn = getattr(lib, f"specdec_attend_{native.KINDS[q.dtype]}")
    rc = fn(plan.count, ctypes.addressof(plan.rows), plan.segment_count, ctypes.addressof(plan.segments), layer,
            kv_heads, heads // kv_heads, dim, t, ctypes.byref(_Rows.of(q)), *stored, ctypes.byref(_Rows.of(out)),
            scale, torch.get_num_threads())
    if rc == native.KernelStatus.BAD_SHAPE:
        raise ValueError(f"the attention kernel takes head_dim <= 256 and at most {MAX_QUERIES} queries a row")
    if rc:
        native.raise_status(rc, "the attention kernel")
