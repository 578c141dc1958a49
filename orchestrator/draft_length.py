"""The draft length of each round: the request's fixed k, or the controller's choice (auto).

Every generation runs one `DraftLengthController`, chosen before its first round by
`orchestrator.sources.controller_for` from what the draft pool reports: `DraftLength` (one
controller state) for a draft that names one source, `SourcedDraftLength` (one state per source)
for a draft that names several. The loop sees only the interface.
"""

from __future__ import annotations

from typing import Protocol

from orchestrator.requests import AUTO
from orchestrator.store import SessionState, SessionStore
from specdec.core.policy import (
    Observation,
    PolicyConfig,
    PolicyState,
    choose_k,
    initial_state,
    merge_prior,
    passes_before_exploration,
    step,
)
from specdec.v1 import orchestrator_pb2 as pb

UNBOUNDED = 1 << 30  # `room` where no exploration is due


class DraftLengthController(Protocol):
    """What the loop asks of a generation's draft-length controller."""

    @property
    def policy(self) -> PolicyState | None:
        """The controller state pricing the next round (None: a fixed draft length)."""

    @property
    def wanted(self) -> int:
        """k for the next round."""

    @property
    def upcoming(self) -> int:
        """What the controller would choose now: the length of a block drafted ahead (overlap)."""

    @property
    def room(self) -> int:
        """The most passes the next round may run at k = 0 (`--decode-steps`) before an exploration
        round of the controller is due (`passes_before_exploration`); unbounded with a fixed k."""

    @property
    def sources(self) -> tuple[str, ...]:
        """The draft's sources the next round's block may come from (empty: any)."""

    def observe(self, state: SessionState, stats: pb.RoundStats, loop_s: float, source: str = "",
                asked: tuple[str, ...] = ()) -> None:
        """Learn from a round (`loop_s`: the orchestrator's own time since the previous one; `source`:
        the source that drafted its block, "" when none did; `asked`: the sources it was asked to
        draft from, empty for any); the state travels with the session."""

    async def finish(self, store: SessionStore) -> None:
        """The generation ended: fold what it learnt into the prior new sessions start from."""


def observation(stats: pb.RoundStats, loop_s: float = 0.0) -> Observation:
    """What the controller learns from one round (`loop_s`: the orchestrator's own time since
    the previous round). A verify of several passes (`decode_steps`) is seen as one of them with the
    call's round trip: its compute and queue per pass, its wall time less the other passes'."""
    passes = max(1, stats.verify_passes)
    compute, queue = stats.verify_compute_ns / passes, min(stats.verify_queue_ns, stats.verify_ns) / passes
    # (passes run ahead of the call may have taken longer than its wall time: the trip is then 0)
    wall = compute + queue + max(0, stats.verify_ns - stats.verify_compute_ns - passes * queue)
    return Observation(
        k=stats.draft_length if not stats.draft_fallback else 0, proposed=stats.proposed, accepted=stats.accepted,
        draft_wall_s=stats.draft_ns / 1e9, draft_compute_s=stats.draft_compute_ns / 1e9,
        verify_wall_s=wall / 1e9, verify_compute_s=compute / 1e9,
        draft_failed=stats.draft_fallback, verify_queue_s=queue / 1e9,
        batch_size=max(1, stats.verify_batch_size), batch_positions=stats.verify_batch_positions,
        drafted=stats.drafted, draft_prefill_tokens=stats.draft_prefill_tokens,
        verify_prefill_tokens=stats.verify_prefill_tokens, loop_s=max(0.0, loop_s),
        verified_ahead=stats.verify_decoded_ahead, passes=passes,
    )


def within_budget(wanted: int, upcoming: int, remaining: int, first: bool, drafting: bool) -> tuple[int, int]:
    """k for the current round and k_next for the block an overlapped draft proposes during its verify.

    The first round drafts nothing: its token comes from the target's prefill alone (the shortest
    time to first token) while the draft prefills, overlapped, for the next block. `upcoming` is
    what the controller would choose now: 0 while it holds k = 0 (a plain round then makes no
    second call). Neither block outruns the tokens still wanted (docs/orchestrator.md).
    """
    if not drafting:
        return 0, 0
    k = 0 if first else max(0, min(wanted, remaining - 1))
    return k, max(0, min(upcoming, remaining - k - 2))


def continues_at_k0(k: int, k_next: int, remaining: int, drafting: bool, guess: bool = False, steps: int = 1) -> bool:
    """Whether the target may verify the round after a round at draft length `k` (`k_next`: its own
    from `within_budget`) at k = 0 before it is asked (VerifyRequest.continues): the tokens still
    wanted (`remaining`) outlast the at most k + `steps` it emits (`steps`: the passes a round at k = 0
    asks, else 1), and either no block is planned after it
    or `guess` (a greedy session whose draft proposes nothing often enough that the pass pays when
    it does: `specdec.core.policy.guess_ahead_pays`; a block that comes is answered from that pass
    when the pass's token refutes the block's first)."""
    return remaining > k + steps and (not drafting or k_next == 0 or guess)


class DraftLength:
    """One controller state for every round (a draft that names one source): fixed unless the
    session runs the controller (`policy`)."""

    def __init__(self, fixed: int, policy: PolicyState | None, config: PolicyConfig) -> None:
        self.fixed = fixed
        self.policy = policy
        self.config = config
        self.upcoming = choose_k(policy, config) if policy is not None else fixed

    @classmethod
    async def of(cls, state: SessionState, drafting: bool, store: SessionStore,
                 config: PolicyConfig) -> DraftLength:
        """The session's: its controller state, or a fresh one started from the global prior."""
        policy = None
        if state.draft_length == AUTO and drafting:
            if state.policy:
                policy = PolicyState.from_dict(state.policy)
            else:
                prior = await store.load_prior()
                policy = initial_state(config, PolicyState.from_dict(prior) if prior else None)
        return cls(max(state.draft_length, 0), policy, config)

    @property
    def wanted(self) -> int:
        return self.policy.k if self.policy is not None else self.fixed

    @property
    def room(self) -> int:
        return passes_before_exploration(self.policy, self.config) if self.policy is not None else UNBOUNDED

    @property
    def sources(self) -> tuple[str, ...]:
        return ()

    def observe(self, state: SessionState, stats: pb.RoundStats, loop_s: float, source: str = "",
                asked: tuple[str, ...] = ()) -> None:
        """Let the controller learn from a round, whichever source drafted it."""
        if self.policy is not None:
            _, self.upcoming, self.policy = step(self.policy, observation(stats, loop_s), self.config)
            state.policy = self.policy.to_dict()

    async def finish(self, store: SessionStore) -> None:
        """Fold a finished generation's estimates into the prior new sessions start from."""
        if self.policy is not None:
            raw = await store.load_prior()
            prior = merge_prior(PolicyState.from_dict(raw) if raw else None, self.policy)
            await store.save_prior(prior.to_dict())
