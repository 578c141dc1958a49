"""Per-source draft lengths for a hybrid draft (`python -m draft_service --proposer hybrid`).

A hybrid draft proposes each block from one of two sources: suffix speculation when it is
confident, the model otherwise (`Proposal.source` names it). Their acceptance and costs differ
by far (a confident suffix match is mostly accepted and costs no forward pass; the model's
acceptance is its own), so one controller state fed by both would price every round with a
blend that fits neither. `SourcedDraftLength` keeps one `PolicyState` per source:

- the model's is the session's usual state (`SessionState.policy`, the one folded into the
  global prior when the generation ends); the suffix's lives beside it in the same record,
  under `policy["by_source"]["suffix"]` (a key `PolicyState.from_dict` ignores, so a replica
  without this module reads the record and merely drops it on its next write);
- a round drafted by one source teaches that source's state only; a round that drafted nothing
  (k = 0, the first round, a draft that failed) teaches both: it says nothing about acceptance,
  only about the verify cost and the draft's health (a failure backs both off);
- the next round is priced with the state of the source predicted to draft it: suffix
  speculation after a round it drafted (a confident match tends to last while the text repeats),
  the model otherwise. The draft still decides per call: a round priced for the suffix that the
  model drafts teaches the model's state, and the next is priced for the model.

The suffix's state starts from the model's as it stands (verify cost, round trips, the loop's
own time are the session's, whatever drafts), with its acceptance, draft cost and proposal rate
unknown. A fixed draft length (not `auto`) needs no state: rounds are only counted by source.
"""

from __future__ import annotations

from dataclasses import replace

from orchestrator.draft_length import DraftLength, observation
from orchestrator.store import SessionState, SessionStore
from specdec.core.policy import PolicyConfig, PolicyState, choose_k, step
from specdec.v1 import orchestrator_pb2 as pb

BY_SOURCE = "by_source"  # key of the secondary sources' states inside SessionState.policy
SUFFIX = "suffix"
MODEL = "model"


def fresh_source_state(main: PolicyState) -> PolicyState:
    """A new source's state: the session's shared estimates from `main`, its own ones unknown."""
    return replace(main, rounds=0, alpha=None, accepted_ewma=None, rejected_ewma=None, rtt_draft_s=None,
                   draft_token_s=None, proposal_rate=None, backoff=0, resume_probe=False, speculating=False)


class SourcedDraftLength:
    """`DraftLength` for a hybrid draft: `wanted` and `upcoming` priced with the state of the source
    predicted to draft the next round (`next_source`); `observe` takes the round's source."""

    def __init__(self, main: DraftLength, suffix: PolicyState | None, config: PolicyConfig) -> None:
        self.main = main  # the model's state (SessionState.policy)
        self.suffix = suffix  # suffix speculation's (None with a fixed draft length)
        self.config = config
        self.suffix_upcoming = choose_k(suffix, config) if suffix is not None else main.fixed
        self.next_source = MODEL

    @classmethod
    async def of(cls, state: SessionState, drafting: bool, store: SessionStore,
                 config: PolicyConfig) -> SourcedDraftLength:
        main = await DraftLength.of(state, drafting, store, config)
        suffix = None
        if main.policy is not None:
            stored = (state.policy or {}).get(BY_SOURCE, {}).get(SUFFIX)
            suffix = PolicyState.from_dict(stored) if stored else fresh_source_state(main.policy)
        return cls(main, suffix, config)

    @property
    def policy(self) -> PolicyState | None:
        """The state pricing the next round."""
        return self.suffix if self.next_source == SUFFIX else self.main.policy

    @property
    def wanted(self) -> int:
        policy = self.policy
        return policy.k if policy is not None else self.main.fixed

    @property
    def upcoming(self) -> int:
        if self.main.policy is None:
            return self.main.fixed
        return self.suffix_upcoming if self.next_source == SUFFIX else self.main.upcoming

    def observe(self, state: SessionState, stats: pb.RoundStats, loop_s: float, source: str = "") -> None:
        """Let the state of the round's source learn from it (every state, when it drafted nothing)."""
        drafted = stats.proposed > 0
        self.next_source = SUFFIX if drafted and source == SUFFIX else MODEL
        if self.main.policy is None or self.suffix is None:
            return
        obs = observation(stats, loop_s)
        if not drafted or source != SUFFIX:
            _, self.main.upcoming, self.main.policy = step(self.main.policy, obs, self.config)
        if not drafted or source == SUFFIX:
            _, self.suffix_upcoming, self.suffix = step(self.suffix, obs, self.config)
        state.policy = {**self.main.policy.to_dict(), BY_SOURCE: {SUFFIX: self.suffix.to_dict()}}

    def acceptance(self) -> dict[str, float | None]:
        """Each source's acceptance estimate α (None: not measured yet, or a fixed draft length)."""
        return {MODEL: self.main.policy.alpha if self.main.policy is not None else None,
                SUFFIX: self.suffix.alpha if self.suffix is not None else None}

    async def finish(self, store: SessionStore) -> None:
        """The model's state joins the global prior (the prior describes the model draft)."""
        await self.main.finish(store)
