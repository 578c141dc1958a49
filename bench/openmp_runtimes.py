"""A decode step of the packaged model (GGUF blocks) with the native kernels on one OpenMP runtime or two.

    python bench/openmp_runtimes.py --rounds 4 --steps 40 --out bench/results/openmp_runtimes.json

The kernels (`specdec.runtime.native`) are linked to the libgomp torch loaded (`torch`, the
engine's way). Two others, built here for comparison, each in a process of its own, the
processes interleaved round by round so that load from elsewhere hits them alike:
- `fopenmp`: linked with plain `-fopenmp` (the compiler's `libgomp.so.1`). Where torch ships its
  runtime under that same name (its CPU wheels) the loader shares torch's: one runtime still.
- `second`: linked to a copy of the system's libgomp under another name, as a wheel whose bundled
  runtime is renamed (`libgomp-<hash>.so.1`) gives: two runtimes, two thread pools on the same cores.
Each process reports the median and minimum wall time of a step and the CPU time it burned a step
(all its threads: spinning workers show there), and the OpenMP runtimes it mapped.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_GOMP = Path("/usr/lib/x86_64-linux-gnu/libgomp.so.1")


def one(variant: str, steps: int, threads: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from specdec.runtime import native

    torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp(prefix="specdec-omp-"))
    if variant == "fopenmp":
        native._link_openmp = lambda: ["-fopenmp"]
    elif variant == "second":
        raw = SYSTEM_GOMP.resolve().read_bytes()
        (tmp / "libgxmp.so.1").write_bytes(raw.replace(b"libgomp.so.1\0", b"libgxmp.so.1\0"))  # another soname
        native._link_openmp = lambda: [str(tmp / "libgxmp.so.1"), f"-Wl,-rpath,{tmp}"]
    native._build("cc", native.NATIVE, tmp / "k.so")
    lib = native.load(tmp / "k.so")
    native.library = lambda: (lib, "")
    from bench.engine import Cell
    from specdec.runtime.models import DEFAULT_MODEL, load_model

    loaded = load_model(DEFAULT_MODEL, weights="gguf", progress=False)
    cell = Cell("new", loaded.model, 64, 1, 1, loaded.vocab_size)
    for _ in range(5):
        cell.batched()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    times = [cell.batched() for _ in range(steps)]
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / steps
    maps = sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                   if "gomp" in line or "gxmp" in line})
    return {"variant": variant, "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
            "cpu_ms_per_step": cpu * 1e3, "runtimes": maps, "weights": loaded.weights.format}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="torch,fopenmp,second")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="bench/results/openmp_runtimes.json")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.steps, args.threads)))
        return
    runs: dict[str, list[dict]] = {v: [] for v in args.variants.split(",")}
    for _ in range(args.rounds):
        for variant in runs:
            out = subprocess.run([sys.executable, __file__, "--one", variant, "--steps", str(args.steps),
                                  "--threads", str(args.threads)], capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[variant][-1]), flush=True)
    summary = {v: {"median_of_medians_ms": statistics.median(r["median_ms"] for r in rs),
                   "best_min_ms": min(r["min_ms"] for r in rs),
                   "median_cpu_ms_per_step": statistics.median(r["cpu_ms_per_step"] for r in rs),
                   "runtimes": len(rs[0]["runtimes"])} for v, rs in runs.items()}
    for v, s in summary.items():
        print(f"{v}: step {s['median_of_medians_ms']:.1f} ms (median of {args.rounds}), min {s['best_min_ms']:.1f} ms, "
              f"CPU {s['median_cpu_ms_per_step']:.1f} ms a step, {s['runtimes']} OpenMP runtime(s)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "steps": args.steps, "summary": summary, "runs": runs},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
