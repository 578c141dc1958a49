"""Runs vLLM (offline, engine in this process) for tests/system/test_vllm.py, in vLLM's own virtualenv.

argv[1]: a JSON object {"model", "spec" (a speculative config or null), "prompts" (token id lists),
"max_tokens", "rounds"}. Before each round it prints {"ready": i} and waits for a line on stdin;
after it, {"round": i, "outputs": [token ids per prompt], "seconds", "stats"} (the proposer's
counts, when it is ours). Greedy decoding throughout.
"""

from __future__ import annotations

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


def _stats(drafter) -> dict:
    stats = getattr(drafter, "stats", None)
    if stats is None:
        return {}
    return {"calls": stats.calls, "failures": stats.failures, "drafted": stats.drafted, "accepted": stats.accepted,
            "verified": stats.verified, "acceptance": stats.acceptance, "outputs_shared": stats.outputs_shared}


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = json.loads(sys.argv[1])
    llm = LLM(model=args["model"], dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              speculative_config=args.get("spec"), max_num_seqs=8)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in args["prompts"]]
    params = SamplingParams(temperature=0, max_tokens=args["max_tokens"])
    drafter = _drafter(llm)
    for i in range(args.get("rounds", 1)):
        print(json.dumps({"ready": i}), flush=True)
        sys.stdin.readline()
        start = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        print(json.dumps({"round": i, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                          "seconds": time.monotonic() - start, "stats": _stats(drafter)}), flush=True)


if __name__ == "__main__":
    main()
