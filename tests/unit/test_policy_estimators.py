"""Learning: how each round's observation moves the estimates of a `PolicyState`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specdec.core.policy import (
    ALPHA_MAX,
    Observation,
    PolicyConfig,
    PolicyState,
    alpha_upper,
    best_k,
    initial_state,
    update,
)
from tests.unit.policy_helpers import CONFIG, cpu, obs, round_time, run


def test_acceptance_counts_truncated_runs() -> None:
    config = PolicyConfig(ewma=1.0)  # keep only the last round: S and F are its counts
    s = update(PolicyState(), obs(4, 4), config)
    assert (s.accepted_ewma, s.rejected_ewma, s.alpha) == (4.0, 0.0, ALPHA_MAX)  # clamped
    s = update(s, obs(4, 1), config)
    assert (s.accepted_ewma, s.rejected_ewma) == (1.0, 1.0) and s.alpha == 0.5
    s = update(s, obs(3, 0), config)
    assert s.alpha == 0.0


def test_acceptance_ewma_weighs_rounds_by_age() -> None:
    config = PolicyConfig(ewma=0.5)
    s = update(PolicyState(), obs(2, 2), config)  # S = 1.0, F = 0: the first round is not inflated
    s = update(s, obs(2, 0), config)  # S = 0.5, F = 0.5
    assert (s.accepted_ewma, s.rejected_ewma, s.alpha) == (0.5, 0.5, 0.5)


def test_rounds_that_propose_nothing_say_nothing_about_alpha() -> None:
    s = update(PolicyState(), obs(4, 2), CONFIG)
    for o in (obs(0, 0), obs(4, 0, proposed=0)):
        t = update(s, o, CONFIG)
        assert (t.alpha, t.accepted_ewma, t.rejected_ewma) == (s.alpha, s.accepted_ewma, s.rejected_ewma)


def test_update_learns_round_trips_and_compute_times() -> None:
    o = Observation(4, 3, 1, draft_wall_s=0.020, draft_compute_s=0.006,
                    verify_wall_s=0.050, verify_compute_s=0.035)
    s = update(initial_state(CONFIG), o, CONFIG)
    assert s.rtt_draft_s == pytest.approx(0.014)
    assert s.draft_token_s == pytest.approx(0.002)  # per *proposed* token
    assert s.rtt_target_s == pytest.approx(0.015)
    assert s.verify_s[3] == pytest.approx(0.035) and s.verify_s[4] is None  # 3 were verified
    assert len(s.verify_s) == CONFIG.k_max + 1
    s2 = update(s, replace(o, verify_wall_s=0.060, verify_compute_s=0.045), CONFIG)
    assert s2.rtt_target_s == pytest.approx(0.015)
    assert s2.verify_s[3] == pytest.approx(0.8 * 0.035 + 0.2 * 0.045)
    # wall below compute (clock skew) never gives a negative round trip
    s3 = update(s, replace(o, draft_wall_s=0.001), CONFIG)
    assert s3.rtt_draft_s == pytest.approx(0.8 * 0.014)


def test_a_round_that_prefilled_teaches_round_trips_but_no_per_token_cost() -> None:
    """A session's first round (or a lost cache) prefills the history: that compute is not the
    cost of drafting or verifying k tokens, and read as one it parks a good draft at k = 0."""
    o = Observation(4, 4, 4, draft_wall_s=0.020, draft_compute_s=0.008,
                    verify_wall_s=0.050, verify_compute_s=0.035)
    steady = update(initial_state(CONFIG), o, CONFIG)
    prefilled = replace(o, draft_wall_s=1.212, draft_compute_s=1.2, verify_wall_s=0.415, verify_compute_s=0.4,
                        draft_prefill_tokens=40, verify_prefill_tokens=40)
    after = update(steady, prefilled, CONFIG)
    assert after.draft_token_s == steady.draft_token_s and after.verify_s == steady.verify_s
    assert after.rtt_draft_s == pytest.approx(0.8 * 0.012 + 0.2 * 0.012)  # round trips still learnt
    assert after.rtt_target_s == pytest.approx(0.015)
    # The usual catch-up (the accepted tokens and the bonus) is a steady round.
    caught_up = update(steady, replace(o, draft_compute_s=0.016, draft_prefill_tokens=2, verify_prefill_tokens=1),
                       CONFIG)
    assert caught_up.draft_token_s == pytest.approx(0.8 * 0.002 + 0.2 * 0.004)
    # With nothing better known, t_d is seeded from the prefilling call, spread over all it processed.
    first = update(initial_state(CONFIG), prefilled, CONFIG)
    assert first.draft_token_s == pytest.approx(1.2 / 44) and first.verify_s[4] is None


def test_a_block_drafted_ahead_is_charged_per_token_computed() -> None:
    """Overlapped, the draft computes the bonus token it guesses before the block: the block's
    compute covers k + 1 tokens, and t_d divided by k alone would read (k + 1) / k too slow."""
    o = Observation(2, 2, 2, draft_wall_s=0.5, draft_compute_s=0.21, verify_wall_s=0.3, verify_compute_s=0.25,
                    drafted=3)
    assert update(initial_state(CONFIG), o, CONFIG).draft_token_s == pytest.approx(0.07)


def test_update_ignores_the_draft_when_not_called_or_failed() -> None:
    s = update(initial_state(CONFIG), obs(0, 0), CONFIG)
    assert s.rtt_draft_s is None and s.draft_token_s is None and s.rtt_target_s is not None
    failed = Observation(3, 0, 0, draft_wall_s=0.5, draft_compute_s=0.0, verify_wall_s=0.05,
                         verify_compute_s=0.03, draft_failed=True)
    s = update(s, failed, CONFIG)
    assert s.rtt_draft_s is None and s.backoff == CONFIG.draft_failure_backoff


def test_optimism_is_bounded_and_shrinks_with_evidence() -> None:
    few = update(PolicyState(), obs(4, 2), CONFIG)
    many = few
    for _ in range(60):
        many = update(many, obs(4, 2), CONFIG)
    assert few.alpha == pytest.approx(many.alpha)
    assert many.alpha < alpha_upper(many, CONFIG) < alpha_upper(few, CONFIG) <= ALPHA_MAX
    assert alpha_upper(PolicyState(), CONFIG) is None


def test_the_orchestrators_own_time_per_round_is_learnt_and_spread_over_longer_blocks() -> None:
    """Saving the session and streaming a chunk cost the same per round whatever k: learnt from
    the gaps between rounds, it is added to every T(k), so it favours longer blocks."""
    state = run(cpu(0.9, 0.01, draft_token_s=0.04), rounds=60).state
    o = Observation(2, 2, 2, 0.05, 0.04, 0.2, 0.19, loop_s=0.05)
    learnt = update(replace(state, loop_s=None), o, CONFIG)
    assert learnt.loop_s == pytest.approx(0.05)
    assert update(learnt, replace(o, loop_s=0.0), CONFIG).loop_s == learnt.loop_s  # 0: not measured
    for k in (0, 1, 4):
        slow = round_time(replace(state, loop_s=0.3), k, CONFIG)
        assert slow == pytest.approx(round_time(replace(state, loop_s=None), k, CONFIG) + 0.3)
    ks = [best_k(replace(state, loop_s=s), CONFIG) for s in (0.0, 0.05, 0.2, 1.0)]
    assert ks == sorted(ks) and ks[-1] > ks[0], ks


def test_the_empty_share_counts_the_rounds_that_asked_the_draft() -> None:
    config = PolicyConfig(ewma=0.5)
    s = update(PolicyState(), obs(0, 0), config)
    assert s.empty_ewma is None  # a round at k = 0 asked nothing
    s = update(s, obs(4, 0, proposed=0), config)
    assert s.empty_ewma == 1.0
    s = update(s, obs(4, 1, proposed=2), config)
    assert s.empty_ewma == 0.5
    s = update(s, obs(4, 0, proposed=0, draft_failed=True), config)
    assert s.empty_ewma == 0.5  # a failed call says nothing about what the draft finds


def test_a_block_answered_from_a_pass_run_ahead_times_a_pass_that_verified_nothing() -> None:
    config = PolicyConfig(ewma=1.0)
    s = update(PolicyState(), obs(4, 0, proposed=3, verify_compute_s=0.006, verified_ahead=True), config)
    assert s.verify_s[0] == 0.006 and s.verify_s[3] is None
    s = update(s, obs(4, 0, proposed=3, verify_compute_s=0.009), config)
    assert s.verify_s[0] == 0.006 and s.verify_s[3] == 0.009
