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

    FLAGS: ClassVar[dict[str, str]] = {"prepack": "--prepack-weights", "torch_compile": "--compile",
                                       "kernels": "--kernels", "linear_rows": "--native-linear-rows"}
    """Each option's command-line flag (a service config names its field after the flag)."""
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"prepack": ("on", "off", "auto"),
                                                     "torch_compile": ("on", "off", "auto"),
                                                     "kernels": ("native", "torch", "auto")}

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
