"""Peak memory of the services for the worst request each public API allows, against the chart's limits.

Starts the pipeline as `specdec up` does on its defaults (Redis, the suffix draft, the packaged
SmolLM2-135M target in float32, the orchestrator, the HTTP gateway), then sends one request at a time
and records each process's peak resident memory while it ran (VmHWM, reset before each request by
writing 5 to /proc/PID/clear_refs):

- `echo_longest`: `POST /v1/completions` with `echo`, `logprobs: 5` and `max_tokens: 0`, a prompt of
  `--prompt-tokens` token ids (the longest the model's context holds): the target scores every
  position of it (`ScoreTokens`);
- `n_at_cap`: the same with `--choices` prompts (128: the gateway's cap on n times the prompts) of
  `--choice-tokens` token ids each, all scored at once;
- `largest_body`: a text prompt that fills the gateway's body limit (4 MiB), with `echo`: the
  orchestrator tokenizes it and refuses it as longer than the context.

    python bench/worst_requests.py --out bench/results/worst_requests.json

Not a timed benchmark: the seconds each request took are recorded, but the figure is the memory.
The chart's limits are read from helm/specdec/values.yaml.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.launcher import Pipeline, PipelineSpec, free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WATCHED = ("target", "orchestrator", "http", "draft")
CHART_COMPONENT = {"target": "target", "orchestrator": "orchestrator", "http": "gateway", "draft": "draft"}


def peak_rss(pid: int) -> int:
    """The process's peak resident memory (VmHWM) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def chart_limits() -> dict[str, str]:
    """Each component's memory limit in helm/specdec/values.yaml."""
    values = yaml.safe_load((ROOT / "helm" / "specdec" / "values.yaml").read_text())
    limits = {}
    for name, key in CHART_COMPONENT.items():
        memory = (((values.get(key) or {}).get("resources") or {}).get("limits") or {}).get("memory")
        if memory:
            limits[name] = memory
    return limits


def gib(value: str) -> float:
    units = {"Gi": 2**30, "Mi": 2**20, "G": 1e9, "M": 1e6}
    for unit, scale in units.items():
        if value.endswith(unit):
            return float(value[: -len(unit)]) * scale / 2**30
    return float(value) / 2**30


def requests_to_send(args: argparse.Namespace, model: str, vocab: int) -> dict[str, dict]:
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    scoring = {"model": model, "echo": True, "logprobs": 5, "max_tokens": 0}
    body_text = "speculative decoding " * (args.body_bytes // len("speculative decoding ") - 16)
    return {
        "echo_longest": {**scoring, "prompt": ids(args.prompt_tokens)},
        "n_at_cap": {**scoring, "prompt": [ids(args.choice_tokens) for _ in range(args.choices)]},
        "largest_body": {**scoring, "prompt": body_text},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=7900)
    parser.add_argument("--choices", type=int, default=128)
    parser.add_argument("--choice-tokens", type=int, default=512)
    parser.add_argument("--body-bytes", type=int, default=4 * 1024 * 1024 - 1024)
    parser.add_argument("--only", default="", help="comma-separated requests to send (default: all)")
    parser.add_argument("--label", default="", help="a name for this run in the output (e.g. before/after)")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--out", default=str(RESULTS / "worst_requests.json"))
    args = parser.parse_args()

    plan = PipelineSpec(log_dir=tempfile.mkdtemp(prefix="bench-worst-"), orchestrator_port=free_port(),
                        draft_port=free_port(), target_port=free_port(), redis_port=free_port(), http_port=free_port(),
                        extra_http_args=["--request-timeout-s", str(args.timeout_s)])  # slow machines finish too
    pipeline = Pipeline(plan)
    pipeline.start(echo=lambda *_: None)
    pids = {name: proc.pid for name, proc in pipeline.procs.items() if name in WATCHED}
    results: dict[str, dict] = {"settings": vars(args), "machine": platform.processor() or platform.machine(),
                                "started_rss": {n: peak_rss(p) for n, p in pids.items()}, "requests": {}}
    try:
        with httpx.Client(base_url=plan.http_url(), timeout=args.timeout_s) as client:
            model = client.get("/models").json()["data"][0]["id"]
            vocab = 49152  # the packaged SmolLM2's
            chosen = [name for name in args.only.split(",") if name] or None
            for name, body in requests_to_send(args, model, vocab).items():
                if chosen and name not in chosen:
                    continue
                for pid in pids.values():
                    reset_peak(pid)
                start = time.perf_counter()
                reply = client.post("/completions", json=body)
                seconds = time.perf_counter() - start
                alive = {n: pipeline.procs[n].poll() is None for n in pids}
                entry = {"status": reply.status_code, "seconds": round(seconds, 1),
                         "peak_rss_bytes": {n: peak_rss(p) for n, p in pids.items() if alive[n]},
                         "died": [n for n, up in alive.items() if not up]}
                if reply.status_code != 200:
                    entry["error"] = reply.text[:300]
                else:
                    choices = reply.json()["choices"]
                    entry["choices"] = len(choices)
                    entry["scored_tokens"] = sum(len(c["logprobs"]["tokens"]) for c in choices)
                results["requests"][name] = entry
                print(name, json.dumps(entry), flush=True)
            results["model"] = model
    finally:
        pipeline.stop()
    limits = chart_limits()
    results["chart_limits"] = limits
    results["within_limits"] = {
        name: {n: rss / 2**30 <= gib(limits[n]) for n, rss in entry["peak_rss_bytes"].items() if n in limits}
        for name, entry in results["requests"].items()}
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    runs = previous.get("runs", {}) if isinstance(previous.get("runs"), dict) else {}
    runs[args.label or time.strftime("%Y-%m-%dT%H:%M:%S")] = results
    out.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
