"""Shared by the policy tests: a simulated world with known true parameters, and the
single-`k` views of the model that only the tests need.

A simulated session feeds the policy the observations that a round of the chosen `k` would
produce under known true parameters: accepted counts drawn from the geometric acceptance run
truncated at `k` (seeded `random.Random`), times exact. The converged `k` (the mode of the last
rounds, exploration rounds excluded) is compared with the brute-force argmax of the true
`E(k) / T(k)`, written here independently of the module under test; `Trace.efficiency` scores
every round of a session (probes and noisy choices included) against that optimum.
"""

from __future__ import annotations

import collections
import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from specdec.core.policy import (
    Observation,
    PolicyConfig,
    PolicyState,
    expected_tokens,
    initial_state,
    is_exploration_round,
)
from specdec.core.policy.cost import proposal_rate, round_seconds, verify_at, verify_line, verify_times
from specdec.core.policy.decision import advance

CONFIG = PolicyConfig()


# ---------------------------------------------------------------------------------------------
# The policy, one `k` at a time (production code calls `step` and `goodput_curve` instead)


def next_k(state: PolicyState, obs: Observation | None, config: PolicyConfig) -> tuple[int, PolicyState]:
    """`step` without the look-ahead choice: fold in the observation, then choose the next `k`."""
    k, new_state, _, _ = advance(state, obs, config)
    return k, new_state


def verify_time(verify_s: Sequence[float | None], k: int) -> float | None:
    """`t_v(k)` from the per-`k` table alone: its own EWMA if observed, else the fitted line."""
    return verify_at(verify_s, verify_line(verify_s), k)


def round_time(state: PolicyState, k: int, config: PolicyConfig) -> float | None:
    """Estimated wall time of a round at draft length `k`, or None if an estimate is missing."""
    if k < 0:
        raise ValueError(f"k={k} is invalid: must be >= 0")
    return round_seconds(state, config, k, state.alpha, verify_times(state, config, k)[k])


def goodput(state: PolicyState, k: int, config: PolicyConfig) -> float | None:
    """`E(k) / T(k)` with the closed-form `E(k)`, or None if unknown or `T(k)` is not positive."""
    t = round_time(state, k, config)
    if t is None or t <= 0.0:
        return None
    if k == 0:
        return config.decode_steps / t
    if state.alpha is None:
        return None
    return (1.0 + proposal_rate(state) * (expected_tokens(state.alpha, k) - 1.0)) / t


def obs(k: int, accepted: int, proposed: int | None = None, **times: float) -> Observation:
    """A round at `k` with fixed, plausible times; `times` overrides any field by name."""
    proposed = k if proposed is None else proposed
    fields: dict[str, Any] = dict(draft_wall_s=0.0, draft_compute_s=0.0, verify_wall_s=0.05, verify_compute_s=0.03)
    if k > 0:
        fields.update(draft_wall_s=0.012, draft_compute_s=0.002 * max(proposed, 1))
    fields.update(times)
    return Observation(k, proposed, accepted, **fields)


# ---------------------------------------------------------------------------------------------
# A simulated world with known true parameters


@dataclass(frozen=True)
class Regime:
    """True parameters of a pair and a network; times in seconds."""

    alpha: float
    rtt_draft_s: float
    rtt_target_s: float
    draft_token_s: float
    verify_base_s: float
    verify_per_token_s: float

    def t_v(self, k: int) -> float:
        return self.verify_base_s + self.verify_per_token_s * k

    def round_time(self, k: int, overlap: bool = False) -> float:
        if k == 0:
            return self.rtt_target_s + self.t_v(0)
        draft = self.rtt_draft_s + k * self.draft_token_s
        if not overlap:
            return draft + self.rtt_target_s + self.t_v(k)
        hit = self.alpha ** (k + 1)  # the block and the guessed bonus token
        verify = self.rtt_target_s + self.t_v(k)
        ahead = self.rtt_draft_s + (k + 1) * self.draft_token_s  # the guessed bonus token, then k
        return verify + (1 - hit) * draft + hit * max(0.0, ahead - verify)

    def goodput(self, k: int, overlap: bool = False) -> float:
        return sum(self.alpha**i for i in range(k + 1)) / self.round_time(k, overlap)

    def best_k(self, k_max: int, overlap: bool = False) -> int:
        return max(range(k_max + 1), key=lambda k: self.goodput(k, overlap))


