"""One forward pass over several sessions' new tokens, packed into one sequence, no padding.

Every session (row) of a pass brings `n_i` new tokens after a past of `L_i` cached ones. The
pass lays all new tokens end to end, `[1, T = sum n_i, hidden]`, with explicit positions
(`L_i .. L_i + n_i - 1` for row i), so every linear layer (projections, MLP) runs ONCE over all
rows. Only attention is per row, and it reads the row's keys/values where they lie:

    per layer, per row i:   write k_i, v_i  [Hkv, n_i, D] into the row's buffer at L_i (in place)
                            q_i [Hq, n_i, D] viewed as [Hkv, G * n_i, D]   (G = Hq / Hkv)
                            attend to keys/values [Hkv, L_i + n_i, D] (a view of the buffer)

so grouped-query attention needs no repeated K/V heads, and the causal mask only concerns the
new block (query j of row i sees keys 0 .. L_i + j). Long blocks (a prefill) attend in chunks
of `QUERY_CHUNK` positions so the score matrix stays small. Logits are computed only for the
positions a row asks for.

This wires the model's own modules (embeddings, norms, projections, rotary embedding, MLP, LM
head) for the Llama layer structure (`supports` checks it); the attention and the cache are
ours. We call the modules rather than hooking transformers' attention interface because that
interface is chosen by the model's config (shared with every other user of the model object) and
its forward builds a 4-D mask over the padded batch that a packed pass does not need.
Other architectures take `forward_generic`: one session at a time through transformers.
"""

from __future__ import annotations

import functools
import logging
import shutil
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # transformers' model code loads with the model: a model-free draft service starts without it
    from transformers import PreTrainedModel

from specdec.runtime import native, native_attention
from specdec.runtime.compiled import CompiledLayers
from specdec.runtime.kv_buffer import SessionKV
from specdec.runtime.native import LINEAR_MAX_ROWS

log = logging.getLogger(__name__)

LINEAR_ROW_CANDIDATES = (1, 2, 4, 8, 16, 24, 32, 48)
"""The row counts `PackedForward.measure_linear_rows` tries, in order (up to native.LINEAR_MAX_ROWS)."""

QUERY_CHUNK = 256
"""A row's new positions attend in chunks of at most this many (bounds the score matrix)."""
FLASH_FROM = 8
"""Blocks of at least this many positions (prefill chunks) attend through `scaled_dot_product_attention`'s
flash kernel in float32/float64 (see `attend`)."""

_MODULES = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")


@dataclass
class PackedRow:
    """One session's part of a pass: its cache, the tokens it feeds, how many last logits it wants."""

    kv: SessionKV
    tokens: list[int]
    keep: int


def supports(model: PreTrainedModel) -> bool:
    """Whether `PackedForward` can run `model`: a Llama-structured decoder with full attention only."""
    config = model.config
    base = getattr(model, "model", None)
    if getattr(config, "model_type", None) != "llama" or base is None:
        return False
    if not all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return False
    for layer in base.layers:
        if not all(hasattr(layer, name) for name in _MODULES):
            return False
        attn = layer.self_attn
        if not all(hasattr(attn, name) for name in _ATTENTION) or hasattr(attn, "q_norm"):
            return False
    return getattr(model, "lm_head", None) is not None


def kv_geometry(model: PreTrainedModel) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a model's cache."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, kv_heads, head_dim


def can_compile(weight: torch.Tensor) -> bool:
    """Whether the compiled pass can run where `weight` lives: CUDA, or a CPU with a C++ compiler
    for inductor's generated kernels."""
    if weight.device.type == "cuda":
        return True
    if weight.device.type != "cpu":
        return False
    from torch._inductor import cpp_builder, exc

    try:
        return bool(shutil.which(cpp_builder.get_cpp_compiler()))
    except exc.InvalidCxxCompiler:
        return False


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether `Projection` can pre-pack this weight: float32 on a CPU with oneDNN built in."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


