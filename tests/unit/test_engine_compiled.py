"""The compiled pass (`--compile`): the same logits as the plain forward, and no compile after the warm-up."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch._dynamo.utils import counters

from specdec.runtime import engine_plan
from specdec.runtime.engine_options import EngineOptions
from specdec.runtime.kv import ScoreRequest, SessionCaches
from specdec.runtime.prefix_cache import PrefixCache
from tests.reference import full_logits


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def compiled(tiny_model) -> SessionCaches:
    caches = SessionCaches(tiny_model, 512, prefix_cache=PrefixCache(8), engine=EngineOptions(torch_compile="on"))
    before = _graphs()
    assert caches.compiled and caches.warm_up() > 0
    assert _graphs() > before  # the warm-up is what compiled
    return caches


def test_compiled_passes_equal_the_plain_forward_to_1e_9_and_compile_nothing_after_the_warm_up(tiny_model, compiled):
    """float64: prefills, decode steps and verify blocks of every width 1..9, sessions packed together,
    a session on a shared prefix; every row's logits equal transformers' own forward."""
    rng, vocab = random.Random(0), tiny_model.config.vocab_size
    graphs = _graphs()
    system = _tokens(rng, 40, vocab)
    histories = {f"s{i}": system + _tokens(rng, 3 + 7 * i, vocab) for i in range(4)}
    for round_ in range(4):
        requests = [ScoreRequest(sid, history, _tokens(rng, (round_ * 3 + i) % 9, vocab))
                    for i, (sid, history) in enumerate(histories.items())]
        for request, result in zip(requests, compiled.score_batch(requests)):
            expected = full_logits(tiny_model, request.history + request.new_tokens)[len(request.history) - 1:]
            torch.testing.assert_close(result.logits, expected, rtol=0, atol=1e-9)
        histories = {r.session_id: r.history + r.new_tokens[:2] + [5] for r in requests}
    assert compiled.table.entries["s3"].cache.offset > 0  # the later sessions read the first one's prefix blocks
    assert _graphs() == graphs


def test_compiled_float32_with_prepacked_weights_scores_as_the_plain_path(tiny_model):
    """The production combination (float32 on a CPU: oneDNN-packed projections, compiled): the plain
    modules' logits to float32 rounding, the same argmax."""
    rng = random.Random(1)
    lm = copy.deepcopy(tiny_model).float()
    plain = SessionCaches(lm, 512, engine=EngineOptions(prepack="off"))
    fast = SessionCaches(lm, 512, engine=EngineOptions(prepack="auto", torch_compile="auto"))
    assert fast.compiled and fast.forward.prepacked
    fast.warm_up()
    requests = [ScoreRequest("a", _tokens(rng, 30, 100), []), ScoreRequest("b", _tokens(rng, 5, 100), [4, 5, 6, 7]),
                ScoreRequest("c", _tokens(rng, 70, 100), [9])]
    for one, other in zip(plain.score_batch(requests), fast.score_batch(requests)):
        torch.testing.assert_close(other.logits, one.logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(other.logits.argmax(-1), one.logits.argmax(-1))


def test_compile_on_where_it_cannot_run_is_refused_and_auto_stays_eager(tiny_model, monkeypatch):
    monkeypatch.setattr(engine_plan, "can_compile", lambda weight: False)  # e.g. no C++ compiler on the machine
    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        SessionCaches(tiny_model, 64, engine=EngineOptions(torch_compile="on"))
    caches = SessionCaches(tiny_model, 64, engine=EngineOptions(torch_compile="auto"))
    assert not caches.compiled and caches.warm_up() == 0.0
    with pytest.raises(ValueError, match="--compile must be on, off or auto, not 'yes'"):
        EngineOptions(torch_compile="yes")
