"""Draft-length policy: choose `k` each round to maximise expected goodput `E(k) / T(k)`. Pure.

Glossary (DESIGN.md section 2): `k` is the draft length; a round proposes `k` draft tokens, of
which a prefix is *accepted*, and the target adds one token of its own (*recovered* or *bonus*),
so a round yields between 1 and `k + 1` tokens. `k = 0` is plain target decoding: no draft
call at all.

The model, with per-token acceptance `alpha`:

- tokens per round `E(k) = (1 - alpha^(k+1)) / (1 - alpha)`, `E(0) = 1` (`k + 1` at `alpha = 1`);
- sequential round time `T(k) = L + rtt_d + k*t_d + rtt_t + t_v(k)` for `k >= 1` and
  `T(0) = L + rtt_t + t_v(0)`, where `rtt_*` is a call's wall time minus the compute time its
  server reports, `t_d` the draft's compute per token, `t_v(k)` the target's compute to
  verify `k` draft tokens (`k + 1` positions) and `L` the orchestrator's own time per round
  (saving the session, streaming the chunk), which a longer block spreads over more tokens;
- overlapped round time (`PolicyConfig.overlap`: the draft of block i+1 runs during the verify
  call of block i, guessing that block i is fully accepted and drafting the bonus token it
  guesses, then `k` more):
  `T(k) = V + (1 - alpha^(k+1))*(rtt_d + k*t_d) + alpha^(k+1)*max(0, rtt_d + (k+1)*t_d - V)`
  with `V = L + rtt_t + t_v(k)`. With probability `alpha^(k+1)` (the whole block accepted and
  the bonus token guessed right) the guess holds and only the part of the draft that outlasts
  the verify call is paid; otherwise the next draft starts fresh after the verdict and is paid
  in full.
  It is an approximation: it ignores the draft compute wasted on a failed guess (that falls on
  the draft server only) and any contention between the two.

Under load the target verifies the blocks of `B` sessions in one pass, and a request may wait in
its queue for other passes first. Every session runs this policy on like measurements, so when
one finds a longer block worth it they all do: the verify term is priced for all `B` sessions
choosing `k`,

  `t_v'(k) = (1 + q) * (c0 + c1 * B * (k + 1))`

where `c0 + c1 * x` is the pass's compute at `x` scored positions (a least-squares line through
EWMA moments of the (positions, compute) pairs the target reports), `B` the batch size and `q`
the queue wait as a fraction of the pass's compute (the wait is spent on passes like this one, so
it scales with them). Pricing one's own tokens alone (`c1 * (k + 1)`) would let every session add
tokens that slow all the others. On a GPU, where `c1` is small until the pass is compute-bound,
speculation keeps paying under load; on a CPU, where every scored position costs, `k` falls as
load rises, to `0` at saturation. Alone (`B` ~ 1) the per-`k` table `t_v(k)` is used as it is.

A draft may propose fewer tokens than asked (prompt lookup proposes nothing when the text does
not repeat). With `rho` the fraction of asked-for tokens proposed (EWMA, 1 for a model draft),
a round yields `1 + rho * (E(k) - 1)` tokens, verifies `rho * k` draft tokens alone on average,
and, in a pass padded to its widest row, makes every row `1 + k * (1 - (1 - rho)^B)` positions
wide: under load, one session's full block widens the pass for all, while most rows gain
nothing.

All of `alpha`, the round trips, `t_d`, `t_v(k)` (per `k`), `B` and `q` are EWMAs of online
measurements (`update`); `choose_k` takes the argmax over `0..k_max`, with a hysteresis band
(`min_gain`) between `k = 0` and speculation judged at an optimistic acceptance (`best_k`), a
deterministic exploration schedule and a back-off after draft failures.
`next_k(state, observation) -> (k, state)` is the whole per-round step. Everything here is a
deterministic function of its arguments: no I/O, clocks or global state; the state is JSON
(`PolicyState.to_dict`) so that it can live in Redis with the session.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

ALPHA_MAX = 0.999  # acceptance estimates are clamped to [0, ALPHA_MAX]
STATE_VERSION = 1  # bump when PolicyState.to_dict changes incompatibly


@dataclass(frozen=True)
class PolicyConfig:
    """How the policy steers; validated on construction (ValueError on a bad field)."""

    k_max: int = 8
    """Upper bound on the draft length `k`."""
    ewma: float = 0.2
    """Weight of a new observation in every EWMA, in (0, 1]."""
    explore_every: int = 16
    """Every N-th round probes a neighbour of the best `k` so its estimates stay fresh (>= 2)."""
    min_gain: float = 1.02
    """Hysteresis band against noise (>= 1): start speculating only when the best `k > 0` beats
    `k = 0` goodput by this factor, and stop only when `k = 0` beats the best `k > 0` by it
    (both judged at an optimistic acceptance, see `best_k`)."""
    overlap: bool = False
    """The draft of the next block overlaps the verify of this one (see the module docstring)."""
    draft_failure_backoff: int = 8
    """After a draft failure, stay at `k = 0` for this many rounds, then probe `k = 1`."""
    fit_ewma: float = 0.05
    """Weight of a new (positions, compute) pair in the moments of the pass-cost line, in (0, 1]
    (slower than `ewma`: a slope needs many points)."""

    def __post_init__(self) -> None:
        if isinstance(self.k_max, bool) or not isinstance(self.k_max, int) or self.k_max < 0:
            raise ValueError(f"k_max={self.k_max!r} is invalid: must be an int >= 0")
        for name in ("ewma", "fit_ewma"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 < value <= 1.0):
                raise ValueError(f"{name}={value!r} is invalid: must be in (0, 1]")
        if (
            isinstance(self.explore_every, bool)
            or not isinstance(self.explore_every, int)
            or self.explore_every < 2
        ):
            raise ValueError(f"explore_every={self.explore_every!r} is invalid: must be an int >= 2")
        if not (isinstance(self.min_gain, (int, float)) and math.isfinite(self.min_gain)
                and self.min_gain >= 1.0):
            raise ValueError(f"min_gain={self.min_gain!r} is invalid: must be a finite number >= 1")
        if (
            isinstance(self.draft_failure_backoff, bool)
            or not isinstance(self.draft_failure_backoff, int)
            or self.draft_failure_backoff < 0
        ):
            raise ValueError(
                f"draft_failure_backoff={self.draft_failure_backoff!r} is invalid: must be an int >= 0"
            )


@dataclass(frozen=True)
class Observation:
    """What one round measured, as seen by the orchestrator. Times in seconds."""

    k: int
    """Draft length requested for the round."""
    proposed: int
    """Draft tokens actually proposed (`<= k`; a prompt-lookup proposer may propose fewer)."""
    accepted: int
    """Draft tokens accepted (`<= proposed`)."""
    draft_wall_s: float
    """Wall time of the draft call (0 when `k = 0`)."""
    draft_compute_s: float
    """Draft server compute time for the whole block."""
    verify_wall_s: float
    """Wall time of the verify call."""
    verify_compute_s: float
    """Target server compute time for the verify."""
    draft_failed: bool = False
    """The draft call failed or timed out (the round fell back to `k = 0`)."""
    verify_queue_s: float = 0.0
    """Time the verify waited in the target's queues before its pass (part of the wall time,
    not of the compute)."""
    batch_size: int = 1
    """Sessions verified in the same forward pass (1: alone)."""
    batch_positions: int = 0
    """Positions that forward pass scored over all its sessions (0: not reported)."""
    drafted: int = 0
    """Tokens the draft computed for the block: the proposed ones, plus the bonus token it
    guessed when it drafted the block ahead, during the previous verify (0: as many as proposed)."""
    draft_prefill_tokens: int = 0
    """History tokens the draft (re-)prefilled into its cache before proposing (a new session, a
    lost cache, or a cache that fell behind while the draft was not called)."""
    verify_prefill_tokens: int = 0
    """History tokens the target (re-)prefilled before verifying."""
    loop_s: float = 0.0
    """The orchestrator's own time between the previous round and this one (saving the session,
    streaming the chunk, choosing `k`); 0 when not measured (a request's first round)."""

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"k={self.k} is invalid: must be >= 0")
        if not 0 <= self.proposed <= self.k:
            raise ValueError(f"proposed={self.proposed} is invalid: need 0 <= proposed <= k={self.k}")
        if not 0 <= self.accepted <= self.proposed:
            raise ValueError(
                f"accepted={self.accepted} is invalid: need 0 <= accepted <= proposed={self.proposed}"
            )
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size!r} is invalid: must be an int >= 1")
        if isinstance(self.batch_positions, bool) or not isinstance(self.batch_positions, int) \
                or self.batch_positions < 0:
            raise ValueError(f"batch_positions={self.batch_positions!r} is invalid: must be an int >= 0")
        for name in ("drafted", "draft_prefill_tokens", "verify_prefill_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} is invalid: must be an int >= 0")
        for name in ("draft_wall_s", "draft_compute_s", "verify_wall_s", "verify_compute_s", "verify_queue_s",
                     "loop_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name}={value!r} is invalid: must be a finite time >= 0")


