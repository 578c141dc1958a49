"""Logits processors: each against an independent reference (transformers' own processors where one
exists), row i of a block equal to the same processor run on the context up to that row, and the
lossless rule with processors: greedy and sampled speculation give the processed target's output."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from specdec.core.acceptance import verify
from specdec.core.logprobs import log_distribution, token_logprobs
from specdec.core.processors import process_block
from specdec.core.sampling import SamplingParams, derive_generator, logits_to_probs, sample

V = 50


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


def test_no_processor_returns_the_logits_unchanged():
    x = logits(3)
    assert process_block(x, [1, 2], [3, 4], SamplingParams()) is x


def test_repetition_penalty_equals_transformers():
    history, params = [4, 9, 9, 17, 3], SamplingParams(repetition_penalty=1.7)
    x = logits(1)
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([history]), x.clone())
    assert torch.allclose(process_block(x, history, [], params), expected, atol=0, rtol=0)


def test_min_tokens_equals_transformers():
    history = [5, 6, 7, 8]  # a prompt of 2, then 2 output tokens
    params = SamplingParams(min_tokens=4, end_token_ids=(0, 11), output_start=2)
    x = logits(1)
    reference = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=4, eos_token_id=[0, 11])
    expected = reference(torch.tensor([history]), x.clone())
    assert torch.equal(process_block(x, history, [], params), expected)
    done = [5, 6, 7, 8, 9, 10]  # 4 output tokens: no longer held back
    assert torch.equal(process_block(x, done, [], params), x)


def test_frequency_presence_and_bias_follow_openais_definition():
    history = [1, 2, 3, 3, 3, 7]  # prompt [1, 2]; output 3 x3 and 7 x1
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.25, logit_bias=((7, 2.0), (40, -100.0)),
                            output_start=2)
    x = logits(1)
    expected = x.clone()
    expected[0, 7] += 2.0
    expected[0, 40] -= 100.0
    expected[0, 3] -= 3 * 0.5 + 1.25
    expected[0, 7] -= 1 * 0.5 + 1.25
    assert torch.allclose(process_block(x, history, [], params), expected, atol=1e-12)


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4, output_start=2),
    SamplingParams(min_tokens=6, end_token_ids=(3,), output_start=3, logit_bias=((5, 1.5),)),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=1.0, min_tokens=4, end_token_ids=(9,), output_start=1),
])
def test_row_i_sees_the_block_tokens_before_it(params):
    """Processing a block's rows at once equals processing each row alone on its own context."""
    history, block = [2, 3, 3, 9, 4], [3, 9, 9, 12]
    x = logits(len(block) + 1, seed=3)
    together = process_block(x, history, block, params)
    for i in range(len(block) + 1):
        alone = process_block(x[i:i + 1], history + block[:i], [], params)
        assert torch.equal(together[i:i + 1], alone), i


def test_min_p_keeps_tokens_within_the_ratio_of_the_most_likely():
    x = logits(2, seed=5)
    params = SamplingParams(temperature=0.7, min_p=0.2)
    p = logits_to_probs(x, params)
    reference = torch.softmax(MinPLogitsWarper(0.2)(None, x / 0.7), dim=1)
    assert torch.allclose(p, reference, atol=1e-12)


@pytest.mark.parametrize("name,value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                        ("repetition_penalty", 0.0), ("min_p", 1.5), ("min_tokens", -1)])
def test_out_of_range_values_are_refused_naming_the_field(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value}).validate()


def test_params_survive_a_json_round_trip():
    """Sessions store their params as JSON: the bias and end tokens come back as lists."""
    params = SamplingParams(logit_bias=((7, 2.0), (1, -1.0)), end_token_ids=(3, 2), min_tokens=2)
    again = SamplingParams(**{**params.__dict__, "logit_bias": [[7, 2.0], [1, -1.0]], "end_token_ids": [2, 3]})
    assert again == params and again.processed


