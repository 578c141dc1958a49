"""Per-round bookkeeping of a generation: draft lengths within budget, stop conditions, the
counters on its records, and the statistics of its last chunk. No I/O."""

from __future__ import annotations

import time

from orchestrator.store import GenerationRecord, SessionState
from orchestrator.text import TextStream
from specdec.v1 import orchestrator_pb2 as pb

# Finish reasons by name, as the SDK (specdec.client) names them.
FINISH_NAMES = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_EOS: "eos", pb.FINISH_REASON_STOP: "stop"}
# The `finish_reason` label of specdec_request_success_total speaks OpenAI: EOS counts as "stop".
METRIC_LABELS = {"length": "length", "eos": "stop", "stop": "stop"}


def finish_label(finish: int) -> str:
    """The metric label of a finish reason."""
    return METRIC_LABELS[FINISH_NAMES[finish]]


def remaining_tokens(state: SessionState, max_context: int) -> int:
    """Tokens the generation may still add: its own limit, or the room left in the context."""
    gen = state.generation
    return min(gen.max_new_tokens - (len(state.tokens) - gen.start), max_context - len(state.tokens))


def draft_lengths(wanted: int, upcoming: int, remaining: int, first: bool, drafting: bool) -> tuple[int, int]:
    """k for this round and k_next for the block an overlapped draft proposes during its verify.

    The first round drafts nothing: its token comes from the target's prefill alone (the shortest
    time to first token) while the draft prefills, overlapped, for the next block. `upcoming` is
    what the controller would choose now: 0 while it holds k = 0 (a plain round then makes no
    second call). Neither block outruns the tokens still wanted (docs/orchestrator.md).
    """
    if not drafting:
        return 0, 0
    k = 0 if first else max(0, min(wanted, remaining - 1))
    return k, max(0, min(upcoming, remaining - k - 2))


def apply_stops(emitted: list[int], remaining: int, text: TextStream, eos_ids: set[int],
                stop_ids: set[int] = frozenset()) -> tuple[list[int], int]:
    """The round's tokens up to the first stop (EOS, a stop token or string, the budget), and the
    finish. `eos_ids` is empty when the request ignores end-of-sequence."""
    kept: list[int] = []
    for token in emitted[:remaining]:
        kept.append(token)
        if token in eos_ids:
            return kept, pb.FINISH_REASON_EOS
        if token in stop_ids:
            return kept, pb.FINISH_REASON_STOP
        text.push(token)
        if text.stopped:
            return kept, pb.FINISH_REASON_STOP
    return kept, (pb.FINISH_REASON_LENGTH if len(kept) == remaining else pb.FINISH_REASON_UNSPECIFIED)


def push_text(text: TextStream, tokens: list[int], eos_ids: set[int]) -> None:
    """Replay tokens already generated into a detokenizer (a resume catching up)."""
    for token in tokens:
        if token not in eos_ids and not text.stopped:
            text.push(token)


def record_round(state: SessionState, stats: pb.RoundStats, kept: list[int], finish: int, lease_s: float,
                 since_start_s: float) -> None:
    """Count a round on the generation and the session, append its tokens, renew or end the lease."""
    gen = state.generation
    gen.rounds += 1
    gen.draft_tokens += stats.proposed
    gen.accepted_tokens += stats.accepted
    gen.fallbacks += stats.draft_fallback
    gen.overlapped += stats.overlapped
    if not gen.first_token_s:
        gen.first_token_s = since_start_s
    gen.finish = finish
    gen.lease_until = 0.0 if finish else time.time() + lease_s
    state.tokens.extend(kept)
    state.rounds += 1
    state.draft_tokens += stats.proposed
    state.accepted_tokens += stats.accepted
    state.generated_tokens += len(kept)


def generation_stats(gen: GenerationRecord, completion_tokens: int, seed: int) -> pb.GenerationStats:
    elapsed = max(time.time() - gen.started_at, 0.0)
    n = completion_tokens
    return pb.GenerationStats(
        prompt_tokens=gen.prompt_tokens, completion_tokens=n, rounds=gen.rounds,
        draft_tokens=gen.draft_tokens, accepted_tokens=gen.accepted_tokens,
        acceptance_rate=gen.accepted_tokens / gen.draft_tokens if gen.draft_tokens else 0.0,
        mean_accepted_length=n / gen.rounds if gen.rounds else 0.0,
        elapsed_s=elapsed, tokens_per_second=n / elapsed if elapsed > 0 else 0.0,
        time_to_first_token_s=gen.first_token_s, seed=seed, draft_fallbacks=gen.fallbacks,
        overlapped_rounds=gen.overlapped,
    )