@dataclass(frozen=True)
class PolicyState:
    """A session's policy state: the `k` for the next round plus EWMA estimates (None = unknown).

    JSON-serialisable via `to_dict` / `from_dict`; the orchestrator stores it per session.
    """

    rounds: int = 0
    """How many times `next_k` has chosen a `k` in this session (drives exploration)."""
    k: int = 0
    """The `k` chosen for the next round."""
    alpha: float | None = None
    """Per-token acceptance estimate, `accepted_ewma / (accepted_ewma + rejected_ewma)`."""
    accepted_ewma: float | None = None
    """EWMA of accepted draft tokens per round (rounds with proposed > 0 only)."""
    rejected_ewma: float | None = None
    """EWMA of rejections per round: 1 when the block was cut short, else 0."""
    rtt_draft_s: float | None = None
    """EWMA of the draft call's wall time minus its compute time."""
    rtt_target_s: float | None = None
    """EWMA of the verify call's wall time minus its compute time and its queue wait."""
    draft_token_s: float | None = None
    """EWMA of draft compute per proposed token."""
    verify_s: tuple[float | None, ...] = ()
    """EWMA of target verify compute, indexed by the number of draft tokens verified
    (`k_max + 1` long from `initial_state`; longer if `k_max` shrank since)."""
    batch_ewma: float | None = None
    """EWMA of the verify's batch size `B` (sessions per target pass)."""
    queue_ratio: float | None = None
    """EWMA of the verify's queue wait over its compute, `q`."""
    proposal_rate: float | None = None
    """EWMA of proposed / asked-for draft tokens, `rho` (rounds that called the draft)."""
    loop_s: float | None = None
    """EWMA of the orchestrator's own time per round, outside the draft and verify calls."""
    pass_moments: tuple[float, ...] = ()
    """EWMA moments `(E[x], E[y], E[x^2], E[x*y])` of the target passes' scored positions `x` and
    compute `y` (empty until a target reports positions): the pass-cost line."""
    backoff: int = 0
    """Rounds left at `k = 0` after a draft failure."""
    resume_probe: bool = False
    """Probe `k = 1` once the back-off has run out."""
    speculating: bool = False
    """The last regular (not probe, not back-off) choice was `k > 0`: the side of the `min_gain` band."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "verify_s", tuple(self.verify_s))
        object.__setattr__(self, "pass_moments", tuple(self.pass_moments))
        if len(self.pass_moments) not in (0, 4):
            raise ValueError(f"pass_moments={self.pass_moments!r}: want 4 moments or none")
        if self.rounds < 0 or self.k < 0 or self.backoff < 0:
            raise ValueError(
                f"rounds={self.rounds}, k={self.k}, backoff={self.backoff}: all must be >= 0"
            )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict (lists, floats, ints, bools and None only)."""
        return {
            "version": STATE_VERSION,
            "rounds": self.rounds,
            "k": self.k,
            "alpha": self.alpha,
            "accepted_ewma": self.accepted_ewma,
            "rejected_ewma": self.rejected_ewma,
            "rtt_draft_s": self.rtt_draft_s,
            "rtt_target_s": self.rtt_target_s,
            "draft_token_s": self.draft_token_s,
            "verify_s": list(self.verify_s),
            "batch_ewma": self.batch_ewma,
            "queue_ratio": self.queue_ratio,
            "proposal_rate": self.proposal_rate,
            "pass_moments": list(self.pass_moments),
            "loop_s": self.loop_s,
            "backoff": self.backoff,
            "resume_probe": self.resume_probe,
            "speculating": self.speculating,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PolicyState:
        """Inverse of `to_dict`; missing fields take their defaults, unknown keys are ignored."""
        version = d.get("version", STATE_VERSION)
        if version != STATE_VERSION:
            raise ValueError(f"policy state version {version!r} is not supported (want {STATE_VERSION})")
        return cls(
            rounds=int(d.get("rounds", 0)),
            k=int(d.get("k", 0)),
            alpha=_opt_float(d.get("alpha")),
            accepted_ewma=_opt_float(d.get("accepted_ewma")),
            rejected_ewma=_opt_float(d.get("rejected_ewma")),
            rtt_draft_s=_opt_float(d.get("rtt_draft_s")),
            rtt_target_s=_opt_float(d.get("rtt_target_s")),
            draft_token_s=_opt_float(d.get("draft_token_s")),
            verify_s=tuple(_opt_float(v) for v in d.get("verify_s", ())),
            batch_ewma=_opt_float(d.get("batch_ewma")),
            queue_ratio=_opt_float(d.get("queue_ratio")),
            proposal_rate=_opt_float(d.get("proposal_rate")),
            pass_moments=tuple(float(v) for v in d.get("pass_moments", ())),
            loop_s=_opt_float(d.get("loop_s")),
            backoff=int(d.get("backoff", 0)),
            resume_probe=bool(d.get("resume_probe", False)),
            speculating=bool(d.get("speculating", False)),
        )


# ---------------------------------------------------------------------------------------------
# The model: E(k), t_v(k), T(k), goodput


def expected_tokens(alpha: float, k: int) -> float:
    """`E(k) = (1 - alpha^(k+1)) / (1 - alpha)`: expected tokens per round; `k + 1` at alpha = 1."""
    if k < 0:
        raise ValueError(f"k={k} is invalid: must be >= 0")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} is invalid: must be in [0, 1]")
    if alpha > 1.0 - 1e-9:  # the closed form loses precision here; sum the series instead
        return math.fsum(alpha**i for i in range(k + 1))
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def verify_time(verify_s: Sequence[float | None], k: int) -> float | None:
    """Target verify compute for `k` draft tokens from the per-`k` EWMAs, or None if none observed.

    An observed `k` returns its own EWMA. Otherwise a line is fitted by least squares through
    the observed points (the `k >= 1` ones alone when there are two: see `_verify_line`),
    constrained to a slope >= 0 (verifying more tokens never costs less; a negative
    unconstrained slope becomes flat at the mean), and read at `k`. One observed point means
    flat. The result is never negative.
    """
    return _verify_at(verify_s, _verify_line(verify_s), k)


