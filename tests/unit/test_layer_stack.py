"""The layer stack (`stack.LayerStack`, `csrc/stack.c`): a short pass's layers in one native call
compute what the pass's own loop of kernel calls computes, bit for bit, and passes it does not take
run that loop."""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.kv import ScoreRequest, SessionCaches
from specdec.runtime.stack import LayerStack


@pytest.fixture(scope="module")
def quantized_target(tiny_models):
    from specdec.runtime.models import load_model

    return load_model(str(tiny_models["target"]), dtype="float32", quantize="int4", progress=False).model


def _pair(model) -> tuple[SessionCaches, SessionCaches]:
    """The same model twice: through the layer stack, and through the loop of kernel calls."""
    stacked, looped = SessionCaches(model, 512, max_sessions=8), SessionCaches(model, 512, max_sessions=8)
    assert stacked.forward.stack is not None
    looped.forward.stack = None
    return stacked, looped


def _count_runs(monkeypatch) -> list[int]:
    runs: list[int] = []
    run = LayerStack.run
    monkeypatch.setattr(LayerStack, "run", lambda self, x, *a: runs.append(x.shape[0]) or run(self, x, *a))
    return runs


def test_decode_verify_and_mixed_passes_equal_the_loop_bit_for_bit(quantized_target, monkeypatch, one_torch_thread):
    stacked, looped = _pair(quantized_target)
    runs = _count_runs(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    histories = {f"s{i}": [int(t) for t in torch.randint(3, 100, (5 + 7 * i,), generator=gen)] for i in range(3)}
    for caches in (stacked, looped):  # prefills of 5, 12 and 19 positions
        for sid, history in histories.items():
            caches.score(sid, history, [])
    for step in range(6):  # every session a decode row, a block of 4 or both, in one pass
        drafts = {sid: [int(t) for t in torch.randint(3, 100, ((step + i) % 5,), generator=gen)]
                  for i, sid in enumerate(histories)}
        got, want = ([caches.score_batch([ScoreRequest(sid, histories[sid], drafts[sid]) for sid in histories])
                      for caches in (stacked, looped)])
        for sid, a, b in zip(histories, got, want):
            assert torch.equal(a.logits, b.logits)
            histories[sid] = histories[sid] + drafts[sid] + [int(a.logits[-1].argmax())]  # every draft kept
    assert len(runs) >= 3 + 6  # the prefills (short enough for the kernel) and every batched pass
    assert max(runs) > 1


def test_a_prefill_runs_the_stack_and_a_pass_of_more_rows_than_it_takes_runs_the_loop(quantized_target, monkeypatch,
                                                                                     one_torch_thread):
    from specdec.runtime.quantized import CHUNK_ROWS

    stacked, looped = _pair(quantized_target)
    runs = _count_runs(monkeypatch)
    prompt = list(range(3, 3 + 40))  # 40 new positions: more queries than the attention kernel takes at once
    a, _ = stacked.score("p", prompt, [])
    b, _ = looped.score("p", prompt, [])
    assert runs == [40] and torch.equal(a, b)
    long = list(range(5, 5 + CHUNK_ROWS + 12))  # more rows than the stack's projections take in one call
    a, _ = stacked.score("q", long, [])
    b, _ = looped.score("q", long, [])
    assert runs == [40] and torch.equal(a, b)
    a, _ = stacked.score("q", long + [7], [8, 9])
    b, _ = looped.score("q", long + [7], [8, 9])
    assert runs == [40, 3] and torch.equal(a, b)


def test_models_whose_projections_are_not_all_quantized_have_no_stack(tiny_models):
    from specdec.runtime.models import load_model

    dense = load_model(str(tiny_models["target"]), dtype="float32", progress=False).model
    assert SessionCaches(dense, 64).forward.stack is None


def test_a_projection_of_the_wrong_shape_is_refused(quantized_target):
    forward = SessionCaches(quantized_target, 64).forward
    layers = []
    for projections, (norm_in, norm_post, eps_in, eps_post) in zip(forward.layers, forward._norms):
        layers.append((*(p.pieces[0][0] for p in projections), norm_in, eps_in, norm_post, eps_post))
    config = quantized_target.config
    geometry = (config.hidden_size, config.intermediate_size, forward.heads, forward.kv_heads, forward.head_dim)
    assert LayerStack(layers, *geometry)
    swapped = [(layer[0], layer[0], *layer[2:]) for layer in layers]  # q/k/v where o belongs
    with pytest.raises(ValueError, match="geometry"):
        LayerStack(swapped, *geometry)


def test_a_call_the_kernels_refuse_raises_and_leaves_nothing_behind(quantized_target, monkeypatch, one_torch_thread):
    """A plan the attention kernel's own checks refuse (a past beyond the row's keys: what a
    corrupted cache would give) fails the pass with the stack's error before anything is stored;
    the session is forgotten, and the next request rebuilds it and scores as the loop does."""
    from specdec.runtime import native_attention

    stacked, looped = _pair(quantized_target)
    built = native_attention.AttentionPlan.__init__

    def corrupted(self, rows, groups):
        built(self, rows, groups)
        self.rows[0].past += 1 << 40

    monkeypatch.setattr(native_attention.AttentionPlan, "__init__", corrupted)
    with pytest.raises(ValueError, match="layer stack refused the call: it would read or write past its buffers"):
        stacked.score("s", [5, 6, 7], [])
    assert "s" not in stacked.table.entries
    monkeypatch.setattr(native_attention.AttentionPlan, "__init__", built)
    a, _ = stacked.score("s", [5, 6, 7], [8])
    b, _ = looped.score("s", [5, 6, 7], [8])
    assert torch.equal(a, b)


def test_rows_reading_a_shared_prefix_equal_the_loop(quantized_target, monkeypatch, one_torch_thread):
    """Sessions whose keys/values start in prefix blocks shared by reference (several segments a
    row, the prefix cache's) are attended by the stack as by the loop, bit for bit."""
    import random

    from specdec.runtime.prefix_cache import PrefixCache

    stacked, looped = (SessionCaches(quantized_target, 1024, max_sessions=8, prefix_cache=PrefixCache(16))
                       for _ in range(2))
    looped.forward.stack = None
    runs = _count_runs(monkeypatch)
    rng = random.Random(5)
    system = [rng.randrange(3, 100) for _ in range(200)]  # a shared prompt head
    histories = {sid: system + [rng.randrange(3, 100) for _ in range(rng.randrange(1, 60))] for sid in "abc"}
    for caches in (stacked, looped):
        for sid, history in histories.items():
            caches.score(sid, history, [])
    assert any(stacked.table.entries[sid].cache.prefix for sid in histories)  # rows with a shared prefix
    requests = [ScoreRequest(sid, history, [rng.randrange(3, 100) for _ in range(width)])
                for (sid, history), width in zip(histories.items(), (0, 2, 4))]
    before = len(runs)
    got, want = (caches.score_batch(requests) for caches in (stacked, looped))
    assert len(runs) == before + 1
    for a, b in zip(got, want):
        assert torch.equal(a.logits, b.logits)
