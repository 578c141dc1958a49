"""Deciding, on the simulated sessions of `tests/unit/policy_helpers.py`: convergence to the
brute-force optimum, exploration, back-off and overlap.
"""

from __future__ import annotations

import random

import pytest

from specdec.core.policy import (
    Observation,
    PolicyConfig,
    PolicyState,
    choose_k,
    initial_state,
    passes_before_exploration,
    step,
)
from tests.unit.policy_helpers import (
    CONFIG,
    Regime,
    assert_probes_alternate_around_the_best,
    converged,
    cpu,
    gpu,
    next_k,
    obs,
    observe,
    run,
    session,
)


def _regimes() -> list:
    params = []
    for name, make in (("cpu", cpu), ("gpu", gpu)):
        for rtt_ms in (0, 2, 10, 30):
            for alpha in (0.3, 0.6, 0.9, 0.98):
                params.append(pytest.param(make(alpha, rtt_ms / 1000), id=f"{name}-rtt{rtt_ms}-a{alpha}"))
    return params


REGIMES = _regimes()


def _decisive(regime: Regime, k_max: int) -> bool:
    """The true optimum stands out: every other k is >= 2% worse, and it is k = 0 or pays >= 5%."""
    best = regime.best_k(k_max)
    g = [regime.goodput(k) for k in range(k_max + 1)]
    others = max(g[k] for k in range(k_max + 1) if k != best)
    return others < 0.98 * g[best] and (best == 0 or g[best] >= 1.05 * g[0])


@pytest.mark.parametrize("regime", REGIMES)
def test_converges_to_the_brute_force_optimum(regime: Regime) -> None:
    k_star = regime.best_k(CONFIG.k_max)
    k = converged(regime)
    if _decisive(regime, CONFIG.k_max):
        assert k == k_star
    else:
        # A flat optimum (neighbours within 2%) or a gain within the noise of alpha's EWMA:
        # any k close in goodput will do.
        assert regime.goodput(k) >= 0.95 * regime.goodput(k_star)


def test_enough_regimes_are_decisive() -> None:
    decisive = [p for p in REGIMES if _decisive(p.values[0], CONFIG.k_max)]
    assert len(decisive) >= 16
    assert sum(p.values[0].best_k(CONFIG.k_max) > 0 for p in decisive) >= 6


@pytest.mark.parametrize("regime", REGIMES)
def test_never_much_worse_than_plain_decoding(regime: Regime) -> None:
    assert regime.goodput(converged(regime)) >= 0.97 * regime.goodput(0)


@pytest.mark.parametrize("regime", REGIMES)
def test_goodput_over_a_session_is_near_the_optimum(regime: Regime) -> None:
    """Every round counts here, probes and noisy choices included, not just the mode."""
    assert session(regime).efficiency() >= 0.94


@pytest.mark.parametrize(
    "series",
    [
        pytest.param([gpu(0.7, 0.002, rtt_target_s=r) for r in (0.0, 0.002, 0.01, 0.03, 0.06, 0.1)],
                     id="gpu-rtt-target-rises"),
        pytest.param([cpu(0.9, 0.0, rtt_target_s=r, draft_token_s=0.04) for r in (0.0, 0.01, 0.03, 0.1, 0.3)],
                     id="cpu-rtt-target-rises"),
    ],
)
def test_k_rises_with_the_target_round_trip(series: list[Regime]) -> None:
    ks = [converged(r) for r in series]
    assert ks == sorted(ks) and ks[-1] > ks[0]


@pytest.mark.parametrize(
    "series",
    [
        pytest.param([gpu(0.9, 0.01, draft_token_s=t) for t in (0.001, 0.003, 0.006, 0.01, 0.02, 0.04)],
                     id="gpu-draft-slows"),
        pytest.param([cpu(0.98, 0.002, draft_token_s=t) for t in (0.005, 0.01, 0.02, 0.04, 0.08)],
                     id="cpu-draft-slows"),
    ],
)
def test_k_falls_as_the_draft_slows(series: list[Regime]) -> None:
    ks = [converged(r) for r in series]
    assert ks == sorted(ks, reverse=True) and ks[-1] == 0 and ks[0] > 0