def round_time(state: PolicyState, k: int, config: PolicyConfig) -> float | None:
    """Estimated wall time of a round at draft length `k`, or None if an estimate is missing."""
    if k < 0:
        raise ValueError(f"k={k} is invalid: must be >= 0")
    return _round_time(state, config, k, state.alpha, _verify_times(state, config, k)[k])


def goodput(state: PolicyState, k: int, config: PolicyConfig) -> float | None:
    """Estimated tokens per second `E(k) / T(k)` at draft length `k`, or None if unknown.

    None too when the estimated round time is not positive (nothing measured yet costs time).
    """
    if k < 0:
        raise ValueError(f"k={k} is invalid: must be >= 0")
    return _goodput(state, config, k, state.alpha, _verify_times(state, config, k)[k])


def goodput_curve(
    state: PolicyState, config: PolicyConfig, alpha: float | None = None
) -> list[float | None]:
    """`goodput` for `k = 0..k_max` (at `alpha` instead of the estimate when given), one fit."""
    return _curve(state, config, state.alpha if alpha is None else alpha, _verify_times(state, config))


def _verify_times(state: PolicyState, config: PolicyConfig, k_max: int | None = None) -> list[float | None]:
    """The verify term of `T(k)` for `k = 0..k_max`: `t_v(k)` alone, priced for load when loaded."""
    line = _verify_line(state.verify_s)
    ks = range(max(config.k_max, 0 if k_max is None else k_max) + 1)
    table = [_verify_at(state.verify_s, line, k) for k in ks]
    batch = state.batch_ewma or 1.0
    q = max(0.0, state.queue_ratio or 0.0)
    rho = _rate(state)
    fit = pass_line(state.pass_moments, None if line is None else line[2]) if _loaded(state) else None
    if fit is None:  # alone: a round verifies the full block with probability rho, else none
        return [None if t is None or (k and table[0] is None)
                else (1.0 + q) * (t if k == 0 else rho * t + (1.0 - rho) * table[0]) for k, t in zip(ks, table)]
    c0, c1 = fit
    full = 1.0 - (1.0 - rho) ** batch  # some row of the pass proposes its whole block
    return [(1.0 + q) * max(0.0, c0 + c1 * batch * (1.0 + k * full)) for k in ks]