def cpu(alpha: float, rtt_s: float, **changes: float) -> Regime:
    """CPU-like: verify grows with k, the draft is a sizeable fraction of a target step."""
    return replace(Regime(alpha, rtt_s, rtt_s, 0.057, 0.078, 0.02), **changes)


def gpu(alpha: float, rtt_s: float, **changes: float) -> Regime:
    """GPU-like: verify nearly flat in k, the draft is cheap."""
    return replace(Regime(alpha, rtt_s, rtt_s, 0.003, 0.030, 0.0005), **changes)


def observe(regime: Regime, k: int, rng: random.Random) -> Observation:
    """What a round at draft length `k` measures: exact times, a truncated geometric run."""
    if k == 0:
        t_v = regime.t_v(0)
        return Observation(0, 0, 0, 0.0, 0.0, regime.rtt_target_s + t_v, t_v)
    accepted = 0
    while accepted < k and rng.random() < regime.alpha:
        accepted += 1
    draft = k * regime.draft_token_s
    t_v = regime.t_v(k)
    return Observation(
        k, k, accepted, regime.rtt_draft_s + draft, draft, regime.rtt_target_s + t_v, t_v
    )


@dataclass(frozen=True)
class Trace:
    ks: tuple[int, ...]  # the k chosen for each round, in order
    explored: tuple[bool, ...]  # whether that choice was an exploration round
    state: PolicyState  # the state after the last choice
    regime: Regime
    config: PolicyConfig

    def efficiency(self, skip: int = 50) -> float:
        """Expected goodput of the choices after the first `skip`, over the true optimum's.

        Uses the true E(k) and T(k) of each choice (not the drawn tokens), so luck cancels;
        exploration, hysteresis and the noise of the estimates all count against it.
        """
        r, overlap = self.regime, self.config.overlap
        ks = self.ks[skip:]
        tokens = sum(r.goodput(k, overlap) * r.round_time(k, overlap) for k in ks)
        time_s = sum(r.round_time(k, overlap) for k in ks)
        return tokens / time_s / r.goodput(r.best_k(self.config.k_max, overlap), overlap)

    def converged(self, last: int = 120) -> int:
        """The mode of the last `last` choices, exploration rounds excluded (ties: smaller k)."""
        counts = collections.Counter(
            k for k, e in zip(self.ks[-last:], self.explored[-last:]) if not e
        )
        return max(sorted(counts), key=lambda k: counts[k])


def run(
    regime: Regime,
    config: PolicyConfig = CONFIG,
    rounds: int = 300,
    seed: int = 0,
    state: PolicyState | None = None,
) -> Trace:
    """Run `rounds` rounds from `state` (a fresh session by default) in the world `regime`."""
    rng = random.Random(seed)
    state = initial_state(config) if state is None else state
    ks, explored = [], []
    for _ in range(rounds):
        obs = observe(regime, state.k, rng)
        explored.append(is_exploration_round(state.rounds, config))
        k, state = next_k(state, obs, config)
        assert 0 <= k <= config.k_max and k == state.k
        ks.append(k)
    return Trace(tuple(ks), tuple(explored), state, regime, config)


@functools.cache
def session(regime: Regime, config: PolicyConfig = CONFIG, seed: int = 0) -> Trace:
    return run(regime, config, seed=seed)


def converged(regime: Regime, config: PolicyConfig = CONFIG, seed: int = 0) -> int:
    return session(regime, config, seed).converged()


def assert_probes_alternate_around_the_best(state: PolicyState, config: PolicyConfig = CONFIG) -> None:
    """A speculating state's probes: one above the best k, the next one below, none in between."""
    from specdec.core.policy import best_k, choose_k

    state = replace(state, speculating=True)
    best = best_k(state, config)
    assert 0 < best < config.k_max
    up = replace(state, rounds=config.explore_every - 1)
    down = replace(state, rounds=2 * config.explore_every - 1)
    assert (choose_k(up, config), choose_k(down, config)) == (best + 1, best - 1)
    assert choose_k(replace(state, rounds=config.explore_every), config) == best
