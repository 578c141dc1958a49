"""One batched scoring pass, the old engine against the new one, and both against the memory floor.

    python bench/engine.py --quick                       # a small subset (a few minutes)
    python bench/engine.py --out bench/results/engine.json  # the whole grid (slow for the old engine)

A cell is (positions a row, context, sessions): every session has `context` tokens cached and
scores `positions` new ones (a verify of k = positions - 1 drafted tokens; 1 is a decode step)
in ONE `SessionCaches.score_batch` pass. Timed: the median (and the minimum) of --repeats
passes after one warm-up, each followed by an untimed rollback to `context`, the engines'
passes interleaved so that load from elsewhere on a shared machine hits them alike. Engines:

- `old`: the engine before K/V moved into per-session buffers written in place, frozen in
  `bench/_legacy_kv.py` (a DynamicCache per session, the pasts copied into a padded batch every pass);
- `new`: `specdec.runtime.kv` (in-place buffers, packed pass), as a service runs it: projections
  of up to `native_linear_rows` rows through the native linear kernel, that count measured once at
  the start as a service's warm-up measures it (`--native-linear-rows auto`; recorded in the JSON);
- `batch_invariant` (with `--engines ...,batch_invariant`): the new engine with every pass of up to
  48 rows through the native linear kernel (`--native-linear-rows 48`: a session's logits the same
  bits whatever shares its pass);
- `new_one_by_one` (sessions > 1): the new engine scoring the same rows one `score` at a time;
- `compiled` (with `--engines ...,compiled`): the new engine with `--compile on` (one compile,
  at the start, shared by every cell; its time is recorded as `compile_s`);
- `torch_kernels` (with `--engines ...,torch_kernels`): the new engine with `--kernels torch`
  (torch's operators: attention row by row, projections through oneDNN, instead of the native
  kernels `new` runs where they build);
- `native_attention` (with `--engines ...,native_attention`): the new engine with the native
  attention kernel but oneDNN's projections (the native linear kernel left out), to tell the two
  kernels' shares apart;
- `avx2_kernels` (with `--engines ...,avx2_kernels`): `new` with the native kernels built for
  x86-64-v3 (their AVX2 loops), where `new` runs the build for this CPU (its AVX-512 loops where
  it has them).

Weight formats (`--formats gguf,float32,bf16,int8,int4`, beside or instead of the engines: `--engines ""`):
the `new` engine on the same model loaded each way, timed interleaved in one run into the JSON's
`formats` section, each cell against the floor of the bytes *that format* reads a step
(`ServedWeights.nbytes`: the projections and the output layer as stored, plus the K/V):
`gguf` (a GGUF's blocks as stored, `--weights gguf`), `float32` (the same weights de-quantized,
`--weights dense`), `bf16` (those weights rounded to bfloat16, `--dtype bfloat16`: oneDNN's bf16
kernels, on AVX512-BF16 / AMX where the CPU has them), `int8`, `int4` (the float32 model quantized
at load, `--quantize`, groups of `--quantize-group`), and `gguf_loop` (`gguf` with its layers' kernels
called one at a time from Python instead of in one call, `stack.LayerStack`: the A/B of that call).

Each figure also appears as a multiple of its floor: (weight bytes + every row's K/V bytes read)
/ the read bandwidth this script measures (sum of a ~500 MB float32 tensor, median of several).
Beside it, the compute floor: the pass's multiply-adds (every projection, the output layer
included, for each of its rows; attention, each query head against every key it sees, scores and
values) / the float32 FMA rate this script measures (`bench/fma_peak.c`, built with the machine's
C compiler; no compute floor without one). A pass is bounded by the larger of the two (the
roofline); batched ÷ one by one is set against the ratio of the two ways' rooflines (the same
multiply-adds, the weights read once against once per session).
Caches are filled with random keys/values, not prefilled: a pass costs the same whatever they
hold, and prefilling 16 x 8000 tokens would take longer than the benchmark. A cell whose
warm-up pass takes over --max-seconds is recorded as skipped, with every larger cell of that
engine; so is a cell whose caches would need more than --max-gb.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _legacy_kv as legacy
from specdec.runtime import kv as current, native
from specdec.runtime.cache_table import Entry
from specdec.runtime.engine_options import EngineOptions
from specdec.runtime.engine_plan import plan_engine
from specdec.runtime.models import DEFAULT_MODEL, load_model
from specdec.runtime.packed import PackedForward, kv_geometry

GRID = {"positions": [1, 3, 5, 9], "contexts": [64, 1024, 4096, 8000], "sessions": [1, 4, 8, 16]}
QUICK = {"positions": [1, 5], "contexts": [64, 4096], "sessions": [1, 8]}
KEYS = ("old", "torch_kernels", "native_attention", "avx2_kernels", "batch_invariant", "new", "new_one_by_one",
        "compiled")
QUICK_EXTRA = [(3, 4096, 8), (3, 4096, 1), (3, 64, 1)]  # the cells the summary reports


def read_bandwidth(repeats: int = 7) -> float:
    """Bytes per second that summing a ~500 MB float32 tensor reads (median of `repeats`)."""
    x = torch.ones(125_000_000, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times)


def fma_peak(threads: int) -> float | None:
    """Float32 multiply-adds per second x 2 (FLOP/s) on `threads` threads: `bench/fma_peak.c`,
    built with the machine's C compiler (None, said why, without one)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        print("no C compiler: no compute floor")
        return None
    with tempfile.TemporaryDirectory() as folder:
        binary = Path(folder) / "fma_peak"
        subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", str(Path(__file__).with_name("fma_peak.c")),
                        "-o", str(binary)], check=True)
        out = subprocess.run([str(binary)], check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout
    return float(out.split()[0]) * 1e9


def distinct(tensors) -> list[torch.Tensor]:
    """`tensors` with each storage once (a tied embedding and output layer are one weight)."""
    return list({t.data_ptr(): t for t in tensors}.values())


def matmul_params(model) -> int:
    """Weights a row is multiplied by: every projection of every layer and the output layer."""
    linears = [m for m in [*model.model.layers.modules(), model.lm_head] if isinstance(m, torch.nn.Linear)]
    return sum(w.numel() for w in distinct(m.weight for m in linears))


def pass_flops(positions: int, context: int, sessions: int, params: int, layers: int, heads: int,
               head_dim: int) -> float:
    """FLOPs (2 a multiply-add) of one pass: each row's projections, and its attention (query j of
    the block sees context + j + 1 keys: a dot product with each, then each one's value added in)."""
    seen = positions * context + positions * (positions + 1) // 2
    return sessions * (2.0 * positions * params + 4.0 * layers * heads * head_dim * seen)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in distinct(model.parameters()))


