"""Sessions and the global prior: a new session's first state, and folding a finished one back.

The prior is a `PolicyState` shared by all sessions (the orchestrator keeps it in Redis); each
finished session moves it a step towards its own estimates. See docs/policy.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from specdec.core.policy.decision import choose
from specdec.core.policy.estimators import acceptance
from specdec.core.policy.state import PolicyConfig, PolicyState, padded


def initial_state(
    config: PolicyConfig, prior: PolicyState | None = None, k0: int = 2
) -> PolicyState:
    """A new session's state: the prior's estimates (if any) with rounds and back-off reset.

    With no prior (or a prior that knows nothing yet) the first round uses `k0` (clamped to
    `k_max`) to gather data; with one, the first `k` is the prior's best.
    """
    if k0 < 0:
        raise ValueError(f"k0={k0} is invalid: must be >= 0")
    k0 = min(k0, config.k_max)
    if prior is None:
        return PolicyState(k=k0, verify_s=(None,) * (config.k_max + 1))
    state = replace(
        prior,
        rounds=0,
        k=k0,
        verify_s=padded(prior.verify_s, config.k_max + 1),
        backoff=0,
        resume_probe=False,
        speculating=False,
    )
    k, speculating = choose(state, config)
    return replace(state, k=k, speculating=bool(speculating))


def merge_prior(
    prior: PolicyState | None, session: PolicyState, weight: float = 0.1
) -> PolicyState:
    """Fold a finished session's estimates into the global prior: `prior + weight*(session - prior)`.

    Per estimate: an unknown on one side takes the other side's value; with no prior the
    session's estimates become the prior. `alpha` is recomputed from the merged acceptance
    EWMAs. `rounds` adds up (rounds of experience behind the prior); back-off is not carried.
    """
    if not 0.0 < weight <= 1.0:
        raise ValueError(f"weight={weight!r} is invalid: must be in (0, 1]")
    if prior is None:
        return replace(session, backoff=0, resume_probe=False, speculating=False)

    n = max(len(prior.verify_s), len(session.verify_s))
    verify = tuple(_mix(p, s, weight) for p, s in zip(padded(prior.verify_s, n), padded(session.verify_s, n)))
    accepted = _mix(prior.accepted_ewma, session.accepted_ewma, weight)
    rejected = _mix(prior.rejected_ewma, session.rejected_ewma, weight)
    return PolicyState(
        rounds=prior.rounds + session.rounds,
        k=session.k,
        alpha=acceptance(accepted, rejected, _mix(prior.alpha, session.alpha, weight)),
        accepted_ewma=accepted,
        rejected_ewma=rejected,
        rtt_draft_s=_mix(prior.rtt_draft_s, session.rtt_draft_s, weight),
        rtt_target_s=_mix(prior.rtt_target_s, session.rtt_target_s, weight),
        draft_token_s=_mix(prior.draft_token_s, session.draft_token_s, weight),
        verify_s=verify,
        batch_ewma=_mix(prior.batch_ewma, session.batch_ewma, weight),
        proposal_rate=_mix(prior.proposal_rate, session.proposal_rate, weight),
        empty_ewma=_mix(prior.empty_ewma, session.empty_ewma, weight),
        queue_ratio=_mix(prior.queue_ratio, session.queue_ratio, weight),
        pass_moments=_mix_moments(prior.pass_moments, session.pass_moments, weight),
        loop_s=_mix(prior.loop_s, session.loop_s, weight),
    )


def _mix(prior: float | None, session: float | None, weight: float) -> float | None:
    """One estimate's step from the prior towards the session; an unknown side takes the other."""
    if session is None:
        return prior
    if prior is None:
        return session
    return prior + weight * (session - prior)


def _mix_moments(prior: Sequence[float], session: Sequence[float], weight: float) -> tuple[float, ...]:
    """The pass-cost moments mixed as a whole (all four are known together, or none)."""
    if not session:
        return tuple(prior)
    if not prior:
        return tuple(session)
    return tuple(p + weight * (s - p) for p, s in zip(prior, session))
