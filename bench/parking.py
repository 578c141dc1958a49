"""What the OpenMP workers cost the machine after a pass, spinning or parked (`specdec.runtime.native.Parking`).

    python bench/parking.py --out bench/results/parking.json

A model thread (one worker, as a service's) runs a pass-sized parallel operation (a float32 matrix
product on torch's threads), then the process sleeps `--gap-ms` as a service does while it waits
for the next request; the CPU time the process spent in that gap is what the workers took from
the cores the request's own path needs. `spin`: the workers left as they are (libgomp spins, then
sleeps); `park`: the batcher's park handed to the model thread when it goes idle, woken at the end
of the gap. The two alternate, `--reps` gaps each, `--rounds` times.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    import torch

    from specdec.runtime import native

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gap-ms", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/parking.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    parking = native.parking()
    if parking is None:
        sys.exit(f"no native kernels here: {native.library()[1]}")
    thread = ThreadPoolExecutor(max_workers=1)
    a = torch.randn(1024, 1024)
    work = lambda: (a @ a).sum().item()  # noqa: E731
    results: dict[str, list[float]] = {"spin": [], "park": []}
    for _ in range(args.rounds):
        for mode in results:
            spent = []
            for _ in range(args.reps):
                thread.submit(work).result()
                if mode == "park":
                    thread.submit(parking.park, parking.ticket())
                before = cpu_s()
                time.sleep(args.gap_ms / 1e3)
                spent.append((cpu_s() - before) * 1e3)
                if mode == "park":
                    parking.unpark()
            results[mode].append(statistics.median(spent))
            print(f"{mode}: {results[mode][-1]:.2f} ms of CPU in a {args.gap_ms:g} ms gap after a pass (median)")
    thread.submit(lambda: None).result()
    out = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
           "threads": args.threads, "gap_ms": args.gap_ms, "reps": args.reps,
           "cpu_ms_in_gap": results, "command": " ".join(sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
