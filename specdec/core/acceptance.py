"""The acceptance rule of speculative decoding: pure functions of tensors and a generator.

Glossary (see docs/maths.md, section "Glossary"): `p` is the target distribution, `q` the draft
distribution, `k` the number of draft tokens. The target scores the block in one forward
pass and returns `k + 1` rows: row `i` is the target's distribution for the token at draft
position `i`, and row `k` the one after the last draft token.

Sampling follows Leviathan et al. 2023 / Chen et al. 2023 and is lossless: the emitted
tokens are distributed exactly as if the target had sampled them one at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core.sampling import SamplingParams, logits_to_probs, sample

_SUM_TOL = 1e-4  # how far a row of p or q may stray from summing to 1 (float32 on the wire)


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one block of `k` draft tokens.

    - *accepted*: the draft tokens kept, always a prefix `draft_tokens[:num_accepted]`.
    - *recovered*: the target's token at the first rejection, replacing the rejected draft
      token (`bonus=False`).
    - *bonus*: the target's extra token after all `k` draft tokens were accepted
      (`bonus=True`, `num_accepted == k`).

    Each round therefore emits `num_accepted + 1` tokens: the accepted ones, then `token`.
    """

    num_accepted: int
    token: int
    """The recovered token, or the bonus token when `bonus` is true."""
    bonus: bool

    def emitted(self, draft_tokens: Sequence[int]) -> list[int]:
        """The tokens the round adds to the sequence: accepted drafts then `token`."""
        return [int(t) for t in draft_tokens[: self.num_accepted]] + [self.token]


def verify_greedy(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor | Sequence[int]
) -> Verdict:
    """Greedy verification: accept `x_i` while `x_i == argmax p_i`.

    target_logits: `[k+1, V]`; draft_tokens: `[k]`. Ties in the argmax go to the lowest id.
    """
    tokens = _as_tokens(draft_tokens)  # [k]
    k, _ = _check_block(target_logits, tokens, "target_logits")
    best = torch.argmax(target_logits, dim=1).tolist()  # [k+1]
    for i in range(k):
        if tokens[i] != best[i]:
            return Verdict(num_accepted=i, token=best[i], bonus=False)
    return Verdict(num_accepted=k, token=best[k], bonus=True)


def verify_sampling(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft_tokens: torch.Tensor | Sequence[int],
    generator: torch.Generator,
) -> Verdict:
    """Lossless rejection sampling over one block.

    p: `[k+1, V]` target probabilities; q: `[k, V]` draft probabilities, or None when the
    draft was deterministic (one-hot q at each draft token, e.g. prompt lookup);
    draft_tokens: `[k]`, with `x_i ~ q_i`.

    Draw `u ~ U[0, 1)^k` and accept `x_i` while `u_i < p_i(x_i) / q_i(x_i)`. At the first
    rejection draw the recovered token from `norm(max(0, p_i - q_i))`; if all are accepted
    draw the bonus from `p_k`. Randomness is consumed in a fixed order (the `k` uniforms,
    then one draw for the emitted token), so a generator seed reproduces the verdict.
    """
    tokens = _as_tokens(draft_tokens)  # [k]
    k, v = _check_block(p, tokens, "p")
    p = p.detach().to("cpu", torch.float64)  # [k+1, V]
    _check_probs(p, "p")
    p_x = [float(p[i, x]) for i, x in enumerate(tokens)]  # [k]: p_i(x_i)
    if q is None:
        q_x = [1.0] * k  # one-hot q at each draft token
    else:
        if tuple(q.shape) != (k, v):
            raise ValueError(f"q must be [k={k}, V={v}], got shape {tuple(q.shape)}")
        q = q.detach().to("cpu", torch.float64)  # [k, V]
        _check_probs(q, "q")
        q_x = [float(q[i, x]) for i, x in enumerate(tokens)]  # [k]: q_i(x_i)
        if not all(qx > 0 for qx in q_x):
            raise ValueError(f"draft tokens {tokens} must have q > 0 (x_i ~ q_i), got {q_x}")

    u = torch.rand(k, generator=generator, dtype=torch.float64).tolist()  # [k]
    for i in range(k):
        if u[i] * q_x[i] < p_x[i]:  # accept with probability min(1, p/q)
            continue
        if q is None:
            residual = p[i].clone()  # [V]
            residual[tokens[i]] = 0.0  # max(0, p - onehot(x)): p with x removed
        else:
            residual = torch.clamp(p[i] - q[i], min=0.0)  # [V]
        if not float(residual.sum()) > 0.0:  # only through rounding when p_i == q_i
            residual = p[i]
        return Verdict(num_accepted=i, token=sample(residual, generator), bonus=False)
    return Verdict(num_accepted=k, token=sample(p[k], generator), bonus=True)


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor | Sequence[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """Verify a block: greedy when `params.greedy`, else lossless rejection sampling.

    target_logits: `[k+1, V]`; draft_tokens: `[k]`; draft_probs: `[k, V]`, the draft's q
    already processed with the same `params`, or None for a deterministic draft (ignored
    when greedy). `generator` is required unless greedy.
    """
    if params.greedy:
        return verify_greedy(target_logits, draft_tokens)
    if generator is None:
        raise ValueError("a generator is required when sampling (temperature > 0)")
    tokens = _as_tokens(draft_tokens)  # [k]
    _check_block(target_logits, tokens, "target_logits")
    p = logits_to_probs(target_logits, params)  # [k+1, V]
    return verify_sampling(p, draft_probs, tokens, generator)


def _as_tokens(draft_tokens: torch.Tensor | Sequence[int]) -> list[int]:
    """Draft token ids `[k]` as a list of ints (k is small; the bookkeeping is scalar)."""
    if isinstance(draft_tokens, torch.Tensor):
        if draft_tokens.ndim != 1:
            raise ValueError(f"draft_tokens must be [k], got shape {tuple(draft_tokens.shape)}")
        return [int(t) for t in draft_tokens.tolist()]
    try:
        return [int(t) for t in draft_tokens]
    except TypeError as e:
        raise ValueError(f"draft_tokens must be [k] token ids, got {draft_tokens!r}") from e


def _check_block(target: torch.Tensor, tokens: list[int], name: str) -> tuple[int, int]:
    """Check `target [k+1, V]` against `tokens [k]`; return (k, V)."""
    if target.ndim != 2:
        raise ValueError(f"{name} must be [k+1, V], got shape {tuple(target.shape)}")
    k = len(tokens)
    rows, v = target.shape
    if rows != k + 1:
        raise ValueError(f"{name} has {rows} rows but there are k={k} draft tokens (want k+1)")
    if tokens and not (min(tokens) >= 0 and max(tokens) < v):
        raise ValueError(f"draft token ids {tokens} must be in [0, V={v})")
    return k, v


def _check_probs(probs: torch.Tensor, name: str) -> None:
    """Rows of `probs [rows, V]` must be non-negative and sum to 1 (NaN and inf fail)."""
    if probs.shape[0] == 0:
        return
    lo, hi = (float(s) for s in probs.sum(dim=1).aminmax())  # smallest and largest row sum
    if not (abs(lo - 1.0) <= _SUM_TOL and abs(hi - 1.0) <= _SUM_TOL):
        raise ValueError(f"rows of {name} must sum to 1, got row sums in [{lo}, {hi}]")
    if float(probs.min()) < 0:
        raise ValueError(f"{name} must be non-negative")
