"""One forward pass over several sessions' new tokens, packed into one sequence, no padding.

Every session (row) of a pass brings `n_i` new tokens after a past of `L_i` cached ones. The
pass lays all new tokens end to end, `[1, T = sum n_i, hidden]`, with explicit positions
(`L_i .. L_i + n_i - 1` for row i), so every linear layer (projections, MLP) runs ONCE over all
rows. Only attention is per row, and it reads the row's keys/values where they lie:

    per layer, per row i:   write k_i, v_i  [Hkv, n_i, D] into the row's buffer at L_i (in place)
                            q_i [Hq, n_i, D] viewed as [Hkv, G * n_i, D]   (G = Hq / Hkv)
                            attend to keys/values [Hkv, L_i + n_i, D] (a view of the buffer)

so grouped-query attention needs no repeated K/V heads, and the causal mask only concerns the
new block (query j of row i sees keys 0 .. L_i + j). On torch's path long blocks (a prefill)
attend in chunks of `QUERY_CHUNK` positions so the score matrix stays small. Logits are computed only for the
positions a row asks for.

This wires the model's own modules (embeddings, norms, projections, rotary embedding, MLP, LM
head) for the Llama layer structure (`supports` checks it); the attention and the cache are
ours. We call the modules rather than hooking transformers' attention interface because that
interface is chosen by the model's config (shared with every other user of the model object) and
its forward builds a 4-D mask over the padded batch that a packed pass does not need.
Other architectures take `GenericForward`: one session at a time through transformers.

Which options the pass runs with (pre-packed weights, the compiled layers, the native kernels)
comes decided in an `engine_plan.EnginePlan`; the projections are `projection.Projection`s, the
attention is the native kernel's (`native_attention`, every row of a pass in one call a layer) or,
where it does not run, `attention.attend`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # transformers' model code loads with the model: a model-free draft service starts without it
    from transformers import PreTrainedModel

from specdec.runtime import native, native_attention
from specdec.runtime.attention import QUERY_CHUNK, attend
from specdec.runtime.compiled import CompiledLayers
from specdec.runtime.engine_plan import EnginePlan, supports
from specdec.runtime.kv_buffer import SessionKV
from specdec.runtime.native_attention import AttentionPlan
from specdec.runtime.projection import LINEAR_ROW_CANDIDATES, Projection, measure_linear_rows
from specdec.runtime.quantized import QuantizedProjection
from specdec.runtime.stack import LayerStack
from specdec.runtime.weights import matrix, output_layer

# With the pass's own names, those its callers knew it by before attention and projections moved out.
__all__ = ["QUERY_CHUNK", "LINEAR_ROW_CANDIDATES", "Forward", "GenericForward", "PackedForward", "PackedRow",
           "attend", "build_forward", "forward_generic", "kv_geometry", "supports"]

log = logging.getLogger(__name__)

LayerProjections = tuple[Projection, Projection, Projection, Projection]
"""A layer's fused q/k/v, o, gate/up and down."""


@dataclass
class PackedRow:
    """One session's part of a pass: its cache, the tokens it feeds, how many last logits it wants."""

    kv: SessionKV
    tokens: list[int]
    keep: int


class Forward(Protocol):
    """A forward pass over rows: feeds each row's tokens into its `SessionKV`, returns each row's last
    `keep` logits `[keep, V]` (possibly views of one tensor)."""

    compiled: CompiledLayers | None

    def __call__(self, rows: list[PackedRow]) -> list[torch.Tensor]: ...

    def warm_up(self) -> float: ...


def build_forward(model: PreTrainedModel, plan: EnginePlan) -> Forward:
    """The pass `plan` says runs `model`: packed, or transformers' own a session at a time."""
    return PackedForward(model, plan) if plan.packed else GenericForward(model)


def kv_geometry(model: PreTrainedModel) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a model's cache."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, kv_heads, head_dim


