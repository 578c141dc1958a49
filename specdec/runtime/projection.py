"""The pass's matrix products: one weight or several fused, through the path that reads them fastest.

A decode or verify pass multiplies a few rows by every weight of the model, so a projection is a
read of its weight. `Projection` picks the path: the native linear kernel for passes of up to
`rows` rows (`native.linear`: each weight row read once for all rows), else oneDNN's pre-packed
weights, else torch's `linear`. `measure_linear_rows` finds, on this machine, up to how many rows
the kernel beats oneDNN.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.nn.functional as F

from specdec.runtime import native
from specdec.runtime.engine_options import LINEAR_MAX_ROWS
from specdec.runtime.quantized import QuantizedProjection, QuantizedWeight

log = logging.getLogger(__name__)

LINEAR_ROW_CANDIDATES = (1, 2, 4, 8, 16, 24, 32, 48)
"""The row counts `measure_linear_rows` tries, in order (up to LINEAR_MAX_ROWS)."""


class Projection:
    """`h @ W.T` for one weight, or for several fused row-wise (q/k/v; gate/up), split on return.

    Plain: `torch.nn.functional.linear` (MKL on a CPU). Pre-packed: the weight reordered once for
    oneDNN (`torch.ops.mkldnn`, the path inductor's weight freezing takes). Measured here on
    SmolLM2-135M in float32 (bench/engine.py): MKL reads a cold weight at about 13 GB/s for one
    row and slows further for a few rows (its small-M GEMM path: the output layer costs 2.4x more
    at 5 rows than at 1), while the packed path reads closer to the bandwidth and costs about the
    same for 1 and 5 rows; fusing q/k/v and gate/up halves the calls per layer. The packed weights
    are a copy: the model's own stay for everything else (a second copy of the weights in memory).

    `native`: passes of at most `rows` rows (at most `LINEAR_MAX_ROWS`; the pass sets it) go through
    the native linear kernel, which reads the model's own weights where they lie (one call per fused
    weight, each writing its columns of the output): a row's output is then the same bits whatever
    shares the pass. Larger passes keep the path above.

    Quantized weights (`quantized.QuantizedWeight`, a GGUF's blocks or `--quantize`): one
    `QuantizedProjection` over the run of them, for every row count (no oneDNN path and no float
    copy: the blocks are all there is), writing its columns of the output; float weights fused with
    them (blocks de-quantized at load) run as above, minus pre-packing, writing theirs.
    """

    def __init__(self, weights: list[torch.Tensor | QuantizedWeight], prepack: bool, native: bool = False) -> None:
        self.sizes = [w.shape[0] for w in weights]
        self.width = sum(self.sizes)
        self.rows = LINEAR_MAX_ROWS
        self.pieces: list[tuple[QuantizedProjection | list[torch.Tensor], int, int]] = []
        self.parts: list[torch.Tensor] = []
        self.weight: torch.Tensor | None = None  # native and not pre-packed: larger passes use `parts`
        if any(isinstance(w, QuantizedWeight) for w in weights):
            self.prepacked, self.native = False, native
            self.pieces = _pieces(weights)
            return
        dense = [w for w in weights if isinstance(w, torch.Tensor)]
        with torch.inference_mode(False), torch.no_grad():
            self.parts = [w.detach().contiguous() for w in dense] if native else []  # no copy when contiguous
            if prepack or not native:
                weight = dense[0].detach() if len(dense) == 1 else torch.cat([w.detach() for w in dense])
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight) if prepack else weight
        self.prepacked = prepack

    def project(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`h` `[T, in]` -> `[T, sum(out_i)]` (the fused weights' outputs side by side), into `out`
        when given (`[T, sum(out_i)]`, features contiguous: a buffer the pass keeps)."""
        if self.pieces:
            return self._project_pieces(h if h.is_contiguous() else h.contiguous(), out)
        if self.parts and h.shape[0] <= self.rows:
            out = h.new_empty((h.shape[0], self.width)) if out is None else out
            return native.linear(h if h.is_contiguous() else h.contiguous(), self.parts, out)
        if self.prepacked:
            y = torch.ops.mkldnn._linear_pointwise(h, self.weight, None, "none", [], "")
        elif self.weight is None:
            y = torch.cat([F.linear(h, w) for w in self.parts], dim=-1)
        else:
            y = F.linear(h, self.weight)
        return y if out is None else out.copy_(y)

    def _project_pieces(self, h: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Each run of quantized weights through its kernel, each run of float ones through the native
        linear kernel (float32, up to `rows` rows) or torch's `linear`, into its columns of one output."""
        out = h.new_empty((h.shape[0], self.width)) if out is None else out
        if len(self.pieces) == 1 and isinstance(self.pieces[0][0], QuantizedProjection):
            return self.pieces[0][0].run(h, out)
        for piece, first, width in self.pieces:
            columns = out[:, first:first + width]
            if isinstance(piece, QuantizedProjection):
                piece(h, columns)
            elif self.native and h.dtype == torch.float32 and h.shape[0] <= self.rows:
                native.linear(h, piece, columns)
            else:
                columns.copy_(torch.cat([F.linear(h, w) for w in piece], dim=-1))
        return out

    def __call__(self, h: torch.Tensor) -> list[torch.Tensor]:
        """`h` `[T, in]` -> one `[T, out_i]` per fused weight."""
        y = self.project(h)
        return [y] if len(self.sizes) == 1 else list(y.split(self.sizes, dim=-1))


def _pieces(weights: list[torch.Tensor | QuantizedWeight]) -> list[tuple[QuantizedProjection | list[torch.Tensor],
                                                                         int, int]]:
    """Runs of consecutive quantized or float weights: (a `QuantizedProjection` or the float
    weights, first output column, columns)."""
    runs: list[list[torch.Tensor | QuantizedWeight]] = []
    for w in weights:
        if runs and isinstance(runs[-1][0], QuantizedWeight) == isinstance(w, QuantizedWeight):
            runs[-1].append(w)
        else:
            runs.append([w])
    pieces: list[tuple[QuantizedProjection | list[torch.Tensor], int, int]] = []
    first = 0
    for run in runs:
        width = sum(w.shape[0] for w in run)
        blocks = [w for w in run if isinstance(w, QuantizedWeight)]
        if blocks:
            pieces.append((QuantizedProjection(blocks), first, width))
        else:
            pieces.append(([w.detach().contiguous() for w in run if isinstance(w, torch.Tensor)], first, width))
        first += width
    return pieces


def measure_linear_rows(projections: list[Projection], candidates: tuple[int, ...] = LINEAR_ROW_CANDIDATES,
                        repeats: int = 3) -> int:
    """The most rows up to which the native linear kernel is at least as fast as the pre-packed
    oneDNN weights, on `projections` (those with both): every one at each count in `candidates`, both
    ways interleaved, medians of `repeats`, counting up until oneDNN wins (0 if it wins at the
    first). Which is faster depends on the CPU: on 2 AVX2 cores the kernel won up to 64 rows, on 2
    AVX-512 cores (where oneDNN runs AVX-512 code) up to 8 rows, tying beyond (see
    docs/architecture.md). Leaves every projection's `rows` as it found it."""
    both = [p for p in projections if p.parts and p.prepacked]
    if not both:
        return 0
    before = {id(p): p.rows for p in both}
    best = 0
    with torch.inference_mode():
        for m in candidates:
            native_s, onednn_s = _race(both, m, repeats)
            log.info("projections of %d rows: native linear kernel %.1f ms, oneDNN %.1f ms", m, native_s * 1e3,
                     onednn_s * 1e3)
            if native_s > onednn_s:
                break
            best = m
    for p in both:
        p.rows = before[id(p)]
    return best


def _race(projections: list[Projection], m: int, repeats: int) -> tuple[float, float]:
    """Median seconds of every projection at `m` rows through the kernel, and through oneDNN."""
    inputs = {p.parts[0].shape[1]: torch.randn(m, p.parts[0].shape[1], dtype=p.parts[0].dtype) for p in projections}
    ways = {"native": m, "onednn": 0}  # the rows each way lets through the kernel
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repeats + 1):  # the first round only touches
        for way, rows in ways.items():
            times[way].append(_time_projections(projections, inputs, rows))
    return statistics.median(times["native"][1:]), statistics.median(times["onednn"][1:])


def _time_projections(projections: list[Projection], inputs: dict[int, torch.Tensor], rows: int) -> float:
    """Seconds for every projection of `inputs` (by input width), letting `rows` rows through the kernel."""
    for p in projections:
        p.rows = rows
    start = time.perf_counter()
    for p in projections:
        p.project(inputs[p.parts[0].shape[1]])
    return time.perf_counter() - start