class Projection:
    """`h @ W.T` for one weight, or for several fused row-wise (q/k/v; gate/up), split on return.

    Plain: `torch.nn.functional.linear` (MKL on a CPU). Pre-packed: the weight reordered once for
    oneDNN (`torch.ops.mkldnn`, the path inductor's weight freezing takes). Measured here on
    SmolLM2-135M in float32 (bench/engine.py): MKL reads a cold weight at about 13 GB/s for one
    row and slows further for a few rows (its small-M GEMM path: the output layer costs 2.4x more
    at 5 rows than at 1), while the packed path reads closer to the bandwidth and costs about the
    same for 1 and 5 rows; fusing q/k/v and gate/up halves the calls per layer. The packed weights
    are a copy: the model's own stay for everything else (a second copy of the weights in memory).

    `native`: passes of at most `rows` rows (at most `native.LINEAR_MAX_ROWS`; `PackedForward`
    sets it) go through the native linear kernel, which reads the model's own weights where they lie
    (one call per fused weight, each writing its columns of the output): a row's output is then the
    same bits whatever shares the pass. Larger passes keep the path above.
    """

    def __init__(self, weights: list[torch.Tensor], prepack: bool, native: bool = False) -> None:
        self.sizes = [w.shape[0] for w in weights]
        self.width = sum(self.sizes)
        with torch.inference_mode(False), torch.no_grad():
            self.parts = [w.detach().contiguous() for w in weights] if native else []  # no copy when contiguous
            self.weight: torch.Tensor | None = None  # native and not pre-packed: larger passes use `parts`
            if prepack or not native:
                weight = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight) if prepack else weight
        self.prepacked = prepack
        self.rows = LINEAR_MAX_ROWS  # `native` here is the argument

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """`h` `[T, in]` -> `[T, sum(out_i)]` (the fused weights' outputs side by side)."""
        if self.parts and h.shape[0] <= self.rows:
            return native.linear(h.contiguous(), self.parts, h.new_empty((h.shape[0], self.width)))
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(h, self.weight, None, "none", [], "")
        if self.weight is None:
            return torch.cat([F.linear(h, w) for w in self.parts], dim=-1)
        return F.linear(h, self.weight)

    def __call__(self, h: torch.Tensor) -> list[torch.Tensor]:
        """`h` `[T, in]` -> one `[T, out_i]` per fused weight."""
        y = self.project(h)
        return [y] if len(self.sizes) == 1 else list(y.split(self.sizes, dim=-1))


