"""The cost model: `E(k)`, the verify-time fit, `T(k)` and goodput on hand-computed states."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specdec.core.policy import PolicyConfig, PolicyState, expected_tokens, goodput_curve, guess_ahead_pays
from tests.unit.policy_helpers import CONFIG, goodput, gpu, round_time, run, verify_time


@pytest.mark.parametrize(
    "alpha, k, expected",
    [
        pytest.param(0.0, 0, 1.0, id="a0-k0"),
        pytest.param(0.0, 5, 1.0, id="a0-k5"),
        pytest.param(0.5, 0, 1.0, id="a.5-k0"),
        pytest.param(0.5, 1, 1.5, id="a.5-k1"),
        pytest.param(0.5, 3, 1.875, id="a.5-k3"),
        pytest.param(0.9, 1, 1.9, id="a.9-k1"),
        pytest.param(0.9, 4, 4.0951, id="a.9-k4"),
        pytest.param(1.0, 0, 1.0, id="a1-k0"),
        pytest.param(1.0, 4, 5.0, id="a1-k4"),
        pytest.param(1.0 - 1e-12, 4, 5.0, id="a-near-1"),
    ],
)
def test_expected_tokens(alpha: float, k: int, expected: float) -> None:
    assert expected_tokens(alpha, k) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("alpha, k", [(0.5, -1), (-0.1, 2), (1.1, 2)])
def test_expected_tokens_rejects_bad_input(alpha: float, k: int) -> None:
    with pytest.raises(ValueError):
        expected_tokens(alpha, k)


# A hand-computed state: verify observed at k = 0 (30 ms) and k = 2 (40 ms): 5 ms per token.
HAND = PolicyState(
    alpha=0.5,
    rtt_draft_s=0.01,
    rtt_target_s=0.02,
    draft_token_s=0.005,
    verify_s=(0.03, None, 0.04) + (None,) * 6,
)


@pytest.mark.parametrize(
    "state, k, overlap, expected_t",
    [
        pytest.param(HAND, 0, False, 0.02 + 0.03, id="k0-no-draft-call"),
        pytest.param(HAND, 1, False, 0.01 + 0.005 + 0.02 + 0.035, id="k1-interpolated"),
        pytest.param(HAND, 2, False, 0.01 + 0.010 + 0.02 + 0.04, id="k2-observed"),
        pytest.param(HAND, 4, False, 0.01 + 0.020 + 0.02 + 0.05, id="k4-extrapolated"),
        pytest.param(HAND, 0, True, 0.02 + 0.03, id="overlap-k0"),
        # the ahead draft (25 ms) < verify 60 ms: hidden when the guess holds (the block and the
        # bonus token: 1/8), the 20 ms draft paid in full otherwise
        pytest.param(HAND, 2, True, 0.02 + 0.04 + (7 / 8) * 0.02, id="overlap-k2-hidden"),
        # the ahead draft (110 ms) > verify 70 ms: the excess shows even when the guess holds (1/32)
        pytest.param(
            replace(HAND, draft_token_s=0.02), 4, True,
            0.02 + 0.05 + (31 / 32) * 0.09 + (1 / 32) * 0.04, id="overlap-k4-draft-longer",
        ),
    ],
)
def test_round_time_and_goodput_on_a_hand_computed_state(
    state: PolicyState, k: int, overlap: bool, expected_t: float
) -> None:
    config = PolicyConfig(overlap=overlap)
    assert round_time(state, k, config) == pytest.approx(expected_t, rel=1e-12)
    expected_e = 1.0 if k == 0 else (1 - 0.5 ** (k + 1)) / 0.5
    assert goodput(state, k, config) == pytest.approx(expected_e / expected_t, rel=1e-12)
    assert goodput_curve(state, config)[k] == pytest.approx(expected_e / expected_t, rel=1e-12)


def test_a_round_at_k0_of_several_passes_pays_its_round_trip_once_for_its_tokens() -> None:
    """`decode_steps` n: T(0) = L + rtt_t + n t_v(0) for n tokens; k > 0 is priced as before, so k = 2
    (1.75 tokens in 80 ms) beats one pass a round (1 in 50 ms) and loses to 8 (8 in 260 ms)."""
    state = replace(HAND, loop_s=0.001)
    for steps, k0 in ((1, 1 / 0.051), (4, 4 / 0.141), (8, 8 / 0.261)):
        config = PolicyConfig(decode_steps=steps)
        assert round_time(state, 0, config) == pytest.approx(0.001 + 0.02 + steps * 0.03, rel=1e-12)
        curve = goodput_curve(state, config)
        assert curve[0] == pytest.approx(k0, rel=1e-12) == goodput(state, 0, config)
        assert curve[2] == pytest.approx(1.75 / 0.081, rel=1e-12)
    assert goodput_curve(state, PolicyConfig(decode_steps=1))[2] > goodput_curve(state, PolicyConfig())[0]
    assert goodput_curve(state, PolicyConfig(decode_steps=8))[2] < goodput_curve(
        state, PolicyConfig(decode_steps=8))[0]


@pytest.mark.parametrize("overlap", [False, True])
def test_goodput_curve_matches_goodput(overlap: bool) -> None:
    config = PolicyConfig(overlap=overlap)
    state = run(gpu(0.8, 0.01), config, rounds=60).state
    curve = goodput_curve(state, config)
    assert curve == pytest.approx([goodput(state, k, config) for k in range(config.k_max + 1)], rel=1e-12)
    assert goodput_curve(replace(state, alpha=None), config)[1:] == [None] * config.k_max


@pytest.mark.parametrize(
    "state, k, overlap",
    [
        pytest.param(PolicyState(), 0, False, id="nothing-known"),
        pytest.param(replace(HAND, rtt_target_s=None), 0, False, id="no-target-rtt"),
        pytest.param(replace(HAND, rtt_draft_s=None), 1, False, id="no-draft-rtt"),
        pytest.param(replace(HAND, draft_token_s=None), 1, False, id="no-draft-time"),
        pytest.param(replace(HAND, alpha=None), 1, True, id="overlap-needs-alpha"),
        pytest.param(replace(HAND, verify_s=(None,) * 9), 0, False, id="no-verify"),
    ],
)
def test_round_time_is_none_when_an_estimate_is_missing(
    state: PolicyState, k: int, overlap: bool
) -> None:
    config = PolicyConfig(overlap=overlap)
    assert round_time(state, k, config) is None
    assert goodput(state, k, config) is None


def test_goodput_needs_alpha_for_k_above_0_and_guards_zero_time() -> None:
    assert round_time(replace(HAND, alpha=None), 1, CONFIG) is not None
    assert goodput(replace(HAND, alpha=None), 1, CONFIG) is None
    assert goodput(replace(HAND, alpha=None), 0, CONFIG) == pytest.approx(20.0)
    zero = PolicyState(alpha=0.5, rtt_draft_s=0.0, rtt_target_s=0.0, draft_token_s=0.0,
                       verify_s=(0.0,))
    assert round_time(zero, 3, CONFIG) == 0.0
    assert goodput(zero, 0, CONFIG) is None and goodput(zero, 3, CONFIG) is None


@pytest.mark.parametrize(
    "verify_s, k, expected",
    [
        pytest.param((), 3, None, id="nothing-observed"),
        pytest.param((None, None, 0.05), 0, 0.05, id="single-point-is-flat-below"),
        pytest.param((None, None, 0.05), 7, 0.05, id="single-point-is-flat-above"),
        pytest.param((0.03, None, 0.04), 1, 0.035, id="interpolated"),
        pytest.param((0.03, None, 0.04), 8, 0.07, id="extrapolated"),
        pytest.param((0.03, 0.05, 0.04), 1, 0.05, id="observed-k-uses-its-own-ewma"),
        pytest.param((None, 0.10, 0.11, 0.15, None), 4, 0.12 + 0.025 * 2, id="least-squares"),
        pytest.param((0.10, 0.11, 0.15, None), 3, 0.19, id="k0-left-out-once-two-longer-blocks-are-known"),
        pytest.param((0.124, 0.203, None), 5, 0.124 + 0.079 * 5, id="k0-kept-with-one-longer-block"),
        pytest.param((0.124, 0.203, 0.237, None, None, None), 5, 0.203 + 0.034 * 4,
                     id="cpu-shape-jump-then-flat"),
        pytest.param((None, 0.05, None, 0.03), 5, 0.04, id="negative-slope-becomes-flat"),
        pytest.param((None, None, 0.001, 0.05), 0, 0.0, id="never-negative"),
    ],
)
def test_verify_time(verify_s: tuple, k: int, expected: float | None) -> None:
    got = verify_time(verify_s, k)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected, abs=1e-12)


# ---------------------------------------------------------------------------------------------
# Verifying the round after this one ahead when the next round asks the draft


@pytest.mark.parametrize(
    "empty, rtt_draft, rtt_target, t_v0, pays",
    [
        pytest.param(0.8, 0.002, 0.001, 0.006, True, id="chat: mostly empty"),  # .8 * 3 > .2 * 4
        pytest.param(0.2, 0.002, 0.001, 0.006, False, id="code: mostly blocks"),  # .2 * 3 < .8 * 4
        pytest.param(0.5, 0.002, 0.001, 0.005, False, id="tie"),  # .5 * 3 == .5 * 3: not worth it
        pytest.param(0.5, 0.002, 0.001, 0.0049, True, id="past the tie"),
        pytest.param(0.1, 0.008, 0.001, 0.006, True, id="a draft call longer than the pass costs nothing"),
        pytest.param(0.0, 0.008, 0.001, 0.006, False, id="never empty"),
        pytest.param(1.0, 0.0, 0.0, 0.006, False, id="nothing to hide"),
    ],
)
def test_guess_ahead_pays_weighs_the_hidden_round_trips_against_the_pass_a_block_waits_out(
        empty: float, rtt_draft: float, rtt_target: float, t_v0: float, pays: bool) -> None:
    state = PolicyState(empty_ewma=empty, rtt_draft_s=rtt_draft, rtt_target_s=rtt_target, verify_s=(t_v0, 0.01))
    assert guess_ahead_pays(state) is pays


def test_guess_ahead_pays_only_once_its_estimates_are_known() -> None:
    known = PolicyState(empty_ewma=0.9, rtt_draft_s=0.002, rtt_target_s=0.001, verify_s=(0.006,))
    assert guess_ahead_pays(known)
    for unknown in (replace(known, empty_ewma=None), replace(known, rtt_draft_s=None),
                    replace(known, rtt_target_s=None), replace(known, verify_s=()), replace(known, verify_s=(None,)),
                    replace(known, empty_ewma=float("nan")), replace(known, empty_ewma=5.0)):
        assert not guess_ahead_pays(unknown)