@contextlib.contextmanager
def using_library(lib):
    """The native kernels run from `lib` inside the block (None: the one `native.library` finds);
    their entry points look the library up on every call."""
    chosen = native.library
    if lib is not None:
        native.library = lambda: (lib, "")
    try:
        yield
    finally:
        native.library = chosen


@functools.lru_cache(maxsize=1)
def avx2_library():
    """The native kernels built for x86-64-v3 (AVX2/FMA), as a container image ships them."""
    folder = Path(tempfile.mkdtemp(prefix="specdec-kernels-"))
    return native.load(next(p for p in native.prebuild(folder) if p.name.endswith("-x86-64-v3.so")))


class Cell:
    """The sessions of one cell, cached to `context`, for one engine."""

    def __init__(self, engine: str, model, context: int, sessions: int, positions: int, vocab: int,
                 compiled=None, linear_rows: int | str = 48) -> None:
        options: dict = {"kernels": "torch"} if engine == "torch_kernels" else {}
        if engine in ("new", "avx2_kernels", "compiled", "loop"):
            options["linear_rows"] = linear_rows
        if engine == "old":
            self.caches = legacy.SessionCaches(model, max_context=context + positions + 1, max_sessions=sessions + 1)
        else:
            self.caches = current.SessionCaches(model, max_context=context + positions + 1,
                                                max_sessions=sessions + 1, engine=EngineOptions(**options))
        if engine == "native_attention":  # every projection through its pre-packed oneDNN weight
            packed = self.caches.forward
            for projection in [packed.head, *(p for layer in packed.layers for p in layer)]:
                projection.parts = []
        if engine == "compiled":
            self.caches.forward = compiled  # compiled once for every cell
        if engine == "loop":  # the layers one kernel call at a time from Python, not the layer stack
            self.caches.forward.stack = None
        self.library = avx2_library() if engine == "avx2_kernels" else None
        gen = torch.Generator().manual_seed(0)
        layers, heads, dim = kv_geometry(model)
        dtype = next(model.parameters()).dtype
        self.history = [int(t) for t in torch.randint(3, vocab, (context + 1,), generator=gen)]
        self.new = [int(t) for t in torch.randint(3, vocab, (positions - 1,), generator=gen)]
        self.context, self.ids = context, [f"s{i}" for i in range(sessions)]
        for sid in self.ids:
            data = torch.randn((2, layers, heads, context, dim), generator=gen, dtype=torch.float32).to(dtype)
            if engine == "old":
                cache = DynamicCache(config=model.config)
                for layer in range(layers):
                    cache.update(data[0, layer][None].clone(), data[1, layer][None].clone(), layer)
                self.caches._entries[sid] = legacy._Entry(tokens=self.history[:-1], cache=cache)
            else:
                kv = self.caches._new_cache(capacity=context + positions)
                kv.load([(data[0, i][None], data[1, i][None]) for i in range(layers)], context)
                self.caches.table.add(sid, Entry(tokens=self.history[:-1], cache=kv))

    def requests(self):
        return [current.ScoreRequest(sid, self.history, self.new) for sid in self.ids]

    def batched(self) -> float:
        with using_library(self.library):
            start = time.perf_counter()
            self.caches.score_batch(self.requests())
            elapsed = time.perf_counter() - start
        for sid in self.ids:
            self.caches.rollback(sid, self.context)
        return elapsed

    def one_by_one(self) -> float:
        start = time.perf_counter()
        for sid in self.ids:
            self.caches.score(sid, self.history, self.new)
        elapsed = time.perf_counter() - start
        for sid in self.ids:
            self.caches.rollback(sid, self.context)
        return elapsed


