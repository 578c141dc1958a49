"""Arrival processes of the open loop, and the start times of the closed loop's workers. Pure.

Open loop: requests arrive on their own clock, whatever the server does. Gaps between arrivals
are gamma-distributed with mean `1 / rate` and shape `burstiness` (vLLM's `--burstiness`):
burstiness 1 is a Poisson process (exponential gaps); below 1 arrivals come in bursts (the
gaps' coefficient of variation is `1 / sqrt(burstiness)`); above 1 they are more regular.

A ramp raises the rate linearly from 0 to `rate` over `ramp_s` seconds. It is a time change:
gaps are drawn at rate 1 in "operational time" `u`, and each arrival is placed at the wall
time `t` where the cumulative intensity `Λ(t) = ∫₀ᵗ rate(s) ds` reaches `u`.
"""

from __future__ import annotations

import math
import random


def gaps(n: int, rate: float, *, burstiness: float = 1.0, rng: random.Random) -> list[float]:
    """n gaps between arrivals: gamma(shape=burstiness, mean=1/rate)."""
    _check(rate, burstiness)
    if burstiness == 1.0:
        return [rng.expovariate(rate) for _ in range(n)]
    scale = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(n)]


def cumulative_intensity(t: float, rate: float, ramp_s: float = 0.0) -> float:
    """Λ(t): expected arrivals by time t with a linear ramp from 0 to `rate` over `ramp_s`."""
    if t <= 0:
        return 0.0
    if ramp_s <= 0:
        return rate * t
    if t <= ramp_s:
        return rate * t * t / (2 * ramp_s)
    return rate * ramp_s / 2 + rate * (t - ramp_s)


def inverse_intensity(u: float, rate: float, ramp_s: float = 0.0) -> float:
    """The time t at which Λ(t) = u (the inverse of `cumulative_intensity`)."""
    if u <= 0:
        return 0.0
    if ramp_s <= 0:
        return u / rate
    during_ramp = rate * ramp_s / 2
    if u <= during_ramp:
        return math.sqrt(2 * ramp_s * u / rate)
    return ramp_s + (u - during_ramp) / rate


def arrival_times(n: int, rate: float, *, burstiness: float = 1.0, ramp_s: float = 0.0,
                  seed: int | random.Random = 0) -> list[float]:
    """Send times (seconds from the start) of n open-loop requests; the first is sent at 0."""
    if ramp_s < 0:
        raise ValueError(f"the ramp must not be negative, got {ramp_s}")
    _check(rate, burstiness)
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    out, u = [], 0.0
    for gap in [0.0] + gaps(max(0, n - 1), 1.0, burstiness=burstiness, rng=rng):  # operational time: rate 1
        u += gap
        out.append(inverse_intensity(u, rate, ramp_s))
    return out[:n]


def worker_starts(concurrency: int, ramp_s: float = 0.0) -> list[float]:
    """Closed loop: when each of `concurrency` workers starts, spread evenly over the ramp."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if ramp_s < 0:
        raise ValueError(f"the ramp must not be negative, got {ramp_s}")
    return [i * ramp_s / concurrency for i in range(concurrency)]


def _check(rate: float, burstiness: float) -> None:
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"the request rate must be a positive number, got {rate}")
    if not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness must be a positive number, got {burstiness}")
