"""How the engine's forward pass runs, as one value: `EngineOptions`, validated when it is made.

A service makes it from its config (`ModelServiceConfig.engine_options`), a test or a benchmark
directly; it then travels unchanged to the cache table, the pass and the kernels. What an option
means for one loaded model on one machine (does the packed pass run this model, do the native
kernels run here) is decided once, by `engine_plan.plan_engine`. Errors name the command-line flags,
since that is where a user fixes them.

This module imports nothing heavy (no torch): service configs validate with it at argument parsing.
To add an option (a weight format, a quantization): a field here, its flag in `FLAGS` (the service
config's field of the same name maps onto it), its values in `CHOICES` or a check in
`__post_init__`, and what it means in `engine_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

LINEAR_MAX_ROWS = 48
"""Most rows a projection sends to the native linear kernel. Measured on the 121 projections of
SmolLM2-135M in float32 (2 threads): the kernel against oneDNN's pre-packed weights 31 / 48 ms at 1
row, 54 / 83 at 16, 75 / 95 at 24, 138 / 158 at 48, even at 64, slower beyond (128 rows: 378 /
339). Larger passes (prefill chunks) are GEMM-shaped and keep oneDNN."""

Switch = Literal["auto", "on", "off"]
Kernels = Literal["auto", "native", "torch"]
Weights = Literal["auto", "gguf", "dense"]
Quantize = Literal["none", "int8", "int4"]
QUANTIZE_GROUP = 32
"""Weights per group of `--quantize` by default: int4 at 32 is byte for byte q4_1, int8 at 32 q8_0."""


@dataclass(frozen=True)
class EngineOptions:
    """The forward pass's options (see the module docstring); the defaults are a library user's."""

    prepack: Switch = "auto"
    """Projection weights pre-packed for oneDNN and fused per layer: on, off, or auto (where that
    path exists: float32 on a CPU with oneDNN, projections without bias). Costs a second copy of the
    weights (`projection.Projection`)."""
    torch_compile: Switch = "off"
    """Each layer's dense part through torch.compile (`compiled.CompiledLayers`, compiled by
    `warm_up`): on, off, or auto (where it can run: CUDA, or a CPU with a C++ compiler)."""
    kernels: Kernels = "auto"
    """The native kernels (`native`: attention of decode and verify rows, and in float32 the
    projections of passes of a few rows): native (refused where they cannot run), torch (torch's
    operators), auto (native where they build and run)."""
    linear_rows: int | Literal["auto"] | None = None
    """The most rows of a pass whose projections take the native linear kernel; "auto": measured at
    `warm_up` against the pre-packed weights; None: every pass up to `LINEAR_MAX_ROWS` rows. A count
    above 0 where the linear kernel does not run is refused: it would change nothing."""

    weights: Weights = "auto"
    """Which weights are served (`models.choose_weights`): gguf (a GGUF file's quantized blocks, run
    as stored by the native kernels with float32 activations), dense (float tensors in the model's
    dtype; a GGUF de-quantized once into a cached float32 checkpoint), auto (gguf where the model is a
    GGUF, float32, on a CPU with the native kernels and not re-quantized; else dense)."""
    quantize: Quantize = "none"
    """Weight-only quantization of a dense model's linear layers at load (`weights.quantize_model`):
    int4 (asymmetric, a scale and a minimum a group) or int8 (symmetric), run by the native kernels."""
    quantize_group: int = QUANTIZE_GROUP
    """Weights per quantization group (a multiple of 32)."""

    FLAGS: ClassVar[dict[str, str]] = {"prepack": "--prepack-weights", "torch_compile": "--compile",
                                       "kernels": "--kernels", "linear_rows": "--native-linear-rows",
                                       "weights": "--weights", "quantize": "--quantize",
                                       "quantize_group": "--quantize-group"}
    """Each option's command-line flag (a service config names its field after the flag)."""
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"prepack": ("on", "off", "auto"),
                                                     "torch_compile": ("on", "off", "auto"),
                                                     "kernels": ("native", "torch", "auto"),
                                                     "weights": ("gguf", "dense", "auto"),
                                                     "quantize": ("none", "int8", "int4")}

    def __post_init__(self) -> None:
        for name, choices in self.CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{self.FLAGS[name]} must be {', '.join(choices[:-1])} or {choices[-1]}, "
                                 f"not {value!r}")
        rows = self.linear_rows
        if rows not in ("auto", None) and not (isinstance(rows, int) and not isinstance(rows, bool)
                                               and 0 <= rows <= LINEAR_MAX_ROWS):
            raise ValueError(f"--native-linear-rows must be auto or 0 to {LINEAR_MAX_ROWS}, not {rows!r}")
        if self.fixed_linear_rows and self.kernels == "torch":
            raise ValueError(f"--native-linear-rows {rows}: the native linear kernel does not run with --kernels "
                             "torch; drop --kernels torch, or the flag")
        group = self.quantize_group
        if isinstance(group, bool) or not isinstance(group, int) or group < 32 or group % 32:
            raise ValueError(f"--quantize-group must be a positive multiple of 32, not {group!r}")
        if self.weights == "gguf" and self.quantize != "none":
            raise ValueError(f"--quantize {self.quantize} quantizes float weights, --weights gguf runs a GGUF's own "
                             "blocks: drop one (--weights dense --quantize ... re-quantizes a de-quantized GGUF)")
        if self.quantized:
            self.refuse_with_quantized(self.quantized)

    @property
    def quantized(self) -> str:
        """What makes the weights quantized whatever the model ("--quantize int4", "--weights gguf"), or ""."""
        if self.quantize != "none":
            return f"--quantize {self.quantize}"
        return "--weights gguf" if self.weights == "gguf" else ""

    def refuse_with_quantized(self, why: str) -> None:
        """Refuse the options quantized weights cannot honour (`why`: what makes them quantized)."""
        conflicts = {"--compile on": self.torch_compile == "on", "--prepack-weights on": self.prepack == "on",
                     "--kernels torch": self.kernels == "torch"}
        for flag, asked in conflicts.items():
            if asked:
                what = {"--compile on": "the compiled pass traces float weights",
                        "--prepack-weights on": "pre-packing reorders float weights for oneDNN",
                        "--kernels torch": "quantized blocks run only in the native kernels"}[flag]
                raise ValueError(f"{flag} conflicts with {why}: {what}; drop {flag}")

    @property
    def fixed_linear_rows(self) -> int:
        """The count of `linear_rows` when it is a fixed count above 0, else 0."""
        rows = self.linear_rows
        return rows if isinstance(rows, int) and rows > 0 else 0

    def check_dtype(self, dtype: str) -> None:
        """Refuse, before a model of `dtype` ("float32", ...) loads, what it could not honour (the
        loaded model is checked again by `engine_plan.plan_engine`)."""
        if self.fixed_linear_rows and dtype != "float32":
            raise ValueError(f"--native-linear-rows {self.linear_rows}: the native linear kernel runs float32, "
                             f"not --dtype {dtype}")
        if self.quantized and dtype not in ("float32", "float64"):
            raise ValueError(f"{self.quantized} runs float32 activations, not --dtype {dtype} (drop --dtype, or pass "
                             "--dtype float32)")
