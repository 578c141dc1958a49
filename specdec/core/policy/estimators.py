"""Learning: fold each round's observation into the EWMA estimates of a `PolicyState`.

`update` is the only writer of the estimates; `alpha_upper` is the optimistic acceptance the
decision judges speculation at. See docs/policy.md.
"""

from __future__ import annotations

import math
from dataclasses import replace

from specdec.core.policy.state import Observation, PolicyConfig, PolicyState, padded

ALPHA_MAX = 0.999  # acceptance estimates are clamped to [0, ALPHA_MAX]

CATCH_UP_TOKENS = 2
"""A call that (re-)prefilled more history tokens than this (a new session, a lost cache, a draft
cache left behind while the draft was not called) is not a steady round: its compute teaches the
per-token draft cost and the verify cost per `k` nothing (round trips it still does)."""


def ewma(old: float | None, new: float, weight: float) -> float:
    """EWMA step; the first observation initialises it."""
    return new if old is None else old + weight * (new - old)


def acceptance(accepted: float | None, rejected: float | None, fallback: float | None) -> float | None:
    """`S / (S + F)` clamped to [0, ALPHA_MAX]; `fallback` when the EWMAs say nothing."""
    if accepted is None or rejected is None or accepted + rejected <= 0.0:
        return fallback
    return min(ALPHA_MAX, max(0.0, accepted / (accepted + rejected)))


def alpha_upper(state: PolicyState, config: PolicyConfig) -> float | None:
    """An optimistic acceptance: the Wilson upper bound at one standard error on `alpha`.

    The draft tokens judged behind the estimate are counted as `(S + F) * (2 - ewma) / ewma`:
    tokens judged per round times the effective number of rounds an EWMA averages over.
    """
    s, f, a = state.accepted_ewma, state.rejected_ewma, state.alpha
    if a is None or s is None or f is None or s + f <= 0.0:
        return a
    n = (s + f) * (2.0 - config.ewma) / config.ewma
    upper = (a + 0.5 / n + math.sqrt(a * (1.0 - a) / n + 0.25 / (n * n))) / (1.0 + 1.0 / n)
    return min(ALPHA_MAX, max(a, upper))


def update(state: PolicyState, obs: Observation, config: PolicyConfig) -> PolicyState:
    """Fold one round's observation into the estimates (does not choose `k` or count the round).

    - Acceptance: see `_fold_acceptance`. Rounds that proposed nothing say nothing about `alpha`.
    - Round trips are wall minus compute (and minus the verify's queue wait), clamped at 0. The
      batch size and the queue wait over the compute feed `B` and `q`. The draft's estimates
      come only from rounds that called it and did not fail (`_fold_draft`).
    - Per-token costs come from steady rounds only: a call that (re-)prefilled more than
      `CATCH_UP_TOKENS` history tokens (the first round of a session, a lost cache) leaves `t_d`
      and `t_v(k)` alone (`t_d` is seeded from it when nothing better is known).
    - Verify compute goes to the EWMA for the number of tokens the target actually verified;
      the (positions, compute) pair of the pass, when the target reports positions, goes to the
      moments of the pass-cost line.
    - A draft failure starts the back-off (`draft_failure_backoff` rounds at `k = 0`).
    """
    w = config.ewma
    accepted, rejected, alpha = _fold_acceptance(state, obs, w)
    rtt_draft, draft_token, rate = _fold_draft(state, obs, w)
    empty = state.empty_ewma
    if obs.k > 0 and not obs.draft_failed:
        empty = ewma(empty, 0.0 if obs.proposed else 1.0, w)
    rtt_target = ewma(state.rtt_target_s,
                      max(0.0, obs.verify_wall_s - obs.verify_compute_s - obs.verify_queue_s), w)
    queue_ratio = state.queue_ratio
    if obs.verify_compute_s > 0.0:
        queue_ratio = ewma(queue_ratio, obs.verify_queue_s / obs.verify_compute_s, w)
    failed = obs.draft_failed
    return replace(
        state,
        alpha=alpha,
        accepted_ewma=accepted,
        rejected_ewma=rejected,
        rtt_draft_s=rtt_draft,
        rtt_target_s=rtt_target,
        draft_token_s=draft_token,
        verify_s=_fold_verify(state, obs, config),
        batch_ewma=ewma(state.batch_ewma, float(obs.batch_size), w),
        queue_ratio=queue_ratio,
        proposal_rate=rate,
        empty_ewma=empty,
        pass_moments=_fold_pass(state, obs, config),
        loop_s=ewma(state.loop_s, obs.loop_s, w) if obs.loop_s > 0.0 else state.loop_s,
        backoff=config.draft_failure_backoff if failed else state.backoff,
        resume_probe=True if failed else state.resume_probe,
        speculating=False if failed else state.speculating,
    )


