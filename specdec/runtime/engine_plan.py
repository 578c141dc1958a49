"""What the engine's options mean for one loaded model on this machine, decided once.

`plan_engine(model, options)` is the one place that looks at the model (is it Llama-structured
with full attention, do its projections carry a bias, which dtype and device) and at the machine
(oneDNN, a C++ compiler for inductor, the native kernels) and turns `EngineOptions` into an
`EnginePlan`: plain booleans and counts the pass builds itself from. An option asked for "on" that
cannot be honoured is refused here, with the reason and the flag; "auto" quietly takes what runs.
"""

from __future__ import annotations

import functools
import logging
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.runtime import native
from specdec.runtime.engine_options import LINEAR_MAX_ROWS, EngineOptions
from specdec.runtime.weights import QuantizedLinear, is_quantized, output_layer

if TYPE_CHECKING:  # transformers' model code loads with the model: a model-free draft service starts without it
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

_MODULES = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")


@dataclass(frozen=True)
class EnginePlan:
    """How the pass runs one model here (`plan_engine` decides; `packed.PackedForward` follows)."""

    packed: bool  # the packed pass runs the model (else transformers' forward, a session at a time)
    prepack: bool = False  # projections through weights pre-packed for oneDNN
    torch_compile: bool = False  # each layer's dense part through torch.compile
    native: bool = False  # attention through the native kernel
    linear: bool = False  # projections of passes of a few rows through the native linear kernel
    linear_rows: int = LINEAR_MAX_ROWS  # the most rows it takes (until measured)
    measure_rows: bool = False  # `warm_up` measures `linear_rows` against the pre-packed weights
    quantized: bool = False  # some matrices are quantized blocks: they run the quantized kernels at every row count

    @property
    def fused(self) -> bool:
        """Whether the pass calls its own fused projections (else the model's modules)."""
        return self.prepack or self.linear or self.torch_compile or self.quantized


def supports(model: PreTrainedModel) -> bool:
    """Whether the packed pass can run `model`: a Llama-structured decoder with full attention only."""
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


def has_bias(model: PreTrainedModel) -> bool:
    """Whether a projection or the MLP departs from plain bias-free Llama (then the pass calls the
    model's own modules for them)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        linears += [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if any(not isinstance(m, (torch.nn.Linear, QuantizedLinear)) or m.bias is not None for m in linears):
            return True
        if not hasattr(mlp, "act_fn"):
            return True
    return getattr(model.lm_head, "bias", None) is not None


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
    """Whether `projection.Projection` can pre-pack this weight: float32 on a CPU with oneDNN built in,
    or bfloat16 where oneDNN runs bf16 in the CPU's own instructions (AVX512-BF16, AMX; elsewhere it
    would convert every call, slower than torch's own path)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bf16_instructions())


@functools.lru_cache(maxsize=1)
def bf16_instructions() -> bool:
    """Whether this CPU multiplies bfloat16 in its own instructions: AVX512-BF16 or AMX (oneDNN's own
    test, `_is_mkldnn_bf16_supported`, also admits plain AVX-512, where it converts)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def plan_engine(model: PreTrainedModel, options: EngineOptions) -> EnginePlan:
    """What `options` mean for `model` here; ValueError (naming the flag) for what cannot be honoured."""
    if is_quantized(model):
        options.refuse_with_quantized(options.quantized or "quantized weights")
    if not supports(model):
        return _generic_plan(model, options)
    if is_quantized(model):
        return _quantized_plan(model, options)
    weight, biased = model.lm_head.weight, has_bias(model)
    prepack = _switch(options.prepack, can_prepack(weight) and not biased,
                      "pre-packed weights need float32 (or bfloat16 on a CPU with AVX512-BF16 or AMX) on a "
                      "CPU with oneDNN, and projections without bias")
    compiled = _switch(options.torch_compile, can_compile(weight) and not biased,
                       "the compiled pass needs a CPU or CUDA device, a C++ compiler on a CPU, and projections "
                       "without bias")
    why = "" if options.kernels == "torch" else native.unavailable(weight.device, weight.dtype)
    if options.kernels == "native" and why:
        raise ValueError(f"--kernels native: {why}")
    if options.kernels == "auto" and why:
        log.info("attention and projections through torch's operators (%s)", why)
    runs_native = options.kernels != "torch" and not why
    linear = runs_native and weight.dtype == torch.float32 and not biased
    if options.fixed_linear_rows and not linear:
        reason = why or _no_linear_kernel(runs_native, weight.dtype)
        raise ValueError(f"--native-linear-rows {options.linear_rows}: the native linear kernel does not run here "
                         f"({reason}); drop the flag or pass auto")
    rows = options.linear_rows if isinstance(options.linear_rows, int) else LINEAR_MAX_ROWS
    return EnginePlan(packed=True, prepack=prepack, torch_compile=compiled, native=runs_native, linear=linear,
                      linear_rows=rows, measure_rows=options.linear_rows == "auto" and linear and prepack)


def _quantized_plan(model: PreTrainedModel, options: EngineOptions) -> EnginePlan:
    """A model with quantized matrices: every projection through `projection.Projection`, the
    quantized blocks through their kernels at every row count (no oneDNN, no float copy; float
    matrices left beside them, blocks de-quantized at load, through the native linear kernel up to
    `linear_rows` rows); neither pre-packing nor the compiled pass (refused when asked for "on")."""
    device, dtype, _ = output_layer(model)
    why = native.unavailable(device, dtype)
    if why:  # the blocks have no other way to run
        raise ValueError(f"quantized weights run in the native kernels, which cannot run here: {why}")
    rows = options.linear_rows if isinstance(options.linear_rows, int) else LINEAR_MAX_ROWS
    fused = not has_bias(model)  # else the pass calls the model's modules (`QuantizedLinear` runs the same kernels)
    return EnginePlan(packed=True, native=True, linear=fused and dtype == torch.float32, linear_rows=rows,
                      quantized=fused)


def _switch(asked: str, possible: bool, refusal: str) -> bool:
    """An on/off/auto option: on where `possible` unless "off"; "on" where impossible is refused."""
    if asked == "on" and not possible:
        raise ValueError(refusal)
    return possible and asked != "off"


def _generic_plan(model: PreTrainedModel, options: EngineOptions) -> EnginePlan:
    """A model the packed pass does not run: every option of the packed pass must be off or auto."""
    asked = {"pre-packed weights": options.prepack == "on", "the compiled pass": options.torch_compile == "on",
             "the native kernels": options.kernels == "native",
             f"--native-linear-rows {options.linear_rows}": bool(options.fixed_linear_rows)}
    for what, on in asked.items():
        if on:
            raise ValueError(f"{what}: a feature of the packed pass, which does not run {type(model).__name__}")
    return EnginePlan(packed=False)


def _no_linear_kernel(runs_native: bool, dtype: torch.dtype) -> str:
    """Why the linear kernel does not run where the native kernels are available (or not asked for)."""
    if not runs_native:
        return "--kernels torch"
    if dtype != torch.float32:
        return f"the model runs {str(dtype).removeprefix('torch.')}"
    return "its projections have a bias"
