"""Closed-loop concurrency benchmark: aggregate tokens/s and per-request TPOT at 1, 4 and 16 clients,
batched against unbatched verification, in one run.

    python bench/concurrency.py                       # the default pair (`specdec up`: SmolLM2 fp32 + suffix, auto k)
    python bench/concurrency.py --proposer ngram      # prompt lookup as the draft
    python bench/concurrency.py --proposer model      # SmolLM2 fp32 + its bf16 copy as a batched model draft
    python bench/concurrency.py --draft-length auto,0,2 --concurrency 1,16   # auto against fixed k, side by side

Two pipelines of real processes are started side by side (the `specdec up` machinery), identical
except for the target's `--max-batch` (16 against 1, i.e. no batching); only one is loaded at a
time, and the cells run interleaved (concurrency c on the batched pipeline, then on the unbatched
one, then the next c), so machine noise falls on both alike; with several draft lengths, each
runs in every cell and their order turns from one c to the next.

Each cell is a closed loop: `c` clients each stream one generation after another (the bundled
prompts in turn, greedy, `--max-new-tokens`), for `--warmup-s` unmeasured seconds and then
`--window-s` measured ones. Aggregate throughput counts the tokens streamed inside the window;
a request's TPOT is the time between its first and last streamed chunk over the tokens after the
first chunk (requests that streamed at least two chunks in the window). Completed outputs are
checked token for token against the target's own greedy `generate`. The target's /metrics gives
the mean batch size per cell. JSON and a plot go to bench/results/.

The clients send the bundled prompts over and over: with suffix speculation every request sends
`share_output=False`, or from the second round on each would replay the shared corpus's copy of
its own earlier output; it drafts from the session's history alone.
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
import urllib.request
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.client import build_request
from specdec.data import bundled_prompts
from specdec.launcher import Pipeline, PipelineSpec
from specdec.runtime.models import DEFAULT_MODEL
from specdec.v1 import orchestrator_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"


def reference_outputs(prompts, max_new: int) -> dict[str, list[int]]:
    """The target's own greedy continuation of every prompt (transformers generate, in-process)."""
    import torch

    from specdec.runtime.models import load_model

    torch.set_num_threads(1)
    loaded = load_model(DEFAULT_MODEL, dtype="float32", progress=False)
    out = {}
    for p in prompts:
        text = loaded.tokenizer.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([loaded.tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.inference_mode():
            gen = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                        do_sample=False, eos_token_id=loaded.eos_token_ids,
                                        pad_token_id=loaded.eos_token_ids[0])
        tokens = gen[0, ids.shape[1]:].tolist()
        for i, t in enumerate(tokens):
            if t in loaded.eos_token_ids:
                tokens = tokens[: i + 1]
                break
        out[p["id"]] = tokens
    del loaded
    return out


def scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if "reason" not in s.labels}


