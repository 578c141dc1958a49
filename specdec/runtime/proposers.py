"""Draft sources behind one interface: a causal LM, or model-free prompt lookup.

A proposer yields draft tokens one at a time so the draft service can stream each as soon as it
exists. With sampling, a model proposer also yields the processed draft distribution q of each
position; a deterministic proposer (prompt lookup) yields none, which the verifier reads as a
one-hot q at the proposed token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np
import torch

from specdec.core.ngram import propose_ngram
from specdec.core.sampling import DRAFT_STREAM, SamplingParams, derive_generator, logits_to_probs, sample
from specdec.runtime.kv import SessionCaches
from specdec.runtime.latency import LatencyProfile


@dataclass(frozen=True)
class DraftToken:
    token_id: int
    probs: np.ndarray | None  # [V] float32 q after temperature/top-k/top-p; None if greedy/deterministic
    compute_ns: int
    prefill_tokens: int = 0


class Proposer(Protocol):
    kind: str

    def propose(self, session_id: str, history: list[int], k: int, params: SamplingParams,
                seed: int) -> Iterator[DraftToken]: ...

    def rollback(self, session_id: str, length: int) -> int: ...

    def release(self, session_id: str) -> bool: ...

    def cached_sessions(self) -> int: ...


class ModelProposer:
    """Autoregressive proposals from a causal LM with a per-session KV cache."""

    kind = "model"

    def __init__(self, caches: SessionCaches, profile: LatencyProfile = LatencyProfile()) -> None:
        self.caches = caches
        self.profile = profile

    def propose(self, session_id: str, history: list[int], k: int, params: SamplingParams,
                seed: int) -> Iterator[DraftToken]:
        generator = None if params.greedy else derive_generator(seed, len(history), DRAFT_STREAM)
        context = list(history)
        for _ in range(k):
            start = time.perf_counter_ns()
            logits, prefilled = self.caches.score(session_id, context, [])  # [1, V]
            if params.greedy:
                token, q = int(torch.argmax(logits[-1])), None
            else:
                q64 = logits_to_probs(logits[-1:], params)[0]  # [V]
                token = sample(q64, generator)
                q = q64.to(torch.float32).numpy()
            context.append(token)
            self.profile.pad(start, 1)
            yield DraftToken(token, q, time.perf_counter_ns() - start, prefilled)

    def rollback(self, session_id: str, length: int) -> int:
        return self.caches.rollback(session_id, length)

    def release(self, session_id: str) -> bool:
        return self.caches.release(session_id)

    def cached_sessions(self) -> int:
        return len(self.caches)


class NgramProposer:
    """Prompt lookup: propose the tokens that followed the latest earlier match of the suffix."""

    kind = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, session_id: str, history: list[int], k: int, params: SamplingParams,
                seed: int) -> Iterator[DraftToken]:
        start = time.perf_counter_ns()
        tokens = propose_ngram(history, k, self.max_ngram, self.min_ngram)
        elapsed = time.perf_counter_ns() - start
        for token in tokens:
            yield DraftToken(token, None, elapsed // max(len(tokens), 1))

    def rollback(self, session_id: str, length: int) -> int:
        return 0

    def release(self, session_id: str) -> bool:
        return False

    def cached_sessions(self) -> int:
        return 0
