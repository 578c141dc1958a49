"""The cost model: tokens per round `E(k)`, round time `T(k)` and goodput `E(k) / T(k)`.

Everything here reads a `PolicyState` and writes nothing. See docs/policy.md for the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specdec.core.policy.state import PolicyConfig, PolicyState

LOADED_BATCH = 1.1
"""Below this mean batch size a session is taken to be alone, and its per-`k` table prices `k`."""
MIN_POSITION_VARIANCE = 0.5
"""The pass-cost line's slope is fitted only when the positions vary at least this much (else
the per-`k` table's slope is used)."""

VerifyLine = tuple[float, float, float]
"""`(mean_k, mean_t, slope)` of the line through the per-`k` verify table."""


def expected_tokens(alpha: float, k: int) -> float:
    """`E(k) = (1 - alpha^(k+1)) / (1 - alpha)`: expected tokens per round; `k + 1` at alpha = 1."""
    if k < 0:
        raise ValueError(f"k={k} is invalid: must be >= 0")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} is invalid: must be in [0, 1]")
    if alpha > 1.0 - 1e-9:  # the closed form loses precision here; sum the series instead
        return math.fsum(alpha**i for i in range(k + 1))
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def proposal_rate(state: PolicyState) -> float:
    """`rho`: the fraction of asked-for draft tokens proposed (1 until measured)."""
    return 1.0 if state.proposal_rate is None else min(1.0, max(0.0, state.proposal_rate))


def guess_ahead_pays(state: PolicyState) -> bool:
    """Whether the target should verify the k = 0 round after this one ahead although the next
    round asks the draft for a block (a greedy session: see `VerifyRequest.continues`).

    The guess hides the next round's draft call and its round trip when the draft proposes nothing
    (a share `e` of the rounds that ask it), and costs a block that does come the rest of the
    guess's pass, which it then waits out: `e * (rtt_draft + rtt_target) > (1 - e) * max(0,
    t_v(0) - rtt_draft)`. Unknown until the draft has answered empty or not.
    """
    e, rtt_draft, rtt_target = state.empty_ewma, state.rtt_draft_s, state.rtt_target_s
    t_v0 = state.verify_s[0] if state.verify_s else None
    if e is None or rtt_draft is None or rtt_target is None or t_v0 is None or not 0.0 <= e <= 1.0:
        return False  # (a share outside [0, 1], or NaN, from a hostile stored state: no guess)
    return e * (rtt_draft + rtt_target) > (1.0 - e) * max(0.0, t_v0 - rtt_draft)


def is_loaded(state: PolicyState) -> bool:
    """Sharing the target's passes, with a pass-cost line to price k by."""
    return (state.batch_ewma or 1.0) >= LOADED_BATCH and len(state.pass_moments) == 4


# ---------------------------------------------------------------------------------------------
# The verify term: the per-`k` table alone, the pass-cost line under load


def verify_line(verify_s: Sequence[float | None]) -> VerifyLine | None:
    """The constrained least-squares line through the observed verify times; None if none.

    The slope is clamped at >= 0 (verifying more tokens never costs less; a negative fit becomes
    flat at the mean); one point is flat. Through the `k >= 1` points alone once there are two
    of them: scoring one position (`k = 0`) is another kernel shape than scoring several (on a
    CPU a matrix-vector product against a small matrix product, which costs twice as much at two
    positions and then grows slowly), so the jump from `k = 0` to `k = 1` would steepen the slope
    that prices the longer blocks.
    """
    points = [(j, float(v)) for j, v in enumerate(verify_s) if v is not None]
    if not points:
        return None
    several = [(j, v) for j, v in points if j >= 1]
    if len(several) >= 2:
        points = several
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    slope = max(0.0, sxy / sxx) if sxx > 0.0 else 0.0
    return mean_x, mean_y, slope


def verify_at(verify_s: Sequence[float | None], line: VerifyLine | None, k: int) -> float | None:
    """`t_v(k)`: the observed EWMA at `k`, else `line` read at `k`; never negative, None if unknown."""
    observed = verify_s[k] if k < len(verify_s) else None
    if observed is not None:
        return max(0.0, float(observed))
    if line is None:
        return None
    mean_x, mean_y, slope = line
    return max(0.0, mean_y + slope * (k - mean_x))


def pass_line(moments: Sequence[float], fallback_slope: float | None) -> tuple[float, float] | None:
    """`(c0, c1)` of the pass-cost line `compute = c0 + c1 * positions`, or None if unknown.

    Least squares on the EWMA moments, the slope clamped at >= 0 (scoring more never costs
    less); with too little spread in the positions, `fallback_slope` (the per-`k` table's: one
    more draft token of one session, which is one more position of a packed pass) through the
    mean point.
    """
    if len(moments) != 4:
        return None
    mx, my, mxx, mxy = moments
    var = mxx - mx * mx
    if var >= MIN_POSITION_VARIANCE:
        slope = max(0.0, (mxy - mx * my) / var)
    elif fallback_slope is not None:
        slope = fallback_slope
    else:
        return None
    return my - slope * mx, slope


