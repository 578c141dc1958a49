"""Runs vLLM (offline, engine in this process) for tests/system/test_vllm.py, in vLLM's own virtualenv.

argv[1]: a JSON object {"model", "spec" (a speculative config or null), "prompts" (token id lists),
"max_tokens", "max_num_seqs" (8)}. Before each round it prints {"ready": i} and reads a line from
stdin: a JSON object is a round of its own, {"prompts" (the default ones if absent), "max_tokens",
"temperature" (0: greedy), "seeds" (one per prompt; absent: vLLM's own generator)}; any other line
is the default round (the prompts, greedy); the end of stdin ends the driver. After the round it
prints {"round": i, "outputs": [token ids per prompt], "seconds", "version" (vLLM's), "stats"}:
the proposer's counts so far when it is ours, and vLLM's own (`vllm_draft_tokens`,
`vllm_accepted_tokens`: it sees the verdict of a request's last step, which the proposer never does).
"""

from __future__ import annotations

import itertools
import json
import sys
import time


def _drafter(llm):
    """The proposer vLLM built (engine in this process), or None."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        return core.model_executor.driver_worker.worker.model_runner.drafter
    except AttributeError:
        return None


VLLM_COUNTERS = {"vllm:spec_decode_num_draft_tokens": "vllm_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "vllm_accepted_tokens"}


def _stats(llm, drafter) -> dict:
    counts = {VLLM_COUNTERS[m.name]: m.value for m in llm.get_metrics() if m.name in VLLM_COUNTERS}
    stats = getattr(drafter, "stats", None)
    if stats is None:
        return counts
    return {"calls": stats.calls, "failures": stats.failures, "drafted": stats.drafted, "accepted": stats.accepted,
            "verified": stats.verified, "acceptance": stats.acceptance, "outputs_shared": stats.outputs_shared,
            **counts}


def _round(line: str, args: dict) -> tuple[list[list[int]], list]:
    """The prompts and the sampling parameters (one per prompt) of the round `line` asks for."""
    from vllm import SamplingParams

    spec = json.loads(line) if line.startswith("{") else {}
    prompts = spec.get("prompts", args["prompts"])
    seeds = spec.get("seeds") or [None] * len(prompts)
    params = [SamplingParams(temperature=spec.get("temperature", 0.0), seed=seed,
                             max_tokens=spec.get("max_tokens", args["max_tokens"])) for seed in seeds]
    return prompts, params


def main() -> None:
    from vllm import LLM, __version__
    from vllm.inputs import TokensPrompt

    args = json.loads(sys.argv[1])
    llm = LLM(model=args["model"], dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              speculative_config=args.get("spec"), max_num_seqs=args.get("max_num_seqs", 8), disable_log_stats=False)
    drafter = _drafter(llm)
    for i in itertools.count():
        print(json.dumps({"ready": i}), flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        prompts, params = _round(line.strip(), args)
        start = time.monotonic()
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
        print(json.dumps({"round": i, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                          "seconds": time.monotonic() - start, "version": __version__,
                          "stats": _stats(llm, drafter)}), flush=True)


if __name__ == "__main__":
    main()
