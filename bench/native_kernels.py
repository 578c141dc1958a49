"""The native kernels alone, side by side with their alternatives, on a model's own shapes.

    python bench/native_kernels.py                                   # the default cells (a few minutes)
    python bench/native_kernels.py --attention 8x4096x3 --rows 1,24 --repeats 15

- attention (`--attention ROWSxPASTxPOSITIONS,...`): every layer's attention of ROWS sessions, each
  with PAST cached positions and POSITIONS new ones (one `native_attention.attend` call a layer),
  through the kernel built for this CPU (`native`), through each portable build this CPU runs
  (`x86-64-v4`: AVX-512 loops, `x86-64-v3`: AVX2, `x86-64`: plain loops; what a container image
  ships), and through torch's operators (`torch`: `packed.attend` row by row). Keys and values are
  random, in `SessionKV` buffers of the model's geometry; caches are flushed before each timing
  (a 400 MB write), so they are read from memory as in a serving pass.
- projections (`--rows M,...`): every projection of the model (the fused q/k/v and gate/up of each
  layer, o, down, and the output layer) for M rows, through the linear kernel of each build and
  through oneDNN's pre-packed weights (`onednn`, what passes larger than `--native-linear-rows`
  take).

Ways alternate within each repeat (in a random order), so load from elsewhere on a shared machine
hits them alike; each figure is a median. Every figure comes with the bytes it reads over the time
(K/V for attention, weights for projections) and the read bandwidth the script measures (sum of a
~500 MB float32 tensor). Writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import read_bandwidth, using_library
from specdec.runtime import native, native_attention, packed
from specdec.runtime.engine_options import EngineOptions
from specdec.runtime.engine_plan import plan_engine
from specdec.runtime.kv_buffer import SessionKV
from specdec.runtime.models import DEFAULT_MODEL, load_model

ATTENTION = "1x4096x3,8x4096x1,8x4096x3,8x4096x5,16x2000x1"
ROWS = "1,2,4,8,16,24,32,48"


def builds() -> dict[str, Any]:
    """The kernel libraries to compare: this CPU's build, then each portable build it runs."""
    lib, why = native.library()
    if lib is None:
        raise SystemExit(f"no native kernels: {why}")
    found = {"native": lib}
    built = dict(zip(native.portable_isas(), native.prebuild(Path(tempfile.mkdtemp(prefix="specdec-kernels-")))))
    for isa in native.runnable_isas():
        found[isa] = native.load(built[isa])
    return found


def timed(ways: dict[str, Any], repeats: int, before=None) -> dict[str, float]:
    """Median seconds of each of `ways` (name -> a call), alternating in a random order each round."""
    for run in ways.values():
        run()  # first touch
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        order = list(ways.items())
        random.shuffle(order)
        for name, run in order:
            if before is not None:
                before()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def with_library(lib, run):
    """`run` with the native kernels running from `lib`."""
    def call():
        with using_library(lib):
            run()
    return call


def attention_cell(model, libraries: dict[str, Any], rows: int, past: int, positions: int, repeats: int,
                   flush: torch.Tensor) -> dict:
    layers, kv_heads, dim = packed.kv_geometry(model)
    heads = model.config.num_attention_heads
    scale = dim ** -0.5
    sessions = []
    for _ in range(rows):
        kv = SessionKV(layers, kv_heads, dim, past + positions, torch.float32, capacity=past + positions)
        kv.data.normal_()
        kv.length = past
        sessions.append(kv)
    q = torch.randn(rows * positions, heads, dim)
    out = torch.empty_like(q)
    plan = native_attention.AttentionPlan([(kv, i * positions, positions, past) for i, kv in enumerate(sessions)])

    def kernel() -> None:
        for layer in range(layers):
            native_attention.attend(plan, layer, q, out, kv_heads, scale)

    def torch_path() -> None:
        for layer in range(layers):
            for i, kv in enumerate(sessions):
                block = q[i * positions:(i + 1) * positions].view(positions, kv_heads, heads // kv_heads, dim)
                packed.attend(block.permute(1, 2, 0, 3), kv.segments(layer, past + positions), past, scale)

    ways = {name: with_library(lib, kernel) for name, lib in libraries.items()}
    ways["torch"] = torch_path
    medians = timed(ways, repeats, before=lambda: flush.add_(1.0))
    kv_bytes = rows * (past + positions) * layers * kv_heads * dim * 2 * 4
    return {"rows": rows, "past": past, "positions": positions, "kv_bytes": kv_bytes,
            "ways": {name: {"median_s": s, "gb_s": kv_bytes / s / 1e9} for name, s in medians.items()}}


def projections_cell(forward: packed.PackedForward, libraries: dict[str, Any], m: int, repeats: int) -> dict:
    projections = [p for layer in forward.layers for p in layer] + [forward.head]
    inputs = {p.parts[0].shape[1]: torch.randn(m, p.parts[0].shape[1]) for p in projections}

    def through(rows: int):
        def run() -> None:
            for p in projections:
                p.rows = rows
                p.project(inputs[p.parts[0].shape[1]])
        return run

    ways = {name: with_library(lib, through(m)) for name, lib in libraries.items()}
    ways["onednn"] = through(0)
    weight_bytes = sum(w.numel() * w.element_size() for p in projections for w in p.parts)
    medians = timed(ways, repeats)
    for p in projections:
        p.rows = forward.linear_rows
    return {"rows": m, "weight_bytes": weight_bytes,
            "ways": {name: {"median_s": s, "gb_s": weight_bytes / s / 1e9} for name, s in medians.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention", default=ATTENTION, help="ROWSxPASTxPOSITIONS cells, comma-separated ('' for none)")
    ap.add_argument("--rows", default=ROWS, help="projection row counts, comma-separated ('' for none)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default="bench/results/native_kernels.json")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        model = load_model(args.model, dtype="float32", progress=False).model
        libraries = builds()
        bandwidth = read_bandwidth()
        print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; builds: {', '.join(libraries)}", flush=True)
        flush = torch.empty(100_000_000)
        attention = []
        for cell in filter(None, args.attention.split(",")):
            rows, past, positions = (int(x) for x in cell.split("x"))
            result = attention_cell(model, libraries, rows, past, positions, args.repeats, flush)
            result["floor_s"] = result["kv_bytes"] / bandwidth
            attention.append(result)
            print(f"attention {cell}: floor {result['floor_s'] * 1e3:.1f} ms; " + ", ".join(
                f"{name} {way['median_s'] * 1e3:.1f} ms ({way['gb_s']:.1f} GB/s)"
                for name, way in result["ways"].items()), flush=True)
        del flush
        forward = packed.PackedForward(model, plan_engine(model, EngineOptions(prepack="on", kernels="native")))
        projections = []
        for m in (int(x) for x in filter(None, args.rows.split(","))):
            result = projections_cell(forward, libraries, m, args.repeats)
            result["floor_s"] = result["weight_bytes"] / bandwidth
            projections.append(result)
            print(f"projections of {m} rows: floor {result['floor_s'] * 1e3:.1f} ms; " + ", ".join(
                f"{name} {way['median_s'] * 1e3:.1f} ms" for name, way in result["ways"].items()), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": args.model, "threads": args.threads, "repeats": args.repeats, "read_bandwidth_gb_s": bandwidth / 1e9,
        "machine": platform.processor() or platform.machine(), "isas": native.runnable_isas(),
        "torch": torch.__version__, "attention": attention, "projections": projections}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