def test_speculation_with_a_penalty_keeps_the_processed_target_distribution():
    """Exact check of the lossless rule under a penalty: the probability of each emitted first token,
    summed over the draft's q and the acceptance test, equals the processed target's p at that
    position (estimated by sampling the verifier with many seeds, compared with chi-square bounds)."""
    torch.manual_seed(0)
    history = [1, 2, 2, 4]
    params = SamplingParams(temperature=1.0, frequency_penalty=1.5, presence_penalty=0.5, output_start=1)
    target = logits(2, seed=11)[:, :8]  # a small vocabulary keeps the test quick
    draft = logits(1, seed=12)[:, :8]
    q = logits_to_probs(process_block(draft, history, [], params), params)  # [1, 8]
    p0 = logits_to_probs(process_block(target[:1], history, [], params), params)[0]  # the target alone, position 0
    counts = torch.zeros(8)
    trials = 2500
    for s in range(trials):
        g = derive_generator(s, len(history), 1)
        x = sample(q[0], g)
        processed = process_block(target, history, [x], params)
        verdict = verify(processed, [x], q, params, derive_generator(s, len(history), 2))
        counts[verdict.emitted([x])[0]] += 1
    expected = p0 * trials
    keep = expected > 5
    chi2 = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    assert chi2 < 24.3, (counts, expected)  # 99.9th percentile of chi-square with 7 degrees of freedom


def test_greedy_speculation_with_processors_equals_the_processed_argmax():
    params = SamplingParams(repetition_penalty=2.0, logit_bias=((4, 3.0),))
    history = [4, 4, 1]
    x = logits(3, seed=21)
    best = []
    context = list(history)
    for i in range(3):
        row = process_block(x[i:i + 1], context, [], params)
        best.append(int(row.argmax()))
        context.append(best[-1])
    block = best[:2]
    verdict = verify(process_block(x, history, block, params), block, None, params, None)
    assert verdict.num_accepted == 2 and verdict.emitted(block) == best


def test_logprobs_are_the_log_softmax_with_ranks_and_top():
    x = logits(3, seed=8)
    tokens = [int(x[0].argmax()), int(x[1].argsort(descending=True)[4]), 0]
    entries = token_logprobs(log_distribution(x, None), tokens, top=5)
    reference = torch.log_softmax(x, dim=1)
    for i, entry in enumerate(entries):
        assert entry.token == tokens[i]
        assert math.isclose(entry.logprob, float(reference[i, tokens[i]]), abs_tol=1e-12)
        assert entry.rank == 1 + int((reference[i] > reference[i, tokens[i]]).sum())
        assert [t for t, _ in entry.top] == reference[i].argsort(descending=True)[:5].tolist()
    assert entries[0].rank == 1 and entries[1].rank == 5


def test_processed_logprobs_describe_the_distribution_drawn_from():
    x = logits(1, seed=9)
    params = SamplingParams(temperature=0.5, top_k=3)
    table = log_distribution(x, params)
    assert torch.isinf(table).sum() == V - 3
    assert math.isclose(float(table.exp().sum()), 1.0, abs_tol=1e-12)
    with pytest.raises(ValueError, match="top_logprobs"):
        token_logprobs(table, [0], top=21)


def test_the_grammar_wins_over_min_tokens_where_it_allows_only_the_end():
    """Row 0: the grammar allows only EOS (it is complete): min_tokens would leave nothing, so EOS
    stays. Row 1: the grammar allows EOS and token 2: min_tokens holds EOS back as usual."""
    eos, v = 0, 5
    params = SamplingParams(min_tokens=5, end_token_ids=(eos,))
    logits = torch.zeros(2, v, dtype=torch.float64)
    allowed = torch.tensor([[True, False, False, False, False], [True, False, True, False, False]])
    out = process_block(logits, [1, 2, 3], [4], params, allowed)
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False, False]
    assert torch.isfinite(out[1]).tolist() == [False, False, True, False, False]
    assert torch.isinf(process_block(logits, [1, 2, 3], [4], params)[:, eos]).all()  # no grammar: held back
    plain = SamplingParams()  # no processor on: only the grammar's mask
    assert torch.isfinite(process_block(logits, [1], [4], plain, allowed)).tolist() == allowed.tolist()
