"""Per-session KV caches: reuse, rollback to a common prefix, rebuild, bounds."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.runtime.kv import SessionCaches, common_prefix_length
from tests.reference import full_logits


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.mark.parametrize("a,b,n", [([], [], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2),
                                   ([1, 2, 3], [1, 9, 3], 1), ([5], [6], 0),
                                   (list(range(100)), list(range(50)) + [0], 50)])
def test_common_prefix_length(a, b, n):
    assert common_prefix_length(a, b) == n


def test_score_matches_a_full_forward_and_reuses_the_cache(model):
    caches = SessionCaches(model, max_context=512)
    history = [10, 11, 12, 13]
    logits, prefilled = caches.score("s", history, [20, 21])
    assert logits.shape == (3, model.config.vocab_size)
    assert prefilled == 3  # the first call prefills everything before the last history token
    torch.testing.assert_close(logits, full_logits(model, history + [20, 21])[3:])
    # Accept 20 and emit 30: the cache already covers history + [20]; only [30, 40] are fed.
    logits, prefilled = caches.score("s", history + [20, 30], [40])
    assert prefilled == 0
    torch.testing.assert_close(logits, full_logits(model, history + [20, 30, 40])[5:])


def test_divergent_history_is_cut_back_and_rebuilt(model):
    caches = SessionCaches(model, max_context=512)
    caches.score("s", [10, 11, 12, 13, 14], [])
    logits, prefilled = caches.score("s", [10, 11, 50, 51, 52], [53])
    assert prefilled == 2  # 50 and 51 were re-prefilled after the common prefix [10, 11]
    torch.testing.assert_close(logits, full_logits(model, [10, 11, 50, 51, 52, 53])[4:])


def test_rollback_release_and_lru_bound(model):
    caches = SessionCaches(model, max_context=512, max_sessions=2)
    caches.score("a", [10, 11, 12], [13, 14])
    assert caches.rollback("a", 4) == 4
    assert caches.rollback("missing", 4) == 0
    _, prefilled = caches.score("a", [10, 11, 12, 13, 15], [])
    assert prefilled == 0  # the rolled-back cache covers [10, 11, 12, 13]
    caches.score("b", [1, 2], [])
    caches.score("c", [1, 2], [])
    assert len(caches) == 2 and not caches.release("a")  # "a" was least recently used: evicted
    assert caches.release("b") and len(caches) == 1


def test_idle_sessions_expire(model):
    caches = SessionCaches(model, max_context=512, idle_ttl_s=1e-9)
    caches.score("a", [1, 2], [])
    caches.score("b", [1, 2], [])
    assert len(caches) == 1  # "a" was idle longer than the TTL when "b" came


@pytest.mark.parametrize("history,new,message", [
    ([], [], "history is empty"),
    ([1] * 500, [2] * 20, "exceeds the model's limit of 512"),
    ([1, 10**6], [], "outside the vocabulary"),
])
def test_bad_input_is_refused_without_creating_a_cache(model, history, new, message):
    caches = SessionCaches(model, max_context=512)
    with pytest.raises(InvalidArgument, match=message):
        caches.score("s", history, new)
    assert len(caches) == 0
