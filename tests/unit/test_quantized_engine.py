"""The engine on quantized weights computes the model those weights are.

- Greedy: the packaged model's GGUF blocks run as stored (`--weights gguf`) decode what the same
  weights de-quantized to float32 (`--weights dense`) decode, on real chat prompts, through the
  engine's own caches; any step where the two differ must be a near-tie (the top two logits
  within `NEAR_TIE`), and the test says how many there were.
- Sampled: speculative sampling with a quantized target (and a quantized draft) emits tokens
  distributed as the quantized target's own distribution (chi-square, as the float tests do).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specdec.core.acceptance import verify_sampling
from specdec.core.sampling import SamplingParams, logits_to_probs, sample
from specdec.runtime.kv import SessionCaches

NEAR_TIE = 1e-3  # top-2 logit gap under which float32 rounding may pick either token
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What are three good habits for staying healthy while working from home?",
    "Explain the difference between a list and a tuple in Python.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I reverse a string in JavaScript?",
]


def _greedy(caches: SessionCaches, session: str, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """`steps` greedy tokens after `prompt` through the engine's caches, and each step's top-2 logit gap."""
    history, gaps = list(prompt), []
    for _ in range(steps):
        logits, _ = caches.score(session, history, [])
        top = logits[-1].float().topk(2).values
        gaps.append(float(top[0] - top[1]))
        history.append(int(logits[-1].argmax()))
    return history[len(prompt):], gaps


@pytest.mark.slow
def test_gguf_blocks_decode_greedily_as_their_float32_dequantization():
    from specdec.runtime.models import DEFAULT_MODEL, load_model

    blocks = load_model(DEFAULT_MODEL, progress=False, weights="gguf")
    dense = load_model(DEFAULT_MODEL, progress=False, weights="dense")
    assert blocks.weights.format == "gguf:q4_1+q8_0" and dense.weights.format == "float32"
    engines = {name: SessionCaches(loaded.model, 1024) for name, loaded in (("gguf", blocks), ("dense", dense))}
    steps, same, ties, report = 32, 0, 0, []
    for i, text in enumerate(PROMPTS):
        chat = blocks.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=False)
        prompt = list(blocks.tokenizer(chat, add_special_tokens=False)["input_ids"])
        (ours, our_gaps), (theirs, their_gaps) = (_greedy(engines[name], f"p{i}", prompt, steps)
                                                  for name in ("gguf", "dense"))
        ties += sum(min(a, b) < NEAR_TIE for a, b in zip(our_gaps, their_gaps))
        if ours == theirs:
            same += 1
            continue
        first = next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        report.append(f"prompt {i}: first differs at step {first}, top-2 gaps {our_gaps[first]:.2e} (gguf) "
                      f"{their_gaps[first]:.2e} (dense)")
        assert min(our_gaps[first], their_gaps[first]) < NEAR_TIE, "; ".join(report)
    print(f"{same} of {len(PROMPTS)} prompts decode the same {steps} tokens; {ties} near-tie steps "
          f"(top-2 gap < {NEAR_TIE}); " + ("; ".join(report) or "no divergence"))
    assert same >= len(PROMPTS) - 1, "; ".join(report)


def _pooled_chisquare(observed: np.ndarray, probs: np.ndarray) -> float:
    """p-value of a chi-square goodness of fit, bins expected below 5 pooled into one (0 for a draw
    outside the support, 1 where the support is one token and every draw was it)."""
    if observed[probs == 0].sum():
        return 0.0
    expected = probs * observed.sum()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def _round(target: SessionCaches, draft: SessionCaches, history: list[int], k: int, params: SamplingParams,
           gen: torch.Generator) -> list[int]:
    """One speculative round: `k` tokens sampled from the draft's q, verified against the target's p."""
    drafts, q_rows = [], []
    for _ in range(k):
        logits, _ = draft.score("d", history + drafts, [])
        q_rows.append(logits_to_probs(logits[-1:], params)[0])
        drafts.append(sample(q_rows[-1], gen))
    logits, _ = target.score("t", history, drafts)  # [k + 1, V]
    verdict = verify_sampling(logits_to_probs(logits, params), torch.stack(q_rows), drafts, gen)
    return verdict.emitted(drafts)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_k=20, top_p=0.9)])
def test_sampling_with_quantized_weights_follows_the_quantized_target(tiny_models, one_torch_thread, params):
    """First and second tokens of speculative sampling (k = 3) with an int4 target and an int8 copy
    of a poor draft, both through the quantized kernels, against the int4 target's exact marginals."""
    from specdec.runtime.models import load_model

    loaded = load_model(str(tiny_models["target"]), dtype="float32", quantize="int4", progress=False)
    assert loaded.weights.format == "q4_1"  # int4 in groups of 32 stores q4_1 blocks
    draft_model = load_model(str(tiny_models["poor_draft"]), dtype="float32", quantize="int8", progress=False).model
    target, draft = SessionCaches(loaded.model, 256), SessionCaches(draft_model, 256)
    prompt = list(loaded.tokenizer("Once upon a time")["input_ids"])
    n, first, second = 1500, [], []
    for seed in range(n):
        gen = torch.Generator().manual_seed(seed)
        out = _round(target, draft, prompt, 3, params, gen)
        if len(out) < 2 and out[0] not in loaded.eos_token_ids:
            out += _round(target, draft, prompt + out, 3, params, gen)
        first.append(out[0])
        if len(out) >= 2:
            second.append(out[1])
    logits, _ = target.score("ref", prompt, [])
    p0 = logits_to_probs(logits[-1:], params)[0].numpy()
    vocab = p0.shape[0]
    pvalue = _pooled_chisquare(np.bincount(first, minlength=vocab), p0)
    assert pvalue > 1e-3, f"first tokens are not distributed as the quantized target's p (p-value {pvalue:.2e})"
    support = [int(x) for x in np.flatnonzero(p0) if x not in loaded.eos_token_ids]
    p1 = np.stack([logits_to_probs(target.score("ref", prompt + [x], [])[0][-1:], params)[0].numpy()
                   for x in support])
    weights = p0[support] / p0[support].sum()
    assert len(second) >= n * 0.9
    pvalue = _pooled_chisquare(np.bincount(second, minlength=vocab), (weights[:, None] * p1).sum(axis=0))
    assert pvalue > 1e-3, f"second tokens are not distributed as the quantized target's (p-value {pvalue:.2e})"
