"""Target-side verification: score k + 1 positions in one forward pass, then apply the rule."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from specdec.core.acceptance import Verdict, verify
from specdec.core.sampling import TARGET_STREAM, SamplingParams, derive_generator
from specdec.errors import InvalidArgument
from specdec.runtime.kv import SessionCaches
from specdec.runtime.latency import LatencyProfile


@dataclass(frozen=True)
class Verification:
    verdict: Verdict
    compute_ns: int
    prefill_tokens: int


class Verifier:
    def __init__(self, caches: SessionCaches, vocab_size: int, profile: LatencyProfile = LatencyProfile()) -> None:
        self.caches = caches
        self.vocab_size = vocab_size
        self.profile = profile

    def verify(self, session_id: str, history: list[int], draft_tokens: list[int],
               draft_probs: np.ndarray | None, params: SamplingParams, seed: int) -> Verification:
        """draft_probs: `[k, V]` float32 q rows, or None for greedy / a deterministic draft."""
        start = time.perf_counter_ns()
        k = len(draft_tokens)
        if draft_probs is not None and draft_probs.shape != (k, self.vocab_size):
            raise InvalidArgument(
                f"draft_probs has shape {tuple(draft_probs.shape)}, expected ({k}, {self.vocab_size})"
            )
        logits, prefilled = self.caches.score(session_id, history, draft_tokens)  # [k+1, V]
        generator = None if params.greedy else derive_generator(seed, len(history), TARGET_STREAM)
        q = None if draft_probs is None or params.greedy else torch.tensor(draft_probs, dtype=torch.float64)
        verdict = verify(logits, torch.tensor(draft_tokens, dtype=torch.long), q, params, generator)
        # Keep only the accepted prefix; the emitted token is fed at the start of the next round.
        self.caches.rollback(session_id, len(history) + verdict.num_accepted)
        self.profile.pad(start, k + 1)
        return Verification(verdict, time.perf_counter_ns() - start, prefilled)
