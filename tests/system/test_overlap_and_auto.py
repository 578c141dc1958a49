"""Overlapped drafting and the auto draft length keep the output lossless."""

from __future__ import annotations

import numpy as np
import pytest

from specdec import Client
from specdec.core.sampling import SamplingParams
from tests.conftest import orchestrator_address, start_tiny_pipeline
from tests.reference import Reference
from tests.system.test_greedy_equivalence import MAX_NEW, PROMPTS
from tests.system.test_pipeline_sampling import _pooled_chisquare


@pytest.fixture(scope="module")
def overlap_pipeline(tiny_models, tmp_path_factory):
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-overlap"), tiny_models, "good_draft",
                                   draft_length="auto", extra_orchestrator_args=["--overlap"])
    yield pipeline
    pipeline.stop()


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_overlap_greedy_equals_target_generate(overlap_pipeline, tiny_models, k):
    reference = Reference(str(tiny_models["target"]))
    overlapped = 0
    with Client(orchestrator_address(overlap_pipeline)) as client:
        for prompt in PROMPTS[:10]:
            out = client.generate(prompt, max_new_tokens=MAX_NEW, draft_length=k)
            assert out.token_ids == reference.greedy(prompt, MAX_NEW), (k, prompt)
            overlapped += out.stats["overlapped_rounds"]
    if k != "auto":  # auto may rightly pick k = 0 for tiny models where drafting costs as much as verifying
        assert overlapped > 0, "no round used an overlapped draft: the path under test never ran"


def test_auto_chooses_k_per_round_and_stays_lossless(tiny_pipeline, tiny_models):
    reference = Reference(str(tiny_models["target"]))
    with Client(orchestrator_address(tiny_pipeline)) as client:
        chunks = list(client.stream(PROMPTS[1], max_new_tokens=48, draft_length="auto"))
    assert [t for c in chunks for t in c.token_ids] == reference.greedy(PROMPTS[1], 48)
    assert all(0 <= c.round.get("draft_length", 0) <= 16 for c in chunks)


def test_overlapped_sampling_follows_the_target_distribution(overlap_pipeline, tiny_models):
    """The third token (drafted during the previous verify when the guess held) vs the exact marginal."""
    reference = Reference(str(tiny_models["target"]))
    params = SamplingParams(temperature=1.0, top_k=4)
    prompt = "Once upon a time"
    prompt_ids = reference.encode(prompt)
    n, third, overlapped = 500, [], 0
    with Client(orchestrator_address(overlap_pipeline)) as client:
        for seed in range(n):
            out = client.generate(prompt, max_new_tokens=4, temperature=1.0, top_k=4, seed=seed, draft_length=1)
            if len(out.token_ids) >= 3:
                third.append(out.token_ids[2])
            overlapped += out.stats["overlapped_rounds"]
    assert overlapped > n // 4, f"only {overlapped} overlapped rounds"
    eos = set(reference.loaded.eos_token_ids)
    p0 = reference.next_token_probs([prompt_ids], params)[0].numpy()
    xs = [int(x) for x in np.flatnonzero(p0) if x not in eos]
    p1 = reference.next_token_probs([prompt_ids + [x] for x in xs], params).numpy()
    pairs = [(x, int(y), p0[x] * p1[i, y]) for i, x in enumerate(xs) for y in np.flatnonzero(p1[i]) if y not in eos]
    p2 = reference.next_token_probs([prompt_ids + [x, y] for x, y, _ in pairs], params).numpy()
    weights = np.array([w for _, _, w in pairs])
    marginal = (weights[:, None] / weights.sum() * p2).sum(axis=0)
    assert len(third) >= 0.9 * n
    assert _pooled_chisquare(np.bincount(third, minlength=p0.shape[0]), marginal, len(third)) > 1e-3