CATCH_UP_TOKENS = 2
"""A call that (re-)prefilled more history tokens than this (a new session, a lost cache, a draft
cache left behind while the draft was not called) is not a steady round: its compute teaches the
per-token draft cost and the verify cost per `k` nothing (round trips it still does)."""
LOADED_BATCH = 1.1
"""Below this mean batch size a session is taken to be alone, and its per-`k` table prices `k`."""
MIN_POSITION_VARIANCE = 0.5
"""The pass-cost line's slope is fitted only when the positions vary at least this much (else
the per-`k` table's slope is used)."""


def _loaded(state: PolicyState) -> bool:
    """Sharing the target's passes, with a pass-cost line to price k by."""
    return (state.batch_ewma or 1.0) >= LOADED_BATCH and len(state.pass_moments) == 4


def pass_line(moments: Sequence[float], fallback_slope: float | None) -> tuple[float, float] | None:
    """`(c0, c1)` of the pass-cost line `compute = c0 + c1 * positions`, or None if unknown.

    Least squares on the EWMA moments, the slope clamped at >= 0 (scoring more never costs
    less); with too little spread in the positions, `fallback_slope` (the per-`k` table's, i.e.
    one more draft token of one session) through the mean point.
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


def _curve(
    state: PolicyState, config: PolicyConfig, alpha: float | None, t_vs: list[float | None]
) -> list[float | None]:
    """`_goodput` for each `k` in turn, with `E(k)` built up as `E(k-1) + alpha^k` (hot path)."""
    curve: list[float | None] = []
    tokens, power = 1.0, 1.0  # E(k), alpha^k
    rho = _rate(state)
    for k, t_v in enumerate(t_vs):
        if k > 0:
            if alpha is None:
                curve.append(None)
                continue
            power *= alpha
            tokens += power
        t = _round_time(state, config, k, alpha, t_v, rho)
        curve.append(None if t is None or t <= 0.0 else (1.0 + rho * (tokens - 1.0)) / t)
    return curve


def _round_time(
    state: PolicyState, config: PolicyConfig, k: int, alpha: float | None, t_v: float | None,
    rho: float | None = None,
) -> float | None:
    """`T(k)`; `rho`: `_rate(state)` when the caller has it already."""
    if t_v is None or state.rtt_target_s is None:
        return None
    loop = state.loop_s or 0.0  # the orchestrator's own time per round, whatever k
    if k == 0:
        return loop + state.rtt_target_s + t_v
    if state.rtt_draft_s is None or state.draft_token_s is None:
        return None
    rho = _rate(state) if rho is None else rho
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


def _goodput(
    state: PolicyState, config: PolicyConfig, k: int, alpha: float | None, t_v: float | None
) -> float | None:
    t = _round_time(state, config, k, alpha, t_v)
    if t is None or t <= 0.0:
        return None
    if k == 0:
        return 1.0 / t
    if alpha is None:
        return None
    return (1.0 + _rate(state) * (expected_tokens(alpha, k) - 1.0)) / t


def _rate(state: PolicyState) -> float:
    """`rho`: the fraction of asked-for draft tokens proposed (1 until measured)."""
    return 1.0 if state.proposal_rate is None else min(1.0, max(0.0, state.proposal_rate))


def _verify_line(verify_s: Sequence[float | None]) -> tuple[float, float, float] | None:
    """`(mean_k, mean_t, slope)` of the constrained least-squares line, None if nothing observed.

    Through the `k >= 1` points alone once there are two of them: scoring one position (`k = 0`)
    is another kernel shape than scoring several (on a CPU a matrix-vector product against a
    small matrix product, which costs twice as much at two positions and then grows slowly), so
    the jump from `k = 0` to `k = 1` would steepen the slope that prices the longer blocks.
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


