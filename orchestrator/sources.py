"""Per-source draft lengths, for a draft that names several sources (`ModelInfo.draft_sources`: a
hybrid draft, `python -m draft_service --proposer hybrid`, names "model" and "suffix"), and the
factory that picks a generation's controller.

Such a draft proposes each block from one of its sources (`Proposal.source` names it): a hybrid's
suffix speculation when it is confident, its model otherwise. Their acceptance and costs differ
by far (a confident suffix match is mostly accepted and costs no forward pass; the model's
acceptance is its own), so one controller state fed by both would price every round with a
blend that fits neither. `SourcedDraftLength` keeps one `PolicyState` per source:

- the primary source's (the first the draft names: the one that drafts when the others propose
  nothing, a hybrid's model) is the session's usual state (`SessionState.policy`, the one folded
  into the global prior when the generation ends); each other source's lives beside it in the
  same record, under `policy["by_source"][source]` (for a hybrid, `policy["by_source"]["suffix"]`:
  a key `PolicyState.from_dict` ignores, so a replica that keeps one state reads the record and
  merely drops it on its next write);
- a round drafted by one source teaches that source's state only (a source the draft did not
  name teaches the primary's); a round that drafted nothing (k = 0, the first round, a draft that
  failed) teaches them all: it says nothing about acceptance, only about the verify cost and the
  draft's health (a failure backs them all off);
- the next round is priced with the state of the source predicted to draft it: another source
  after a round it drafted (a confident match tends to last while the text repeats), the primary
  otherwise. The draft still decides per call: a round priced for the suffix that the model
  drafts teaches the model's state, and the next is priced for the model;
- where the primary's state would draft nothing (k = 0: the model does not pay), the round is
  asked of the other sources alone (`ProposeRequest.sources`): priced for the one predicted to
  draft it, or, after a round nobody drafted, for the other source whose state would draft the
  most (one not measured yet is asked for a first block while it keeps proposing). A hybrid
  draft asked for its suffix alone answers a confident match or nothing, never a model block:
  without this a session whose prior says the model does not pay would ask for nothing, and find
  its suffix matches only at the primary's exploration probes. Such a round teaches the sources
  it was asked of; one that drafted nothing is a plain round for the others.

Another source's state starts from the primary's as it stands (verify cost, round trips, the
loop's own time are the session's, whatever drafts), with its acceptance, draft cost and proposal
rate unknown. A fixed draft length (not `auto`) needs no state: rounds are only counted by source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from orchestrator.draft_length import DraftLength, DraftLengthController, observation
from orchestrator.store import SessionState, SessionStore
from specdec.core.policy import PolicyConfig, PolicyState, choose_k, passes_before_exploration, step
from specdec.v1 import orchestrator_pb2 as pb

BY_SOURCE = "by_source"  # key of the other sources' states inside SessionState.policy
UNMEASURED_K = 2  # the block asked of a source whose acceptance is not measured yet
UNMEASURED_MIN_RATE = 0.25  # ... while it proposes at least this share of the tokens it is asked for


async def controller_for(state: SessionState, store: SessionStore, config: PolicyConfig, drafting: bool,
                         sources: Sequence[str]) -> DraftLengthController:
    """A generation's draft-length controller, from what the draft pool reports: one state per source
    when the draft names several (`sources`, ModelInfo.draft_sources), one state otherwise."""
    if drafting and len(sources) > 1:
        return await SourcedDraftLength.of(state, drafting, store, config, sources)
    return await DraftLength.of(state, drafting, store, config)


def fresh_source_state(main: PolicyState) -> PolicyState:
    """A new source's state: the session's shared estimates from `main`, its own ones unknown."""
    return replace(main, rounds=0, alpha=None, accepted_ewma=None, rejected_ewma=None, rtt_draft_s=None,
                   draft_token_s=None, proposal_rate=None, backoff=0, resume_probe=False, speculating=False)


class SourcedDraftLength:
    """`DraftLength` with one state per source: `wanted` and `upcoming` priced with the state of the
    source predicted to draft the next round (`next_source`); `observe` teaches the round's source."""

    def __init__(self, main: DraftLength, primary: str, others: dict[str, PolicyState],
                 config: PolicyConfig) -> None:
        self.main = main  # the primary source's state (SessionState.policy)
        self.primary = primary
        self.others = others  # every other source's (none with a fixed draft length)
        self.config = config
        self.others_upcoming = {source: choose_k(policy, config) for source, policy in others.items()}
        self.next_source = primary

    @classmethod
    async def of(cls, state: SessionState, drafting: bool, store: SessionStore, config: PolicyConfig,
                 sources: Sequence[str]) -> SourcedDraftLength:
        main = await DraftLength.of(state, drafting, store, config)
        others: dict[str, PolicyState] = {}
        if main.policy is not None:
            stored = (state.policy or {}).get(BY_SOURCE, {})
            others = {source: PolicyState.from_dict(stored[source]) if stored.get(source)
                      else fresh_source_state(main.policy) for source in sources[1:]}
        return cls(main, sources[0], others, config)

    @property
    def policy(self) -> PolicyState | None:
        """The state pricing the next round."""
        return self.others.get(self.next_source, self.main.policy)

    @property
    def wanted(self) -> int:
        return self._plan()[0]

    @property
    def sources(self) -> tuple[str, ...]:
        return self._plan()[1]

    def _plan(self) -> tuple[int, tuple[str, ...]]:
        """The next round's draft length and the sources it is asked of (empty: any)."""
        main = self.main.policy
        if main is None:
            return self.main.fixed, ()
        other = self.others.get(self.next_source)
        if other is not None:  # priced for the source that drafted the last round
            return other.k, ((self.next_source,) if main.k == 0 else ())
        if main.k > 0:
            return main.k, ()
        k, name = max(((self._ask(policy), name) for name, policy in self.others.items()), default=(0, ""))
        return (k, (name,)) if k > 0 else (0, ())

    def _ask(self, policy: PolicyState) -> int:
        """The block to ask of another source alone where the primary would draft nothing: its own
        choice once its acceptance is measured; before that, a new session's first block
        (`UNMEASURED_K`) while it proposes at least `UNMEASURED_MIN_RATE` of what it is asked (a
        source that keeps finding nothing is asked no more: its exploration probes retry it)."""
        if policy.alpha is not None or policy.backoff > 0:
            return policy.k
        rate = policy.proposal_rate
        return min(UNMEASURED_K, self.config.k_max) if rate is None or rate >= UNMEASURED_MIN_RATE else policy.k

    @property
    def upcoming(self) -> int:
        return self.others_upcoming.get(self.next_source, self.main.upcoming)

    @property
    def room(self) -> int:
        return min([self.main.room, *(passes_before_exploration(p, self.config) for p in self.others.values())])

    def observe(self, state: SessionState, stats: pb.RoundStats, loop_s: float, source: str = "",
                asked: tuple[str, ...] = ()) -> None:
        """Let the state of the round's source learn from it (every state, when it drafted nothing);
        a round asked of some sources alone (`asked`) teaches those, and is a plain round for the
        others when it drafted nothing."""
        drafted = stats.proposed > 0
        self.next_source = source if drafted and source in self.others else self.primary
        if self.main.policy is None:
            return
        obs = observation(stats, loop_s)
        only = {name for name in asked if name in self.others}
        if only:
            for name in only:
                _, self.others_upcoming[name], self.others[name] = step(self.others[name], obs, self.config)
            if not drafted:  # for the sources not asked, a round that verified one position
                plain = replace(obs, k=0, draft_wall_s=0.0, draft_compute_s=0.0, drafted=0, draft_prefill_tokens=0)
                _, self.main.upcoming, self.main.policy = step(self.main.policy, plain, self.config)
                for name in set(self.others) - only:
                    _, self.others_upcoming[name], self.others[name] = step(self.others[name], plain, self.config)
        else:
            if not drafted or source not in self.others:
                _, self.main.upcoming, self.main.policy = step(self.main.policy, obs, self.config)
            for name, policy in self.others.items():
                if not drafted or source == name:
                    _, self.others_upcoming[name], self.others[name] = step(policy, obs, self.config)
        state.policy = {**self.main.policy.to_dict(),
                        BY_SOURCE: {name: policy.to_dict() for name, policy in self.others.items()}}

    def acceptance(self) -> dict[str, float | None]:
        """Each source's acceptance estimate α (None: not measured yet, or a fixed draft length)."""
        main = self.main.policy.alpha if self.main.policy is not None else None
        return {self.primary: main, **{name: policy.alpha for name, policy in self.others.items()}}

    async def finish(self, store: SessionStore) -> None:
        """The primary source's state joins the global prior (the prior describes the drafts' primary source)."""
        await self.main.finish(store)
