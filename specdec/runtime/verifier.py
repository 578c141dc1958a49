"""Target-side verification: score k + 1 positions in one forward pass, then apply the rule.

`Verifier.job` turns a request into a `VerifyJob` for the `Batcher`, which scores the blocks of
many sessions in one forward pass; the acceptance rule then runs per session on that session's
rows, with that session's own seeded generator, exactly as when the block is verified alone.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.core.acceptance import Verdict, verify
from specdec.core.sampling import TARGET_STREAM, SamplingParams, derive_generator
from specdec.errors import InvalidArgument
from specdec.runtime.batching import Job
from specdec.runtime.kv import Scored, ScoreRequest, SessionCaches


def accept_block(logits: torch.Tensor, history_length: int, draft_tokens: list[int], draft_probs: np.ndarray | None,
                 params: SamplingParams, seed: int) -> Verdict:
    """The acceptance rule on a block's target logits `[k+1, V]`, with the session's generator."""
    if params.greedy:  # the argmax runs where the logits are; only k + 1 ids come back
        return verify(logits, draft_tokens, None, params, None)
    # The sampling maths runs on the host in float64, so a seed draws the same tokens on any device.
    generator = derive_generator(seed, history_length, TARGET_STREAM)
    logits = logits.cpu()
    q = None if draft_probs is None else torch.tensor(draft_probs, dtype=torch.float64)
    return verify(logits, draft_tokens, q, params, generator)


class VerifyJob(Job):
    """One block to verify: a single batched step, then the acceptance rule and the rollback."""

    def __init__(self, session_id: str, history: list[int], draft_tokens: list[int], draft_probs: np.ndarray | None,
                 params: SamplingParams, seed: int, deadline: float | None = None) -> None:
        super().__init__(session_id, deadline)
        self.history = history
        self.draft_tokens = draft_tokens
        self.draft_probs = draft_probs
        self.params = params
        self.seed = seed

    def request(self) -> ScoreRequest:
        return ScoreRequest(self.session_id, self.history, self.draft_tokens)

    def advance(self, scored: Scored, caches: SessionCaches) -> tuple[tuple[Verdict, int], bool]:
        verdict = accept_block(scored.logits, len(self.history), self.draft_tokens, self.draft_probs, self.params,
                               self.seed)
        # Keep only the accepted prefix; the emitted token is fed at the start of the next round.
        caches.rollback(self.session_id, len(self.history) + verdict.num_accepted)
        return (verdict, scored.prefilled), True


class Verifier:
    """Checks verify requests against the model's vocabulary and makes their jobs."""

    def __init__(self, caches: SessionCaches, vocab_size: int) -> None:
        self.caches = caches
        self.vocab_size = vocab_size

    def job(self, session_id: str, history: list[int], draft_tokens: list[int], draft_probs: np.ndarray | None,
            params: SamplingParams, seed: int, deadline: float | None = None) -> VerifyJob:
        """A checked job for the batcher. draft_probs: `[k, V]` float32 q rows, or None."""
        k = len(draft_tokens)
        if draft_probs is not None and draft_probs.shape != (k, self.vocab_size):
            raise InvalidArgument(
                f"draft_probs has shape {tuple(draft_probs.shape)}, expected ({k}, {self.vocab_size})"
            )
        return VerifyJob(session_id, history, draft_tokens, draft_probs, params, seed, deadline)