class Cell:
    """One closed-loop run at concurrency c against one orchestrator."""

    def __init__(self, address: str, prompts, concurrency: int, max_new: int, warmup_s: float, window_s: float,
                 draft_length: str, share_output: bool | None = None) -> None:
        self.address = address
        self.share_output = share_output
        self.prompts = prompts
        self.concurrency = concurrency
        self.max_new = max_new
        self.draft_length = draft_length
        self.start = time.perf_counter()
        self.window = (self.start + warmup_s, self.start + warmup_s + window_s)
        self.requests: list[dict] = []
        self.lock = threading.Lock()

    def run(self) -> None:
        workers = [threading.Thread(target=self.worker, args=(i,)) for i in range(self.concurrency)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def worker(self, index: int) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            n = 0
            while time.perf_counter() < self.window[1]:
                prompt = self.prompts[(index + n * self.concurrency) % len(self.prompts)]
                n += 1
                self.one_request(stub, prompt)

    def one_request(self, stub, prompt) -> None:
        request = build_request(messages=prompt["messages"], max_new_tokens=self.max_new,
                                draft_length=self.draft_length, share_output=self.share_output)
        started = time.perf_counter()
        chunks: list[tuple[float, int, int]] = []  # (time, tokens, draft length)
        tokens: list[int] = []
        finished = False
        call = stub.Generate(request, timeout=600)
        try:
            for msg in call:
                if not msg.token_ids:
                    continue  # the header chunk announcing the session
                now = time.perf_counter()
                chunks.append((now, len(msg.token_ids), msg.round.draft_length))
                tokens.extend(msg.token_ids)
                if msg.finish_reason:
                    finished = True
                    break
                if now >= self.window[1]:
                    break  # the window is over: stop streaming (cancels the call)
        finally:
            call.cancel()
        with self.lock:
            self.requests.append({"prompt": prompt["id"], "started": started, "chunks": chunks,
                                  "tokens": tokens, "finished": finished})

    def summary(self, expected: dict[str, list[int]]) -> dict:
        lo, hi = self.window
        in_window = sum(n for r in self.requests for t, n, _ in r["chunks"] if lo <= t < hi)
        tpots, ks = [], []
        for r in self.requests:
            inside = [(t, n, k) for t, n, k in r["chunks"] if lo <= t < hi]
            ks.extend(k for _, _, k in inside)
            if len(inside) >= 2:
                tpots.append((inside[-1][0] - inside[0][0]) / sum(n for _, n, _ in inside[1:]))
        done = [r for r in self.requests if r["finished"]]
        same = [r["tokens"] == expected[r["prompt"]] for r in done]
        return {
            "concurrency": self.concurrency,
            "tokens_in_window": in_window,
            "window_s": round(hi - lo, 3),
            "aggregate_tokens_per_s": round(in_window / (hi - lo), 3),
            "tpot_median_s": round(statistics.median(tpots), 4) if tpots else None,
            "tpot_mean_s": round(statistics.fmean(tpots), 4) if tpots else None,
            "requests_measured": len(tpots),
            "requests_completed": len(done),
            "completed_identical_to_target_greedy": sum(same),
            "mean_draft_length": round(statistics.fmean(ks), 3) if ks else None,
        }


def start_pipeline(base_port: int, max_batch: int, args) -> Pipeline:
    batching = ["--max-batch", str(max_batch)]
    if args.window_ms is not None:
        batching += ["--batch-window-ms", str(args.window_ms)]
    plan = PipelineSpec(proposer=args.proposer, log_dir=tempfile.mkdtemp(prefix=f"bench-concurrency-{max_batch}-"),
                        target_threads=args.target_threads or None, orchestrator_port=base_port,
                        draft_port=base_port + 1, target_port=base_port + 2, redis_port=base_port + 3,
                        extra_target_args=[*batching, "--metrics-port", str(base_port + 4)],
                        extra_draft_args=batching if args.proposer == "model" else [])
    pipeline = Pipeline(plan)
    pipeline.start(echo=lambda *_: None)
    return pipeline


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("batched", "o-"), ("unbatched", "s--")):
        for length in results["draft_lengths"]:
            cells = [c for c in results["modes"][mode] if c["draft_length"] == length]
            cs = [c["concurrency"] for c in cells]
            label = mode if len(results["draft_lengths"]) == 1 else f"{mode}, k = {length}"
            left.plot(cs, [c["aggregate_tokens_per_s"] for c in cells], style, label=label)
            right.plot(cs, [1000 * (c["tpot_median_s"] or float("nan")) for c in cells], style, label=label)
    for ax, title in ((left, "aggregate output tokens/s"), (right, "median TPOT per request (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(results["concurrency"], [str(c) for c in results["concurrency"]])
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{results['pair']} — this machine: {results['machine']['cpus']} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--proposer", choices=["suffix", "ngram", "model"], default="suffix")
    parser.add_argument("--draft-length", default="auto",
                        help="auto, a fixed k, or a comma list of them, run side by side in every cell (default: auto)")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--window-ms", type=float, default=None,
                        help="--batch-window-ms of the services (default: theirs)")
    parser.add_argument("--target-threads", type=int, default=1,
                        help="torch threads of the target (0: torch's choice). On this shared 2-core machine two "
                             "threads stall each other under load: a 16-session pass took 3-10 s with 2 threads "
                             "and 0.5-0.8 s with 1")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--window-s", type=float, default=45.0)
    parser.add_argument("--base-port", type=int, default=52100)
    parser.add_argument("--out", default=str(RESULTS / "concurrency.json"))
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = bundled_prompts()
    print("reference outputs (transformers generate) ...", flush=True)
    expected = reference_outputs(prompts, args.max_new_tokens)
    modes = {"batched": args.max_batch, "unbatched": 1}
    lengths = [d.strip() for d in args.draft_length.split(",")]
    pipelines = {}
    try:
        for i, (mode, max_batch) in enumerate(modes.items()):
            pipelines[mode] = start_pipeline(args.base_port + 10 * i, max_batch, args)
            print(f"{mode} pipeline up (target --max-batch {max_batch})", flush=True)
        results = {"modes": {mode: [] for mode in modes}}
        for level, c in enumerate(levels):
            # The order of the draft lengths turns from one level to the next, so that none is
            # always measured first after a change of load.
            for length in lengths[level % len(lengths):] + lengths[:level % len(lengths)]:
                for i, mode in enumerate(modes):
                    base = args.base_port + 10 * i
                    before = scrape(base + 4)
                    cell = Cell(f"127.0.0.1:{base}", prompts, c, args.max_new_tokens, args.warmup_s, args.window_s,
                                length, share_output=False if args.proposer == "suffix" else None)
                    cell.run()
                    after = scrape(base + 4)
                    summary = cell.summary(expected)
                    passes = after["specdec_batch_size_count"] - before["specdec_batch_size_count"]
                    summary["target_mean_batch_size"] = round(
                        (after["specdec_batch_size_sum"] - before["specdec_batch_size_sum"]) / passes, 3,
                    ) if passes else None
                    summary["draft_length"] = length
                    results["modes"][mode].append(summary)
                    print(f"c={c:<3} k={length:<4} {mode:9} {summary['aggregate_tokens_per_s']:7.2f} tok/s  "
                          f"TPOT {summary['tpot_median_s']}s  batch {summary['target_mean_batch_size']}  "
                          f"identical {summary['completed_identical_to_target_greedy']}/"
                          f"{summary['requests_completed']}",
                          flush=True)
    finally:
        for pipeline in pipelines.values():
            pipeline.stop()
    lo, hi = min(levels), max(levels)
    rate = {(m, c["draft_length"], c["concurrency"]): c["aggregate_tokens_per_s"]
            for m, cells in results["modes"].items() for c in cells}
    ratios = {}
    for length in lengths:
        tag = "" if len(lengths) == 1 else f"k={length}: "
        ratios[f"{tag}batched_{hi}_over_batched_{lo}"] = round(rate["batched", length, hi]
                                                               / rate["batched", length, lo], 3)
        ratios[f"{tag}batched_over_unbatched_at_{hi}"] = round(rate["batched", length, hi]
                                                             / rate["unbatched", length, hi], 3)
    if "auto" in lengths and len(lengths) > 1:
        for c in levels:
            for m in modes:
                best = max(rate[m, length, c] for length in lengths if length != "auto")
                ratios[f"auto_over_best_fixed_{m}_at_{c}"] = round(rate[m, "auto", c] / best, 3)
    results.update({
        "pair": f"target {DEFAULT_MODEL} float32 ({args.target_threads or 'default'} thread) + {args.proposer} draft, "
                f"k={args.draft_length}",
        "concurrency": levels,
        "draft_lengths": lengths,
        "settings": vars(args),
        "machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform()},
        "ratios": ratios,
    })
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(json.dumps(results["ratios"]), f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
