"""Deciding: the goodput argmax with hysteresis, exploration probes and back-off, and `step`.

`step(state, obs, config) -> (k, k_ahead, state)` is the whole per-round call. See docs/policy.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from specdec.core.policy.cost import curve_at, verify_times
from specdec.core.policy.estimators import alpha_upper, update
from specdec.core.policy.state import Observation, PolicyConfig, PolicyState

Best = tuple[int | None, int | None]
"""`(best_k, best positive k)` of one goodput fit; None where nothing is known."""


def is_exploration_round(rounds: int, config: PolicyConfig) -> bool:
    """True on the rounds that probe a neighbour of the best `k`: the last of every `explore_every`.

    The same under load: the target packs a pass's rows end to end, so a probe adds only its
    own positions to the pass, not a wider row for every session in it."""
    return rounds % config.explore_every == config.explore_every - 1


def passes_before_exploration(state: PolicyState, config: PolicyConfig) -> int:
    """The most passes (tokens) the round just chosen may run at `k = 0` (`PolicyConfig.decode_steps`)
    before the next exploration round is due: its passes count as rounds (`Observation.passes`),
    and none of them may stand in for an exploration round."""
    return (config.explore_every - 1 - state.rounds) % config.explore_every + 1


def best_k(state: PolicyState, config: PolicyConfig) -> int | None:
    """The estimated goodput argmax over `0..k_max` with hysteresis; None if nothing is known.

    The best `k > 0` is the argmax of the estimated goodput (ties: the smaller `k`); `k`s
    whose goodput is unknown (no draft or acceptance estimate yet) are skipped, so an unknown
    draft gives 0 and exploration then probes `k = 1`. Whether it replaces `k = 0` is judged
    at an optimistic acceptance (`alpha_upper`), with the `min_gain` band around it:

    - not speculating: speculate when the optimistic best goodput is `>= min_gain * g(0)`;
    - speculating: stop only when `g(0) > min_gain *` the optimistic best goodput.

    Why optimistic: `alpha` is an EWMA over a handful of rounds, hence noisy, and while at
    `k = 0` it is refreshed only by exploration probes; judged at the bare estimate, a few
    unlucky rounds would park a profitable draft at 0 for a long time. A draft that clearly
    does not pay (low acceptance, slow draft) still falls to 0: the bound is tight once the
    estimate rests on many draft tokens, and no acceptance can rescue a draft that is too slow.
    """
    return best_ks(state, config)[0]


def best_ks(state: PolicyState, config: PolicyConfig) -> Best:
    """`(best_k, best positive k)`, sharing one fit of the verify times."""
    t_vs = verify_times(state, config)
    curve = curve_at(state, config, state.alpha, t_vs)
    base, best = curve[0], _argmax_positive(curve)
    if best is None:
        return (None if base is None else 0), None
    if base is None:
        return best, best
    optimistic = curve_at(state, config, alpha_upper(state, config), t_vs)
    upper = max((g for g in optimistic[1:] if g is not None), default=0.0)
    if state.speculating:
        return (best if upper * config.min_gain >= base else 0), best
    return (best if upper >= config.min_gain * base else 0), best


def _argmax_positive(curve: Sequence[float | None]) -> int | None:
    """The `k >= 1` with the highest known goodput (ties: the smaller), None if none is known."""
    best, best_g = None, None
    for k in range(1, len(curve)):
        g = curve[k]
        if g is not None and (best_g is None or g > best_g):
            best, best_g = k, g
    return best


def choose_k(state: PolicyState, config: PolicyConfig) -> int:
    """The draft length for the round `state.rounds` (0-based). In order of precedence:

    1. back-off after a draft failure: 0 while `state.backoff > 0`, then one probe at `k = 1`;
    2. nothing measured yet: keep `state.k` (a new session's `k0`) to gather data;
    3. exploration: on rounds where `rounds % explore_every == explore_every - 1`, a neighbour of
       the best `k`: `best + 1` on even exploration rounds and `best - 1` on odd ones
       (`(rounds // explore_every) % 2`), the other one at the ends of `[0, k_max]`; when the
       best is `0`, the best `k > 0` by estimated goodput (`1` while that is unknown), so a
       dead, unknown or unhelpful draft keeps being retried at the length that would replace 0;
    4. otherwise the best `k` (`best_k`).
    """
    return choose(state, config)[0]


def choose(state: PolicyState, config: PolicyConfig, best: Best | None = None) -> tuple[int, bool | None]:
    """`(k, speculating)`: the choice and the `speculating` flag it leaves (None = unchanged).

    `best`: `best_ks(state, config)` when the caller has it already.
    """
    if config.k_max == 0 or state.backoff > 0:
        return 0, False
    if state.resume_probe:
        return 1, False
    k, best_positive = best_ks(state, config) if best is None else best
    if k is None:
        return min(state.k, config.k_max), None
    if not is_exploration_round(state.rounds, config):
        return k, k > 0
    if k == 0:
        return best_positive or 1, None
    up = (state.rounds // config.explore_every) % 2 == 0
    if k == config.k_max or not up:
        return k - 1, None
    return k + 1, None


def step(
    state: PolicyState, obs: Observation | None, config: PolicyConfig
) -> tuple[int, int, PolicyState]:
    """One policy round: `(k, k_ahead, state)`.

    Folds in the last round's observation (if any) and chooses `k` for the next round; the state
    returned has `state.k = k`, the round counted, one back-off round spent and the post-back-off
    probe consumed when it was taken. `k_ahead` is `choose_k` of that state: the draft length of
    the round after (the block an overlapped draft proposes ahead, during the current round's verify).
    One goodput fit serves both choices whenever the step left the hysteresis flag as it was (the
    only input of the fit a step changes; a back-off clears it without consulting the fit).
    """
    k, s, best, fitted_flag = advance(state, obs, config)
    return k, choose(s, config, best if s.speculating == fitted_flag else None)[0], s


def advance(
    state: PolicyState, obs: Observation | None, config: PolicyConfig
) -> tuple[int, PolicyState, Best | None, bool]:
    """`step` without `k_ahead`: `(k, next state, best_ks of the state the choice was made on
    (None: not fitted), that state's flag)`."""
    s = update(state, obs, config) if obs is not None else state
    if obs is not None and obs.passes > 1:
        s = replace(s, rounds=s.rounds + obs.passes - 1)  # the further passes count as rounds at k = 0
    # The fit, unless the choice will not consult it (no draft allowed, back-off, its probe).
    best = best_ks(s, config) if config.k_max > 0 and s.backoff <= 0 and not s.resume_probe else None
    k, speculating = choose(s, config, best)
    in_backoff = s.backoff > 0
    return k, replace(
        s,
        k=k,
        rounds=s.rounds + 1,
        backoff=s.backoff - 1 if in_backoff else 0,
        resume_probe=s.resume_probe and in_backoff,
        speculating=s.speculating if speculating is None else speculating,
    ), best, s.speculating