def measure(runs: dict[str, object], repeats: int, max_seconds: float) -> dict[str, dict]:
    """Time each of `runs` (name -> a pass) `repeats` times, the runs interleaved so that a burst
    of load from elsewhere on the machine hits them alike; each warmed up once first."""
    out: dict[str, dict] = {}
    live = {}
    for name, run in runs.items():
        warm = run()  # type: ignore[operator]
        if warm > max_seconds:
            out[name] = {"skipped": f"warm-up pass took {warm:.1f} s > --max-seconds", "warmup_s": warm}
        else:
            live[name], out[name] = run, {"times_s": []}
    for _ in range(repeats):
        for name, run in live.items():
            out[name]["times_s"].append(run())  # type: ignore[operator]
    for name in live:
        times = out[name]["times_s"]
        out[name].update(median_s=statistics.median(times), min_s=min(times))
    return out


def cells(args) -> list[tuple[int, int, int]]:
    grid = QUICK if args.quick else GRID
    if args.positions:
        grid = {**grid, "positions": [int(x) for x in args.positions.split(",")]}
    if args.contexts:
        grid = {**grid, "contexts": [int(x) for x in args.contexts.split(",")]}
    if args.sessions:
        grid = {**grid, "sessions": [int(x) for x in args.sessions.split(",")]}
    out = [(p, c, s) for s in grid["sessions"] for c in grid["contexts"] for p in grid["positions"]]
    if args.quick:
        out += [cell for cell in QUICK_EXTRA if cell not in out]
    return sorted(out, key=lambda cell: (cell[1] * cell[2], cell[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="positions {1,5} x contexts {64,4096} x sessions {1,8}, plus the cells the summary reports")
    ap.add_argument("--positions", help="comma-separated, overrides the grid's")
    ap.add_argument("--contexts", help="comma-separated, overrides the grid's")
    ap.add_argument("--sessions", help="comma-separated, overrides the grid's")
    ap.add_argument("--engines", default="old,new")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-seconds", type=float, default=15.0, help="skip a cell (and larger ones) past this")
    ap.add_argument("--max-gb", type=float, default=6.0, help="skip a cell whose caches need more memory")
    ap.add_argument("--formats", default="",
                    help="weight formats to time side by side: gguf,float32,bf16,int8,int4,gguf_loop")
    ap.add_argument("--quantize-group", type=int, default=32, help="group size of the int8 / int4 formats")
    ap.add_argument("--out", default="bench/results/engine.json")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    # The engines compared are the float32 ones (the legacy engine scores with a float head):
    # a GGUF is de-quantized for them; --formats times the blocks as stored.
    loaded = load_model(args.model, dtype=args.dtype, progress=True, weights="dense")
    model = loaded.model
    bandwidth = read_bandwidth()
    layers, heads, dim = kv_geometry(model)
    kv_token_bytes = layers * heads * dim * 2 * next(model.parameters()).element_size()
    weights = weight_bytes(model)
    peak = fma_peak(args.threads)
    params, heads = matmul_params(model), model.config.num_attention_heads
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, weights {weights / 1e6:.0f} MB, "
          f"K/V {kv_token_bytes / 1e3:.1f} KB a token"
          + (f", float32 FMA {peak / 1e9:.0f} GFLOP/s on {args.threads} threads" if peak else ""), flush=True)
    engines = [e for e in args.engines.split(",") if e]
    probe = current.SessionCaches(model, 64, engine=EngineOptions(linear_rows="auto"))  # as a service measures it
    probe.warm_up()
    linear_rows = getattr(probe.forward, "linear_rows", 0)
    print(f"native linear kernel for passes of up to {linear_rows} rows (measured)", flush=True)
    compiled, compile_s = None, None
    if "compiled" in engines:
        compiled = PackedForward(model, plan_engine(model, EngineOptions(torch_compile="on", linear_rows=linear_rows)))
        compile_s = compiled.warm_up()
        print(f"compiled in {compile_s:.1f} s", flush=True)
    too_big: dict[str, list[tuple[int, int, int]]] = {e: [] for e in engines}
    rows = []
    for positions, context, sessions in (cells(args) if engines else []):
        floor_s = (weights + sessions * (context + positions) * kv_token_bytes) / bandwidth
        row = {"positions": positions, "context": context, "sessions": sessions, "floor_s": floor_s,
               "flops": pass_flops(positions, context, sessions, params, layers, heads, dim)}
        if peak:
            row["compute_floor_s"] = row["flops"] / peak
        if sessions > 1:  # the same rows one session a pass: the weights read once for each
            row["one_by_one_floor_s"] = sessions * (weights + (context + positions) * kv_token_bytes) / bandwidth
        runs = {}
        for engine in engines:
            copies = 2 if engine == "old" else 1  # the old pass copies every past into a padded batch
            if copies * sessions * (context + positions) * kv_token_bytes > args.max_gb * 1e9:
                row[engine] = {"skipped": "over --max-gb"}
            elif any(positions >= p and context >= c and sessions >= s for p, c, s in too_big[engine]):
                row[engine] = {"skipped": "a smaller cell took over --max-seconds"}
            else:
                cell = Cell(engine, model, context, sessions, positions, loaded.vocab_size, compiled, linear_rows)
                runs[engine] = cell.batched
                if engine == "new" and sessions > 1:
                    runs["new_one_by_one"] = cell.one_by_one
        row.update(measure(runs, args.repeats, args.max_seconds))
        for engine in engines:
            if "warmup_s" in row.get(engine, {}):
                too_big[engine].append((positions, context, sessions))
        del runs
        for key in KEYS:
            if "median_s" in row.get(key, {}):
                row[key]["over_floor"] = row[key]["median_s"] / floor_s
        rows.append(row)
        compute = f" (compute {row['compute_floor_s'] * 1e3:.1f})" if "compute_floor_s" in row else ""
        print(" ".join([f"pos {positions} ctx {context:5d} sessions {sessions:2d}: "
                        f"floor {floor_s * 1e3:7.1f} ms{compute}"]
                       + [f"{key} {row[key]['median_s'] * 1e3:7.1f} ms ({row[key]['over_floor']:.1f}x)"
                          if "median_s" in row.get(key, {}) else f"{key} skipped"
                          for key in KEYS if key in row]), flush=True)
    result = {"model": loaded.name, "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
              "read_bandwidth_gb_s": bandwidth / 1e9, "weight_bytes": weights, "kv_bytes_per_token": kv_token_bytes,
              "fma_gflop_s": peak / 1e9 if peak else None, "matmul_params": params,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "compile_s": compile_s,
              "native_linear_rows": linear_rows,
              "summary": summary(rows), "cells": rows}
    if args.formats:
        result["formats"] = weight_formats(args, bandwidth, linear_rows)
    for line in result["summary"]:
        print(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if rows:
        plot(rows, out.with_suffix(".png"))


FORMATS = {"gguf": {"weights": "gguf"}, "float32": {"weights": "dense"},
           "bf16": {"weights": "dense", "dtype": "bfloat16"},
           "int8": {"weights": "dense", "quantize": "int8"}, "int4": {"weights": "dense", "quantize": "int4"},
           "gguf_loop": {"weights": "gguf"}}
LOOPED = {"gguf_loop"}  # formats whose pass calls the layers' kernels one at a time (no `stack.LayerStack`)


def weight_formats(args, bandwidth: float, linear_rows: int) -> dict:
    """The `new` engine on `args.model` in each of `args.formats` (`FORMATS`), every cell timed with
    the formats interleaved, each against the floor of the bytes its own format reads."""
    loaded = {}
    for name in args.formats.split(","):
        loaded[name] = load_model(args.model, progress=False, quantize_group=args.quantize_group, **FORMATS[name])
        print(f"format {name}: {loaded[name].weights.format}, {loaded[name].weights.nbytes / 1e6:.1f} MB a step",
              flush=True)
    again = read_bandwidth()  # the floor takes the better of two reads: load from elsewhere only lowers it
    print(f"read bandwidth again {again / 1e9:.1f} GB/s", flush=True)
    bandwidth = max(bandwidth, again)
    any_model = next(iter(loaded.values()))
    layers, heads, dim = kv_geometry(any_model.model)
    element = {name: kv_element_bytes(m.model) for name, m in loaded.items()}
    kv_token_bytes = {name: layers * heads * dim * 2 * element[name] for name in loaded}
    # the measured native-linear row count is float32's; bfloat16 has no native linear kernel: its own plan
    rows_for = {name: linear_rows if element[name] == 4 else "auto" for name in loaded}
    rows = []
    for positions, context, sessions in cells(args):
        tokens = sessions * (context + positions)
        runs = {name: Cell("loop" if name in LOOPED else "new", m.model, context, sessions, positions, m.vocab_size,
                           linear_rows=rows_for[name]).batched for name, m in loaded.items()}
        row = {"positions": positions, "context": context, "sessions": sessions,
               **measure(runs, args.repeats, args.max_seconds)}
        for name, m in loaded.items():
            floor = (m.weights.nbytes + tokens * kv_token_bytes[name]) / bandwidth
            row[name].update(format=m.weights.format, weight_bytes=m.weights.nbytes, floor_s=floor)
            if "median_s" in row[name]:
                row[name]["over_floor"] = row[name]["median_s"] / floor
        del runs
        rows.append(row)
        print(f"pos {positions} ctx {context:5d} sessions {sessions:2d}: " + "  ".join(
            f"{name} {row[name]['median_s'] * 1e3:6.1f} ms (min {row[name]['min_s'] * 1e3:.1f}, floor "
            f"{row[name]['floor_s'] * 1e3:.1f}, {row[name]['over_floor']:.1f}x)" if "median_s" in row[name]
            else f"{name} skipped" for name in loaded), flush=True)
    return {"quantize_group": args.quantize_group,
            "kv_bytes_per_token": kv_token_bytes,
            "read_bandwidth_gb_s": bandwidth / 1e9,
            "weights": {name: {"format": m.weights.format, "bytes": m.weights.nbytes,
                               "fingerprint": m.weights.fingerprint} for name, m in loaded.items()},
            "cells": rows}


def kv_element_bytes(model) -> int:
    """Bytes of one cached K/V element: the model's float dtype (a quantized model's activations and
    caches are float32)."""
    floats = [p for p in model.parameters() if p.is_floating_point()]
    return floats[0].element_size() if floats else 4


def summary(rows: list[dict]) -> list[str]:
    """The headline figures (decode step, verify cost, batched against one by one), where the grid has them."""
    def ms(positions: int, context: int, sessions: int, key: str, stat: str = "median_s") -> float | None:
        for r in rows:
            if (r["positions"], r["context"], r["sessions"]) == (positions, context, sessions):
                return r.get(key, {}).get(stat, None) if key != "floor_s" else r["floor_s"]
        return None

    def both(positions: int, context: int, sessions: int, key: str) -> str | None:
        median, best = ms(positions, context, sessions, key), ms(positions, context, sessions, key, "min_s")
        if key == "floor_s":
            return None if median is None else f"floor {median * 1e3:.0f} ms"
        return None if median is None or best is None else f"{key} {median * 1e3:.0f} ms (min {best * 1e3:.0f})"

    lines = []
    for positions, context, sessions in ((1, 64, 1), (5, 64, 1), (3, 4096, 1), (3, 4096, 8)):
        got = [both(positions, context, sessions, key)
               for key in (*KEYS, "floor_s")]
        if got[-1] is not None:
            lines.append(f"{sessions} session(s) x context {context} x {positions} positions: "
                         + ", ".join(part for part in got if part is not None))
    for r in rows:
        cell = (r["positions"], r["context"], r["sessions"])
        if cell != (3, 4096, 8) or "median_s" not in r.get("new_one_by_one", {}):
            continue
        measured = r["new"]["median_s"] / r["new_one_by_one"]["median_s"]
        line = (f"batched / one by one at 8 x 4096 x 3: {measured:.2f} (medians); "
                f"bytes floors {r['floor_s'] / r['one_by_one_floor_s']:.2f}")
        if "compute_floor_s" in r:
            compute = r["compute_floor_s"]
            roofs = max(r["floor_s"], compute) / max(r["one_by_one_floor_s"], compute)
            line += (f", rooflines {roofs:.2f} (compute floor "
                     f"{compute * 1e3:.0f} ms, bytes {r['floor_s'] * 1e3:.0f} ms batched, "
                     f"{r['one_by_one_floor_s'] * 1e3:.0f} ms one by one)")
        lines.append(line)
    for key in ("old", "torch_kernels", "native_attention", "avx2_kernels", "batch_invariant", "new", "compiled"):
        one, five = ms(1, 64, 1, key), ms(5, 64, 1, key)
        if one and five:
            lines.append(f"{key}: 5 positions cost {five / one:.2f}x a decode step (1 session, context 64; medians)")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    sessions = sorted({r["sessions"] for r in rows})
    all_positions = sorted({r["positions"] for r in rows})
    markers = dict(zip(all_positions, "os^Dv*"))  # a marker per positions, a colour and line per engine
    engines = {"old": ("tab:red", "--"), "torch_kernels": ("tab:orange", (0, (3, 1, 1, 1))),
               "native_attention": ("tab:green", (0, (1, 1))), "avx2_kernels": ("tab:cyan", (0, (5, 2))),
               "batch_invariant": ("tab:olive", (0, (2, 2))),
               "new": ("tab:blue", "-"),
               "compiled": ("tab:purple", "-.")}
    fig, axes = plt.subplots(1, len(sessions), figsize=(4.5 * len(sessions), 4), squeeze=False)
    for ax, s in zip(axes[0], sessions):
        for positions in all_positions:
            cells = sorted((r for r in rows if r["sessions"] == s and r["positions"] == positions),
                           key=lambda r: r["context"])
            for key, (colour, style) in engines.items():
                points = [(r["context"], r[key]["median_s"] * 1e3) for r in cells if "median_s" in r.get(key, {})]
                if points:
                    ax.plot(*zip(*points), linestyle=style, color=colour, marker=markers[positions],
                            label=f"{key}, {positions} pos")
            ax.plot([r["context"] for r in cells], [r["floor_s"] * 1e3 for r in cells], ":", color="grey",
                    marker=markers[positions], label=f"floor, {positions} pos")
            computed = [(r["context"], r["compute_floor_s"] * 1e3) for r in cells if "compute_floor_s" in r]
            if computed:
                ax.plot(*zip(*computed), linestyle=(0, (1, 3)), color="black", marker=markers[positions],
                        fillstyle="none", label=f"compute floor, {positions} pos")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="one pass (ms)",
               title=f"{s} session{'s' if s > 1 else ''}")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
