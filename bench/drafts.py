"""Shallow self-distilled drafts for the default target: build several depths, then profile them
next to the bf16 copy of the target and prompt lookup.

    python bench/drafts.py --depths 2,4,8 --budget 10 --threads 1 --out bench/results/drafts.json
    python bench/drafts.py --depths 2,4,8 --budget 10 --device cuda --out bench/results/drafts-gpu.json

Each depth is built with `specdec draft build` machinery within the same training budget (data
generation is shared and cached, and reported separately), then one `specdec draft profile` run
measures every candidate side by side: step latency, held-out greedy acceptance, and end-to-end
speedup through a real pipeline (k = 0, fixed k and auto, interleaved per prompt). The JSON gets
the build reports (with loss curves) added; the plot goes next to it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafts.build import REPORT_FILE, BuildConfig, build_draft
from drafts.profile import ProfileConfig, profile_drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default")
    parser.add_argument("--depths", default="2,4,8")
    parser.add_argument("--budget", type=float, default=10.0, help="training minutes per draft")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the builds")
    parser.add_argument("--device", default="auto", help="where the builds train and the profiled models run: "
                                                         "auto (a CUDA GPU if any, else the CPU), cpu, cuda or cuda:N")
    parser.add_argument("--work", default=".drafts-work/bench", help="where the drafts are written")
    parser.add_argument("--reuse", action="store_true", help="skip a depth whose draft already exists")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--profile-threads", type=int, default=1,
                        help="torch threads of the target and draft processes and of the in-process latency "
                             "measurements (one: two threads stall each other on this busy 2-core machine)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--e2e-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="bench/results/drafts.json")
    args = parser.parse_args()

    work = Path(args.work)
    drafts = []
    for depth in [int(d) for d in args.depths.split(",")]:
        out = work / f"L{depth}"
        drafts.append(str(out))
        if args.skip_build or (args.reuse and (out / REPORT_FILE).is_file()):
            continue
        build_draft(BuildConfig(target=args.target, layers=str(depth), out=str(out), budget_min=args.budget,
                                threads=args.threads, device=args.device))

    threads = args.profile_threads
    result = profile_drafts(ProfileConfig(target=args.target, drafts=drafts, copy=True, ngram=True, k=args.k,
                                          e2e_tokens=args.e2e_tokens, repeats=args.repeats, out=args.out,
                                          threads=threads, target_threads=threads, draft_threads=threads,
                                          device=args.device))
    result["builds"] = {Path(d).name: json.loads((Path(d) / REPORT_FILE).read_text()) for d in drafts}
    for report in result["builds"].values():
        report.pop("config", None)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for cand in result["candidates"]:
        e2e = cand["e2e"]
        print(f"{cand['name']:>22}  step {cand['step_ms']:7.2f} ms ({cand['latency_ratio']:.3f}×)  "
              f"α {cand['agreement']:.3f}  acc@k={args.k} {cand['acceptance']['acceptance_rate']:.3f}  "
              f"ideal ×{cand['ideal_speedup']:.2f}  e2e k={args.k} ×{e2e[str(args.k)]['speedup']:.2f}  "
              f"auto ×{e2e['auto']['speedup']:.2f}")
    print(json.dumps(result["goal"], indent=2))


if __name__ == "__main__":
    main()
