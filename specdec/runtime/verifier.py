"""Target-side verification: score k + 1 positions in one forward pass, then apply the rule.

`Verifier.job` turns a request into a `VerifyJob` for the `Batcher`, which scores the blocks of
many sessions in one forward pass; the acceptance rule then runs per session on that session's
rows, with that session's own seeded generator, exactly as when the block is verified alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.core.acceptance import Verdict, verify
from specdec.core.logprobs import TokenLogprob, logprobs_of
from specdec.core.processors import process_block
from specdec.core.sampling import TARGET_STREAM, SamplingParams, derive_generator
from specdec.errors import FailedPrecondition, InvalidArgument
from specdec.runtime.batching import MAX_SCORED_POSITIONS, MAX_STEP_TOKENS, Job
from specdec.runtime.grammars import SessionGrammars, grammar_of
from specdec.runtime.kv import Scored, ScoreRequest, SessionCaches


def accept_block(logits: torch.Tensor, history_length: int, draft_tokens: list[int], draft_probs: np.ndarray | None,
                 params: SamplingParams, seed: int) -> Verdict:
    """The acceptance rule on a block's target logits `[k+1, V]` (already processed: see
    `process_block`), with the session's generator."""
    if params.greedy:  # the argmax runs where the logits are; only k + 1 ids come back
        return verify(logits, draft_tokens, None, params, None)
    # The sampling maths runs on the host in float64, so a seed draws the same tokens on any device.
    generator = derive_generator(seed, history_length, TARGET_STREAM)
    logits = logits.cpu()
    q = None if draft_probs is None else torch.tensor(draft_probs, dtype=torch.float64)
    return verify(logits, draft_tokens, q, params, generator)


def target_rows(logits: torch.Tensor, session_id: str, context: list[int], block: list[int], params: SamplingParams,
                grammars: SessionGrammars | None) -> torch.Tensor:
    """Rows `[N, V]` of the target's logits as the target alone would sample them: row i after
    `context + block[:i]`, through the processors and, when the request has one, the grammar (over the
    output part: it starts at `params.output_start`, within `context`)."""
    spec = grammar_of(params)
    if spec is None or grammars is None or len(context) < params.output_start:
        return process_block(logits, context, block, params)
    masks = grammars.block_masks(session_id, spec, context[params.output_start:], block)  # [len(block) + 1, V]
    return process_block(logits, context, block, params, masks[:logits.shape[0]])


@dataclass(frozen=True)
class LogprobRequest:
    """What a verify call wants back besides its verdict: the emitted tokens' log-probabilities."""

    top: int = 0  # alternatives per position (0..20)
    mode: str = "raw"  # "raw" (the model's softmax) or "processed" (what the token was drawn from)


@dataclass(frozen=True)
class Verified:
    verdict: Verdict
    prefilled: int
    logprobs: list[TokenLogprob] = field(default_factory=list)


class VerifyJob(Job):
    """One block to verify: a single batched step, then the acceptance rule and the rollback."""

    def __init__(self, session_id: str, history: list[int], draft_tokens: list[int], draft_probs: np.ndarray | None,
                 params: SamplingParams, seed: int, deadline: float | None = None,
                 logprobs: LogprobRequest | None = None, grammars: SessionGrammars | None = None) -> None:
        super().__init__(session_id, deadline)
        self.grammars = grammars
        self.history = history
        self.draft_tokens = draft_tokens
        self.draft_probs = draft_probs
        self.params = params
        self.seed = seed
        self.logprobs = logprobs

    def request(self) -> ScoreRequest:
        return ScoreRequest(self.session_id, self.history, self.draft_tokens)

    def advance(self, scored: Scored, caches: SessionCaches) -> tuple[Verified, bool]:
        logits = target_rows(scored.logits, self.session_id, self.history, self.draft_tokens, self.params,
                             self.grammars)  # [k+1, V]
        verdict = accept_block(logits, len(self.history), self.draft_tokens, self.draft_probs, self.params,
                               self.seed)
        # Keep only the accepted prefix; the emitted token is fed at the start of the next round.
        caches.rollback(self.session_id, len(self.history) + verdict.num_accepted)
        return Verified(verdict, scored.prefilled, self._logprobs(scored.logits, logits, verdict)), True

    def _logprobs(self, raw: torch.Tensor, processed: torch.Tensor, verdict: Verdict) -> list[TokenLogprob]:
        """The emitted tokens' log-probabilities, from the rows of this pass that scored them."""
        if self.logprobs is None:
            return []
        rows = verdict.num_accepted + 1
        if self.logprobs.mode == "raw":
            return logprobs_of(raw[:rows], verdict.emitted(self.draft_tokens), self.logprobs.top)
        return logprobs_of(processed[:rows], verdict.emitted(self.draft_tokens), self.logprobs.top, self.params)