@pytest.mark.parametrize(
    "series",
    [
        pytest.param([gpu(a, 0.01) for a in (0.1, 0.3, 0.5, 0.7, 0.9, 0.98)], id="gpu"),
        pytest.param([cpu(a, 0.002, draft_token_s=0.01) for a in (0.2, 0.5, 0.7, 0.9, 0.98)], id="cpu-fast-draft"),
    ],
)
def test_k_rises_with_acceptance(series: list[Regime]) -> None:
    ks = [converged(r) for r in series]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] > 0


@pytest.mark.parametrize(
    "regime",
    [
        pytest.param(make(alpha, rtt, draft_token_s=factor * base), id=f"{name}-a{alpha}-rtt{rtt}-x{factor}")
        for name, make, base in (("cpu", cpu, 0.078), ("gpu", gpu, 0.030))
        for alpha in (0.6, 0.98)
        for rtt in (0.0, 0.002)
        for factor in (1.0, 2.0)
    ],
)
def test_slow_draft_gives_k0(regime: Regime) -> None:
    assert regime.best_k(CONFIG.k_max) == 0  # the premise: t_d >= t_v(0) never pays here
    assert converged(regime) == 0


@pytest.mark.parametrize("rtt", [0.0, 0.002, 0.01, 0.03])
@pytest.mark.parametrize("alpha", [0.05, 0.2])
def test_low_acceptance_gives_k0_on_cpu(alpha: float, rtt: float) -> None:
    assert converged(cpu(alpha, rtt)) == 0


def test_recovers_when_acceptance_comes_back() -> None:
    bad, good = gpu(0.1, 0.002), gpu(0.9, 0.002)
    assert bad.best_k(CONFIG.k_max) == 0 and good.best_k(CONFIG.k_max) == 8
    before = run(bad, rounds=300)
    assert before.converged() == 0 and set(before.ks[-50:]) <= {0, 1}
    after = run(good, rounds=300, state=before.state, seed=1)
    first = next(i for i, (k, e) in enumerate(zip(after.ks, after.explored)) if k > 0 and not e)
    assert first <= 2 * CONFIG.explore_every
    assert after.converged(last=100) == 8


@pytest.mark.parametrize("overlap", [False, True])
def test_step_is_next_k_then_choose_k(overlap: bool) -> None:
    """The orchestrator's one call per round (one goodput fit shared by both choices) equals the
    two calls it replaces, round by round, through probes, back-off after a draft failure and
    the hysteresis flag flipping both ways (the case where the fit cannot be shared)."""
    config = PolicyConfig(overlap=overlap)
    failed = Observation(4, 0, 0, 0.5, 0.0, 0.032, 0.030, draft_failed=True)
    rng = random.Random(5)
    state, flips, checked = initial_state(config), 0, 0
    for regime, rounds in [(gpu(0.1, 0.002), 120), (gpu(0.9, 0.002), 120), (cpu(0.2, 0.0), 120),
                           (gpu(0.95, 0.03), 60), (None, 1), (gpu(0.9, 0.0), 60)]:
        for _ in range(rounds):
            observed = failed if regime is None else observe(regime, state.k, rng)
            k, expected = next_k(state, observed, config)
            k2, ahead, got = step(state, observed, config)
            assert (k2, got) == (k, expected)
            assert ahead == choose_k(expected, config)
            flips += expected.speculating != state.speculating
            state, checked = expected, checked + 1
    assert flips >= 2 and checked == 481


