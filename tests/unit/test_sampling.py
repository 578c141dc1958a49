"""Table tests for specdec.core.sampling: params validation, logits_to_probs, sample, seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.core.sampling import (
    DRAFT_STREAM,
    TARGET_STREAM,
    SamplingParams,
    derive_generator,
    logits_to_probs,
    sample,
)


def _logits(*probs: float) -> torch.Tensor:
    """One row of logits `[1, V]` whose softmax is `probs` (zeros become -inf)."""
    return torch.log(torch.tensor([probs], dtype=torch.float64))


# --- SamplingParams.validate ------------------------------------------------------------


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=-0.5), ["temperature", "-0.5", ">= 0"]),
        (SamplingParams(temperature=math.nan), ["temperature", "nan", "finite"]),
        (SamplingParams(temperature=math.inf), ["temperature", "inf", "finite"]),
        (SamplingParams(temperature=1.0, top_k=-1), ["top_k", "-1", ">= 0"]),
        (SamplingParams(temperature=1.0, top_p=0.0), ["top_p", "0.0", "(0, 1]"]),
        (SamplingParams(temperature=1.0, top_p=1.5), ["top_p", "1.5", "(0, 1]"]),
        (SamplingParams(temperature=1.0, top_p=math.nan), ["top_p", "nan", "(0, 1]"]),
        (SamplingParams(temperature=1.0, top_p=-0.1), ["top_p", "-0.1", "(0, 1]"]),
    ],
)
def test_validate_names_field_value_and_range(params: SamplingParams, expected: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        params.validate()
    for part in expected:
        assert part in str(info.value)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=0, top_p=1.0),
        SamplingParams(temperature=2.0, top_k=1, top_p=1e-9),
    ],
)
def test_validate_accepts_valid_params(params: SamplingParams) -> None:
    params.validate()


def test_greedy_is_temperature_zero() -> None:
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_k=5).greedy
    assert not SamplingParams(temperature=1e-3).greedy


# --- logits_to_probs ----------------------------------------------------------------------

Q = 0.125  # probabilities below are exact binary fractions


def _sp(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


@pytest.mark.parametrize(
    "logits, params, expected",
    [
        # temperature only
        (_logits(1, 2, 4), _sp(), [1 / 7, 2 / 7, 4 / 7]),
        (_logits(1, 2, 4), _sp(2.0), np.sqrt([1, 2, 4]) / (3 + np.sqrt(2))),
        (_logits(1, 2, 4), _sp(0.5), [1 / 21, 4 / 21, 16 / 21]),
        # top-k keeps the k largest
        (_logits(1, 2, 4, 1), _sp(top_k=2), [0, 1 / 3, 2 / 3, 0]),
        (_logits(1, 2, 4, 1), _sp(top_k=1), [0, 0, 1, 0]),
        (_logits(1, 2, 4, 1), _sp(top_k=4), [1 / 8, 2 / 8, 4 / 8, 1 / 8]),
        (_logits(1, 2, 4, 1), _sp(top_k=99), [1 / 8, 2 / 8, 4 / 8, 1 / 8]),
        # top-p keeps the smallest prefix (by probability) whose mass reaches top_p
        (_logits(4 * Q, 2 * Q, Q, Q), _sp(top_p=0.6), [2 / 3, 1 / 3, 0, 0]),
        (_logits(4 * Q, 2 * Q, Q, Q), _sp(top_p=0.8), [4 / 7, 2 / 7, 1 / 7, 0]),
        (_logits(Q, 2 * Q, 4 * Q, Q), _sp(top_p=0.8), [1 / 7, 2 / 7, 4 / 7, 0]),
        (_logits(4 * Q, 2 * Q, Q, Q), _sp(top_p=0.01), [1, 0, 0, 0]),
        (_logits(4 * Q, 2 * Q, Q, Q), _sp(top_p=1.0), [4 * Q, 2 * Q, Q, Q]),
        # top-k first, then top-p on the renormalised survivors: {1,2,3} -> 4/9, 7/9 >= 0.75
        (_logits(0.1, 0.4, 0.3, 0.2), _sp(top_k=3, top_p=0.75), [0, 4 / 7, 3 / 7, 0]),
        # same top-p without top-k keeps three tokens: 0.4, 0.7 < 0.75
        (_logits(0.1, 0.4, 0.3, 0.2), _sp(top_p=0.75), [0, 4 / 9, 3 / 9, 2 / 9]),
        # temperature applies before top-p: at T=0.5 the mass is 16/21, 4/21, 1/21
        (_logits(4, 2, 1), _sp(0.5, top_p=0.8), [0.8, 0.2, 0]),
    ],
)
def test_logits_to_probs_table(
    logits: torch.Tensor, params: SamplingParams, expected: list[float]
) -> None:
    probs = logits_to_probs(logits, params)
    assert probs.dtype == torch.float64
    expected_t = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(probs[0], expected_t, atol=1e-12, rtol=0)


def test_logits_to_probs_rows_are_independent() -> None:
    logits = torch.cat([_logits(1, 2, 4, 1), _logits(4, 2, 1, 1)])  # [2, 4]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.tensor([[0, 1 / 3, 2 / 3, 0], [2 / 3, 1 / 3, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(probs, expected, atol=1e-12, rtol=0)


def test_top_k_ties_keep_exactly_k_and_are_deterministic() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    params = SamplingParams(temperature=1.0, top_k=2)
    first = logits_to_probs(logits, params)
    assert int((first > 0).sum()) == 2
    assert set(torch.nonzero(first[0]).flatten().tolist()) <= {1, 2, 3}
    for _ in range(5):
        assert torch.equal(logits_to_probs(logits, params), first)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_logits_to_probs_any_dtype_gives_float64_rows_summing_to_one(dtype: torch.dtype) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.8, top_k=20, top_p=0.9))
    assert probs.dtype == torch.float64 and probs.shape == (3, 50)
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(3, dtype=torch.float64))
    assert bool((probs >= 0).all())


def test_logits_to_probs_handles_masked_vocabulary() -> None:
    logits = torch.tensor([[0.0, -math.inf, 0.0, -math.inf]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))
    torch.testing.assert_close(probs[0], torch.tensor([0.5, 0, 0.5, 0], dtype=torch.float64))


def test_logits_to_probs_refuses_greedy_params() -> None:
    with pytest.raises(AssertionError):
        logits_to_probs(torch.zeros(1, 4), SamplingParams(temperature=0.0))


# --- sample -------------------------------------------------------------------------------


def test_sample_follows_the_distribution_and_skips_zero_mass() -> None:
    probs = torch.tensor([0.0, 0.1, 0.0, 0.4, 0.2, 0.3, 0.0], dtype=torch.float64)
    generator = torch.Generator().manual_seed(1234)
    draws = [sample(probs, generator) for _ in range(5000)]
    counts = np.bincount(draws, minlength=7)
    assert counts[[0, 2, 6]].sum() == 0
    support = probs.numpy() > 0
    assert chisquare(counts[support], probs.numpy()[support] * len(draws)).pvalue > 1e-3


def test_sample_accepts_unnormalised_rows_and_one_hot() -> None:
    generator = torch.Generator().manual_seed(0)
    assert {sample(torch.tensor([0.0, 0.0, 3.0]), generator) for _ in range(50)} == {2}
    assert {sample(torch.tensor([2.0, 0.0, 2.0]), generator) for _ in range(200)} == {0, 2}


def test_sample_is_reproducible_from_the_seed() -> None:
    probs = torch.softmax(torch.randn(100, generator=torch.Generator().manual_seed(3)), dim=0)
    a = [sample(probs, derive_generator(7, 0, TARGET_STREAM)) for _ in range(3)]
    b = [sample(probs, derive_generator(7, 0, TARGET_STREAM)) for _ in range(3)]
    assert a == b


# --- derive_generator ---------------------------------------------------------------------


def _draws(seed: int, position: int, stream: int) -> list[float]:
    return torch.rand(8, generator=derive_generator(seed, position, stream)).tolist()


def test_derive_generator_is_deterministic() -> None:
    assert _draws(42, 17, DRAFT_STREAM) == _draws(42, 17, DRAFT_STREAM)
    assert derive_generator(42, 17, DRAFT_STREAM).device == torch.device("cpu")


@pytest.mark.parametrize(
    "other",
    [
        (43, 17, DRAFT_STREAM),  # another session
        (42, 18, DRAFT_STREAM),  # the next position
        (42, 17, TARGET_STREAM),  # the other stream
        (42, 16, DRAFT_STREAM + 1),  # position and stream must not cancel out
    ],
)
def test_derive_generator_differs_for_other_inputs(other: tuple[int, int, int]) -> None:
    assert _draws(*other) != _draws(42, 17, DRAFT_STREAM)


def test_derive_generator_seeds_are_spread_out() -> None:
    seeds = {
        derive_generator(seed, position, stream).initial_seed()
        for seed in range(4)
        for position in range(64)
        for stream in (DRAFT_STREAM, TARGET_STREAM)
    }
    assert len(seeds) == 4 * 64 * 2


@pytest.mark.parametrize("seed", [0, 1, 2**63, 2**64 - 1])
def test_derive_generator_accepts_all_uint64_seeds(seed: int) -> None:
    assert len(_draws(seed, 2**40, TARGET_STREAM)) == 8


@pytest.mark.parametrize(
    "args, field",
    [
        ((-1, 0, 1), "seed"),
        ((2**64, 0, 1), "seed"),
        ((0, -1, 1), "position"),
        ((0, 0, -2), "stream"),
    ],
)
def test_derive_generator_rejects_out_of_range(args: tuple[int, int, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        derive_generator(*args)
