"""Hybrid drafting through the whole pipeline (`--proposer hybrid`: the poor tiny draft model with
suffix speculation): lossless under greedy and sampling, both sources drafting, each source's
acceptance learnt apart, and a flag combination that means hybrid refused with a pointer to it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import redis

from orchestrator.sources import BY_SOURCE
from orchestrator.store import RedisSessionStore
from specdec import Client
from specdec.core.policy import PolicyConfig, PolicyState, initial_state
from specdec.core.sampling import SamplingParams
from specdec.keys import PRIOR_KEY
from specdec.launcher import free_port
from tests.conftest import orchestrator_address, start_tiny_pipeline
from tests.system.test_pipeline_sampling import _pooled_chisquare

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, world!", "abcabcabc", "The answer is"]
LOOP = "x y z x y z x y z x y z x y z"  # the tiny target settles into a short loop: suffix speculation takes over
MAX_NEW = 24


@pytest.fixture(scope="module")
def hybrid_pipeline(tiny_models, tmp_path_factory):
    """The launcher passes --suffix-redis-url to a hybrid draft as to a suffix one; metrics on the orchestrator."""
    port = free_port()
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-hybrid"), tiny_models, "poor_draft",
                                   proposer="hybrid", extra_orchestrator_args=["--metrics-port", str(port)])
    pipeline.metrics_port = port
    yield pipeline
    pipeline.stop()


def by_source(pipeline, what: str = "draft_tokens") -> dict[str, float]:
    """specdec_spec_decode_num_{what}_by_source_total of the orchestrator, per source."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{pipeline.metrics_port}/metrics", timeout=10).read().decode()
    counts: dict[str, float] = {}
    prefix = f"specdec_spec_decode_num_{what}_by_source_total{{"
    for line in text.splitlines():
        if line.startswith(prefix):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            counts[source] = counts.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {source: after[source] - before.get(source, 0.0) for source in after}


def test_the_draft_reports_its_kind(hybrid_pipeline):
    with Client(orchestrator_address(hybrid_pipeline)) as client:
        kinds = {backend["kind"] for backend in client.status()["backends"] if backend["role"] == "draft"}
    assert kinds == {"hybrid"}


@pytest.mark.parametrize("draft_length", [4, "auto"])
def test_hybrid_greedy_equals_the_target_alone(hybrid_pipeline, reference, draft_length):
    before = by_source(hybrid_pipeline)
    with Client(orchestrator_address(hybrid_pipeline)) as client:
        for prompt in PROMPTS + [LOOP]:
            out = client.generate(prompt, max_new_tokens=MAX_NEW, draft_length=draft_length)
            assert out.token_ids == reference.greedy(prompt, MAX_NEW), prompt
    drafted = delta(by_source(hybrid_pipeline), before)
    assert drafted.get("model", 0) > 0 and drafted.get("suffix", 0) > 0, drafted


def test_rounds_name_their_source_and_each_sources_acceptance_is_learnt_apart(hybrid_pipeline, reference):
    """On a text that repeats, suffix speculation drafts once the loop is in the history and the model
    before; the controller keeps one acceptance estimate per source in the session's record.

    The session starts without a prior: the earlier tests' sessions, folded into it, teach that the
    poor model does not pay, and a session that starts at k = 0 asks the draft for nothing."""
    plan = hybrid_pipeline.plan
    with redis.Redis(host=plan.host, port=plan.redis_port) as connection:
        connection.delete(PRIOR_KEY)
    proposed, accepted = by_source(hybrid_pipeline), by_source(hybrid_pipeline, "accepted_tokens")
    with Client(orchestrator_address(hybrid_pipeline)) as client:
        out = client.generate(LOOP, max_new_tokens=48, draft_length="auto")
    assert out.token_ids == reference.greedy(LOOP, 48)
    proposed = delta(by_source(hybrid_pipeline), proposed)
    accepted = delta(by_source(hybrid_pipeline, "accepted_tokens"), accepted)
    assert proposed.get("model", 0) > 0 and proposed.get("suffix", 0) > 0, proposed
    assert accepted["suffix"] / proposed["suffix"] > accepted.get("model", 0) / proposed["model"]

    async def load():
        store = RedisSessionStore(f"redis://{plan.host}:{plan.redis_port}/0", ttl_s=3600)
        try:
            return await store.load(out.session_id)
        finally:
            await store.close()

    state = asyncio.run(load())
    model_alpha, suffix_alpha = state.policy["alpha"], state.policy[BY_SOURCE]["suffix"]["alpha"]
    assert model_alpha is not None and suffix_alpha is not None
    assert suffix_alpha > model_alpha  # a loop is mostly accepted; the poor draft's guesses are not