def test_learns_a_draft_it_has_never_seen() -> None:
    """Starting at k0 = 0, the unknown draft is probed on the exploration schedule."""
    state = initial_state(CONFIG, k0=0)
    assert state.k == 0
    rng = random.Random(0)
    regime = gpu(0.9, 0.002)
    ks = []
    for _ in range(3 * CONFIG.explore_every):
        k, state = next_k(state, observe(regime, state.k, rng), CONFIG)
        ks.append(k)
    assert ks[: CONFIG.explore_every - 1] == [0] * (CONFIG.explore_every - 1)
    assert ks[CONFIG.explore_every - 1] == 1  # the first exploration round probes k = 1
    assert ks[-1] > 1 and state.draft_token_s == pytest.approx(0.003)


def probed_tokens(decode_steps: int, tokens: int) -> list[tuple[int, int]]:
    """(token, k) of the rounds at k > 0 over `tokens` tokens of a draft whose blocks are all rejected,
    rounds at k = 0 running up to `decode_steps` passes, each bounded by `passes_before_exploration`."""
    config = PolicyConfig(decode_steps=decode_steps)
    state, token, probes = initial_state(config, k0=0), 0, []
    k, state = next_k(state, None, config)
    while token < tokens:
        passes = min(decode_steps, passes_before_exploration(state, config)) if k == 0 else 1
        if k > 0:
            probes.append((token, k))
        token += passes
        k, state = next_k(state, obs(k, 0, passes=passes), config)
    assert state.rounds == token + 1  # every pass counted as a round
    return probes


@pytest.mark.parametrize("decode_steps", [1, 3, 4, 16, 64])
def test_rounds_of_several_passes_at_k0_explore_on_the_tokens_rounds_of_one_would(decode_steps: int) -> None:
    """At k = 0, rounds of up to `decode_steps` passes: the exploration probes come on the same tokens
    as with one pass a round (every `explore_every`-th), none swallowed by a round of several passes;
    between them, the draft's rejected blocks keep the controller at k = 0."""
    every = CONFIG.explore_every
    probes = probed_tokens(decode_steps, 8 * every)
    assert [t for t, _ in probes if t % every == every - 1] == [every * i - 1 for i in range(1, 9)]
    assert all(t % every == every - 1 for t, _ in probes[3:])


def test_observations_of_several_passes_are_at_k0() -> None:
    with pytest.raises(ValueError, match="passes"):
        obs(2, 0, passes=3)
    with pytest.raises(ValueError, match="passes"):
        obs(0, 0, passes=0)
    assert [passes_before_exploration(PolicyState(rounds=r), CONFIG)
            for r in (0, 1, 14, 15, 16, 17)] == [16, 15, 2, 1, 16, 15]


def test_draft_failure_backs_off_then_probes_k1() -> None:
    warm = run(gpu(0.9, 0.002), rounds=100).state
    assert warm.k > 0
    failed = Observation(warm.k, 0, 0, draft_wall_s=0.5, draft_compute_s=0.0,
                         verify_wall_s=0.032, verify_compute_s=0.030, draft_failed=True)
    plain = obs(0, 0, verify_wall_s=0.032, verify_compute_s=0.030)
    k, state = next_k(warm, failed, CONFIG)
    ks = [k]
    for _ in range(CONFIG.draft_failure_backoff + 1):
        k, state = next_k(state, plain if k == 0 else failed, CONFIG)
        ks.append(k)
    assert ks == [0] * CONFIG.draft_failure_backoff + [1, 0]  # the probe at k = 1 failed again
    assert state.backoff == CONFIG.draft_failure_backoff - 1
    # back again: after the back-off and the probe, speculation resumes
    rng = random.Random(0)
    for _ in range(CONFIG.draft_failure_backoff + 3):
        k, state = next_k(state, observe(gpu(0.9, 0.002), k, rng), CONFIG)
    assert k > 1 and state.backoff == 0


def test_draft_failure_without_backoff_probes_at_once() -> None:
    config = PolicyConfig(draft_failure_backoff=0)
    warm = run(gpu(0.9, 0.002), config, rounds=50).state
    failed = Observation(warm.k, 0, 0, 0.5, 0.0, 0.032, 0.030, draft_failed=True)
    k, _ = next_k(warm, failed, config)
    assert k == 1


OVERLAP = PolicyConfig(overlap=True)


