"""Benchmark the pipeline on the bundled prompts: tokens/s per draft length and proposer,
side by side in one run, against transformers' in-process generation (plain and assisted).

    python bench/pipeline.py --out bench/results/pipeline.json

For each proposer a whole pipeline of real processes is started (`specdec up` machinery); every
prompt is run at every k in turn (interleaved, so machine noise falls on all k alike). Greedy
output is checked token for token against the target's own `generate`. Figures are medians of
per-prompt tokens/s and the ratio of total tokens over total time.

Suffix speculation (`--suffix-ks`) would learn each prompt's output from its first run (the
orchestrator shares finished outputs with it) and replay it in the next: every request there
sends `share_output=False`, so each drafts from its own history alone, as a first sight of a
text would.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import Client
from specdec.data import bundled_prompts
from specdec.launcher import Pipeline, PipelineSpec
from specdec.runtime.models import DEFAULT_MODEL, load_model


def encode_chat(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def summarise(runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    seconds = sum(r["elapsed_s"] for r in runs)
    drafted = sum(r.get("draft_tokens", 0) for r in runs)
    accepted = sum(r.get("accepted_tokens", 0) for r in runs)
    rounds = sum(r.get("rounds", 0) for r in runs)
    return {
        "tokens": tokens, "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 3),
        "median_prompt_tokens_per_s": round(statistics.median(r["tokens"] / r["elapsed_s"] for r in runs), 3),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_tokens_per_round": round(tokens / rounds, 3) if rounds else None,
        "identical_to_target_greedy": all(r.get("identical", True) for r in runs),
    }


def bench_pipeline(proposer: str, ks: list[str], prompts, max_new: int, expected, args) -> dict:
    share = {"share_output": False} if proposer == "suffix" else {}  # no replay of an earlier run
    plan = PipelineSpec(proposer=proposer, draft_dtype=args.draft_dtype, log_dir=tempfile.mkdtemp(prefix="bench-logs-"),
                        orchestrator_port=args.base_port, draft_port=args.base_port + 1,
                        target_port=args.base_port + 2, redis_port=args.base_port + 3,
                        target_threads=args.target_threads, draft_threads=args.draft_threads,
                        ngram_min=args.ngram_min, ngram_max=args.ngram_max)
    pipeline = Pipeline(plan)
    pipeline.start(echo=lambda *_: None)
    runs: dict[str, list[dict]] = {k: [] for k in ks}
    try:
        with Client(f"127.0.0.1:{args.base_port}") as client:
            client.generate("Warm up.", max_new_tokens=8, draft_length=2, **share)
            for p in prompts:
                for k in ks:
                    out = client.generate(messages=p["messages"], max_new_tokens=max_new,
                                          draft_length=k if k == "auto" else int(k), **share)
                    s = out.stats
                    runs[k].append({
                        "prompt": p["id"], "tokens": s["completion_tokens"], "elapsed_s": s["elapsed_s"],
                        "rounds": s["rounds"], "draft_tokens": s["draft_tokens"],
                        "accepted_tokens": s["accepted_tokens"], "identical": out.token_ids == expected[p["id"]],
                    })
                    print(f"{proposer:6} k={k:<4} {p['id']:18} {s['tokens_per_second']:6.2f} tok/s "
                          f"acc {s['acceptance_rate']:.2f} same={runs[k][-1]['identical']}", flush=True)
    finally:
        pipeline.stop()
    return {str(k): {"summary": summarise(r), "runs": r} for k, r in runs.items()}


def bench_hf(target, draft, prompts, max_new: int, ks: list[int]) -> tuple[dict, dict]:
    """transformers in-process: plain greedy generate and assisted generation with the draft."""
    expected, plain, assisted, lookup = {}, [], {k: [] for k in ks}, {k: [] for k in ks}
    for p in prompts:
        ids = torch.tensor([encode_chat(target.tokenizer, p["messages"])])
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                  eos_token_id=target.eos_token_ids, pad_token_id=target.eos_token_ids[0])
        with torch.inference_mode():
            start = time.perf_counter()
            out = target.model.generate(ids, **kw)[0, ids.shape[1]:].tolist()
            plain.append({"prompt": p["id"], "tokens": len(out), "elapsed_s": time.perf_counter() - start})
            expected[p["id"]] = out
            for k in ks:
                start = time.perf_counter()
                got = target.model.generate(ids, prompt_lookup_num_tokens=k, max_matching_ngram_size=3, **kw)
                got = got[0, ids.shape[1]:].tolist()
                lookup[k].append({"prompt": p["id"], "tokens": len(got), "elapsed_s": time.perf_counter() - start,
                                  "identical": got == out})
                draft.model.generation_config.num_assistant_tokens = k
                draft.model.generation_config.num_assistant_tokens_schedule = "constant"
                start = time.perf_counter()
                got = target.model.generate(ids, assistant_model=draft.model, **kw)[0, ids.shape[1]:].tolist()
                assisted[k].append({"prompt": p["id"], "tokens": len(got), "elapsed_s": time.perf_counter() - start,
                                    "identical": got == out})
        print(f"hf     {p['id']:18} plain {plain[-1]['tokens'] / plain[-1]['elapsed_s']:.2f} tok/s", flush=True)
    result = {"plain": {"summary": summarise(plain), "runs": plain}}
    for k in ks:
        result[f"assisted_k{k}"] = {"summary": summarise(assisted[k]), "runs": assisted[k]}
        result[f"prompt_lookup_k{k}"] = {"summary": summarise(lookup[k]), "runs": lookup[k]}
    return result, expected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/pipeline.json")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=8, help="how many bundled prompts to use")
    parser.add_argument("--ks", default="0,1,2,3,4,6")
    parser.add_argument("--ngram-ks", default="0,2,4")
    parser.add_argument("--suffix-ks", default="0,4,auto", help="suffix speculation (the default draft); '' for none")
    parser.add_argument("--hf-ks", default="4")
    parser.add_argument("--draft-dtype", default="bfloat16")
    parser.add_argument("--target-threads", type=int, default=None)
    parser.add_argument("--draft-threads", type=int, default=None)
    parser.add_argument("--base-port", type=int, default=51051)
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=3)
    parser.add_argument("--skip-model-draft", action="store_true")
    args = parser.parse_args()
    ks = args.ks.split(",")
    prompts = bundled_prompts()[: args.prompts]

    target = load_model(DEFAULT_MODEL, dtype="float32")
    draft = load_model(DEFAULT_MODEL, dtype=args.draft_dtype)
    hf, expected = bench_hf(target, draft, prompts, args.max_new_tokens, [int(k) for k in args.hf_ks.split(",")])
    del target, draft

    result = {
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
        "config": vars(args), "prompts": [p["id"] for p in prompts],
        "transformers_in_process": hf,
    }
    if not args.skip_model_draft:
        result["pipeline_model_draft"] = bench_pipeline("model", ks, prompts, args.max_new_tokens, expected, args)
    if args.ngram_ks:
        ngram_ks = args.ngram_ks.split(",")
        result["pipeline_ngram_draft"] = bench_pipeline("ngram", ngram_ks, prompts, args.max_new_tokens, expected, args)
    if args.suffix_ks:
        result["pipeline_suffix_draft"] = bench_pipeline("suffix", args.suffix_ks.split(","), prompts,
                                                         args.max_new_tokens, expected, args)
    names = ("pipeline_model_draft", "pipeline_ngram_draft", "pipeline_suffix_draft")
    first = next(result[name] for name in names if name in result)
    base = first["0"]["summary"]["tokens_per_s"]
    table = {}
    for name in names:
        for k, v in result.get(name, {}).items():
            table[f"{name} k={k}"] = {**v["summary"], "speedup_vs_k0": round(v["summary"]["tokens_per_s"] / base, 3)}
    hf_base = hf["plain"]["summary"]["tokens_per_s"]
    for name, v in hf.items():
        table[f"transformers {name}"] = {**v["summary"],
                                         "speedup_vs_plain": round(v["summary"]["tokens_per_s"] / hf_base, 3)}
    result["table"] = table
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for name, row in table.items():
        print(f"{name:40} {row['tokens_per_s']:6.2f} tok/s  acc {row['acceptance_rate']}  "
              f"tok/round {row['mean_tokens_per_round']}  identical {row['identical_to_target_greedy']}  "
              f"x{row.get('speedup_vs_k0', row.get('speedup_vs_plain'))}")


if __name__ == "__main__":
    main()
