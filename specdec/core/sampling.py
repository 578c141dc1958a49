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
    """How logits become a token. `temperature == 0` means greedy (argmax).

    The fields after `top_p` are logits processors (specdec.core.processors): they depend on the
    tokens before each position, and both sides apply them identically to every position of a
    block, so they are part of the target distribution the output follows exactly.
    """

    temperature: float = 0.0
    """Divides the logits; 0 = greedy. Must be finite and >= 0."""
    top_k: int = 0
    """Keep only the `top_k` most likely tokens; 0 = off."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of most likely tokens with mass >= `top_p`; 1 = off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below `min_p` times the most likely one's; 0 = off."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token the output holds so far (OpenAI's); in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it (OpenAI's); in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or output (CTRL's); 1 = off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits; biases in [-100, 100]."""
    min_tokens: int = 0
    """Until the output holds this many tokens, `end_token_ids` cannot be drawn."""
    end_token_ids: tuple[int, ...] = ()
    """The tokens `min_tokens` holds back: end of sequence and any stop token ids."""
    output_start: int = 0
    """Where the output starts in the history: the penalties count tokens from here."""
    grammar_kind: str = ""
    """Structured output: the kind of `grammar_text` (specdec.core.grammar.KINDS); "" = none. The
    grammar masks p and q at every position, from the output before it."""
    grammar_text: str = ""

    def __post_init__(self) -> None:
        # Stored as JSON (lists), given back as tuples, so that params stay hashable and comparable.
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in self.logit_bias)))
        object.__setattr__(self, "end_token_ids", tuple(sorted({int(t) for t in self.end_token_ids})))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """True when a logits processor is on (the logits depend on the tokens before them)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or (self.min_tokens and self.end_token_ids))

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
        checks = [
            ("min_p", self.min_p, 0.0, 1.0, "0 = off"),
            ("presence_penalty", self.presence_penalty, -2.0, 2.0, "0 = off"),
            ("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "0 = off"),
        ]
        for name, value, lo, hi, off in checks:
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not lo <= value <= hi:
                raise ValueError(f"{name}={value!r} is invalid: must be in [{lo:g}, {hi:g}] ({off})")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or not math.isfinite(r) or not 0 < r <= 10:
            raise ValueError(f"repetition_penalty={r!r} is invalid: must be in (0, 10] (1 = off)")
        for token, bias in self.logit_bias:
            if token < 0 or not math.isfinite(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{token}]={bias!r} is invalid: token ids >= 0, biases in [-100, 100]")
        if self.min_tokens < 0 or self.output_start < 0 or any(t < 0 for t in self.end_token_ids):
            raise ValueError("min_tokens, output_start and end_token_ids must be >= 0")


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits `[N, V]` -> probabilities `[N, V]` (float64, rows sum to 1).

    Order: temperature, then min-p, then top-k, then top-p, then renormalise (the logits
    processors of `specdec.core.processors` come before all of them). Ties at the top-k
    boundary are broken by `torch.topk`; ties inside the nucleus by a stable sort, so the
    result is deterministic.
    """
    assert logits.ndim == 2, f"logits must be [N, V], got {tuple(logits.shape)}"
    assert not params.greedy, "logits_to_probs is for sampling; greedy params take argmax"
    n, v = logits.shape
    x = logits.to(torch.float64) / params.temperature  # [N, V]

    if params.min_p > 0.0:  # relative to the most likely token, after temperature
        floor = torch.log_softmax(x, dim=1).amax(dim=1, keepdim=True) + math.log(params.min_p)  # [N, 1]
        x = x.masked_fill(torch.log_softmax(x, dim=1) < floor, -math.inf)

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
