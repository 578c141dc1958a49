"""bench/engine.py's compute floor: the FLOPs it charges a pass are the model's own."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import DynamicCache

from bench.engine import matmul_params, pass_flops


@pytest.mark.parametrize(("positions", "context"), [(1, 0), (1, 7), (3, 5), (5, 12)])
def test_pass_flops_match_torch_flop_count_of_the_models_forward(tiny_model, positions, context):
    """torch counts every matmul of an eager forward over `positions` new tokens after `context`
    cached ones; its attention multiplies the whole block by every key (the causal mask is applied
    after), where pass_flops charges query j only the context + j + 1 keys it sees."""
    config = tiny_model.config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    previous = tiny_model.config._attn_implementation
    tiny_model.set_attn_implementation("eager")  # attention as matmuls torch counts (its SDPA kernel is not)
    cache = DynamicCache(config=config)
    ids = torch.arange(3, 3 + context + positions)[None]
    try:
        with torch.inference_mode():
            if context:
                tiny_model(ids[:, :context], cache=cache, use_cache=True)
            with FlopCounterMode(display=False) as counter:
                tiny_model(ids[:, context:], cache=cache, use_cache=True)
    finally:
        tiny_model.set_attn_implementation(previous)
    masked = 4 * layers * heads * head_dim * (positions * positions - positions * (positions + 1) // 2)
    expected = pass_flops(positions, context, 1, matmul_params(tiny_model), layers, heads, head_dim)
    assert counter.get_total_flops() == expected + masked


def test_more_sessions_multiply_the_flops():
    one = pass_flops(3, 4096, 1, 134_479_872, 30, 9, 64)
    assert pass_flops(3, 4096, 8, 134_479_872, 30, 9, 64) == 8 * one
    assert round(8 * one / 1e9, 2) == 13.25  # docs/benchmarks.md's 8 x 4096 x 3 figure
