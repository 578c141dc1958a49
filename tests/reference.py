"""Target-only reference decoding with plain transformers, for comparison with the pipeline."""

from __future__ import annotations

import torch

from specdec.core.sampling import SamplingParams, logits_to_probs
from specdec.runtime.models import load_model


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