def _verify_at(
    verify_s: Sequence[float | None], line: tuple[float, float, float] | None, k: int
) -> float | None:
    observed = verify_s[k] if k < len(verify_s) else None
    if observed is not None:
        return max(0.0, float(observed))
    if line is None:
        return None
    mean_x, mean_y, slope = line
    return max(0.0, mean_y + slope * (k - mean_x))


# ---------------------------------------------------------------------------------------------
# Learning: fold observations into the EWMAs


def update(state: PolicyState, obs: Observation, config: PolicyConfig) -> PolicyState:
    """Fold one round's observation into the estimates (does not choose `k` or count the round).

    - Acceptance: a round with `proposed = n > 0` and `accepted = a` counts `a` successes and
      one failure if `a < n` (the block was cut short), none otherwise; the EWMAs of both give
      `alpha = S / (S + F)`, the estimator of a geometric acceptance run truncated at `n`.
      Rounds that proposed nothing say nothing about `alpha`.
    - Round trips are wall minus compute (and minus the verify's queue wait), clamped at 0. The
      batch size and the queue wait over the compute feed `B` and `q`. The draft's are learnt only from
      rounds that called it (`k >= 1`) and did not fail; `t_d` only when tokens were proposed.
    - Per-token costs come from steady rounds only: a call that (re-)prefilled more than
      `CATCH_UP_TOKENS` history tokens (the first round of a session, a lost cache) leaves `t_d`
      and `t_v(k)` alone (`t_d` is seeded from it, spread over every token processed, when
      nothing better is known).
    - Verify compute goes to the EWMA for the number of tokens the target actually verified;
      `rho` is the EWMA of proposed / k over rounds that called the draft; the (positions,
      compute) pair of the pass, when the target reports positions, goes to the line's moments.
    - A draft failure starts the back-off (`draft_failure_backoff` rounds at `k = 0`).
    """
    w = config.ewma
    accepted, rejected, alpha = state.accepted_ewma, state.rejected_ewma, state.alpha
    if obs.proposed > 0:
        # Both start from 0 rather than from the first round: their ratio then weighs every
        # round by (1 - ewma)^age, instead of letting the first round count for 1/ewma rounds.
        accepted = _ewma(accepted or 0.0, float(obs.accepted), w)
        rejected = _ewma(rejected or 0.0, 1.0 if obs.accepted < obs.proposed else 0.0, w)
        alpha = _alpha(accepted, rejected, alpha)

    rtt_draft, draft_token, rate = state.rtt_draft_s, state.draft_token_s, state.proposal_rate
    if obs.k > 0 and not obs.draft_failed:
        rate = _ewma(rate, obs.proposed / obs.k, w)
        rtt_draft = _ewma(rtt_draft, max(0.0, obs.draft_wall_s - obs.draft_compute_s), w)
        drafted = max(obs.proposed, obs.drafted)
        if obs.proposed > 0 and obs.draft_prefill_tokens <= CATCH_UP_TOKENS:
            draft_token = _ewma(draft_token, obs.draft_compute_s / drafted, w)
        elif obs.proposed > 0 and draft_token is None:
            # Only a call that also prefilled has been seen: spread its compute over every token
            # it processed. A prefilled token costs less than a drafted one, so this errs low,
            # towards trying speculation, whose steady rounds then measure `t_d` itself.
            draft_token = obs.draft_compute_s / (drafted + obs.draft_prefill_tokens)

    rtt_target = _ewma(state.rtt_target_s,
                       max(0.0, obs.verify_wall_s - obs.verify_compute_s - obs.verify_queue_s), w)
    batch = _ewma(state.batch_ewma, float(obs.batch_size), w)
    moments = state.pass_moments
    if obs.batch_positions > 0:
        x, y = float(obs.batch_positions), obs.verify_compute_s
        point = (x, y, x * x, x * y)
        moments = point if not moments else tuple(_ewma(m, p, config.fit_ewma) for m, p in zip(moments, point))
    queue_ratio = state.queue_ratio
    if obs.verify_compute_s > 0.0:
        queue_ratio = _ewma(queue_ratio, obs.verify_queue_s / obs.verify_compute_s, w)
    verify = list(_padded(state.verify_s, max(config.k_max, obs.proposed) + 1))
    if obs.verify_prefill_tokens <= CATCH_UP_TOKENS:  # a prefill's cost is not that of verifying k
        verify[obs.proposed] = _ewma(verify[obs.proposed], obs.verify_compute_s, w)

    return replace(
        state,
        alpha=alpha,
        accepted_ewma=accepted,
        rejected_ewma=rejected,
        rtt_draft_s=rtt_draft,
        rtt_target_s=rtt_target,
        draft_token_s=draft_token,
        verify_s=tuple(verify),
        batch_ewma=batch,
        queue_ratio=queue_ratio,
        proposal_rate=rate,
        pass_moments=moments,
        loop_s=_ewma(state.loop_s, obs.loop_s, w) if obs.loop_s > 0.0 else state.loop_s,
        backoff=config.draft_failure_backoff if obs.draft_failed else state.backoff,
        resume_probe=True if obs.draft_failed else state.resume_probe,
        speculating=False if obs.draft_failed else state.speculating,
    )


