"""What a generation's rounds cost, by kind, on real prompts through the default pipeline.

    python bench/rounds.py --out bench/results/rounds.json
    python bench/rounds.py --modes 0,auto --kinds sharegpt --reps 2

Starts the default pipeline (`specdec up`'s: the packaged model, suffix speculation, Redis) once,
then sends the prompts of `bench/peers.py` (HumanEval completions and edits, ShareGPT first turns)
one at a time through the SDK, greedy, every mode in turn (`--modes`: `auto` and fixed draft
lengths), the outputs kept out of the corpus. Each streamed chunk is one round; its wall time is
the time since the previous chunk, and its `RoundStats` say what kind of round it was:

- `k0`: asked the draft for nothing; `k0-ahead`: ... and answered from a pass the target ran
  before the request came (`verify_decoded_ahead`);
- `empty`: asked the draft, which proposed nothing (the round is then a plain one, verified
  after the draft's answer); `empty-ahead`: ... answered from a pass run ahead;
- `block`: the draft proposed a block, verified by its pass; `block-ahead`: the block answered from
  a pass run ahead whose token refuted its first draft token.

The JSON holds, per mode and prompt kind, the wall time, tokens and each kind of round's count,
time and tokens, and each request's rounds in order (`traces`, of the last repetition:
`k:proposed/accepted`, `a` when answered from a pass run ahead, then `@` the round's wall time, its
draft call, its verify call, the target's pass and its queue wait in ms, `/q` before the last, and
the pass's positions `/p`, the history tokens it prefilled `/f` and the sessions in it `/b`); the
plot (next to it, `.png`) shows each kind's share of the wall time. The first round of a
generation (its time to first token) is left out of the rounds.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("k0", "k0-ahead", "empty", "empty-ahead", "block", "block-ahead")
PARTS = {"draft_ms": "draft_ns", "verify_ms": "verify_ns", "verify_compute_ms": "verify_compute_ns",
         "verify_queue_ms": "verify_queue_ns", "between_ms": "between_ns", "save_ms": "save_ns",
         "detokenize_ms": "detokenize_ns"}
"""Parts of a round its `RoundStats` time, kept per kind (medians): the draft call and the verify call as
the orchestrator waited for them, the target's pass, the pass's wait in the target's queue, and the
orchestrator's own parts (its time between the rounds' calls, the save, detokenizing)."""


def kind_of(stats) -> str:
    """The kind of round its `RoundStats` describe (see the module's docstring)."""
    ahead = "-ahead" if stats.get("verify_decoded_ahead") else ""
    if not stats.get("draft_length"):
        return "k0" + ahead
    return ("block" if stats.get("proposed") else "empty") + ahead


def run(modes: list, kinds: list[str], prompts: int, reps: int, max_tokens: int, draft_args: list[str],
        orchestrator_args: list[str] = ()) -> dict:
    from bench.peers import free_port, prompts as real_prompts
    from specdec.client import Client
    from specdec.launcher import Pipeline, PipelineSpec

    spec = PipelineSpec(orchestrator_port=free_port(), draft_port=free_port(), target_port=free_port(),
                        extra_draft_args=draft_args, extra_orchestrator_args=list(orchestrator_args),
                        redis_port=free_port(), log_dir=str(Path("/tmp") / f"specdec-rounds-{free_port()}"))
    pipeline = Pipeline(spec)
    pipeline.start(echo=lambda *_: None)
    work = [w for w in real_prompts(prompts, 0) if w["kind"] in kinds]
    out: dict = {str(m): collections.defaultdict(lambda: {"wall_s": 0.0, "tokens": 0, "rounds": {}}) for m in modes}
    texts: dict = collections.defaultdict(dict)
    traces: dict = collections.defaultdict(dict)  # mode -> prompt id -> each round "k:proposed/accepted[a]"
    try:
        with Client(f"127.0.0.1:{spec.orchestrator_port}") as client:
            client.generate(messages=work[0]["messages"], max_new_tokens=8, temperature=0, draft_length=0,
                            share_output=False)  # warm-up
            for _ in range(reps):
                for w in work:
                    for mode in modes:
                        cell = out[str(mode)][w["kind"]]
                        started, previous, ids, trace = time.perf_counter(), None, [], []
                        for chunk in client.stream(messages=w["messages"], max_new_tokens=max_tokens, temperature=0,
                                                   draft_length=mode, share_output=False):
                            now = time.perf_counter()
                            ids += chunk.token_ids
                            if chunk.round:
                                r = chunk.round
                                ms = [(now - (previous or now)) * 1e3,
                                      *(r.get(f, 0) / 1e6 for f in ("draft_ns", "verify_ns", "verify_compute_ns",
                                                                     "verify_queue_ns"))]
                                trace.append(f"{r.get('draft_length', 0)}:{r.get('proposed', 0)}/{r.get('accepted', 0)}"
                                             + ("a" if r.get("verify_decoded_ahead") else "")
                                             + "@{:.1f}/{:.1f}/{:.1f}/{:.1f}/q{:.1f}".format(*ms)
                                             + f"/p{r.get('verify_batch_positions', 0)}"
                                             + f"/f{r.get('verify_prefill_tokens', 0)}"
                                             + f"/b{r.get('verify_batch_size', 0)}")
                            if previous is not None and chunk.round:
                                entry = cell["rounds"].setdefault(kind_of(chunk.round), {
                                    "wall_ms": [], "tokens": 0, **{part: [] for part in PARTS}})
                                entry["wall_ms"].append((now - previous) * 1e3)
                                for part, field in PARTS.items():
                                    entry[part].append(chunk.round.get(field, 0) / 1e6)
                                entry["tokens"] += len(chunk.token_ids)
                            previous = now
                        cell["wall_s"] += time.perf_counter() - started
                        cell["tokens"] += len(ids)
                        texts[w["id"]][str(mode)] = ids
                        traces[str(mode)][w["id"]] = " ".join(trace)
    finally:
        pipeline.stop()
    equal = sum(len({tuple(v) for v in by_mode.values()}) == 1 for by_mode in texts.values())
    summary: dict = {"outputs_equal_across_modes": f"{equal} of {len(texts)}", "modes": {}, "traces": traces}
    for mode, cells in out.items():
        summary["modes"][mode] = {}
        for kind, cell in cells.items():
            summary["modes"][mode][kind] = {
                "wall_s": round(cell["wall_s"], 3), "tokens": cell["tokens"],
                "ms_per_token": round(cell["wall_s"] / max(1, cell["tokens"]) * 1e3, 3),
                "rounds": {name: {"count": len(r["wall_ms"]), "total_s": round(sum(r["wall_ms"]) / 1e3, 3),
                                  "median_ms": round(statistics.median(r["wall_ms"]), 3),
                                  **{f"median_{part}": round(statistics.median(r[part]), 3) for part in PARTS},
                                  "tokens_per_round": round(r["tokens"] / len(r["wall_ms"]), 3)}
                           for name, r in sorted(cell["rounds"].items())}}
    return summary


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(mode, kind, cell) for mode, kinds in summary["modes"].items() for kind, cell in kinds.items()]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(cells)), 3.8))
    bottoms = [0.0] * len(cells)
    for name in KINDS:
        heights = [cell["rounds"].get(name, {}).get("total_s", 0.0) for _, _, cell in cells]
        if any(heights):
            ax.bar(range(len(cells)), heights, bottom=bottoms, label=name)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(cells)), [f"{kind}\nk={mode}" for mode, kind, _ in cells], fontsize=7)
    ax.set_ylabel("seconds in rounds of each kind")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="auto", help="comma-separated: auto and/or fixed draft lengths")
    parser.add_argument("--kinds", default="humaneval,humaneval-edit,sharegpt")
    parser.add_argument("--prompts", type=int, default=24, help="as bench/peers.py: a third of each kind")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-args", default="", help="extra draft-service flags, e.g. '--suffix-spec-factor 1'")
    parser.add_argument("--orchestrator-args", default="", help="extra orchestrator flags, e.g. '--overlap'")
    parser.add_argument("--out", default="bench/results/rounds.json")
    args = parser.parse_args()
    modes = [m if m == "auto" else int(m) for m in args.modes.split(",")]
    summary = run(modes, args.kinds.split(","), args.prompts, args.reps, args.max_tokens, args.draft_args.split(),
                  args.orchestrator_args.split())
    summary.update(date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv))
    for mode, kinds in summary["modes"].items():
        for kind, cell in kinds.items():
            parts = ", ".join(f"{n} {r['count']} x {r['median_ms']:.2f} ms" for n, r in cell["rounds"].items())
            print(f"k={mode} {kind}: {cell['ms_per_token']:.2f} ms/token ({cell['tokens']} tokens); {parts}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
