"""Sampling through the pipeline: a seed reproduces a generation, and output follows the target."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from specdec import Client
from specdec.core.sampling import SamplingParams
from tests.conftest import orchestrator_address
from tests.reference import Reference

PROMPT = "Once upon a time"


def test_seed_reproduces_a_generation(tiny_pipeline):
    with Client(orchestrator_address(tiny_pipeline)) as client:
        runs = [client.generate(PROMPT, max_new_tokens=32, temperature=1.0, top_p=0.95, seed=1234, draft_length=4)
                for _ in range(2)]
        other = client.generate(PROMPT, max_new_tokens=32, temperature=1.0, top_p=0.95, seed=4321, draft_length=4)
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats["seed"] == 1234
    assert other.token_ids != runs[0].token_ids


def _pooled_chisquare(observed: np.ndarray, probs: np.ndarray, n: int) -> float:
    """p-value of a chi-square goodness of fit, pooling bins expected below 5 into one."""
    expected = probs * n
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_k=20, top_p=0.9)])
def test_sampled_tokens_follow_the_target_distribution(tiny_pipeline, tiny_models, params):
    """First and second generated tokens vs the exact target marginals, with a poor draft (k = 3)."""
    reference = Reference(str(tiny_models["target"]))
    prompt_ids = reference.encode(PROMPT)
    n = 600
    first, pairs = [], []
    with Client(orchestrator_address(tiny_pipeline)) as client:
        for seed in range(n):
            out = client.generate(PROMPT, max_new_tokens=2, temperature=params.temperature, top_k=params.top_k,
                                  top_p=params.top_p, seed=seed, draft_length=3)
            first.append(out.token_ids[0])
            if len(out.token_ids) == 2:
                pairs.append(tuple(out.token_ids))
    p0 = reference.next_token_probs([prompt_ids], params)[0].numpy()
    vocab = p0.shape[0]
    assert _pooled_chisquare(np.bincount(first, minlength=vocab), p0, n) > 1e-3
    # Second token (present unless the first was EOS): its law is sum_x p0(x) p1(. | x) over non-EOS x.
    eos = set(reference.loaded.eos_token_ids)
    support = np.array([x for x in np.flatnonzero(p0) if x not in eos])
    p1 = reference.next_token_probs([prompt_ids + [int(x)] for x in support], params).numpy()
    weights = p0[support] / p0[support].sum()
    marginal = (weights[:, None] * p1).sum(axis=0)
    second = [b for a, b in pairs]
    assert len(second) >= n * 0.9
    assert _pooled_chisquare(np.bincount(second, minlength=vocab), marginal, len(second)) > 1e-3
