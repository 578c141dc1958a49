"""The stored form, new sessions and the global prior, and validation of the inputs."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from specdec.core.policy import Observation, PolicyConfig, PolicyState, initial_state, merge_prior, update
from tests.unit.policy_helpers import CONFIG, gpu, run

# ---------------------------------------------------------------------------------------------
# Sessions, the prior and the stored form


def test_state_round_trips_through_json() -> None:
    state = run(gpu(0.7, 0.01), rounds=40).state
    failed = Observation(state.k, 0, 0, 0.5, 0.0, 0.04, 0.03, draft_failed=True)
    for s in (PolicyState(), initial_state(CONFIG), state, update(state, failed, CONFIG), replace(state, loop_s=0.02),
              replace(state, empty_ewma=0.75)):
        d = json.loads(json.dumps(s.to_dict(), allow_nan=False))
        assert PolicyState.from_dict(d) == s


def test_from_dict_tolerates_missing_and_unknown_keys_but_not_other_versions() -> None:
    assert PolicyState.from_dict({"k": 3, "extra": 1}) == PolicyState(k=3)
    with pytest.raises(ValueError):
        PolicyState.from_dict({"version": 99})


def test_initial_state_from_a_prior() -> None:
    session = run(gpu(0.9, 0.01), rounds=100).state
    prior = merge_prior(None, session)
    fresh = initial_state(CONFIG, prior)
    assert fresh.rounds == 0 and fresh.backoff == 0 and not fresh.resume_probe
    assert (fresh.alpha, fresh.rtt_target_s, fresh.verify_s) == (session.alpha, session.rtt_target_s, session.verify_s)
    assert fresh.k == 8  # the prior's best, not k0
    assert initial_state(CONFIG).k == 2 and initial_state(CONFIG, PolicyState()).k == 2
    with pytest.raises(ValueError):
        initial_state(CONFIG, k0=-1)


def test_merge_prior_is_an_ewma() -> None:
    a = PolicyState(rounds=10, alpha=0.5, accepted_ewma=1.0, rejected_ewma=1.0, rtt_draft_s=0.01,
                    rtt_target_s=None, draft_token_s=0.004, verify_s=(0.03, None, 0.05), empty_ewma=0.2)
    b = PolicyState(rounds=5, alpha=0.75, accepted_ewma=3.0, rejected_ewma=1.0, rtt_draft_s=0.03,
                    rtt_target_s=0.02, draft_token_s=None, verify_s=(0.05, 0.04, None, 0.06),
                    backoff=3, resume_probe=True, empty_ewma=0.6)
    m = merge_prior(a, b, weight=0.25)
    assert m.accepted_ewma == pytest.approx(1.5) and m.rejected_ewma == pytest.approx(1.0)
    assert m.alpha == pytest.approx(0.6)
    assert m.rtt_draft_s == pytest.approx(0.015) and m.empty_ewma == pytest.approx(0.3)
    assert m.rtt_target_s == 0.02 and m.draft_token_s == 0.004  # one side unknown
    assert m.verify_s == pytest.approx((0.035, 0.04, 0.05, 0.06))
    assert m.rounds == 15 and m.backoff == 0 and not m.resume_probe
    assert merge_prior(a, b, weight=1.0).rtt_draft_s == 0.03
    assert merge_prior(None, b).backoff == 0
    # repeated merges of the same session converge to it
    p = a
    for _ in range(200):
        p = merge_prior(p, b, weight=0.1)
    assert p.alpha == pytest.approx(0.75) and p.rtt_draft_s == pytest.approx(0.03)
    with pytest.raises(ValueError):
        merge_prior(a, b, weight=0.0)


# ---------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    "fields",
    [
        {"k_max": -1},
        {"k_max": 2.5},
        {"ewma": 0.0},
        {"ewma": 1.5},
        {"explore_every": 1},
        {"min_gain": 0.99},
        {"min_gain": math.inf},
        {"draft_failure_backoff": -1},
        {"decode_steps": 0},
    ],
)
def test_invalid_configs_raise(fields: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(fields))):
        PolicyConfig(**fields)


@pytest.mark.parametrize(
    "args",
    [
        (-1, 0, 0, 0.0, 0.0, 0.1, 0.1),
        (2, 3, 0, 0.1, 0.1, 0.1, 0.1),
        (2, 2, 3, 0.1, 0.1, 0.1, 0.1),
        (2, 2, 1, -0.1, 0.1, 0.1, 0.1),
        (2, 2, 1, 0.1, 0.1, math.nan, 0.1),
    ],
)
def test_invalid_observations_raise(args: tuple) -> None:
    with pytest.raises(ValueError):
        Observation(*args)


@pytest.mark.parametrize("field", ["drafted", "draft_prefill_tokens", "verify_prefill_tokens"])
@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_invalid_token_counts_raise(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        Observation(2, 2, 1, 0.1, 0.1, 0.1, 0.1, **{field: value})
