"""Sampling helpers shared by the draft and the target: pure tensor functions, no I/O.

Glossary (see docs/maths.md, section "Glossary"): `p` is the target distribution, `q` the draft
distribution, `k` the number of draft tokens in a block. Both sides turn logits into
probabilities with the same `logits_to_probs`, so temperature, top-k and top-p are applied
to `p` and `q` alike before the acceptance test.

Randomness is injected: every random choice takes a `torch.Generator`, and
`derive_generator` makes one from (session seed, token position, stream), so a session's
draws are a pure function of its seed and survive a failover to another replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DRAFT_STREAM = 1
"""Stream tag for the draft's draws (sampling the `k` draft tokens)."""
TARGET_STREAM = 2
"""Stream tag for the target's draws (acceptance uniforms, recovered and bonus tokens)."""

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64 increment (2**64 / golden ratio)


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a token. `temperature == 0` means greedy (argmax)."""

    temperature: float = 0.0
    """Divides the logits; 0 = greedy. Must be finite and >= 0."""
    top_k: int = 0
    """Keep only the `top_k` most likely tokens; 0 = off."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of most likely tokens with mass >= `top_p`; 1 = off."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise `ValueError` naming the field, its value and the allowed range."""
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r} is invalid: must be finite and >= 0 (0 = greedy)")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k={k!r} is invalid: must be an integer >= 0 (0 = off)")
        p = self.top_p
        if not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
            raise ValueError(f"top_p={p!r} is invalid: must be in (0, 1] (1 = off)")


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits `[N, V]` -> probabilities `[N, V]` (float64, rows sum to 1).

    Order: temperature, then top-k, then top-p, then renormalise. Ties at the top-k
    boundary are broken by `torch.topk`; ties inside the nucleus by a stable sort, so the
    result is deterministic.
    """
    assert logits.ndim == 2, f"logits must be [N, V], got {tuple(logits.shape)}"
    assert not params.greedy, "logits_to_probs is for sampling; greedy params take argmax"
    n, v = logits.shape
    x = logits.to(torch.float64) / params.temperature  # [N, V]

    if 0 < params.top_k < v:
        keep = torch.zeros_like(x, dtype=torch.bool)  # [N, V]
        keep.scatter_(1, torch.topk(x, params.top_k, dim=1).indices, True)
        x = x.masked_fill(~keep, -math.inf)

    probs = torch.softmax(x, dim=1)  # [N, V]

    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=1, descending=True, stable=True)  # [N, V]
        mass_before = torch.cumsum(sorted_probs, dim=1) - sorted_probs  # [N, V]
        keep_sorted = mass_before < params.top_p  # the first token always has mass_before 0
        keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)  # [N, V]
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum(dim=1, keepdim=True)

    assert probs.shape == (n, v)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a row `[V]` of (possibly unnormalised) probabilities.

    Inverse CDF on a single uniform from `generator`, so each call consumes exactly one
    draw; a token with zero probability is never returned.
    """
    assert probs.ndim == 1, f"probs must be [V], got {tuple(probs.shape)}"
    cdf = torch.cumsum(probs.detach().to("cpu", torch.float64), dim=0)  # [V]
    total = float(cdf[-1])
    assert total > 0 and math.isfinite(total), f"probs must have positive finite mass, got {total}"
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    # The first index whose cdf exceeds u * total; it always has positive probability.
    token = int(torch.searchsorted(cdf, u * total, right=True))
    if token == cdf.shape[0]:  # u * total rounded up to total: take the last token with mass
        token = int(torch.searchsorted(cdf, total, right=False))
    return token


def _splitmix64(x: int) -> int:
    z = (x + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def derive_generator(seed: int, position: int, stream: int) -> torch.Generator:
    """A CPU generator whose state is a pure function of (seed, position, stream).

    `seed` is the session's uint64 seed, `position` the token position of the first token
    of the block, `stream` a tag such as `DRAFT_STREAM` or `TARGET_STREAM`. The three are
    mixed with splitmix64, so neighbouring positions and streams give unrelated streams.
    """
    for name, value in (("seed", seed), ("position", position), ("stream", stream)):
        if not 0 <= value <= _MASK64:
            raise ValueError(f"{name}={value!r} is invalid: must be in [0, 2**64 - 1]")
    h = _splitmix64(_splitmix64(_splitmix64(seed) ^ position) ^ stream)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(h)
    return generator
