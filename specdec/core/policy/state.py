"""The policy's data: its configuration, one round's observation and a session's state.

All three are frozen dataclasses validated on construction; `PolicyState` round-trips through
JSON (`to_dict` / `from_dict`) so that it can live in Redis with the session. See docs/policy.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

STATE_VERSION = 1  # bump when PolicyState.to_dict changes incompatibly


def _check_int(name: str, value: object, minimum: int) -> None:
    """Raise ValueError unless `value` is an int (not a bool) `>= minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: must be an int >= {minimum}")


def _check_time(name: str, value: object) -> None:
    """Raise ValueError unless `value` is a finite number of seconds `>= 0`."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name}={value!r} is invalid: must be a finite time >= 0")


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
    """The draft of the next block overlaps the verify of this one (see docs/policy.md)."""
    draft_failure_backoff: int = 8
    """After a draft failure, stay at `k = 0` for this many rounds, then probe `k = 1`."""
    fit_ewma: float = 0.05
    """Weight of a new (positions, compute) pair in the moments of the pass-cost line, in (0, 1]
    (slower than `ewma`: a slope needs many points)."""
    decode_steps: int = 1
    """Tokens a round at `k = 0` emits, one pass each, in its one verify call (>= 1): its round trip
    and the orchestrator's work are paid once for them."""

    def __post_init__(self) -> None:
        _check_int("k_max", self.k_max, 0)
        for name in ("ewma", "fit_ewma"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 < value <= 1.0):
                raise ValueError(f"{name}={value!r} is invalid: must be in (0, 1]")
        _check_int("explore_every", self.explore_every, 2)
        gain = self.min_gain
        if not (isinstance(gain, (int, float)) and math.isfinite(gain) and gain >= 1.0):
            raise ValueError(f"min_gain={gain!r} is invalid: must be a finite number >= 1")
        _check_int("draft_failure_backoff", self.draft_failure_backoff, 0)
        _check_int("decode_steps", self.decode_steps, 1)


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
    """Positions that forward pass scored over all its sessions, the sum of its rows' (a packed
    pass: a row that verifies `n` draft tokens scores `n + 1`); 0: not reported."""
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
    verified_ahead: bool = False
    """The verify was answered from a k = 0 pass the target ran before the request came (its
    compute is that pass's, whatever the block)."""
    passes: int = 1
    """Target passes the round ran: at `k = 0` with `decode_steps`, one a token it emitted (its
    times are then one pass's, with the call's round trip); they count as rounds, so that
    exploration comes every `explore_every` tokens at `k = 0` whatever the passes a round runs."""

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"k={self.k} is invalid: must be >= 0")
        if not 0 <= self.proposed <= self.k:
            raise ValueError(f"proposed={self.proposed} is invalid: need 0 <= proposed <= k={self.k}")
        if not 0 <= self.accepted <= self.proposed:
            raise ValueError(
                f"accepted={self.accepted} is invalid: need 0 <= accepted <= proposed={self.proposed}"
            )
        _check_int("batch_size", self.batch_size, 1)
        _check_int("passes", self.passes, 1)
        if self.passes > 1 and self.k > 0:
            raise ValueError(f"passes={self.passes} is invalid with k={self.k}: a round of several passes is at k = 0")
        for name in ("batch_positions", "drafted", "draft_prefill_tokens", "verify_prefill_tokens"):
            _check_int(name, getattr(self, name), 0)
        for name in ("draft_wall_s", "draft_compute_s", "verify_wall_s", "verify_compute_s",
                     "verify_queue_s", "loop_s"):
            _check_time(name, getattr(self, name))


# How `PolicyState.from_dict` reads each stored field back.
_COUNTS = ("rounds", "k", "backoff")
_FLAGS = ("resume_probe", "speculating")
_ESTIMATES = ("alpha", "accepted_ewma", "rejected_ewma", "rtt_draft_s", "rtt_target_s", "draft_token_s",
              "batch_ewma", "queue_ratio", "proposal_rate", "empty_ewma", "loop_s")


@dataclass(frozen=True)
class PolicyState:
    """A session's policy state: the `k` for the next round plus EWMA estimates (None = unknown).

    JSON-serialisable via `to_dict` / `from_dict`; the orchestrator stores it per session.
    """

    rounds: int = 0
    """How many policy steps have chosen a `k` in this session (drives exploration)."""
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
    empty_ewma: float | None = None
    """EWMA of the rounds that called the draft and got nothing (1) or a block (0), `e`."""
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
        stored: dict[str, Any] = {"version": STATE_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            stored[f.name] = list(value) if isinstance(value, tuple) else value
        return stored

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PolicyState:
        """Inverse of `to_dict`; missing fields take their defaults, unknown keys are ignored."""
        version = d.get("version", STATE_VERSION)
        if version != STATE_VERSION:
            raise ValueError(f"policy state version {version!r} is not supported (want {STATE_VERSION})")
        values: dict[str, Any] = {name: int(d.get(name, 0)) for name in _COUNTS}
        values.update({name: bool(d.get(name, False)) for name in _FLAGS})
        values.update({name: _opt_float(d.get(name)) for name in _ESTIMATES})
        return cls(
            verify_s=tuple(_opt_float(v) for v in d.get("verify_s", ())),
            pass_moments=tuple(float(v) for v in d.get("pass_moments", ())),
            **values,
        )


def padded(values: Sequence[float | None], n: int) -> tuple[float | None, ...]:
    """`values` extended with None to at least length `n` (never truncated)."""
    return tuple(values) + (None,) * max(0, n - len(values))


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