# ---------------------------------------------------------------------------------------------
# Deciding: argmax with hysteresis, exploration and back-off


def is_exploration_round(rounds: int, config: PolicyConfig, batch: float = 1.0) -> bool:
    """True on the rounds that probe a neighbour of the best `k`: the last of every `explore_every`
    (times the batch size `batch` when sessions share passes, so that the batch as a whole probes
    about once every `explore_every` passes: a probe that widens a padded pass costs all of it)."""
    every = config.explore_every * max(1, math.ceil(batch - 1e-9))
    return rounds % every == every - 1


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
    return _best(state, config)[0]


def best_positive_k(state: PolicyState, config: PolicyConfig) -> int | None:
    """The `k` in `1..k_max` with the highest estimated goodput (ties: smaller), None if unknown."""
    return _argmax_positive(goodput_curve(state, config))


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


def choose_k(state: PolicyState, config: PolicyConfig) -> int:
    """The draft length for the round `state.rounds` (0-based). In order of precedence:

    1. back-off after a draft failure: 0 while `state.backoff > 0`, then one probe at `k = 1`;
    2. nothing measured yet: keep `state.k` (a new session's `k0`) to gather data;
    3. exploration: on rounds where `rounds % explore_every == explore_every - 1`, a neighbour of
       the best `k`: `best + 1` on even exploration rounds and `best - 1` on odd ones
       (`(rounds // explore_every) % 2`), the other one at the ends of `[0, k_max]`; when the
       best is `0`, the best `k > 0` by estimated goodput (`1` while that is unknown), so a
       dead, unknown or unhelpful draft keeps being retried at the length that would replace 0;
       under load (`B` sessions per pass, a pass-cost line known) probes come `B` times rarer
       and only go down, since a longer block widens every row of a padded pass;
    4. otherwise the best `k` (`best_k`).
    """
    return _choose(state, config)[0]