# A prior learnt from sessions where the poor model's drafts were all rejected.
UNPAID_PRIOR = {"version": 1, "rounds": 90, "k": 1, "alpha": 0.0, "accepted_ewma": 0.0, "rejected_ewma": 0.2,
                "rtt_draft_s": 0.0089, "rtt_target_s": 0.0007, "draft_token_s": 0.00016,
                "verify_s": [0.00106, None, 0.00164] + [None] * 14, "batch_ewma": 1.0, "queue_ratio": 0.69,
                "proposal_rate": 1.0, "loop_s": 0.00018, "backoff": 0, "resume_probe": False, "speculating": False}


def test_where_the_prior_says_the_model_does_not_pay_suffix_matches_still_draft(hybrid_pipeline, reference):
    """The session starts with the model at k = 0; its rounds are then asked of suffix speculation
    alone (never the model's block), so a text the shared corpus holds is drafted from the start: before,
    such a session asked for nothing and found its suffix matches only at exploration probes. (The text
    goes into the corpus first, so the test does not depend on the tests before it.)"""
    assert initial_state(PolicyConfig(k_max=16), PolicyState.from_dict(UNPAID_PRIOR)).k == 0  # the premise
    with Client(orchestrator_address(hybrid_pipeline)) as client:  # the text, once, into the shared corpus
        client.generate(LOOP, max_new_tokens=48, draft_length=0)
    plan = hybrid_pipeline.plan
    with redis.Redis(host=plan.host, port=plan.redis_port) as connection:
        connection.set(PRIOR_KEY, json.dumps(UNPAID_PRIOR))
    proposed = by_source(hybrid_pipeline)
    with Client(orchestrator_address(hybrid_pipeline)) as client:
        out = client.generate(LOOP, max_new_tokens=48, draft_length="auto")
    assert out.token_ids == reference.greedy(LOOP, 48)
    proposed = delta(by_source(hybrid_pipeline), proposed)
    assert proposed.get("suffix", 0) >= 8 and proposed["suffix"] > proposed.get("model", 0), proposed


def test_suffix_options_without_suffix_speculation_are_refused_at_startup_pointing_to_hybrid(tiny_models):
    """`--proposer model --suffix-...` reads like a hybrid draft but would run the model alone: refused."""
    result = subprocess.run([sys.executable, "-m", "draft_service", "--proposer", "model", "--model",
                             str(tiny_models["poor_draft"]), "--suffix-min-prob", "0.5", "--port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--suffix-min-prob configure suffix speculation, which --proposer model does not run" in result.stderr
    assert "--proposer hybrid" in result.stderr


def test_sampled_tokens_after_a_deterministic_suffix_block_follow_the_target(hybrid_pipeline, reference):
    """A prompt built so that, after the target's likeliest first token x, suffix speculation is sure of a
    continuation Y: the second round's block is then suffix-drafted (q one-hot, accepted with probability
    p(y)). The second and third tokens, given the first ones, must follow the target exactly."""
    params = SamplingParams(temperature=1.0)
    base = reference.encode("Once upon a time")
    x, prompt = 0, base
    for _ in range(4):  # the prompt is base + x + Y + base, with x the target's likeliest token after it
        p0 = reference.next_token_probs([prompt], params)[0].numpy()
        x = int(np.argmax(p0))
        y = reference.greedy_ids(prompt + [x], 3)  # likely but not sure under sampling: accepted or rejected
        prompt = base + [x] + y + base
    p0 = reference.next_token_probs([prompt], params)[0].numpy()
    p1 = reference.next_token_probs([prompt + [x]], params)[0].numpy()
    assert int(np.argmax(p0)) == x and p0[x] > 0.3, "the prompt does not lead to one likely first token"
    assert 0.2 < p1[y[0]] < 0.8, "the suffix's first token should be accepted sometimes and rejected sometimes"
    n, seconds, thirds = 500, [], []
    suffix_before = by_source(hybrid_pipeline).get("suffix", 0.0)
    with Client(orchestrator_address(hybrid_pipeline)) as client:
        for seed in range(n):
            out = client.generate(list(prompt), max_new_tokens=3, temperature=1.0, seed=seed, draft_length=3,
                                  ignore_eos=True)
            if out.token_ids[0] == x:
                seconds.append(out.token_ids[1])
                if out.token_ids[1] == y[0]:
                    thirds.append(out.token_ids[2])
    assert by_source(hybrid_pipeline).get("suffix", 0.0) - suffix_before >= len(seconds), "suffix never drafted"
    vocab = p1.shape[0]
    assert len(seconds) >= n * 0.2
    assert _pooled_chisquare(np.bincount(seconds, minlength=vocab), p1, len(seconds)) > 1e-3
    assert len(thirds) >= 50  # the third token once the suffix's first token was accepted
    p2 = reference.next_token_probs([prompt + [x, y[0]]], params)[0].numpy()
    assert _pooled_chisquare(np.bincount(thirds, minlength=vocab), p2, len(thirds)) > 1e-3
