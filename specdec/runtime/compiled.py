"""The packed pass's layers through torch.compile (`--compile`), one graph shared by every layer.

Run eagerly, a Llama layer is some twenty small operator calls besides its four projections
(norms, rotary embedding, activation, residuals, splits and views), each costing microseconds of
Python and dispatch. Compiled, inductor fuses that elementwise work into a few generated kernels.

What is traced and what is not:
- One layer is one graph, the same for every layer: its norm weights are inputs, and its
  projections and index are integers (`SymInt`s), so one compile serves all layers. Tracing
  the whole stack as one graph (the loop over layers unrolled) would save the ~0.1-0.2 ms of
  guards and wrappers each call into a compiled region costs, but inductor took over 15 minutes
  to compile the 30 layers of SmolLM2-135M on 2 cores (the 2-layer test model: 40 s).
- Projections are an opaque operator, `specdec::projection(h, slot, out)`: it runs the layer's
  `projection.Projection` (oneDNN pre-packed where that is on), which inductor's own lowering does
  only for weights frozen as constants (one graph per layer).
- Attention is an opaque operator too, `specdec::attend_rows(q, k, v, owner, layer)`: it writes
  the new keys and values into each row's cache and attends there (`PackedForward._attend_rows`),
  for whatever rows the current pass holds (handed over in `_PASSES`), so the graph does not
  depend on how many sessions a pass packs or how their pasts are laid out.
- The number of new positions T is dynamic. Dynamo specialises the size 1 (and the integers 0
  and 1), so a pass of one position has a graph of its own: `PackedForward.warm_up` compiles
  T = 1 and a dynamic T >= 2 at service start and logs how long that took. Afterwards a call
  that would compile again runs eagerly instead (`torch.compiler.set_stance(
  "eager_on_recompile")`): correct, slower, never a compile inside a request.
- In float64 (the tests' exactness checks) the RMSNorm stays out of the fusion: transformers
  rounds the hidden states to float32 inside it, a rounding inductor's fusion skips (~1e-7).

Measured (`bench/engine.py --engines new,compiled`): on this 2-core CPU it does not pay for
SmolLM2-135M, the fused elementwise work saves about what the region and operator calls cost,
so `--compile` is off by default; see the README's engine table.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch

_SLOTS: list[Any] = [None, None]
"""Projections `specdec::projection` can run, by slot. Slots 0 and 1 stay empty: dynamo specialises
the integers 0 and 1, which would give the layers using them graphs of their own."""
_PASSES: dict[int, tuple[Any, list[Any]]] = {}
"""owner -> (its `PackedForward`, the rows of the pass it is running)."""
_LOCK = threading.Lock()

_lib = torch.library.Library("specdec", "DEF")  # noqa: TOR901 (operators defined once, at import)
_lib.define("projection(Tensor h, SymInt slot, SymInt out_features) -> Tensor")
_lib.define("attend_rows(Tensor q, Tensor k, Tensor v, SymInt owner, SymInt layer) -> Tensor")
_lib.define("rms_norm_exact(Tensor x, Tensor weight, float eps) -> Tensor")


def _projection(h: torch.Tensor, slot: int, out_features: int) -> torch.Tensor:
    return _SLOTS[slot].project(h)


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: int, layer: int) -> torch.Tensor:
    forward, rows = _PASSES[owner]
    return forward._attend_rows(layer - 2, q, k, v, rows, forward.scaling)  # layer i comes as i + 2 (see _SLOTS)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm as transformers computes it (the statistics in float32)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


for _device in ("CPU", "CUDA"):
    _lib.impl("projection", _projection, _device)
    _lib.impl("attend_rows", _attend_rows, _device)
    _lib.impl("rms_norm_exact", rms_norm, _device)


@torch.library.register_fake("specdec::projection", lib=_lib)
def _projection_shape(h: torch.Tensor, slot: int, out_features: int) -> torch.Tensor:
    return h.new_empty((*h.shape[:-1], out_features))


@torch.library.register_fake("specdec::attend_rows", lib=_lib)
def _attend_rows_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: int, layer: int) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


@torch.library.register_fake("specdec::rms_norm_exact", lib=_lib)
def _rms_norm_shape(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


def _register(projections: list[Any], owner: object) -> list[int]:
    """Slots for `projections`, freed when `owner` is collected."""
    with _LOCK:
        slots = list(range(len(_SLOTS), len(_SLOTS) + len(projections)))
        _SLOTS.extend(projections)
    weakref.finalize(owner, _release, slots)
    return slots


def _release(slots: list[int]) -> None:
    with _LOCK:
        for slot in slots:
            _SLOTS[slot] = None


class CompiledLayers:
    """`__call__(x, cos, sin, rows)`: every layer of `forward` (a `packed.PackedForward`) for the packed
    hidden states `x` `[T, hidden]`, compiled; attention runs on `rows`."""

    def __init__(self, forward: Any) -> None:
        self._forward = weakref.proxy(forward)
        flat = [p for layer in forward.layers for p in layer]
        self._slots = _register(flat, self)[::4]  # layer i's qkv, o, gate_up, down: 4 slots from _slots[i]
        self._qkv_sizes = list(flat[0].sizes)
        self._qkv = flat[0].width
        self._hidden = flat[1].sizes[0]
        self._inter = flat[2].sizes[0]
        layers = forward.base.layers
        self._norms = [(layer.input_layernorm.weight, layer.post_attention_layernorm.weight) for layer in layers]
        norm = layers[0].input_layernorm
        self._eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        self._exact_norm = norm.weight.dtype == torch.float64
        self._act = layers[0].mlp.act_fn
        self._rope = forward.rope
        self._owner = id(self)
        self.heads, self.kv_heads, self.head_dim = forward.heads, forward.kv_heads, forward.head_dim
        self._compiled = torch.compile(self._layer, dynamic=True, fullgraph=True)
        self.warm = False  # set by `PackedForward.warm_up` once every graph is compiled

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._exact_norm:
            return torch.ops.specdec.rms_norm_exact(x, weight, self._eps)
        return rms_norm(x, weight, self._eps)

    def _layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_in: torch.Tensor,
               norm_out: torch.Tensor, slot: int, index: int) -> torch.Tensor:
        """The traced code: one layer (the same graph for every layer: its weights are inputs, its
        projections' slots and its index integers)."""
        t, d = x.shape[0], self.head_dim
        q, k, v = torch.ops.specdec.projection(self._norm(x, norm_in), slot, self._qkv).split(self._qkv_sizes, dim=-1)
        q, k = self._rope(q.reshape(1, t, self.heads, d), k.reshape(1, t, self.kv_heads, d), cos, sin,
                          unsqueeze_dim=2)
        attended = torch.ops.specdec.attend_rows(q[0], k[0], v.reshape(t, self.kv_heads, d), self._owner, index)
        x = x + torch.ops.specdec.projection(attended, slot + 1, self._hidden)
        gate, up = torch.ops.specdec.projection(self._norm(x, norm_out), slot + 2, 2 * self._inter).split(
            [self._inter, self._inter], dim=-1)
        return x + torch.ops.specdec.projection(self._act(gate) * up, slot + 3, self._hidden)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: list[Any]) -> torch.Tensor:
        _PASSES[self._owner] = (self._forward, rows)
        try:
            with torch.compiler.set_stance("eager_on_recompile") if self.warm else contextlib.nullcontext():
                for index, (norm_in, norm_out) in enumerate(self._norms):
                    x = self._compiled(x, cos, sin, norm_in, norm_out, self._slots[index], index + 2)
            return x
        finally:
            del _PASSES[self._owner]
