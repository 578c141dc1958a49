"""A round's time outside the model, part by part, at k = 0 and one client.

    python bench/round_overhead.py --out bench/results/round_overhead.json
    python bench/round_overhead.py --config serial=--no-save-behind --config behind=--save-behind
    python bench/round_overhead.py --config ahead= --config serial=--no-verify-ahead --target-threads 1
    python bench/round_overhead.py --config one=--decode-steps=1 --config four=--decode-steps=4

Starts the real pipeline on the packaged default model (Redis, the target service, one
orchestrator and one HTTP gateway per `--config`: NAME=ORCHESTRATOR-ARGS, all sharing the target
and Redis), then runs every prompt greedily at k = 0, one request at a time, on every
configuration in turn (the order rotates each repetition, so machine load falls on all alike),
through gRPC (the SDK) and through the gateway (streamed chat completions).

Per round it reads the round's own statistics (`RoundStats`): the engine step as the target times
it (`verify_compute_ns`), the time the verify waited in the target service before its pass
(`verify_queue_ns`: admission, the batcher's wait, event-loop hops), the rest of the verify call
(`target_rpc`: gRPC both ways and the servicers' own work), and the orchestrator's time between
one round's verify and the next round's call (`between_ns`), of which the session save
(`save_ns`) and detokenizing (`detokenize_ns`). The client's time per output token
(`(last chunk - first token) / (tokens - 1)`) is set against the step; the gateway's share is the
HTTP client's time per output token minus the gRPC client's. Figures are medians over rounds
(parts) and requests (time per token); a round of several passes (`--decode-steps`) counts its
parts a token (each divided by its passes: `step` is one pass). A round the target verified ahead (`--verify-ahead`, the
default: `ahead` is the share of such rounds) reports the pass it ran before the request came:
its `step` is that pass, its queue 0, and `tgt rpc` what was left of the call after the pass (it
may fall below zero); the time per output token is the figure to compare, against the `step` of a
`--no-verify-ahead` configuration run beside it. Outputs are compared across configurations and with the
gateway's text: they must be identical.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import Client
from specdec.data import bundled_prompts
from specdec.launcher import Pipeline, PipelineSpec, wait_healthy, wait_http_healthy

PARTS = ("step", "target_queue", "target_rpc", "between", "save", "detokenize")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                platform.processor())


def parts_of(rnd: dict) -> dict[str, float]:
    """One round's parts in ms a token (RoundStats as the SDK gives it): a round of several passes
    (--decode-steps) spreads its parts over its tokens, one a pass; `step` is then a pass."""
    passes = max(1, rnd.get("verify_passes", 1))
    step, queue, wall = rnd.get("verify_compute_ns", 0), rnd.get("verify_queue_ns", 0), rnd.get("verify_ns", 0)
    return {"step": step / 1e6 / passes, "target_queue": queue / 1e6 / passes,
            "target_rpc": (wall - step - queue) / 1e6 / passes, "between": rnd.get("between_ns", 0) / 1e6 / passes,
            "save": rnd.get("save_ns", 0) / 1e6 / passes, "detokenize": rnd.get("detokenize_ns", 0) / 1e6 / passes,
            "verify_wall": wall / 1e6 / passes, "ahead": 1.0 if rnd.get("verify_decoded_ahead") else 0.0,
            "passes": float(passes)}


def run_grpc(client: Client, messages, max_new: int) -> dict:
    start = time.perf_counter()
    times, rounds, tokens, text = [], [], [], ""
    for chunk in client.stream(messages=messages, max_new_tokens=max_new, draft_length=0, temperature=0.0,
                               share_output=False):
        now = time.perf_counter()
        if chunk.token_ids:
            times.append((now, len(chunk.token_ids)))
            rounds.append(chunk.round)
            tokens.extend(chunk.token_ids)
        text += chunk.text
    n = len(tokens)
    tpot = (times[-1][0] - times[0][0]) / (n - times[0][1]) if n > times[0][1] else float("nan")
    periods = [(b[0] - a[0]) * 1e3 for a, b in zip(times, times[1:])]
    return {"tokens": tokens, "text": text, "ttft_ms": (times[0][0] - start) * 1e3, "tpot_ms": tpot * 1e3,
            "rounds": [parts_of(r) for r in rounds[1:]], "periods_ms": periods}


def run_http(http: httpx.Client, url: str, model: str, messages, max_new: int, n_tokens: int) -> dict:
    start = time.perf_counter()
    body = {"model": model, "messages": messages, "max_tokens": max_new, "temperature": 0.0, "stream": True}
    first = last = None
    text = ""
    with http.stream("POST", f"{url}/chat/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choice = (event.get("choices") or [{}])[0]
            piece = (choice.get("delta") or {}).get("content") or ""
            now = time.perf_counter()
            if piece and first is None:
                first = now
            if piece or choice.get("finish_reason"):
                last = now
            text += piece
    tpot = (last - first) / (n_tokens - 1) if first is not None and n_tokens > 1 else float("nan")
    return {"text": text, "ttft_ms": ((first or start) - start) * 1e3, "tpot_ms": tpot * 1e3}


def median(values) -> float:
    values = [v for v in values if v == v]
    return round(statistics.median(values), 4) if values else float("nan")


def summarise(runs: list[dict]) -> dict:
    rounds = [r for run in runs for r in run["rounds"]]
    out: dict = {"requests": len(runs), "rounds": len(rounds)}
    out["parts_ms"] = {p: median(r[p] for r in rounds) for p in (*PARTS, "verify_wall")}
    out["parts_mean_ms"] = {p: round(statistics.fmean(r[p] for r in rounds), 4) for p in (*PARTS, "verify_wall")}
    out["round_period_ms"] = median(p for run in runs for p in run["periods_ms"])
    out["grpc_tpot_ms"] = median(run["tpot_ms"] for run in runs)
    out["http_tpot_ms"] = median(run["http"]["tpot_ms"] for run in runs)
    out["step_ms"] = out["parts_ms"]["step"]
    # Per round and per request, so that the load on a shared machine (which moves the step a lot)
    # cancels out: the round's time outside the model on the orchestrator's critical path, and each
    # request's time per output token minus its own mean step.
    out["outside_ms"] = median(r["target_queue"] + r["target_rpc"] + r["between"] for r in rounds)
    out["grpc_overhead_ms"] = median(run["tpot_ms"] - statistics.fmean(r["step"] for r in run["rounds"])
                                     for run in runs)
    out["gateway_ms"] = median(run["http"]["tpot_ms"] - run["tpot_ms"] for run in runs)
    out["grpc_ttft_ms"] = median(run["ttft_ms"] for run in runs)
    out["decoded_ahead_share"] = round(statistics.fmean(r["ahead"] for r in rounds), 4) if rounds else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=[],
                    help="NAME=ORCHESTRATOR-ARGS (space separated); repeat for an A/B run (default: one, as is)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--base-port", type=int, default=51300)
    ap.add_argument("--target-threads", type=int, default=None)
    ap.add_argument("--out", default="bench/results/round_overhead.json")
    ap.add_argument("--summarise", metavar="JSON", help="only recompute and print the summary of an earlier run")
    args = ap.parse_args()
    if args.summarise:
        data = json.loads(Path(args.summarise).read_text())
        data["summary"] = {name: summarise(runs) for name, runs in data["runs"].items()}
        Path(args.summarise).write_text(json.dumps(data, indent=1))
        print_table(data["summary"])
        return
    configs = [(c.split("=", 1)[0], c.split("=", 1)[1].split() if "=" in c else []) for c in args.config] \
        or [("as-is", [])]
    prompts = bundled_prompts()[:args.prompts]
    base = args.base_port
    log_dir = tempfile.mkdtemp(prefix="bench-round-")
    plans = [PipelineSpec(proposer="none", draft_length="0", log_dir=log_dir, redis_port=base, target_port=base + 1,
                          orchestrator_port=base + 10 + 2 * i, http_port=base + 11 + 2 * i,
                          target_threads=args.target_threads, extra_orchestrator_args=extra)
             for i, (_, extra) in enumerate(configs)]
    pipeline = Pipeline(plans[0])
    extra_procs: list[subprocess.Popen] = []
    pipeline.start(echo=lambda *_: None)
    results: dict[str, list[dict]] = {name: [] for name, _ in configs}
    try:
        for i, plan in enumerate(plans[1:], 1):
            cmds = plan.commands()
            for name in ("orchestrator", "http"):
                log = open(Path(log_dir) / f"{name}-{i}.log", "w")  # noqa: SIM115 - lives as long as the process
                extra_procs.append(subprocess.Popen(cmds[name], stdout=log, stderr=subprocess.STDOUT))
            wait_healthy(f"127.0.0.1:{plan.orchestrator_port}", 300, extra_procs[-2])
            wait_http_healthy(f"http://127.0.0.1:{plan.http_port}/health", 300, extra_procs[-1])
        clients = [Client(f"127.0.0.1:{plan.orchestrator_port}") for plan in plans]
        with httpx.Client(timeout=300) as http:
            model = http.get(f"{plans[0].http_url()}/models").json()["data"][0]["id"]
            for client, plan in zip(clients, plans):  # warm up every path
                run_grpc(client, [{"role": "user", "content": "Warm up."}], 8)
                run_http(http, plan.http_url(), model, [{"role": "user", "content": "Warm up."}], 8, 8)
            for rep in range(args.reps):
                for p in prompts:
                    order = list(range(len(configs)))
                    order = order[rep % len(order):] + order[:rep % len(order)]
                    for i in order:
                        name = configs[i][0]
                        run = run_grpc(clients[i], p["messages"], args.max_new)
                        run["http"] = run_http(http, plans[i].http_url(), model, p["messages"], args.max_new,
                                               len(run["tokens"]))
                        run["prompt"], run["rep"] = p["id"], rep
                        results[name].append(run)
                print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
        for client in clients:
            client.close()
    finally:
        for proc in extra_procs:
            proc.terminate()
        for proc in extra_procs:
            proc.wait(timeout=30)
        pipeline.stop()

    reference = {run["prompt"]: run["tokens"] for run in results[configs[0][0]]}
    texts = {run["prompt"]: run["text"] for run in results[configs[0][0]]}
    identical = all(run["tokens"] == reference[run["prompt"]] and run["text"] == texts[run["prompt"]]
                    and run["http"]["text"] == run["text"] for runs in results.values() for run in runs)
    summary = {name: summarise(runs) for name, runs in results.items()}
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(),
        "command": "python " + " ".join(sys.argv), "prompts": [p["id"] for p in prompts], "max_new": args.max_new,
        "reps": args.reps, "identical_outputs": identical, "configs": {n: " ".join(e) for n, e in configs},
        "summary": summary,
        "runs": {name: [{k: v for k, v in run.items() if k not in ("tokens", "text")} for run in runs]
                 for name, runs in results.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{out['cpu']}; k = 0, 1 client, {len(prompts)} prompts x {args.reps} reps, {args.max_new} tokens; "
          f"identical outputs: {identical}")
    print_table(summary)
    print(f"(ms; medians over rounds and requests; written to {args.out})")


def print_table(summary: dict) -> None:
    header = ["config", "step", "tgt queue", "tgt rpc", "between", "(save)", "(detok)", "outside", "gRPC tpot",
              "tpot-step", "HTTP tpot", "gateway", "ahead"]
    print(" | ".join(f"{h:>9}" for h in header))
    for name, s in summary.items():
        p = s["parts_ms"]
        row = [name, p["step"], p["target_queue"], p["target_rpc"], p["between"], p["save"], p["detokenize"],
               s["outside_ms"], s["grpc_tpot_ms"], s["grpc_overhead_ms"], s["http_tpot_ms"], s["gateway_ms"],
               s["decoded_ahead_share"]]
        print(" | ".join(f"{v:>9}" if isinstance(v, str) else f"{v:9.3f}" for v in row))


if __name__ == "__main__":
    main()