def verify_times(state: PolicyState, config: PolicyConfig, k_max: int | None = None) -> list[float | None]:
    """The verify term of `T(k)` for `k = 0..max(k_max, config.k_max)`.

    Alone, the per-`k` table, blended by `rho` with the cost of verifying nothing; under load,
    the pass-cost line read at the positions of a packed pass in which every one of the `B`
    sessions chooses `k`: `c0 + c1 * B * (1 + rho * k)` (see docs/policy.md); both scaled by the
    queue wait `1 + q`.
    """
    line = verify_line(state.verify_s)
    ks = range(max(config.k_max, 0 if k_max is None else k_max) + 1)
    table = [verify_at(state.verify_s, line, k) for k in ks]
    batch = state.batch_ewma or 1.0
    queue = 1.0 + max(0.0, state.queue_ratio or 0.0)
    rho = proposal_rate(state)
    fit = pass_line(state.pass_moments, None if line is None else line[2]) if is_loaded(state) else None
    if fit is not None:
        c0, c1 = fit
        # The pass packs its rows end to end, so it costs c0 + c1 * (the sum of their positions);
        # a row that asks for k scores 1 + rho * k of them on average. Every session makes this
        # choice on the same kind of measurements, so the others' rows are priced at k too: that
        # charges a session's extra positions to all B rows that wait for them.
        return [queue * max(0.0, c0 + c1 * batch * (1.0 + rho * k)) for k in ks]
    # Alone: a round verifies the full block with probability rho, else none.
    base = table[0]
    times: list[float | None] = []
    for k, t in zip(ks, table):
        if t is None:
            times.append(None)
        elif k == 0:
            times.append(queue * t)
        elif base is None:
            times.append(None)
        else:
            times.append(queue * (rho * t + (1.0 - rho) * base))
    return times


# ---------------------------------------------------------------------------------------------
# Round time and goodput


def round_seconds(
    state: PolicyState, config: PolicyConfig, k: int, alpha: float | None, t_v: float | None,
    rho: float | None = None,
) -> float | None:
    """`T(k)` with verify term `t_v`, sequential or overlapped; None if an estimate is missing.

    `rho`: `proposal_rate(state)` when the caller has it already.
    """
    if t_v is None or state.rtt_target_s is None:
        return None
    loop = state.loop_s or 0.0  # the orchestrator's own time per round, whatever k
    if k == 0:
        return loop + state.rtt_target_s + config.decode_steps * t_v
    if state.rtt_draft_s is None or state.draft_token_s is None:
        return None
    rho = proposal_rate(state) if rho is None else rho
    draft = state.rtt_draft_s + rho * k * state.draft_token_s
    if not config.overlap:
        return loop + draft + state.rtt_target_s + t_v
    if alpha is None:
        return None
    hit = alpha ** (k + 1)  # the whole block accepted and the bonus token guessed: the guess holds
    # The block drafted ahead (the guessed bonus token, then k) ran beside the whole verify call
    # and the orchestrator's work between the rounds.
    ahead = state.rtt_draft_s + rho * (k + 1) * state.draft_token_s
    verify = loop + state.rtt_target_s + t_v
    return verify + (1.0 - hit) * draft + hit * max(0.0, ahead - verify)


def curve_at(
    state: PolicyState, config: PolicyConfig, alpha: float | None, t_vs: Sequence[float | None]
) -> list[float | None]:
    """Goodput for each `k` with verify terms `t_vs`, at acceptance `alpha` (the hot path).

    `E(k)` is built up as `E(k-1) + alpha^k`; a round yields `1 + rho * (E(k) - 1)` tokens.
    None where a time is unknown or not positive, and for `k > 0` when `alpha` is None.
    """
    curve: list[float | None] = []
    tokens, power = 1.0, 1.0  # E(k), alpha^k
    rho = proposal_rate(state)
    for k, t_v in enumerate(t_vs):
        if k > 0:
            if alpha is None:
                curve.append(None)
                continue
            power *= alpha
            tokens += power
        t = round_seconds(state, config, k, alpha, t_v, rho)
        made = 1.0 + rho * (tokens - 1.0) if k > 0 else float(config.decode_steps)
        curve.append(None if t is None or t <= 0.0 else made / t)
    return curve


def goodput_curve(
    state: PolicyState, config: PolicyConfig, alpha: float | None = None
) -> list[float | None]:
    """Estimated tokens per second `E(k) / T(k)` for `k = 0..k_max`, None where unknown.

    At `alpha` instead of the state's estimate when given.
    """
    return curve_at(state, config, state.alpha if alpha is None else alpha, verify_times(state, config))
