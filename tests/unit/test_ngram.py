"""Table tests for the prompt-lookup proposer, plus a check against a naive reference."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest

from specdec.core.ngram import propose_ngram


@pytest.mark.parametrize(
    "history, k, max_ngram, min_ngram, expected",
    [
        pytest.param([1, 2, 3, 4, 1, 2, 3], 2, 3, 1, [4, 1], id="match-of-3"),
        pytest.param([5, 2, 3, 9, 7, 2, 3], 3, 3, 1, [9, 7, 2], id="match-of-2"),
        pytest.param([4, 8, 1, 9, 8], 2, 3, 1, [1, 9], id="match-of-1"),
        pytest.param([1, 2, 7, 1, 2, 8, 1, 2], 2, 3, 1, [8, 1], id="most-recent-wins"),
        pytest.param([1, 2, 3, 5, 9, 2, 3, 6, 1, 2, 3], 2, 3, 1, [5, 9], id="longer-beats-recent"),
        pytest.param([4, 8, 1, 9, 8], 5, 3, 1, [1, 9, 8], id="fewer-than-k-left"),
        pytest.param([7, 7, 7, 7], 3, 3, 1, [7], id="overlaps-the-suffix"),
        pytest.param([1, 2, 3, 4], 3, 3, 1, [], id="no-match"),
        pytest.param([1, 2, 3, 4, 1, 2, 3], 0, 3, 1, [], id="k-zero"),
        pytest.param([], 3, 3, 1, [], id="empty-history"),
        pytest.param([5], 3, 3, 1, [], id="single-token"),
        pytest.param([5, 5], 3, 3, 1, [5], id="shorter-than-max-ngram"),
        pytest.param([4, 8, 1, 9, 8], 3, 3, 2, [], id="only-1-gram-but-min-2"),
        pytest.param([1, 2, 3, 4, 1, 2, 3], 2, 1, 1, [4, 1], id="max-ngram-1"),
        pytest.param((1, 2, 3, 4, 1, 2, 3), 2, 3, 1, [4, 1], id="tuple-history"),
    ],
)
def test_propose_ngram_table(
    history: Sequence[int], k: int, max_ngram: int, min_ngram: int, expected: list[int]
) -> None:
    assert propose_ngram(history, k, max_ngram=max_ngram, min_ngram=min_ngram) == expected


@pytest.mark.parametrize("k, max_ngram, min_ngram", [(-1, 3, 1), (2, 3, 0), (2, 1, 2)])
def test_propose_ngram_rejects_bad_arguments(k: int, max_ngram: int, min_ngram: int) -> None:
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1], k, max_ngram=max_ngram, min_ngram=min_ngram)


def _reference(history: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The definition, written plainly: longest n first, most recent earlier occurrence."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(history) <= n:
            continue
        key = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == key:
                return history[start + n : start + n + k]
    return []


@pytest.mark.parametrize("vocab", [2, 4, 30])
def test_propose_ngram_matches_the_definition(vocab: int) -> None:
    rng = random.Random(vocab)
    for _ in range(300):
        history = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        k, max_ngram = rng.randrange(0, 6), rng.randrange(1, 5)
        min_ngram = rng.randrange(1, max_ngram + 1)
        expected = _reference(history, k, max_ngram, min_ngram)
        assert propose_ngram(history, k, max_ngram, min_ngram) == expected, (history, k)


def test_propose_ngram_is_fast_on_long_histories() -> None:
    rng = random.Random(0)
    history = rng.sample(range(50_000), 8_192)  # no repeats: every call scans it all
    start = time.perf_counter()
    for _ in range(10):
        propose_ngram(history, 8)
    assert (time.perf_counter() - start) / 10 < 0.05
