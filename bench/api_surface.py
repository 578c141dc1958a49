"""Benchmark what the API surface costs and gains under speculation, on the default pair (packaged
SmolLM2 target and draft), side by side in one run:

- JSON-schema output (a fixed set of schemas, greedy) at k = 0 and with speculation (auto and a
  fixed k): tokens/s, acceptance and tokens per round, with the same prompts as free text for
  comparison;
- the cost of logprobs (top 5) per round: the target's verify compute time with and without;
- every structured output parses and validates against its schema.

    python bench/api_surface.py --out bench/results/api_surface.json

Runs are interleaved (every prompt at every setting in turn) so machine noise falls on all alike;
figures are medians over prompts and totals over the run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import Client
from specdec.launcher import Pipeline, PipelineSpec

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40}}, "required": ["name", "age", "email"],
        "additionalProperties": False},
    "weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "temperature_c": {"type": "integer", "minimum": -60,
                                                                        "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "fog"]}},
        "required": ["city", "temperature_c", "conditions"], "additionalProperties": False},
    "book": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "author": {"type": "string", "maxLength": 30},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
        "genres": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
        "required": ["title", "author", "year", "genres"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "order_id": {"type": "string", "maxLength": 12},
        "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "product": {"type": "string", "maxLength": 20}, "quantity": {"type": "integer", "minimum": 1,
                                                                          "maximum": 20}},
            "required": ["product", "quantity"], "additionalProperties": False}},
        "paid": {"type": "boolean"}}, "required": ["order_id", "items", "paid"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "attendees": {"type": "integer", "minimum": 0, "maximum": 10000}},
        "required": ["name", "date", "attendees"], "additionalProperties": False},
    "movie": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "director": {"type": "string", "maxLength": 30},
        "rating": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["title", "director", "rating"], "additionalProperties": False},
}
PROMPTS = {
    "person": "Invent a person and describe them as JSON with name, age and email.",
    "weather": "Give today's weather in Paris as JSON: city, temperature_c and conditions.",
    "book": "Describe a classic novel as JSON: title, author, year and genres.",
    "order": "Write an online shop order as JSON with an order id, items with quantities, and whether it is paid.",
    "event": "Describe a conference as JSON: name, date (YYYY-MM-DD) and number of attendees.",
    "movie": "Describe a famous film as JSON: title, director and a rating out of 10.",
}


def run(client: Client, name: str, k, grammar: bool, logprobs: bool, max_new: int) -> dict:
    kwargs = dict(messages=[{"role": "user", "content": PROMPTS[name]}], max_new_tokens=max_new, temperature=0,
                  draft_length=k)
    if grammar:
        kwargs["grammar"] = ("json_schema", json.dumps(SCHEMAS[name]))
    if logprobs:
        kwargs.update(logprobs=True, top_logprobs=5)
    chunks = list(client.stream(**kwargs))
    stats = chunks[-1].stats
    text = "".join(c.text for c in chunks)
    valid = None
    if grammar:
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
    rounds = [c.round for c in chunks if c.round]
    return {"schema": name, "k": str(k), "grammar": grammar, "logprobs": logprobs,
            "tokens": stats["completion_tokens"], "elapsed_s": stats["elapsed_s"], "rounds": stats["rounds"],
            "draft_tokens": stats["draft_tokens"], "accepted_tokens": stats["accepted_tokens"],
            "finish": chunks[-1].finish_reason, "valid": valid,
            "verify_compute_ms": [r.get("verify_compute_ns", 0) / 1e6 for r in rounds],
            "verify_positions": [r.get("draft_length", 0) + 1 for r in rounds]}


def logprob_compute_ms(rows: int, vocab: int = 49152, top: int = 5, repeats: int = 50) -> float:
    """Median time to turn `rows` logits rows into logprobs with their top alternatives (the target's
    extra work per round when a request asks for logprobs)."""
    import time

    from specdec.core.logprobs import log_distribution, token_logprobs

    logits = torch.randn(rows, vocab)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        token_logprobs(log_distribution(logits, None), list(range(rows)), top)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def summary(runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    seconds = sum(r["elapsed_s"] for r in runs)
    drafted = sum(r["draft_tokens"] for r in runs)
    accepted = sum(r["accepted_tokens"] for r in runs)
    rounds = sum(r["rounds"] for r in runs)
    out = {"runs": len(runs), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 3),
           "median_tokens_per_s": round(statistics.median(r["tokens"] / r["elapsed_s"] for r in runs), 3),
           "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
           "tokens_per_round": round(tokens / rounds, 3) if rounds else None,
           "median_verify_compute_ms": round(statistics.median(ms for r in runs for ms in r["verify_compute_ms"]), 3)}
    if any(r["grammar"] for r in runs):
        out["valid"] = sum(bool(r["valid"]) for r in runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/api_surface.json")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="the fixed draft length compared with k = 0 and auto")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--base-port", type=int, default=51151)
    parser.add_argument("--proposer", default="model", choices=["model", "ngram"])
    args = parser.parse_args()
    plan = PipelineSpec(log_dir=tempfile.mkdtemp(prefix="bench-api-"), orchestrator_port=args.base_port,
                        proposer=args.proposer, draft_port=args.base_port + 1, target_port=args.base_port + 2,
                        redis_port=args.base_port + 3)
    pipeline = Pipeline(plan)
    pipeline.start(echo=lambda *_: None)
    settings = [("json k=0", 0, True, False), ("json k=auto", "auto", True, False),
                (f"json k={args.k}", args.k, True, False), ("text k=0", 0, False, False),
                (f"text k={args.k}", args.k, False, False), (f"text k={args.k} logprobs", args.k, False, True)]
    runs: dict[str, list[dict]] = {label: [] for label, *_ in settings}
    try:
        with Client(f"127.0.0.1:{args.base_port}") as client:
            client.generate("Warm up.", max_new_tokens=8, draft_length=2,
                            grammar=("json_schema", json.dumps(SCHEMAS["movie"])))
            for _ in range(args.repeats):
                for name in SCHEMAS:
                    for label, k, grammar, logprobs in settings:
                        r = run(client, name, k, grammar, logprobs, args.max_new_tokens)
                        runs[label].append(r)
                        print(f"{label:22} {name:8} {r['tokens'] / r['elapsed_s']:6.2f} tok/s "
                              f"acc {r['accepted_tokens'] / max(r['draft_tokens'], 1):.2f} valid={r['valid']}",
                              flush=True)
    finally:
        pipeline.stop()
    table = {label: summary(r) for label, r in runs.items()}
    for label in table:
        base = table["json k=0" if label.startswith("json") else "text k=0"]["tokens_per_s"]
        table[label]["speedup_vs_k0"] = round(table[label]["tokens_per_s"] / base, 3)
    plain, with_lp = table[f"text k={args.k}"], table[f"text k={args.k} logprobs"]
    result = {
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform(), "torch": torch.__version__},
        "config": vars(args), "table": table,
        "logprobs_cost_per_round": round(with_lp["median_verify_compute_ms"] / plain["median_verify_compute_ms"] - 1,
                                         4),
        "logprobs_compute_ms_for_k_plus_1_rows": round(logprob_compute_ms(args.k + 1), 3),
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for label, row in table.items():
        print(f"{label:22} {row['tokens_per_s']:6.2f} tok/s  x{row['speedup_vs_k0']}  acc {row['acceptance_rate']}  "
              f"tok/round {row['tokens_per_round']}  verify {row['median_verify_compute_ms']} ms  "
              f"valid {row.get('valid', '-')}/{row['runs']}")
    print(f"logprobs cost per round: {result['logprobs_cost_per_round']:+.1%} (verify medians); computing them for "
          f"{args.k + 1} rows takes {result['logprobs_compute_ms_for_k_plus_1_rows']} ms against a "
          f"{plain['median_verify_compute_ms']} ms verify")


if __name__ == "__main__":
    main()
