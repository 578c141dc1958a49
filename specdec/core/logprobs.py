"""Log-probabilities of emitted tokens, from the logits of the pass that scored them: pure, no I/O.

Two distributions can be reported, as vLLM's `--logprobs-mode` offers: `raw`, the model's own
softmax over its logits (what a plain forward pass of the target gives, and what prompt-scoring
clients such as lm-evaluation-harness expect), and `processed`, the distribution the token was
actually drawn from (after processors, grammar, temperature, min-p, top-k and top-p; a greedy
request's processed distribution is the softmax of its processed logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core.sampling import SamplingParams, logits_to_probs

MAX_TOP_LOGPROBS = 20
MODES = ("raw", "processed")
LOGPROB_ROWS = 16
"""Rows `logprobs_of` turns into float64 log-probabilities at a time: `[16, V]` is 6 MB at a 49k
vocabulary, where a whole scored prompt's `[N, V]` would be N x 393 KB (3.2 GB at 8k tokens, twice:
the float64 copy and its log-softmax)."""


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    rank: int
    """1 + the number of tokens strictly more likely than `token` at its position."""
    top: tuple[tuple[int, float], ...] = ()
    """The most likely (token, logprob) pairs at the position, most likely first."""


def log_distribution(logits: torch.Tensor, params: SamplingParams | None) -> torch.Tensor:
    """Log-probabilities `[N, V]` (float64) from logits `[N, V]`: the raw softmax when `params` is
    None, else the distribution sampling uses under `params` (logits already processed)."""
    x = logits.to(torch.float64)
    if params is None or params.greedy:
        return torch.log_softmax(x, dim=1)
    return torch.log(logits_to_probs(x, params))  # zeroed tokens get -inf


def logprobs_of(logits: torch.Tensor, tokens: Sequence[int], top: int = 0,
                params: SamplingParams | None = None) -> list[TokenLogprob]:
    """`token_logprobs(log_distribution(logits, params), tokens, top)`, computed `LOGPROB_ROWS` rows at
    a time (every row is a distribution of its own, so the result is the same): row i of `logits`
    `[N, V]` describes the position of `tokens[i]`."""
    assert logits.ndim == 2 and logits.shape[0] == len(tokens), \
        f"{len(tokens)} tokens need [{len(tokens)}, V] logits, got {tuple(logits.shape)}"
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs={top} is invalid: must be in [0, {MAX_TOP_LOGPROBS}]")
    out: list[TokenLogprob] = []
    for lo in range(0, len(tokens), LOGPROB_ROWS):
        hi = min(lo + LOGPROB_ROWS, len(tokens))
        out.extend(token_logprobs(log_distribution(logits[lo:hi], params), tokens[lo:hi], top))
    return out


def token_logprobs(logprobs: torch.Tensor, tokens: Sequence[int], top: int = 0) -> list[TokenLogprob]:
    """Row i of `logprobs [N, V]` describes the position of `tokens[i]` (N == len(tokens))."""
    assert logprobs.ndim == 2 and logprobs.shape[0] == len(tokens), \
        f"{len(tokens)} tokens need [{len(tokens)}, V] log-probabilities, got {tuple(logprobs.shape)}"
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs={top} is invalid: must be in [0, {MAX_TOP_LOGPROBS}]")
    if not tokens:
        return []
    ids = torch.tensor([int(t) for t in tokens], dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [N]
    if top:
        best = torch.topk(logprobs, top, dim=1)  # values, indices [N, top], sorted
        top_values, top_ids = best.values.cpu().tolist(), best.indices.cpu().tolist()
    chosen_list, rank_list = chosen[:, 0].cpu().tolist(), ranks.cpu().tolist()
    return [
        TokenLogprob(int(t), float(chosen_list[i]), int(rank_list[i]),
                     tuple(zip(top_ids[i], top_values[i])) if top else ())
        for i, t in enumerate(tokens)
    ]
