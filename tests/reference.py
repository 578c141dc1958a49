"""References to compare with: target-only decoding with plain transformers, a block verified alone."""

from __future__ import annotations

import numpy as np
import torch

from specdec.core.acceptance import Verdict
from specdec.core.sampling import SamplingParams, logits_to_probs
from specdec.runtime.batching import Job
from specdec.runtime.kv import Scored, ScoreRequest, SessionCaches
from specdec.runtime.models import load_model
from specdec.runtime.verifier import Verifier


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """`[S, V]` logits of a plain forward pass over `tokens`, no cache."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]


class Reference:
    def __init__(self, model_dir: str, dtype: str = "float64") -> None:
        self.loaded = load_model(model_dir, dtype=dtype, progress=False)
        self.tokenizer = self.loaded.tokenizer

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def greedy(self, prompt: str, max_new_tokens: int) -> list[int]:
        """transformers `generate` with the target alone, greedy, stopping at EOS like the pipeline."""
        return self.greedy_ids(self.encode(prompt), max_new_tokens)

    def greedy_ids(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            out = self.loaded.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=self.loaded.eos_token_ids, pad_token_id=self.loaded.eos_token_ids[0],
            )
        tokens = out[0, ids.shape[1]:].tolist()
        for i, t in enumerate(tokens):
            if t in self.loaded.eos_token_ids:
                return tokens[: i + 1]
        return tokens

    def next_token_probs(self, contexts: list[list[int]], params: SamplingParams) -> torch.Tensor:
        """`[N, V]` processed target distributions after each context."""
        rows = []
        with torch.inference_mode():
            for ctx in contexts:
                logits = self.loaded.model(torch.tensor([ctx])).logits[0, -1:]
                rows.append(logits_to_probs(logits, params)[0])
        return torch.stack(rows)


def verify_alone(verifier: Verifier, session_id: str, history: list[int], draft_tokens: list[int],
                 draft_probs: np.ndarray | None, params: SamplingParams, seed: int) -> Verdict:
    """Verify one block on its own (no batcher): the reference the batched path must equal."""
    job = verifier.job(session_id, history, draft_tokens, draft_probs, params, seed)
    logits, prefilled = verifier.caches.score(session_id, history, draft_tokens)  # [k+1, V]
    verified, _ = job.advance(Scored(logits, prefilled), verifier.caches)
    return verified.verdict


class OnePassJob(Job):
    """A batcher job of one pass scoring `new` after `history`; its item is the `Scored`."""

    def __init__(self, session_id: str, history: list[int], new: list[int]) -> None:
        super().__init__(session_id)
        self.scored = ScoreRequest(session_id, history, new)

    def request(self) -> ScoreRequest:
        return self.scored

    def advance(self, scored: Scored, caches: SessionCaches) -> tuple[Scored, bool]:
        return scored, True