def _argmax_positive(curve: Sequence[float | None]) -> int | None:
    best, best_g = None, None
    for k in range(1, len(curve)):
        g = curve[k]
        if g is not None and (best_g is None or g > best_g):
            best, best_g = k, g
    return best


def _best(state: PolicyState, config: PolicyConfig) -> tuple[int | None, int | None]:
    """`(best_k, best_positive_k)`, sharing one goodput curve."""
    t_vs = _verify_times(state, config)
    curve = _curve(state, config, state.alpha, t_vs)
    base, best = curve[0], _argmax_positive(curve)
    if best is None:
        return (None if base is None else 0), None
    if base is None:
        return best, best
    optimistic = _curve(state, config, alpha_upper(state, config), t_vs)
    upper = max((g for g in optimistic[1:] if g is not None), default=0.0)
    if state.speculating:
        return (best if upper * config.min_gain >= base else 0), best
    return (best if upper >= config.min_gain * base else 0), best


def _choose(
    state: PolicyState, config: PolicyConfig, best: tuple[int | None, int | None] | None = None
) -> tuple[int, bool | None]:
    """`(k, speculating)`: the choice and the `speculating` flag it leaves (None = unchanged).

    `best`: `_best(state, config)` when the caller has it already."""
    if config.k_max == 0:
        return 0, False
    if state.backoff > 0:
        return 0, False
    if state.resume_probe:
        return 1, False
    best, best_positive = _best(state, config) if best is None else best
    if best is None:
        return min(state.k, config.k_max), None
    if is_exploration_round(state.rounds, config, state.batch_ewma if _loaded(state) else 1.0):
        if best == 0:
            return best_positive or 1, None
        # Under load a longer block widens the whole padded pass, for every session in it; the
        # pass-cost line already prices longer blocks, so probes only go down there.
        up = (state.rounds // config.explore_every) % 2 == 0 and not _loaded(state)
        if best == config.k_max or not up:
            return best - 1, None
        return best + 1, None
    return best, best > 0


def next_k(
    state: PolicyState, obs: Observation | None, config: PolicyConfig
) -> tuple[int, PolicyState]:
    """One policy step: fold in the last round's observation (if any), then choose the next `k`.

    Returns `(k, state)` with `state.k = k`, the round counted, one back-off round spent and
    the post-back-off probe consumed when it was taken.
    """
    k, s, _, _ = _step(state, obs, config)
    return k, s


def step(
    state: PolicyState, obs: Observation | None, config: PolicyConfig
) -> tuple[int, int, PolicyState]:
    """`next_k`, and `choose_k` of the state it returns: the draft length of the round after
    (the block an overlapped draft proposes ahead, during this round's verify).

    The same as calling the two in turn, with one goodput fit instead of two whenever the step
    left the hysteresis flag as it was (the only input of the fit a step changes; a back-off
    clears it without consulting the fit).
    """
    k, s, best, fitted_flag = _step(state, obs, config)
    return k, _choose(s, config, best if s.speculating == fitted_flag else None)[0], s


def _step(
    state: PolicyState, obs: Observation | None, config: PolicyConfig
) -> tuple[int, PolicyState, tuple[int | None, int | None] | None, bool]:
    """`(k, next state, _best of the state the choice was made on (None: not fitted), that
    state's flag)`."""
    s = update(state, obs, config) if obs is not None else state
    # The fit, unless the choice will not consult it (no draft allowed, back-off, its probe).
    best = _best(s, config) if config.k_max > 0 and s.backoff <= 0 and not s.resume_probe else None
    k, speculating = _choose(s, config, best)
    in_backoff = s.backoff > 0
    return k, replace(
        s,
        k=k,
        rounds=s.rounds + 1,
        backoff=s.backoff - 1 if in_backoff else 0,
        resume_probe=s.resume_probe and in_backoff,
        speculating=s.speculating if speculating is None else speculating,
    ), best, s.speculating


# ---------------------------------------------------------------------------------------------
# Sessions and the global prior


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
        verify_s=_padded(prior.verify_s, config.k_max + 1),
        backoff=0,
        resume_probe=False,
        speculating=False,
    )
    k, speculating = _choose(state, config)
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
    verify = tuple(
        _mix(p, s, weight)
        for p, s in zip(_padded(prior.verify_s, n), _padded(session.verify_s, n))
    )
    accepted = _mix(prior.accepted_ewma, session.accepted_ewma, weight)
    rejected = _mix(prior.rejected_ewma, session.rejected_ewma, weight)
    return PolicyState(
        rounds=prior.rounds + session.rounds,
        k=session.k,
        alpha=_alpha(accepted, rejected, _mix(prior.alpha, session.alpha, weight)),
        accepted_ewma=accepted,
        rejected_ewma=rejected,
        rtt_draft_s=_mix(prior.rtt_draft_s, session.rtt_draft_s, weight),
        rtt_target_s=_mix(prior.rtt_target_s, session.rtt_target_s, weight),
        draft_token_s=_mix(prior.draft_token_s, session.draft_token_s, weight),
        verify_s=verify,
        batch_ewma=_mix(prior.batch_ewma, session.batch_ewma, weight),
        proposal_rate=_mix(prior.proposal_rate, session.proposal_rate, weight),
        queue_ratio=_mix(prior.queue_ratio, session.queue_ratio, weight),
        pass_moments=_mix_moments(prior.pass_moments, session.pass_moments, weight),
        loop_s=_mix(prior.loop_s, session.loop_s, weight),
    )


def _mix_moments(prior: Sequence[float], session: Sequence[float], weight: float) -> tuple[float, ...]:
    if not session:
        return tuple(prior)
    if not prior:
        return tuple(session)
    return tuple(p + weight * (s - p) for p, s in zip(prior, session))


# ---------------------------------------------------------------------------------------------
# Helpers


def _ewma(old: float | None, new: float, weight: float) -> float:
    """EWMA step; the first observation initialises it."""
    return new if old is None else old + weight * (new - old)


def _mix(prior: float | None, session: float | None, weight: float) -> float | None:
    if session is None:
        return prior
    if prior is None:
        return session
    return prior + weight * (session - prior)


def _alpha(accepted: float | None, rejected: float | None, fallback: float | None) -> float | None:
    """`S / (S + F)` clamped to [0, ALPHA_MAX]; `fallback` when the EWMAs say nothing."""
    if accepted is None or rejected is None or accepted + rejected <= 0.0:
        return fallback
    return min(ALPHA_MAX, max(0.0, accepted / (accepted + rejected)))


def _padded(values: Sequence[float | None], n: int) -> tuple[float | None, ...]:
    """`values` extended with None to at least length `n` (never truncated)."""
    return tuple(values) + (None,) * max(0, n - len(values))


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