class PackedForward:
    """`__call__(rows)`: feed every row's tokens into its `SessionKV`; each row's last `keep` logits."""

    def __init__(self, model: PreTrainedModel, plan: EnginePlan) -> None:
        """Run `model` as `plan` says (`engine_plan.plan_engine`: pre-packed weights, compiled
        layers, native kernels; call `warm_up` before serving: it measures and compiles)."""
        if not plan.packed:
            raise TypeError(f"{type(model).__name__} is not a Llama-structured model")
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.rope = apply_rotary_pos_emb  # (q, k, cos, sin, unsqueeze_dim) -> rotated q, k
        self.model, self.base, self.plan = model, model.model, plan
        _, self.kv_heads, self.head_dim = kv_geometry(model)
        self.heads = model.config.num_attention_heads
        self.scaling = self.base.layers[0].self_attn.scaling
        self.groups = self.heads // self.kv_heads
        self.native, self.prepacked = plan.native, plan.prepack
        self.device, self.dtype, _ = output_layer(model)
        self.head: Projection | None = None
        self.layers: list[LayerProjections] = []
        if plan.fused:
            self.head, self.layers = _projections(model, plan)
        self._measure_rows = plan.measure_rows
        self._set_linear_rows(plan.linear_rows)
        self.compiled = CompiledLayers(self) if plan.torch_compile else None
        self._final: tuple[torch.Tensor, float] | None = None  # the last norm's weight and epsilon, for `ops`
        self.ops = self._layer_ops(plan)
        self.stack = self._layer_stack()
        self._pass_plan: tuple[list[PackedRow] | None, AttentionPlan | None] = (None, None)

    def __call__(self, rows: list[PackedRow]) -> list[torch.Tensor]:
        """Feed every row's tokens into its cache; each row's last `keep` logits `[keep, V]` (views of
        one tensor)."""
        device = self.device
        for row in rows:
            row.kv.reserve(row.kv.length + len(row.tokens))
        self._pass_plan = (None, None)  # the native kernel's plan is built at the first layer (buffers are final)
        # the pass's token ids, their positions and the rows whose logits are kept, as plain lists first:
        # one tensor each (per-row aranges and cats cost several operator calls a row)
        positions_list: list[int] = []
        picks_list: list[int] = []
        end = 0
        for row in rows:
            n = len(row.tokens)
            positions_list.extend(range(row.kv.length, row.kv.length + n))
            end += n
            picks_list.extend(range(end - row.keep, end))
        ids = torch.tensor([t for row in rows for t in row.tokens], dtype=torch.long)  # [T]
        positions, picks = torch.tensor(positions_list), torch.tensor(picks_list)
        if device.type != "cpu":
            ids, positions, picks = (t.to(device) for t in (ids, positions, picks))
        x = self.base.embed_tokens(ids)[None]  # [1, T, hidden]
        cos, sin = self.base.rotary_emb(x, positions[None])  # [1, T, D] each
        if self.compiled is not None:
            x = self.compiled(x[0], cos, sin, rows)[None]
        elif self.ops is not None:
            x = self._native_layers(x[0], cos[0], sin[0], rows)[None]
        elif self.layers:
            x = self._fused_layers(x[0], cos, sin, rows)[None]
        else:
            for index, layer in enumerate(self.base.layers):
                x = x + self._attention(index, layer.self_attn, layer.input_layernorm(x), cos, sin, rows)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = self._final_norm(x[0, picks])  # [sum keep, hidden]
        logits = self.head(h)[0] if self.head is not None else self.model.lm_head(h)  # [sum keep, V]
        for row in rows:
            row.kv.length += len(row.tokens)
        return list(logits.split([row.keep for row in rows]))

    def _fused_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      rows: list[PackedRow]) -> torch.Tensor:
        """Every layer for `x` `[T, hidden]` through the fused projections, with as few operator calls
        as the maths allows (each costs microseconds; a decode step of a small model is hundreds of
        them): RMSNorm as one `rms_norm` call where the model computes it in the input's dtype
        (float32), and the rotary embedding applied to q and k at once, `x * cos + roll(x) * sin'`
        with rotate_half's signs folded into `sin'` once per pass (the same products and sums as
        transformers' `q * cos + rotate_half(q) * sin`)."""
        t, d, heads, hkv = x.shape[0], self.head_dim, self.heads, self.kv_heads
        half, qk_width = d // 2, (heads + hkv) * d
        cos_t = cos[0][:, None]  # [T, 1, D]
        sin_t = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)[:, None]
        act = self.base.layers[0].mlp.act_fn
        for index, layer in enumerate(self.base.layers):
            qkv, o, gate_up, down = self.layers[index]
            y = qkv.project(self._norm(layer.input_layernorm, x))  # [T, (H + 2 Hkv) D]: q, k, v side by side
            qk = y[:, :qk_width].view(t, heads + hkv, d)
            qk = qk * cos_t + qk.roll(half, dims=-1) * sin_t
            attended = self._attend_rows(index, qk[:, :heads], qk[:, heads:], y[:, qk_width:].view(t, hkv, d),
                                         rows, self.scaling)
            x = x + o.project(attended)
            gate, up = gate_up.project(self._norm(layer.post_attention_layernorm, x)).chunk(2, dim=-1)
            x = x + down.project(act(gate).mul_(up))
        return x

    def _layer_ops(self, plan: EnginePlan) -> native.LayerOps | None:
        """The native elementwise kernels, where the layers run in float32 or bfloat16 on a CPU with the
        native kernels through the fused projections, with SiLU MLPs and RMSNorms of weights in that
        dtype."""
        if not (plan.native and self.layers and self.dtype in native.LayerOps.DTYPES and self.device.type == "cpu"):
            return None
        if getattr(self.model.config, "hidden_act", None) != "silu":
            return None
        norms = [(layer.input_layernorm, layer.post_attention_layernorm) for layer in self.base.layers]
        if any(n.weight.dtype != self.dtype or not n.weight.is_contiguous() for pair in norms for n in pair):
            return None
        self._norms = [(a.weight, b.weight, float(a.variance_epsilon), float(b.variance_epsilon)) for a, b in norms]
        final = getattr(self.base, "norm", None)
        weight, eps = getattr(final, "weight", None), getattr(final, "variance_epsilon", None)
        if (isinstance(weight, torch.Tensor) and weight.dtype == self.dtype and weight.is_contiguous()
                and eps is not None):
            self._final = (weight, float(eps))
        return native.LayerOps(self.dtype)

    def _layer_stack(self) -> LayerStack | None:
        """The layers as one native call (`stack.LayerStack`), where the native layer kernels run and
        every projection of every layer is one run of quantized weights."""
        if self.ops is None or not self.layers:
            return None
        layers = []
        for projections, (norm_in, norm_post, eps_in, eps_post) in zip(self.layers, self._norms):
            runs = [p.pieces[0][0] for p in projections if len(p.pieces) == 1]
            if len(runs) != 4 or not all(isinstance(run, QuantizedProjection) for run in runs):
                return None
            layers.append((*runs, norm_in, eps_in, norm_post, eps_post))
        config = self.model.config
        try:
            return LayerStack(layers, config.hidden_size, config.intermediate_size, self.heads, self.kv_heads,
                              self.head_dim)
        except ValueError as e:  # a geometry the stack does not take: the loop below runs it
            log.info("the layers run one kernel call at a time: %s", e)
            return None

    def _native_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rows: list[PackedRow]) -> torch.Tensor:
        """Every layer for `x` `[T, hidden]` (updated in place: the residual stream) with the
        elementwise work in the native kernels (`native.LayerOps`: RMSNorm with the residual add
        before it, the rotary embedding of q and k in place, SiLU times up) and every product written
        into buffers made once per pass: a layer is 9 calls into C and no tensor allocated. The same
        arithmetic as `_fused_layers` to the rounding of the pass's dtype (float32 or bfloat16; the
        projections of a bfloat16 model stay oneDNN's). `cos`, `sin` `[T, D]`. Where the layer stack
        runs (`_layer_stack`) and the native attention kernel takes every row, the same calls are made
        from C in one (`LayerStack.run`)."""
        ops, t, d, heads, hkv = self.ops, x.shape[0], self.head_dim, self.heads, self.kv_heads
        assert ops is not None
        if self.stack is not None and self.stack.takes(t):
            plan = self._native_plan(rows)
            if plan is not None:
                return self.stack.run(x, cos, sin, plan, self.scaling)
        q_width, qk_width = heads * d, (heads + hkv) * d
        qkv_p, _, gate_up_p, _ = self.layers[0]
        qkv, attended = x.new_empty((t, qkv_p.width)), x.new_empty((t, q_width))
        gate_up, act = x.new_empty((t, gate_up_p.width)), x.new_empty((t, gate_up_p.width // 2))
        h, delta = torch.empty_like(x), torch.empty_like(x)
        cos, sin = cos.contiguous(), sin.contiguous()
        q = qkv[:, :q_width].view(t, heads, d)
        k, v = qkv[:, q_width:qk_width].view(t, hkv, d), qkv[:, qk_width:].view(t, hkv, d)
        ops.rms_norm(x, self._norms[0][0], self._norms[0][2], h)
        last = len(self.layers) - 1
        for index, (qkv_p, o, gate_up_p, down) in enumerate(self.layers):
            qkv_p.project(h, qkv)
            ops.rope(qkv, heads + hkv, d, cos, sin)
            self._attend_rows(index, q, k, v, rows, self.scaling, attended)
            o.project(attended, delta)
            _, post, _, post_eps = self._norms[index]
            ops.rms_norm(x, post, post_eps, h, delta)  # x += attention; h = norm(x)
            gate_up_p.project(h, gate_up)
            ops.silu_mul(gate_up, act)
            down.project(act, delta)
            if index < last:
                following = self._norms[index + 1]
                ops.rms_norm(x, following[0], following[2], h, delta)  # x += mlp; h = the next layer's norm(x)
            else:
                x.add_(delta)
        return x

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's last RMSNorm of the kept rows `x` `[n, hidden]`: one native call where the layers'
        norms are native (the module is several operator calls, ~60 us a decode step), else the module."""
        if self.ops is None or self._final is None:
            return self.base.norm(x)
        weight, eps = self._final
        return self.ops.rms_norm(x, weight, eps, torch.empty_like(x))

    @staticmethod
    def _norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
        """`norm(x)` for a Llama RMSNorm module; one fused call in float32 (the module's own
        arithmetic there), the module itself in other dtypes (it upcasts to float32 inside)."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
        return norm(x)

    def _attention(self, index: int, attn: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   rows: list[PackedRow]) -> torch.Tensor:
        """The attention block of layer `index` through the model's own modules (`attn`: its
        Llama-shaped attention module) for the packed hidden states `h` [1, T, hidden]."""
        t, d = h.shape[1], self.head_dim
        q = attn.q_proj(h).reshape(1, t, self.heads, d)
        k = attn.k_proj(h).reshape(1, t, self.kv_heads, d)
        q, k = self.rope(q, k, cos, sin, unsqueeze_dim=2)  # [1, T, H, D]
        out = self._attend_rows(index, q[0], k[0], attn.v_proj(h).reshape(t, self.kv_heads, d), rows, attn.scaling)
        return attn.o_proj(out[None])

    def _attend_rows(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[PackedRow],
                     scaling: float, into: torch.Tensor | None = None) -> torch.Tensor:
        """Write each row's new keys/values (`k`, `v` `[T, Hkv, D]`) into its cache at layer `index`
        and attend its queries (`q` `[T, H, D]`) to its whole past; `[T, H * D]` (`into`, when given:
        a contiguous buffer of that shape). Where the native kernel runs, every row goes through it in
        one call, which also stores their keys/values; elsewhere each row through `SessionKV.write`
        and `attend`."""
        t, d, hkv, g = q.shape[0], self.head_dim, self.kv_heads, self.groups
        out = q.new_empty((t, hkv, g, d)) if into is None else into.view(t, hkv, g, d)  # head kv * G + g: [:, kv, g]
        kernel_plan = self._native_plan(rows)
        if kernel_plan is not None:
            native_attention.attend(kernel_plan, index, q, out.view(t, self.heads, d), hkv, scaling, new=(k, v))
            return out.view(t, self.heads * d)
        start = 0
        for row in rows:
            n, past = len(row.tokens), row.kv.length
            span = slice(start, start + n)
            row.kv.write(index, past, k[span].transpose(0, 1), v[span].transpose(0, 1))
            queries = q[span].view(n, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
            o = attend(queries, row.kv.segments(index, past + n), past, scaling)
            out[span] = o.permute(2, 0, 1, 3)  # [n, Hkv, G, D]
            start += n
        return out.view(t, self.heads * d)

    def _native_plan(self, rows: list[PackedRow]) -> AttentionPlan | None:
        """The native kernel's plan for every row of this pass (a prefill chunk in pieces,
        `AttentionPlan`), built at its first layer; None where the kernel does not run."""
        if self._pass_plan[0] is rows:
            return self._pass_plan[1]
        plan = None
        if self.native and rows and self.groups <= native_attention.MAX_QUERIES:
            starts = accumulate((len(row.tokens) for row in rows[:-1]), initial=0)
            plan = AttentionPlan([(row.kv, start, len(row.tokens), row.kv.length)
                                  for row, start in zip(rows, starts)], self.groups)
        self._pass_plan = (rows, plan)
        return plan

    def _projections(self) -> list[Projection]:
        return [*(p for layer in self.layers for p in layer), *([self.head] if self.head is not None else [])]

    def _set_linear_rows(self, rows: int) -> None:
        self.linear_rows = rows
        for projection in self._projections():
            projection.rows = rows

    def measure_linear_rows(self) -> int:
        """Up to how many rows the native linear kernel beats oneDNN on this model's projections
        (`projection.measure_linear_rows`); changes nothing."""
        return measure_linear_rows(self._projections())

    def warm_up(self) -> float:
        """At service start: with `linear_rows="auto"`, measure how many rows the native linear kernel
        takes (`measure_linear_rows`); then compile the compiled pass's graphs, on a scratch session:
        a pass of one position (dynamo gives it a graph of its own) and of 2 and 3 (which make T
        dynamic), each after a first pass so that it attends to a past. Afterwards nothing compiles
        again (see `compiled`). Returns the seconds compiling took (0 without `compile`)."""
        if self._measure_rows:
            self._measure_rows = False
            self._set_linear_rows(self.measure_linear_rows())
            log.info("projections of up to %d rows through the native linear kernel, larger ones through oneDNN "
                     "(measured; --native-linear-rows N fixes it)", self.linear_rows)
        if self.compiled is None:
            return 0.0
        start = time.perf_counter()
        with torch.inference_mode():
            for t in (1, 2, 3):
                kv = SessionKV(len(self.base.layers), self.kv_heads, self.head_dim, 4 * t, self.dtype, self.device)
                self([PackedRow(kv, [0] * t, 1)])
                self([PackedRow(kv, [0] * t, t)])
        self.compiled.warm = True
        seconds = time.perf_counter() - start
        log.info("compiled the forward pass in %.1f s (torch.compile, inductor; --compile off turns it off)", seconds)
        return seconds


def _projections(model: PreTrainedModel, plan: EnginePlan) -> tuple[Projection, list[LayerProjections]]:
    """The output layer's projection, and each layer's (qkv, o, gate_up, down), fused as `plan` says."""
    packs, linear = plan.prepack, plan.linear
    head = Projection([matrix(model.lm_head)], packs, linear)
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append((
            Projection([matrix(attn.q_proj), matrix(attn.k_proj), matrix(attn.v_proj)], packs, linear),
            Projection([matrix(attn.o_proj)], packs, linear),
            Projection([matrix(mlp.gate_proj), matrix(mlp.up_proj)], packs, linear),
            Projection([matrix(mlp.down_proj)], packs, linear),
        ))
    return head, layers


class GenericForward:
    """Any full-attention architecture the packed pass does not know: one row at a time through
    transformers' own forward (`forward_generic`)."""

    compiled: CompiledLayers | None = None

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model

    def __call__(self, rows: list[PackedRow]) -> list[torch.Tensor]:
        return [forward_generic(self.model, row) for row in rows]

    def warm_up(self) -> float:
        return 0.0


def forward_generic(model: PreTrainedModel, row: PackedRow) -> torch.Tensor:
    """One row through transformers' own forward (any full-attention architecture); its last `keep` logits.

    The row's past is handed over as a `DynamicCache` (a copy: this path is the fallback for
    architectures `PackedForward` does not know), and the new keys/values are written back.
    """
    from transformers import DynamicCache

    kv, n, past = row.kv, len(row.tokens), row.kv.length
    kv.reserve(past + n)
    device = output_layer(model)[0] if hasattr(model, "lm_head") else kv.data.device
    cache = DynamicCache(config=model.config)
    if past:
        for index in range(kv.data.shape[1]):
            past_keys, past_values = kv.joined(index, past)
            cache.update(past_keys[None], past_values[None], index)
    ids = torch.tensor([row.tokens], dtype=torch.long, device=device)
    positions = torch.arange(past, past + n, device=device)[None]
    out = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=row.keep)
    for index, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None or keys.shape[-2] != past + n:
            raise TypeError(f"layer {index} of {type(model).__name__} is not a full-attention cache layer")
        kv.write(index, past, keys[0, :, past:], values[0, :, past:])
    kv.length = past + n
    return out.logits[0, -row.keep:]
