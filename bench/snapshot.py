"""KV snapshot restore against re-prefill, per context length, on this machine.

    python bench/snapshot.py --out bench/results/snapshot.json            # the target (float32)
    python bench/snapshot.py --role draft --dtype bfloat16 --out bench/results/snapshot-draft.json

For each context length: the model's prefill of the whole context with logits for its last
position only (what a replica without the cache pays), and a restore (fetch the snapshot from a
real local Redis + decode it into a cache), plus the one-off cost of writing it (encode + put).
Medians over --repeats, measured side by side in one run. A restore is worth it where it beats
the prefill; the services' threshold flag takes the crossover from here.
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

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.data import bundled_prompts
from specdec.launcher import _wait_redis, free_port, redis_server_binary
from specdec.runtime.models import DEFAULT_MODEL, load_model
from specdec.runtime.snapshot_codec import SnapshotIdentity, decode, encode
from specdec.runtime.snapshot_store import RedisSnapshotStore
from specdec.server.redis import RedisSettings, connect


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32", help="float32: the target's default; bfloat16: the draft's")
    ap.add_argument("--role", choices=["target", "draft"], default="target", help="whose snapshot keys to write")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--lengths", default="125,250,500,1000,2000")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/snapshot.json")
    args = ap.parse_args()

    loaded = load_model(args.model, dtype=args.dtype, threads=args.threads, progress=True)
    model, tokenizer = loaded.model, loaded.tokenizer
    text = " ".join(m["content"] for p in bundled_prompts() for m in p["messages"])
    corpus = tokenizer(text * 20, add_special_tokens=False)["input_ids"]
    identity = SnapshotIdentity(loaded.name, args.dtype, loaded.fingerprint, model.config.num_hidden_layers)

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        redis_proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                       "--save", "", "--appendonly", "no", "--dir", tmp],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            _wait_redis("127.0.0.1", port, redis_proc, timeout_s=20)
            store = RedisSnapshotStore(connect(RedisSettings(url=f"redis://127.0.0.1:{port}/0")), args.role)
            rows = []
            for n in [int(x) for x in args.lengths.split(",")]:
                if n > min(len(corpus), loaded.max_context):
                    continue
                tokens = corpus[:n]

                def prefill():
                    cache = DynamicCache(config=model.config)
                    with torch.inference_mode():
                        model(torch.tensor([tokens]), cache=cache, use_cache=True, logits_to_keep=1)  # noqa: B023
                    return cache

                # B023: timed() calls each closure at once, inside this iteration, so the loop
                # variables they read are the current ones.
                prefill_s, cache = timed(prefill, args.repeats)
                encode_s, blob = timed(lambda: encode(cache, tokens, identity), args.repeats)  # noqa: B023
                put_s, _ = timed(lambda: store.put("bench", blob, len(tokens)), args.repeats)  # noqa: B023
                get_s, fetched = timed(lambda: store.get("bench"), args.repeats)
                decode_s, _ = timed(lambda: decode(fetched, identity, model.config), args.repeats)  # noqa: B023
                restore_s = get_s + decode_s
                row = dict(context_tokens=n, snapshot_bytes=len(blob), prefill_s=prefill_s,
                           restore_s=restore_s, fetch_s=get_s, decode_s=decode_s,
                           write_s=encode_s + put_s, restore_over_prefill=restore_s / prefill_s)
                rows.append(row)
                print(f"{n:>5} tokens: prefill {prefill_s * 1e3:7.1f} ms, restore {restore_s * 1e3:7.1f} ms "
                      f"(fetch {get_s * 1e3:.1f} + decode {decode_s * 1e3:.1f}), write {row['write_s'] * 1e3:.1f} ms, "
                      f"{len(blob) / 2**20:.1f} MiB", flush=True)
            store.delete("bench")
        finally:
            redis_proc.terminate()
            redis_proc.wait(10)
    crossover = next((r["context_tokens"] for r in rows if r["restore_s"] < r["prefill_s"]), None)
    result = dict(role=args.role, model=loaded.name, dtype=args.dtype, threads=torch.get_num_threads(),
                  repeats=args.repeats,
                  machine=dict(processor=platform.processor() or platform.machine(), cpus=torch.get_num_threads()),
                  rows=rows, restore_wins_from_tokens=crossover,
                  note="medians; Redis on loopback on the same host (a remote Redis adds its round trips)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}; restore beats prefill from {crossover} tokens")


if __name__ == "__main__":
    main()