class ScoreJob(Job):
    """Log-probabilities of `tokens[start:]`, each after the tokens before it, leaving them in the
    session's cache. `params` None: the raw softmax; else `logprobs.mode` under `params` (the
    processors see each position's own context, as in a verify).

    A prompt costs what its prefill costs: a step scores at most `positions` of them (one pass each,
    under the batcher's prefill budget, which the history before `start` is fed under too), and its
    item is that step's log-probabilities, so no more than a step's logits are held at once."""

    def __init__(self, session_id: str, tokens: list[int], start: int, logprobs: LogprobRequest,
                 params: SamplingParams | None, deadline: float | None = None,
                 grammars: SessionGrammars | None = None, positions: int = MAX_SCORED_POSITIONS) -> None:
        super().__init__(session_id, deadline)
        if positions < 1:
            raise ValueError(f"a step scores at least one position, got {positions}")
        self.grammars = grammars
        self.tokens = tokens
        self.start = start
        self.logprobs = logprobs
        self.params = params
        self.positions = positions
        self.next = start  # the first position the next step scores

    def _span(self) -> tuple[int, int]:
        return self.next, min(len(self.tokens), self.next + self.positions)

    def request(self) -> ScoreRequest:
        # Rows of tokens[lo:hi] are the logits after tokens[:lo] and each of tokens[lo:hi - 1]: the
        # last token of the span is scored, not fed (the next step feeds it).
        lo, hi = self._span()
        return ScoreRequest(self.session_id, self.tokens[:lo], self.tokens[lo:hi - 1])

    def advance(self, scored: Scored, caches: SessionCaches) -> tuple[list[TokenLogprob], bool]:
        lo, hi = self._span()
        rows, span = scored.logits, self.tokens[lo:hi]  # [hi - lo, V]: row i after tokens[:lo + i]
        if self.params is None or self.logprobs.mode == "raw":
            entries = logprobs_of(rows, span, self.logprobs.top)
        else:
            processed = target_rows(rows, self.session_id, self.tokens[:lo], span[:-1], self.params, self.grammars)
            entries = logprobs_of(processed, span, self.logprobs.top, self.params)
        self.next = hi
        return entries, hi == len(self.tokens)


class Verifier:
    """Checks verify requests against the model's vocabulary and makes their jobs."""

    def __init__(self, caches: SessionCaches, vocab_size: int, grammars: SessionGrammars | None = None,
                 score_positions: int = MAX_SCORED_POSITIONS) -> None:
        """`score_positions`: what a prompt-scoring job scores a pass at most (the batcher's
        `BatchConfig.score_positions`)."""
        self.caches = caches
        self.vocab_size = vocab_size
        self.grammars = grammars
        self.score_positions = score_positions

    def job(self, session_id: str, history: list[int], draft_tokens: list[int], draft_probs: np.ndarray | None,
            params: SamplingParams, seed: int, deadline: float | None = None,
            logprobs: LogprobRequest | None = None) -> VerifyJob:
        """A checked job for the batcher. draft_probs: `[k, V]` float32 q rows, or None."""
        if params.output_start > len(history):
            raise InvalidArgument(f"sampling.output_start={params.output_start} lies beyond the history "
                                  f"({len(history)} tokens)")
        k = len(draft_tokens)
        if k > MAX_STEP_TOKENS:
            raise InvalidArgument(f"{k} draft tokens: a verify takes at most {MAX_STEP_TOKENS}")
        if draft_probs is not None and draft_probs.shape != (k, self.vocab_size):
            raise InvalidArgument(
                f"draft_probs has shape {tuple(draft_probs.shape)}, expected ({k}, {self.vocab_size})"
            )
        self._check_grammar(params)
        return VerifyJob(session_id, history, draft_tokens, draft_probs, params, seed, deadline, logprobs,
                         self.grammars)

    def _check_grammar(self, params: SamplingParams | None) -> None:
        if params is not None and params.grammar_kind and self.grammars is None:
            raise FailedPrecondition("this target service has no tokenizer to apply grammars with")

    def score_job(self, session_id: str, tokens: list[int], start: int, logprobs: LogprobRequest,
                  params: SamplingParams | None, deadline: float | None = None) -> ScoreJob:
        """A checked prompt-scoring job for the batcher."""
        if not 1 <= start < len(tokens):
            raise InvalidArgument(f"start must lie in [1, {len(tokens)}) (the first token of a sequence has no "
                                  f"log-probability), got {start}")
        if max(tokens) >= self.vocab_size:
            raise InvalidArgument(f"token {max(tokens)} is outside the vocabulary (ids below {self.vocab_size})")
        self._check_grammar(params)
        return ScoreJob(session_id, tokens, start, logprobs, params, deadline, self.grammars, self.score_positions)