class PackedForward:
    """`__call__(rows)`: feed every row's tokens into its `SessionKV`; each row's last `keep` logits."""

    def __init__(self, model: PreTrainedModel, prepack: str = "off", compile: str = "off",
                 kernels: str = "auto", linear_rows: int | str | None = None) -> None:
        """`prepack`: "on" (the weights pre-packed for oneDNN, fused per layer), "off" (the model's
        own modules), "auto" (on where `can_prepack`). `compile`: "on" (the dense part of every
        layer through torch.compile, `compiled.CompiledLayers`; call `warm_up` before serving),
        "off", "auto" (on where `can_compile`). `kernels`: "native" (`specdec.runtime.native`: the
        attention of decode and verify rows through `native_attention`, and in float32 the
        projections of passes of a few rows through its linear kernel), "torch" (`attend`, and
        oneDNN/MKL), "auto" (native where the kernels build and run: a CPU, float32/float64, a C
        compiler or prebuilt kernels). `linear_rows`: the most rows of a pass whose projections take
        the native linear kernel (float32), or "auto": measured by `warm_up` against the pre-packed
        weights (`measure_linear_rows`); until then, and without pre-packed weights, all it takes;
        None (not given): all it takes. A count above 0 where the linear kernel does not run (no
        native kernels here, another dtype, projections with bias) is refused: it would do nothing."""
        if not supports(model):
            raise TypeError(f"{type(model).__name__} is not a Llama-structured model")
        if prepack not in ("on", "off", "auto"):
            raise ValueError(f"prepack must be on, off or auto, not {prepack!r}")
        if compile not in ("on", "off", "auto"):
            raise ValueError(f"compile must be on, off or auto, not {compile!r}")
        if kernels not in ("native", "torch", "auto"):
            raise ValueError(f"kernels must be native, torch or auto, not {kernels!r}")
        if linear_rows not in ("auto", None) and not (isinstance(linear_rows, int)
                                                      and 0 <= linear_rows <= native.LINEAR_MAX_ROWS):
            raise ValueError(f"linear_rows must be auto or 0 to {native.LINEAR_MAX_ROWS}, not {linear_rows!r}")
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.rope = apply_rotary_pos_emb  # (q, k, cos, sin, unsqueeze_dim) -> rotated q, k
        self.model = model
        self.base = model.model
        _, self.kv_heads, self.head_dim = kv_geometry(model)
        self.heads = model.config.num_attention_heads
        self.scaling = self.base.layers[0].self_attn.scaling
        self.groups = self.heads // self.kv_heads
        weight = model.lm_head.weight
        usable = can_prepack(weight) and not self._biased()
        if prepack == "on" and not usable:
            raise ValueError("pre-packed weights need float32 on a CPU with oneDNN, and projections without bias")
        self.prepacked = usable and prepack != "off"
        compilable = can_compile(weight) and not self._biased()
        if compile == "on" and not compilable:
            raise ValueError("the compiled pass needs a CPU or CUDA device, a C++ compiler on a CPU, "
                             "and projections without bias")
        why = "" if kernels == "torch" else native.unavailable(weight.device, weight.dtype)
        if kernels == "native" and why:
            raise ValueError(f"--kernels native: {why}")
        if kernels == "auto" and why:
            log.info("attention and projections through torch's operators (%s)", why)
        self.native = kernels != "torch" and not why
        linear = self.native and weight.dtype == torch.float32 and not self._biased()
        if isinstance(linear_rows, int) and linear_rows > 0 and not linear:
            if not self.native:
                reason = why or "--kernels torch"
            elif weight.dtype != torch.float32:
                reason = f"the model runs {str(weight.dtype).removeprefix('torch.')}"
            else:
                reason = "its projections have a bias"
            raise ValueError(f"--native-linear-rows {linear_rows}: the native linear kernel does not run here "
                             f"({reason}); drop the flag or pass auto")
        self.compiled: CompiledLayers | None = None
        self.head: Projection | None = None
        self.layers: list[tuple[Projection, Projection, Projection, Projection]] = []
        if self.prepacked or linear or (compilable and compile != "off"):
            packs = self.prepacked
            self.head = Projection([weight], packs, linear)
            for layer in self.base.layers:
                attn, mlp = layer.self_attn, layer.mlp
                self.layers.append((
                    Projection([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], packs, linear),
                    Projection([attn.o_proj.weight], packs, linear),
                    Projection([mlp.gate_proj.weight, mlp.up_proj.weight], packs, linear),
                    Projection([mlp.down_proj.weight], packs, linear),
                ))
        self.linear_rows = linear_rows if isinstance(linear_rows, int) else LINEAR_MAX_ROWS
        self._measure_rows = linear_rows == "auto" and linear and self.prepacked
        self._set_linear_rows(self.linear_rows)
        if compilable and compile != "off":
            self.compiled = CompiledLayers(self)
        self._plan: tuple[list[PackedRow] | None, native_attention.Plan | None, list[bool]] = (None, None, [])

    def _biased(self) -> bool:
        """Whether a projection or the MLP departs from plain bias-free Llama (then modules are called)."""
        for layer in self.base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
            linears += [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
            if any(not isinstance(m, torch.nn.Linear) or m.bias is not None for m in linears):
                return True
            if not hasattr(mlp, "act_fn"):
                return True
        return getattr(self.model.lm_head, "bias", None) is not None

    def __call__(self, rows: list[PackedRow]) -> list[torch.Tensor]:
        device = self.model.lm_head.weight.device
        for row in rows:
            row.kv.reserve(row.kv.length + len(row.tokens))
        self._plan = (None, None, [])  # the native kernel's plan is built at the first layer (buffers are final)
        ids = torch.tensor([t for row in rows for t in row.tokens], dtype=torch.long)  # [T]
        positions = torch.cat([torch.arange(row.kv.length, row.kv.length + len(row.tokens)) for row in rows])
        ends = torch.tensor([len(row.tokens) for row in rows]).cumsum(0)
        picks = torch.cat([torch.arange(int(end) - row.keep, int(end)) for row, end in zip(rows, ends)])
        ids, positions, picks = (t.to(device) for t in (ids, positions, picks))
        x = self.base.embed_tokens(ids)[None]  # [1, T, hidden]
        cos, sin = self.base.rotary_emb(x, positions[None])  # [1, T, D] each
        if self.compiled is not None:
            x = self.compiled(x[0], cos, sin, rows)[None]
        elif self.layers:
            x = self._fused_layers(x[0], cos, sin, rows)[None]
        else:
            for index, layer in enumerate(self.base.layers):
                x = x + self._attention(index, layer.self_attn, layer.input_layernorm(x), cos, sin, rows)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = self.base.norm(x[0, picks])  # [sum keep, hidden]
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
                     scaling: float) -> torch.Tensor:
        """Write each row's new keys/values (`k`, `v` `[T, Hkv, D]`) into its cache at layer `index`
        and attend its queries (`q` `[T, H, D]`) to its whole past; `[T, H * D]`. Short rows (decode,
        verify) go through the native kernel when it runs, all in one call, which also stores their
        keys/values; the others through `SessionKV.write` and `attend`."""
        t, d, hkv, g = q.shape[0], self.head_dim, self.kv_heads, self.groups
        out = q.new_empty((t, hkv, g, d))  # query head kv * G + g lives at [:, kv, g]
        plan, native = self._native_plan(rows)
        start = 0
        for row, short in zip(rows, native):
            n, past = len(row.tokens), row.kv.length
            span = slice(start, start + n)
            if not short:
                row.kv.write(index, past, k[span].transpose(0, 1), v[span].transpose(0, 1))
                queries = q[span].view(n, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
                o = attend(queries, row.kv.segments(index, past + n), past, scaling)
                out[span] = o.permute(2, 0, 1, 3)  # [n, Hkv, G, D]
            start += n
        if plan is not None:
            native_attention.attend(plan, index, q, out.view(t, self.heads, d), hkv, scaling, new=(k, v))
        return out.view(t, self.heads * d)

    def _native_plan(self, rows: list[PackedRow]) -> tuple[native_attention.Plan | None, list[bool]]:
        """The native kernel's plan for this pass's short rows (built at its first layer), and which
        rows it covers."""
        if self._plan[0] is rows:
            return self._plan[1], self._plan[2]
        short = [self.native and len(row.tokens) * self.groups <= native_attention.MAX_QUERIES for row in rows]
        described, start = [], 0
        for row, take in zip(rows, short):
            if take:
                described.append((row.kv, start, len(row.tokens), row.kv.length))
            start += len(row.tokens)
        plan = native_attention.Plan(described) if described else None
        self._plan = (rows, plan, short)
        return plan, short

    def _projections(self) -> list[Projection]:
        return [*(p for layer in self.layers for p in layer), *([self.head] if self.head is not None else [])]

    def _set_linear_rows(self, rows: int) -> None:
        self.linear_rows = rows
        for projection in self._projections():
            projection.rows = rows

    def measure_linear_rows(self, candidates: tuple[int, ...] = LINEAR_ROW_CANDIDATES, repeats: int = 3) -> int:
        """The most rows up to which the native linear kernel is at least as fast as the pre-packed
        oneDNN weights, on this model's own projections: every projection of the model at each
        count in `candidates`, both ways interleaved, medians of `repeats`, counting up until oneDNN
        wins (0 if it wins at the first). Which is faster depends on the CPU: on 2 AVX2 cores the
        kernel won up to 64 rows, on 2 AVX-512 cores (where oneDNN runs AVX-512 code) up to 8 rows,
        tying beyond (see docs/architecture.md)."""
        projections = [p for p in self._projections() if p.parts and p.prepacked]
        if not projections:
            return 0
        best = 0
        with torch.inference_mode():
            for m in candidates:
                inputs = {p.parts[0].shape[1]: torch.randn(m, p.parts[0].shape[1], dtype=p.parts[0].dtype)
                          for p in projections}
                ways = {"native": m, "onednn": 0}  # the rows each way lets through the kernel
                times: dict[str, list[float]] = {way: [] for way in ways}
                for _ in range(repeats + 1):  # the first round only touches
                    for way, rows in ways.items():
                        times[way].append(_time_projections(projections, inputs, rows))
                native_s, onednn_s = (statistics.median(times[way][1:]) for way in ways)
                log.info("projections of %d rows: native linear kernel %.1f ms, oneDNN %.1f ms", m, native_s * 1e3,
                         onednn_s * 1e3)
                if native_s > onednn_s:
                    break
                best = m
        self._set_linear_rows(self.linear_rows)
        return best

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
        weight = self.model.lm_head.weight
        start = time.perf_counter()
        with torch.inference_mode():
            for t in (1, 2, 3):
                kv = SessionKV(len(self.base.layers), self.kv_heads, self.head_dim, 4 * t, weight.dtype, weight.device)
                self([PackedRow(kv, [0] * t, 1)])
                self([PackedRow(kv, [0] * t, t)])
        self.compiled.warm = True
        seconds = time.perf_counter() - start
        log.info("compiled the forward pass in %.1f s (torch.compile, inductor; --compile off turns it off)", seconds)
        return seconds

def _time_projections(projections: list[Projection], inputs: dict[int, torch.Tensor], rows: int) -> float:
    """Seconds for every projection of `inputs` (by input width), letting `rows` rows through the kernel."""
    for p in projections:
        p.rows = rows
    start = time.perf_counter()
    for p in projections:
        p.project(inputs[p.parts[0].shape[1]])
    return time.perf_counter() - start


def attend(q: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], past: int,
           scale: float) -> torch.Tensor:
    """Causal attention of one row's new block without repeating K/V heads.

    q `[Hkv, G, n, D]` (query j is position past + j); `segments`: the row's keys and values
    `[Hkv, m_i, D]` in position order (shared prefix segments, then the row's own buffer: views,
    read in place) covering positions 0 .. past + n - 1; returns `[Hkv, G, n, D]`. Query j sees
    keys 0 .. past + j, so only the last n key columns (in the last segment) need a mask.

    One segment and one query (a decode step): `scaled_dot_product_attention` with its grouped
    heads (one call instead of five; measured on the CPU for 30 layers of SmolLM2-135M: 0.7 ms
    against 2.8 ms at context 64, 23 against 24 ms at 4096). A block of at least `FLASH_FROM`
    positions in float32/float64 (a prefill chunk): `scaled_dot_product_attention` with a boolean
    mask and grouped heads, whose flash kernel never writes the score matrix to memory; several
    segments are joined first (a copy of the keys and values, small beside the arithmetic of a
    chunk). Measured for 30 layers of SmolLM2-135M on 2 cores: a 512-position chunk after 2,488
    positions 2,221 -> 976 ms against the matmuls below (with a 1,000-position shared prefix 1,742
    -> 762), a 3,000-token prefill in 512-token chunks 8.1 -> 4.6 s. One segment and a shorter
    block, in float32/float64: plain matmuls (they beat `scaled_dot_product_attention` there, 13
    against 21 ms for 3 queries at 4096, and take strided views without a copy); in half precision,
    `scaled_dot_product_attention`, which accumulates in float32 as transformers' own path does.
    Several segments (a shared prefix): the scores of every segment side by side, one softmax
    over them (exact, no copy of any key or value; the score matrix is the only thing joined),
    and the output summed segment by segment; in half precision the softmax runs in float32.
    """
    hkv, g, n, d = q.shape
    widths = [k.shape[1] for k, _ in segments]
    assert sum(widths) == past + n and widths[-1] >= n, (q.shape, widths, past)
    low = q.dtype in (torch.float16, torch.bfloat16)
    out = q.new_empty(q.shape)
    for lo in range(0, n, QUERY_CHUNK):
        hi = min(n, lo + QUERY_CHUNK)
        c, seen = hi - lo, past + hi  # queries in the chunk; keys the chunk's last query sees
        chunk = q[:, :, lo:hi].reshape(hkv, g * c, d)
        cut = seen - (past + n - widths[-1])  # own-buffer keys the chunk sees
        k_own, v_own = segments[-1][0][:, :cut], segments[-1][1][:, :cut]
        mask = _future_mask(c, g, torch.float32 if low else q.dtype, q.device) if c > 1 else None
        if len(segments) == 1 and c == 1:  # a decode step: one fused call, the K/V heads shared (no repeat)
            o = F.scaled_dot_product_attention(chunk.view(1, hkv * g, 1, d), k_own[None], v_own[None], scale=scale,
                                               enable_gqa=True)
        elif len(segments) == 1 and low:
            full = None
            if mask is not None:
                full = chunk.new_zeros((g * c, seen))
                full[:, seen - c:] = mask.to(chunk.dtype)
            o = F.scaled_dot_product_attention(chunk, k_own, v_own, attn_mask=full, scale=scale)
        elif c >= FLASH_FROM and not low:  # a prefill chunk: flash attention, no score matrix in memory
            all_k = k_own if len(segments) == 1 else torch.cat([k for k, _ in segments[:-1]] + [k_own], dim=1)
            all_v = v_own if len(segments) == 1 else torch.cat([v for _, v in segments[:-1]] + [v_own], dim=1)
            allowed = torch.ones(c, seen, dtype=torch.bool, device=q.device).tril(seen - c)
            o = F.scaled_dot_product_attention(q[:, :, lo:hi].reshape(1, hkv * g, c, d), all_k[None], all_v[None],
                                               attn_mask=allowed, scale=scale, enable_gqa=True)
        elif len(segments) == 1:
            scores = torch.matmul(chunk * scale, k_own.transpose(1, 2))  # [Hkv, G * c, seen]
            if mask is not None:  # query lo + i must not see the chunk's keys after its own
                scores[:, :, seen - c:] += mask
            o = torch.matmul(scores.softmax(-1), v_own)
        else:
            keys = [k for k, _ in segments[:-1]] + [k_own]
            values = [v for _, v in segments[:-1]] + [v_own]
            scores = torch.cat([torch.matmul(chunk * scale, k.transpose(1, 2)) for k in keys], dim=-1)
            if low:
                scores = scores.float()
            if mask is not None:
                scores[:, :, seen - c:] += mask
            probs = scores.softmax(-1).to(q.dtype).split([k.shape[1] for k in keys], dim=-1)
            o = torch.matmul(probs[0], values[0])
            for p, v in zip(probs[1:], values[1:]):
                o.add_(torch.matmul(p, v))
        out[:, :, lo:hi] = o.view(hkv, g, c, d)
    return out


@functools.lru_cache(maxsize=64)
def _future_mask(c: int, g: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[G * c, c]`: -inf where key j comes after query i (j > i) within a chunk, else 0."""
    upper = torch.ones((c, c), dtype=torch.bool, device=device).triu(1)
    return torch.zeros((c, c), dtype=dtype, device=device).masked_fill(upper, float("-inf")).repeat(g, 1)


def forward_generic(model: PreTrainedModel, row: PackedRow) -> torch.Tensor:
    """One row through transformers' own forward (any full-attention architecture); its last `keep` logits.

    The row's past is handed over as a `DynamicCache` (a copy: this path is the fallback for
    architectures `PackedForward` does not know), and the new keys/values are written back.
    """
    from transformers import DynamicCache

    kv, n, past = row.kv, len(row.tokens), row.kv.length
    kv.reserve(past + n)
    device = model.lm_head.weight.device if hasattr(model, "lm_head") else kv.data.device
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