@pytest.mark.parametrize(
    "regime",
    [
        pytest.param(cpu(0.98, 0.0), id="cpu-bf16-copy"),  # docs/maths.md: 57 ms draft, 78 ms step
        pytest.param(cpu(0.98, 0.002, draft_token_s=0.07), id="cpu-draft-90pct-of-a-step"),
        pytest.param(cpu(0.9, 0.0, draft_token_s=0.03), id="cpu-draft-40pct-of-verify"),
        pytest.param(cpu(0.8, 0.002, draft_token_s=0.02), id="cpu-draft-25pct-of-verify"),
        pytest.param(cpu(0.6, 0.0, draft_token_s=0.02), id="cpu-mid-acceptance"),
        pytest.param(gpu(0.9, 0.002), id="gpu-10pct"),
    ],
)
def test_overlap_picks_at_least_the_sequential_k(regime: Regime) -> None:
    k_seq, k_ovl = converged(regime), converged(regime, OVERLAP)
    assert k_ovl >= k_seq and k_ovl > 0
    best = regime.goodput(regime.best_k(CONFIG.k_max, overlap=True), overlap=True)
    assert regime.goodput(k_ovl, overlap=True) >= 0.98 * best
    assert regime.goodput(k_ovl, overlap=True) > regime.goodput(k_seq)


def test_a_draft_slower_than_a_target_step_never_pays_even_overlapped() -> None:
    """Overlapped, the draft computes every token the round emits (the bonus it guesses, then the
    block), so it bounds the pace at one token per draft step: slower than the target's own step,
    it cannot beat plain decoding whatever the acceptance."""
    regime = cpu(0.99, 0.002, draft_token_s=0.1)  # a step: 78 ms
    assert regime.best_k(CONFIG.k_max, overlap=True) == 0
    assert converged(regime, OVERLAP) == 0


@pytest.mark.parametrize(
    "regime",
    [
        pytest.param(cpu(0.9, 0.01, draft_token_s=0.01), id="cpu-draft-13pct-of-verify"),
        pytest.param(gpu(0.7, 0.01, verify_base_s=0.05), id="gpu-slow-verify"),
        pytest.param(gpu(0.6, 0.01), id="gpu-mid-acceptance"),
    ],
)
def test_overlap_can_prefer_a_shorter_block_when_the_draft_is_nearly_free(regime: Regime) -> None:
    """The model hides the draft only when the guess holds (probability alpha^(k+1)), so the
    saving alpha^(k+1) * (rtt_d + k*t_d) can shrink with k: the true overlap optimum is then
    one shorter than the sequential one, and the policy follows the truth, not the intuition."""
    assert regime.best_k(CONFIG.k_max, overlap=True) == regime.best_k(CONFIG.k_max) - 1
    k_ovl = converged(regime, OVERLAP)
    best = regime.goodput(regime.best_k(CONFIG.k_max, overlap=True), overlap=True)
    assert regime.goodput(k_ovl, overlap=True) >= 0.97 * best


@pytest.mark.parametrize("k_max", [0, 1, 3])
def test_k_never_exceeds_k_max(k_max: int) -> None:
    config = PolicyConfig(k_max=k_max)
    trace = run(gpu(0.98, 0.03), config, rounds=200)
    assert max(trace.ks) == k_max and len(trace.state.verify_s) == k_max + 1
    assert initial_state(config, k0=5).k == k_max


def test_exploration_schedule_alternates_around_the_best() -> None:
    trace = run(gpu(0.6, 0.002), rounds=300)
    probes = [(i, k) for i, (k, e) in enumerate(zip(trace.ks, trace.explored)) if e]
    assert [i % CONFIG.explore_every for i, _ in probes] == [CONFIG.explore_every - 1] * len(probes)
    assert_probes_alternate_around_the_best(trace.state)


def test_is_deterministic() -> None:
    a = run(gpu(0.7, 0.01), rounds=200, seed=3)
    b = run(gpu(0.7, 0.01), rounds=200, seed=3)
    assert a == b
