"""Logits processors that depend on the tokens before a position: pure functions, no I/O.

Penalties, biases and `min_tokens` are part of the distribution a client asks for, so under
speculation both sides apply them to every position of a block exactly as the target alone
would have at that position: row `i` of a block sees the history and the block's tokens before
`i`. The draft processes each `q` row over its own proposal so far; the target processes each
`p` row over the history plus the draft tokens before it; a row is only used when every token
before it was accepted, so the two always agree on the context (docs/maths.md, "Processors and grammars").

Order, per row: `min_tokens` (the end tokens get -inf), `logit_bias` (added), the repetition
penalty (over prompt and output, CTRL / transformers' `RepetitionPenaltyLogitsProcessor`), then
the frequency and presence penalties (over the output only, as OpenAI defines them), then the
grammar's mask. The grammar wins over `min_tokens`: where it allows only end tokens, they stay.
Then `specdec.core.sampling.logits_to_probs` applies temperature, min-p, top-k and top-p.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch

from specdec.core.sampling import SamplingParams


def process_block(logits: torch.Tensor, history: Sequence[int], block: Sequence[int],
                  params: SamplingParams, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Logits `[N, V]` for the positions after `history + block[:i]`, i = 0..N-1, processed.

    `history` is everything before the block (prompt, earlier turns and output);
    `params.output_start` says where in it the output begins. `block` needs at least N - 1
    tokens. `allowed` `[N, V]` (bool): what the grammar allows at each row (None: no grammar);
    disallowed tokens get -inf, last. Returns a new tensor (the input is not changed);
    unchanged when no processor is on and there is no grammar.

    The grammar wins over `min_tokens`: a row where the grammar allows no token but end tokens (it
    is complete) keeps its end tokens, so the output ends there, shorter than `min_tokens`, rather
    than drawing from a row where nothing is allowed.
    """
    assert logits.ndim == 2, f"logits must be [N, V], got {tuple(logits.shape)}"
    n, v = logits.shape
    assert len(block) >= n - 1, f"{n} rows need {n - 1} block tokens, got {len(block)}"
    assert allowed is None or allowed.shape == logits.shape, f"allowed {tuple(allowed.shape)} != logits"
    if not params.processed:
        return logits if allowed is None else logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    x = logits.clone()
    output = Counter(int(t) for t in history[params.output_start:])  # token -> times in the output
    seen = set(int(t) for t in history) if params.repetition_penalty != 1.0 else set()
    produced = max(len(history) - params.output_start, 0)
    dev = x.device
    bias_ids = torch.tensor([t for t, _ in params.logit_bias if t < v], dtype=torch.long, device=dev)
    bias = torch.tensor([b for t, b in params.logit_bias if t < v], dtype=x.dtype, device=dev)
    ends = torch.tensor([t for t in params.end_token_ids if t < v], dtype=torch.long, device=dev)
    holds_ends = _holds_ends(allowed, ends, n) if params.min_tokens and len(ends) else [False] * n
    for i in range(n):
        if i > 0:  # the block's token before this row joins the context
            token = int(block[i - 1])
            output[token] += 1
            produced += 1
            if params.repetition_penalty != 1.0:
                seen.add(token)
        row = x[i]  # [V], a view: the updates below write into x
        if holds_ends[i] and produced < params.min_tokens:
            row[ends] = -math.inf
        if len(bias_ids):
            row[bias_ids] += bias
        if seen:
            ids = torch.tensor([t for t in sorted(seen) if t < v], dtype=torch.long, device=dev)
            values = row[ids]
            r = params.repetition_penalty
            row[ids] = torch.where(values > 0, values / r, values * r)
        if output and (params.frequency_penalty or params.presence_penalty):
            pairs = [(t, c) for t, c in output.items() if t < v]
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=dev)
            counts = torch.tensor([c for _, c in pairs], dtype=x.dtype, device=dev)
            row[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return x if allowed is None else x.masked_fill(~allowed.to(dev), float("-inf"))


def _holds_ends(allowed: torch.Tensor | None, ends: torch.Tensor, n: int) -> list[bool]:
    """Per row, whether `min_tokens` may hold the end tokens back: only where the grammar (if any)
    allows some other token."""
    if allowed is None:
        return [True] * n
    others = allowed.to(ends.device).clone()  # [N, V]
    others[:, ends] = False
    return others.any(dim=1).tolist()
