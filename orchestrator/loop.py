"""One speculative round: the draft proposes k tokens, the target verifies them in one pass.

Every round yields between 1 and k + 1 tokens: the accepted draft tokens plus the target's own
token (recovered at the first rejection, or the bonus when all k were accepted). With k = 0, or
when the draft is down, the round is plain target decoding through the same verify call.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.backends import DraftBackend, DraftUnavailable, Proposal, TargetBackend
from specdec.core.sampling import SamplingParams
from specdec.v1 import orchestrator_pb2


@dataclass
class Round:
    emitted: list[int]  # accepted draft tokens + the target's token
    stats: orchestrator_pb2.RoundStats


async def speculative_round(
    session_id: str,
    history: list[int],
    k: int,
    params: SamplingParams,
    seed: int,
    draft: DraftBackend | None,
    target: TargetBackend,
    fingerprint: str,
) -> Round:
    proposal, fallback = Proposal(), False
    if k > 0 and draft is not None and draft.available:
        try:
            proposal = await draft.propose(session_id, history, k, params, seed, fingerprint)
        except DraftUnavailable:
            fallback = True  # the session goes on at k = 0; no client-visible error
    verdict = await target.verify(session_id, history, proposal, params, seed)
    emitted = proposal.tokens[:verdict.num_accepted] + [verdict.token_id]
    stats = orchestrator_pb2.RoundStats(
        draft_length=k, proposed=len(proposal.tokens), accepted=verdict.num_accepted,
        draft_ns=proposal.wall_ns, draft_compute_ns=proposal.compute_ns,
        verify_ns=verdict.wall_ns, verify_compute_ns=verdict.compute_ns, draft_fallback=fallback,
    )
    return Round(emitted, stats)