def _fold_acceptance(
    state: PolicyState, obs: Observation, w: float
) -> tuple[float | None, float | None, float | None]:
    """`(accepted_ewma, rejected_ewma, alpha)` after the round.

    A round with `proposed = n > 0` and `accepted = a` counts `a` successes and one failure if
    `a < n` (the block was cut short), none otherwise; the EWMAs of both give `alpha = S / (S + F)`,
    the estimator of a geometric acceptance run truncated at `n`.
    """
    if obs.proposed == 0:
        return state.accepted_ewma, state.rejected_ewma, state.alpha
    # Both start from 0 rather than from the first round: their ratio then weighs every
    # round by (1 - ewma)^age, instead of letting the first round count for 1/ewma rounds.
    accepted = ewma(state.accepted_ewma or 0.0, float(obs.accepted), w)
    rejected = ewma(state.rejected_ewma or 0.0, 1.0 if obs.accepted < obs.proposed else 0.0, w)
    return accepted, rejected, acceptance(accepted, rejected, state.alpha)


def _fold_draft(
    state: PolicyState, obs: Observation, w: float
) -> tuple[float | None, float | None, float | None]:
    """`(rtt_draft_s, draft_token_s, proposal_rate)` after the round.

    Learnt only from rounds that called the draft (`k >= 1`) and did not fail; `t_d` only when
    tokens were proposed; `rho` is the EWMA of proposed / k.
    """
    rtt_draft, draft_token, rate = state.rtt_draft_s, state.draft_token_s, state.proposal_rate
    if obs.k == 0 or obs.draft_failed:
        return rtt_draft, draft_token, rate
    rate = ewma(rate, obs.proposed / obs.k, w)
    rtt_draft = ewma(rtt_draft, max(0.0, obs.draft_wall_s - obs.draft_compute_s), w)
    drafted = max(obs.proposed, obs.drafted)
    if obs.proposed > 0 and obs.draft_prefill_tokens <= CATCH_UP_TOKENS:
        draft_token = ewma(draft_token, obs.draft_compute_s / drafted, w)
    elif obs.proposed > 0 and draft_token is None:
        # Only a call that also prefilled has been seen: spread its compute over every token
        # it processed. A prefilled token costs less than a drafted one, so this errs low,
        # towards trying speculation, whose steady rounds then measure `t_d` itself.
        draft_token = obs.draft_compute_s / (drafted + obs.draft_prefill_tokens)
    return rtt_draft, draft_token, rate


def _fold_verify(state: PolicyState, obs: Observation, config: PolicyConfig) -> tuple[float | None, ...]:
    """The per-`k` verify table, with the current round's compute in the slot of the tokens verified
    (none for a block answered from a pass run ahead: that pass verified nothing)."""
    verify = list(padded(state.verify_s, max(config.k_max, obs.proposed) + 1))
    verified = 0 if obs.verified_ahead else obs.proposed
    if obs.verify_prefill_tokens <= CATCH_UP_TOKENS:  # a prefill's cost is not that of verifying k
        verify[verified] = ewma(verify[verified], obs.verify_compute_s, config.ewma)
    return tuple(verify)


def _fold_pass(state: PolicyState, obs: Observation, config: PolicyConfig) -> tuple[float, ...]:
    """The pass-cost line's moments, with the pass's (positions, compute) pair when reported."""
    moments = state.pass_moments
    if obs.batch_positions <= 0:
        return moments
    x, y = float(obs.batch_positions), obs.verify_compute_s
    point = (x, y, x * x, x * y)
    return point if not moments else tuple(ewma(m, p, config.fit_ewma) for m, p in zip(moments, point))
