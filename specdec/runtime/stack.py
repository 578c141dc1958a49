"""A short pass's layers in one native call (`csrc/stack.c`).

The pass's layer loop (`PackedForward._native_layers`) makes ~9 kernel calls a layer; from Python
each costs a few microseconds of interpreter and ctypes around the kernel, ~270 calls a decode step
of SmolLM2-135M. Where every projection of every layer is one run of quantized weights (a GGUF's
blocks or `--quantize`: `QuantizedProjection`) and the native attention kernel takes every row of
the pass, `LayerStack.run` makes the same calls, in the same order and with the same arguments, from
C: the same bits, one call. Built once per model; the pass's buffers and attention plan are its
arguments.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from specdec.runtime import native
from specdec.runtime.native_attention import AttentionPlan
from specdec.runtime.quantized import CHUNK_ROWS, QuantizedProjection


class _Layer(ctypes.Structure):
    """stack.c's `specdec_llama_layer`."""

    _fields_ = [("qkv_count", ctypes.c_int32), ("o_count", ctypes.c_int32), ("gate_up_count", ctypes.c_int32),
                ("down_count", ctypes.c_int32), ("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p),
                ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p), ("norm_in", ctypes.c_void_p),
                ("norm_post", ctypes.c_void_p), ("eps_in", ctypes.c_float), ("eps_post", ctypes.c_float)]


LayerWeights = tuple[QuantizedProjection, QuantizedProjection, QuantizedProjection, QuantizedProjection,
                     torch.Tensor, float, torch.Tensor, float]
"""A layer's q/k/v, o, gate/up and down projections, its input RMSNorm's weight and epsilon, and its
post-attention RMSNorm's."""


class LayerStack:
    """Every layer of a Llama-structured model whose projections are all quantized, run by one call.

    `hidden`, `inter`, `heads`, `kv_heads`, `dim`: the model's geometry; each projection must have
    the inputs and outputs it implies (checked here: a model that does not fit gets no stack)."""

    def __init__(self, layers: Sequence[LayerWeights], hidden: int, inter: int, heads: int, kv_heads: int,
                 dim: int) -> None:
        lib, why = native.library()
        if lib is None:
            raise RuntimeError(why)
        self.hidden, self.inter, self.heads, self.kv_heads, self.dim = hidden, inter, heads, kv_heads, dim
        shapes = (((heads + 2 * kv_heads) * dim, hidden), (hidden, heads * dim), (2 * inter, hidden), (hidden, inter))
        described = []
        for weights in layers:
            projections, (norm_in, eps_in, norm_post, eps_post) = weights[:4], weights[4:]
            for p, (width, k) in zip(projections, shapes):
                if p.width != width or p.k != k:
                    raise ValueError(f"a projection of [{p.width}, {p.k}] where the model's geometry says "
                                     f"[{width}, {k}]")
            for norm in (norm_in, norm_post):
                if norm.dtype != torch.float32 or norm.shape != (hidden,) or not norm.is_contiguous():
                    raise ValueError(f"an RMSNorm weight {norm.dtype} {tuple(norm.shape)}, not float32 [{hidden}]")
            qkv, o, gate_up, down = projections
            described.append(_Layer(len(qkv.weights), len(o.weights), len(gate_up.weights), len(down.weights),
                                    qkv.address, o.address, gate_up.address, down.address, norm_in.data_ptr(),
                                    norm_post.data_ptr(), eps_in, eps_post))
        if not described:
            raise ValueError("a layer stack of no layers")
        self._keep = list(layers)  # the weights and norms the structs point into
        self._layers = (_Layer * len(described))(*described)
        self._fn = lib.specdec_llama_layers_f32

    def takes(self, t: int) -> bool:
        """Whether a pass of `t` rows runs here (the projections take up to `CHUNK_ROWS` in one call)."""
        return 1 <= t <= CHUNK_ROWS

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
            scale: float) -> torch.Tensor:
        """Every layer for `x` `[t, hidden]` float32 (updated in place: the residual stream), `cos`,
        `sin` `[t, dim]`; `plan` covers every row of the pass (their new keys/values are stored as
        the layers go). Returns `x`."""
        t = x.shape[0]
        if not self.takes(t) or x.shape != (t, self.hidden) or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"the layer stack takes x [1..{CHUNK_ROWS}, {self.hidden}] float32, contiguous")
        if cos.shape != (t, self.dim) or sin.shape != (t, self.dim) or cos.dtype != x.dtype or sin.dtype != x.dtype:
            raise ValueError(f"the layer stack takes cos and sin [{t}, {self.dim}] float32")
        if plan.dtype not in (None, torch.float32) or sum(row.queries for row in plan.rows) != t:
            raise ValueError("the layer stack's attention plan must cover every row of the pass, in float32")
        cos, sin = cos.contiguous(), sin.contiguous()
        width = (self.heads + 2 * self.kv_heads) * self.dim
        h, delta = torch.empty_like(x), torch.empty_like(x)
        qkv, attended = x.new_empty((t, width)), x.new_empty((t, self.heads * self.dim))
        gate_up, act = x.new_empty((t, 2 * self.inter)), x.new_empty((t, self.inter))
        rc = self._fn(len(self._layers), ctypes.addressof(self._layers), t, self.hidden, self.inter, self.heads,
                      self.kv_heads, self.dim, x.data_ptr(), h.data_ptr(), delta.data_ptr(), qkv.data_ptr(),
                      attended.data_ptr(), gate_up.data_ptr(), act.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      plan.count, ctypes.addressof(plan.rows), plan.segment_count, ctypes.addressof(plan.segments),
                      scale, torch.get_num_threads())
        if rc:
            native.raise_status(rc, "the layer stack")
        return x
