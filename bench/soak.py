"""Soak: steady closed-loop concurrency for a long time, recording every process's resident memory.

    python bench/soak.py --duration-s 720 --concurrency 8      # writes bench/results/soak.json and .png

A pipeline of real processes (the `specdec up` default: target SmolLM2-135M float32 with
batched verification, n-gram draft, auto k, Redis) serves `--concurrency` clients that each
stream one generation after another (the bundled prompts in turn) and close each session when it
ends, as a well-behaved client does. Every `--sample-s` seconds the RSS of each process (from
/proc) and the caches the services report (GetInfo) are recorded. The verdict compares the mean
RSS of the last 10% of samples with the mean over the first minute after `--warmup-s`: growth
above 10% for any process is reported as a failure.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.client import build_request
from specdec.data import bundled_prompts
from specdec.launcher import Pipeline, PipelineSpec
from specdec.v1 import common_pb2, draft_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc, target_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


class Load:
    """`concurrency` closed-loop clients until `stop` is set; counts requests, tokens and errors."""

    def __init__(self, address: str, concurrency: int, max_new: int) -> None:
        self.address = address
        self.concurrency = concurrency
        self.max_new = max_new
        self.prompts = bundled_prompts()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.requests = self.tokens = self.errors = 0
        self.threads = [threading.Thread(target=self.worker, args=(i,), daemon=True) for i in range(concurrency)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=600)

    def worker(self, index: int) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            n = 0
            while not self.stop.is_set():
                prompt = self.prompts[(index + n * self.concurrency) % len(self.prompts)]
                n += 1
                session, tokens = "", 0
                try:
                    for msg in stub.Generate(build_request(messages=prompt["messages"], max_new_tokens=self.max_new),
                                             timeout=600):
                        session = session or msg.session_id
                        tokens += len(msg.token_ids)
                    stub.CloseSession(orchestrator_pb2.CloseSessionRequest(session_id=session), timeout=30)
                    with self.lock:
                        self.requests += 1
                        self.tokens += tokens
                except grpc.RpcError as exc:
                    with self.lock:
                        self.errors += 1
                    print(f"request failed: {exc.code().name}: {exc.details()}", flush=True)
                    time.sleep(1)


def cache_view(addresses: dict[str, str]) -> dict[str, dict]:
    out = {}
    for name, stub_class in (("target", target_pb2_grpc.TargetServiceStub), ("draft", draft_pb2_grpc.DraftServiceStub)):
        if name not in addresses:
            continue
        with grpc.insecure_channel(addresses[name]) as ch:
            info = stub_class(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=30)
        out[name] = {"cached_sessions": info.cached_sessions, "cached_tokens": info.cached_tokens}
    return out


def verdict(samples: list[dict], names: list[str], warmup_s: float) -> dict:
    after = [s for s in samples if s["t"] >= warmup_s]
    if len(after) < 10:
        return {"error": "too few samples after the warm-up"}
    base = [s for s in after if s["t"] < warmup_s + 60] or after[:3]
    tail = after[-max(3, len(after) // 10):]
    out = {}
    for name in names:
        b = statistics.fmean(s["rss"][name] for s in base if s["rss"].get(name))
        e = statistics.fmean(s["rss"][name] for s in tail if s["rss"].get(name))
        out[name] = {"rss_after_warmup_mb": round(b / 2**20, 1), "rss_at_end_mb": round(e / 2**20, 1),
                     "growth": round(e / b - 1, 4)}
    out["max_growth"] = max(v["growth"] for k, v in out.items() if isinstance(v, dict))
    out["passed"] = out["max_growth"] <= 0.10
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    fig, ax = plt.subplots(figsize=(9, 4))
    for name in result["processes"]:
        ax.plot([s["t"] / 60 for s in samples], [s["rss"].get(name, 0) / 2**20 for s in samples], label=name)
    ax.axvline(result["settings"]["warmup_s"] / 60, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_yscale("log")
    ax.set_title(f"soak: {result['settings']['concurrency']} clients, {result['load']['requests']} requests, "
                 f"max growth after warm-up {100 * result['verdict']['max_growth']:.1f}%")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=720.0)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--proposer", choices=["ngram", "model"], default="ngram")
    parser.add_argument("--base-port", type=int, default=52200)
    parser.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = parser.parse_args()
    plan = PipelineSpec(proposer=args.proposer, log_dir=tempfile.mkdtemp(prefix="bench-soak-"), target_threads=1,
                        orchestrator_port=args.base_port, draft_port=args.base_port + 1, target_port=args.base_port + 2,
                        redis_port=args.base_port + 3)
    pipeline = Pipeline(plan)
    pipeline.start(echo=lambda *_: None)
    pids = {name: proc.pid for name, proc in pipeline.procs.items()}
    addresses = plan.grpc_addresses()
    load = Load(addresses["orchestrator"], args.concurrency, args.max_new_tokens)
    samples = []
    start = time.monotonic()
    try:
        load.start()
        while (t := time.monotonic() - start) < args.duration_s:
            sample = {"t": round(t, 1), "rss": {n: rss_bytes(p) for n, p in pids.items()},
                      "requests": load.requests, "tokens": load.tokens, "errors": load.errors}
            try:
                sample["caches"] = cache_view(addresses)
            except grpc.RpcError as exc:
                sample["caches"] = {"error": exc.code().name}
            samples.append(sample)
            print(json.dumps(sample), flush=True)
            time.sleep(max(0.0, args.sample_s - (time.monotonic() - start - t)))
        load.join()
        time.sleep(2)
        final_caches = cache_view(addresses)
    finally:
        load.stop.set()
        pipeline.stop()
    result = {
        "settings": vars(args),
        "machine": {"platform": platform.platform()},
        "processes": list(pids),
        "load": {"requests": load.requests, "tokens": load.tokens, "errors": load.errors,
                 "tokens_per_s": round(load.tokens / args.duration_s, 3)},
        "caches_after_load": final_caches,
        "verdict": verdict(samples, list(pids), args.warmup_s),
        "samples": samples,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("load", "caches_after_load", "verdict")}, indent=2))


if __name__ == "__main__":
    main()
