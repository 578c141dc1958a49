"""Arrival processes: seeded Poisson and gamma at the asked mean rate and burstiness, ramps, workers."""

from __future__ import annotations

import random
import statistics

import pytest

from loadtest.arrivals import arrival_times, cumulative_intensity, gaps, inverse_intensity, worker_starts


def _rate_and_cv2(times: list[float]) -> tuple[float, float]:
    g = [b - a for a, b in zip(times, times[1:])]
    mean = statistics.fmean(g)
    return 1 / mean, statistics.pvariance(g) / mean ** 2


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_arrivals_have_the_mean_rate_and_exponential_gaps(seed, rate):
    times = arrival_times(20_000, rate, seed=seed)
    got, cv2 = _rate_and_cv2(times)
    assert got == pytest.approx(rate, rel=0.03)
    assert cv2 == pytest.approx(1.0, rel=0.06)  # exponential: variance = mean²


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 8.0])
def test_gamma_arrivals_keep_the_rate_and_set_the_burstiness(burstiness):
    times = arrival_times(40_000, 2.0, burstiness=burstiness, seed=11)
    got, cv2 = _rate_and_cv2(times)
    assert got == pytest.approx(2.0, rel=0.03)
    assert cv2 == pytest.approx(1 / burstiness, rel=0.08)  # gamma(shape b): CV² = 1/b


def test_burstier_means_more_short_gaps():
    def share_short(b: float) -> float:
        g = gaps(20_000, 1.0, burstiness=b, rng=random.Random(5))
        return sum(x < 0.1 for x in g) / len(g)

    assert share_short(0.25) > share_short(1.0) > share_short(4.0)


def test_arrivals_are_seeded_sorted_and_start_at_zero():
    a = arrival_times(100, 3.0, burstiness=0.5, seed=7)
    assert a == arrival_times(100, 3.0, burstiness=0.5, seed=7)
    assert a != arrival_times(100, 3.0, burstiness=0.5, seed=8)
    assert a[0] == 0.0 and a == sorted(a) and len(a) == 100
    assert arrival_times(1, 3.0, seed=1) == [0.0]
    assert arrival_times(0, 3.0, seed=1) == []
    rng = random.Random(4)
    assert arrival_times(5, 1.0, seed=rng) != arrival_times(5, 1.0, seed=rng)  # a generator moves on


def test_ramp_intensity_is_invertible_and_continuous():
    rate, ramp = 4.0, 10.0
    assert cumulative_intensity(ramp, rate, ramp) == pytest.approx(rate * ramp / 2)
    assert cumulative_intensity(ramp + 1, rate, ramp) == pytest.approx(rate * ramp / 2 + rate)
    for t in [0.0, 0.3, 5.0, 9.99, 10.0, 10.01, 25.0]:
        assert inverse_intensity(cumulative_intensity(t, rate, ramp), rate, ramp) == pytest.approx(t)
        assert inverse_intensity(cumulative_intensity(t, rate), rate) == pytest.approx(t)
    assert cumulative_intensity(-1, rate, ramp) == 0.0 and inverse_intensity(-1, rate, ramp) == 0.0


def test_ramp_rises_linearly_then_holds_the_rate():
    rate, ramp = 200.0, 50.0
    times = arrival_times(30_000, rate, ramp_s=ramp, seed=3)
    first_half = sum(t < ramp / 2 for t in times)
    during = sum(t < ramp for t in times)
    assert during == pytest.approx(rate * ramp / 2, rel=0.03)  # Λ(R) = rR/2 = 5000
    assert first_half == pytest.approx(rate * ramp / 8, rel=0.06)  # Λ grows with t²: Λ(R/2) = Λ(R)/4
    after = [t for t in times if t >= ramp]
    assert (len(after) - 1) / (after[-1] - after[0]) == pytest.approx(rate, rel=0.03)


def test_worker_starts_spread_over_the_ramp():
    assert worker_starts(4) == [0.0, 0.0, 0.0, 0.0]
    assert worker_starts(4, 8.0) == [0.0, 2.0, 4.0, 6.0]
    assert worker_starts(1, 5.0) == [0.0]


@pytest.mark.parametrize("call", [
    lambda: arrival_times(5, 0.0), lambda: arrival_times(5, -1.0), lambda: arrival_times(5, float("inf")),
    lambda: arrival_times(5, 1.0, burstiness=0.0), lambda: arrival_times(5, 1.0, ramp_s=-1),
    lambda: worker_starts(0), lambda: worker_starts(2, -1.0), lambda: gaps(3, 1.0, burstiness=-2, rng=random.Random()),
])
def test_bad_parameters_are_refused(call):
    with pytest.raises(ValueError):
        call()
