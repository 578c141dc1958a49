"""Draft-length benchmark: `auto` against every fixed k, per round trip, cost regime and draft.

    python bench/draft_length.py --out bench/results/draft_length.json

Grid: round trip {0, 2, 10, 30} ms (real delay on the wire: a TCP relay process in front of
the draft and of the target, holding every chunk for half the round trip) × regime × draft.

Regimes
- `cpu-real`: the packaged SmolLM2-135M-Instruct target (fp32) on this CPU. Speculative runs pin
  the target to core 0 and the draft to core 1 (one thread each); the `k = 0` baseline gives
  the target both cores (`plain-2-cores`), as a user without a draft would run it. Good draft:
  the bf16 copy of the target; poor draft: prompt lookup with 1-token matches on an open chat
  prompt (acceptance ≈ 0.1–0.3).
- `gpu-emulated` (a labelled simulation): tiny models from a config whose forward passes are
  padded up to a GPU-class profile (target verify 30 ms + 0.5 ms per position, draft 3 ms per
  token); good draft: a lightly perturbed copy of the target (acceptance ≈ 0.9), poor draft: a
  heavily perturbed copy (≈ 0.3).

Every cell runs the same prompt at every mode, interleaved (the order rotated each
repetition), after one unmeasured warm-up of `auto` (so the session prior is warm, as in a
running server). Output: JSON with tokens/s per mode, `auto` against the best fixed k and k = 0, and the k
chosen by `auto` per round; `--plot` adds a PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import Client
from specdec.launcher import Pipeline, PipelineSpec, free_port, wait_healthy

RTTS_MS = [0, 2, 10, 30]
MODES = ["auto", "0", "1", "2", "4", "6", "8", "12"]
CHAT = [{"role": "user", "content": "Explain in simple words how a refrigerator keeps food cold."}]


def tiny_models(root: Path) -> dict[str, str]:
    from specdec.testing.tiny import make_tiny_model

    target = make_tiny_model(root / "target", seed=0)
    return {
        "target": str(target),
        "good": str(make_tiny_model(root / "good", base=target, perturb=0.02, seed=1)),
        "poor": str(make_tiny_model(root / "poor", base=target, perturb=0.2, seed=2)),
    }


def cells(models: dict[str, str], args) -> list[dict]:
    emulate_t = ["--emulate-verify-ms", "30", "--emulate-verify-per-token-ms", "0.5"]
    emulate_d = ["--emulate-draft-per-token-ms", "3"]
    pinned = dict(target_threads=1, draft_threads=1, target_cpus="0", draft_cpus="1")
    out = []
    if "cpu-real" in args.regimes:
        out += [
            dict(regime="cpu-real", draft="good", plan=dict(proposer="model", draft_dtype="bfloat16", **pinned),
                 request=dict(messages=CHAT), tokens=args.cpu_tokens),
            dict(regime="cpu-real", draft="poor", plan=dict(proposer="ngram", ngram_min=1, **pinned),
                 request=dict(messages=CHAT), tokens=args.cpu_tokens),
            dict(regime="cpu-real", draft="none", modes=["0"], plan=dict(proposer="none", target_threads=2),
                 request=dict(messages=CHAT), tokens=args.cpu_tokens, label="plain-2-cores"),
        ]
    if "gpu-emulated" in args.regimes:
        for name in ("good", "poor"):
            out.append(dict(
                regime="gpu-emulated", draft=name, request=dict(prompt="Once upon a time"), tokens=args.gpu_tokens,
                plan=dict(proposer="model", target_model=models["target"], draft_model=models[name],
                          target_dtype="float32", draft_dtype="float32", target_threads=1, draft_threads=1,
                          extra_target_args=emulate_t, extra_draft_args=emulate_d),
            ))
    return out


class RttFleet:
    """One orchestrator per round trip, each reaching draft and target through its own relays."""

    def __init__(self, pipeline: Pipeline, log_dir: Path, overlap: bool) -> None:
        self.pipeline = pipeline
        self.log_dir = log_dir
        self.overlap = overlap
        self.procs: list[subprocess.Popen] = []

    def orchestrator_for(self, rtt_ms: float, db: int) -> str:
        plan = self.pipeline.plan
        addresses = plan.grpc_addresses()
        via = {}
        for name in ("target", "draft"):
            if name not in addresses:
                continue
            if rtt_ms == 0:
                via[name] = addresses[name]
                continue
            port = free_port()
            self._spawn(f"relay-{name}-{rtt_ms}", [sys.executable, "bench/relay.py", "--port", str(port),
                                                   "--upstream", addresses[name], "--delay-ms", str(rtt_ms / 2)])
            via[name] = f"127.0.0.1:{port}"
        port = free_port()
        cmd = [sys.executable, "-m", "orchestrator", "--port", str(port), "--target", via["target"],
               "--draft", via.get("draft", ""), "--redis-url", f"redis://127.0.0.1:{plan.redis_port}/{db}",
               "--model", plan.target_model, "--draft-length", "auto", "--log-level", "WARNING"]
        if self.overlap:
            cmd.append("--overlap")
        proc = self._spawn(f"orchestrator-{rtt_ms}", cmd)
        wait_healthy(f"127.0.0.1:{port}", 120, proc)
        return f"127.0.0.1:{port}"

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (the child's stdout, open while it runs)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        time.sleep(0.3)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def run_mode(client: Client, cell: dict, mode: str) -> dict:
    draft_length = "auto" if mode == "auto" else int(mode)
    started = time.perf_counter()
    chunks = list(client.stream(**cell["request"], max_new_tokens=cell["tokens"], draft_length=draft_length))
    stats = chunks[-1].stats
    return {
        "tokens_per_s": stats["tokens_per_second"], "tokens": stats["completion_tokens"],
        "acceptance_rate": stats["acceptance_rate"], "rounds": stats["rounds"],
        "k_chosen": [c.round.get("draft_length", 0) for c in chunks],
        "elapsed_s": time.perf_counter() - started,
        "token_ids": [t for c in chunks for t in c.token_ids],
    }


def run_cell(cell: dict, args, log_root: Path) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix=f"{cell['regime']}-{cell['draft']}-", dir=log_root))
    plan = PipelineSpec(orchestrator_port=free_port(), draft_port=free_port(), target_port=free_port(),
                        redis_port=free_port(), log_dir=str(log_dir), **cell["plan"])
    pipeline = Pipeline(plan)
    pipeline.start(echo=lambda *_: None)
    fleet = RttFleet(pipeline, log_dir, overlap=args.overlap)
    result = {}
    try:
        for db, rtt in enumerate(args.rtts):
            address = fleet.orchestrator_for(rtt, db)
            modes = cell.get("modes", args.modes)
            with Client(address) as client:
                if "auto" in modes:
                    run_mode(client, cell, "auto")  # warm the prior, unmeasured
                runs = {mode: [] for mode in modes}
                for repeat in range(args.repeats):
                    # Rotate the order each repetition so no mode always runs first (or right
                    # after the warm-up) in a cell.
                    shift = repeat % len(modes)
                    for mode in modes[shift:] + modes[:shift]:
                        runs[mode].append(run_mode(client, cell, mode))
            row = {}
            for mode, rs in runs.items():
                row[mode] = {
                    "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rs), 3),
                    "acceptance_rate": round(statistics.median(r["acceptance_rate"] for r in rs), 3),
                    "mean_k": round(statistics.mean(k for r in rs for k in r["k_chosen"]), 2),
                    "k_chosen": rs[0]["k_chosen"],
                }
            greedy = {tuple(r["token_ids"]) for rs in runs.values() for r in rs}
            row["_identical_outputs"] = len(greedy) == 1
            result[str(rtt)] = row
            print(f"{cell['regime']:12} {cell.get('label', cell['draft']):13} rtt {rtt:>2} ms  " +
                  "  ".join(f"{m}:{v['tokens_per_s']:.1f}" for m, v in row.items() if not m.startswith("_")),
                  flush=True)
    finally:
        fleet.stop()
        pipeline.stop()
    return result


def judge(results: dict) -> dict:
    """Per cell: `auto` against the best fixed k and against k = 0 (on the CPU pair, the target alone on both cores)."""
    verdicts = {}
    for key, by_rtt in results.items():
        if key.endswith("plain-2-cores"):
            continue
        regime = key.split("/")[0]
        for rtt, row in by_rtt.items():
            fixed = {m: v["tokens_per_s"] for m, v in row.items() if m not in ("auto",) and not m.startswith("_")}
            auto = row["auto"]["tokens_per_s"]
            best_mode = max(fixed, key=fixed.get)
            baseline = fixed["0"]
            if regime == "cpu-real" and "cpu-real/plain-2-cores" in results:
                baseline = results["cpu-real/plain-2-cores"][rtt]["0"]["tokens_per_s"]
            verdicts[f"{key}@{rtt}ms"] = {
                "auto": auto, "best_fixed_k": best_mode, "best_fixed": fixed[best_mode],
                "auto_vs_best": round(auto / fixed[best_mode], 3),
                "auto_vs_k0": round(auto / baseline, 3),
                "k0_baseline": baseline,
            }
    return verdicts


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in results if not k.endswith("plain-2-cores")]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rtts = sorted(results[key], key=float)
        for mode in MODES:
            ys = [results[key][r].get(mode, {}).get("tokens_per_s") for r in rtts]
            if any(y is not None for y in ys):
                ax.plot([float(r) for r in rtts], ys, marker="o" if mode == "auto" else ".",
                        linewidth=2.5 if mode == "auto" else 0.8, label=f"k={mode}")
        ax.set_title(key)
        ax.set_xlabel("round trip (ms)")
        ax.set_ylabel("tokens/s")
        ax2 = ax.twinx()
        ax2.plot([float(r) for r in rtts], [results[key][r]["auto"]["mean_k"] for r in rtts], "k--",
                 label="auto: mean k")
        ax2.set_ylabel("mean k chosen by auto")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/draft_length.json")
    parser.add_argument("--regimes", default="gpu-emulated,cpu-real")
    parser.add_argument("--rtts", default=",".join(map(str, RTTS_MS)))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--cpu-tokens", type=int, default=32)
    parser.add_argument("--gpu-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    args.regimes = args.regimes.split(",")
    args.rtts = [float(r) if "." in r else int(r) for r in args.rtts.split(",")]
    args.modes = args.modes.split(",")
    root = Path(tempfile.mkdtemp(prefix="bench-draft-length-"))
    models = tiny_models(root / "models") if "gpu-emulated" in args.regimes else {}
    results = {}
    for cell in cells(models, args):
        results[f"{cell['regime']}/{cell.get('label', cell['draft'])}"] = run_cell(cell, args, root)
    out = {"config": {k: v for k, v in vars(args).items()}, "results": results, "verdicts": judge(results)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    for name, v in out["verdicts"].items():
        print(f"{name:32} auto {v['auto']:6.2f}  best k={v['best_fixed_k']:>2} {v['best_fixed']:6.2f}  "
              f"auto/best {v['auto_vs_best']:.2f}  auto/k0 {v['auto_vs_k0']:.2f}")
    if args.plot:
        plot(results, Path(args.out).with_suffix(".png"))
        print("plot:", Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
