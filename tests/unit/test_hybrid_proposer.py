"""Hybrid drafting (a draft model with suffix speculation): which source drafts a block, what it
streams, the model's KV cache after rounds it skipped, the flags, and the orchestrator's
per-source controller state and metrics. A real tiny model; no services."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import pytest
from pydantic import ValidationError

from draft_service.config import DraftConfig
from orchestrator.draft_length import DraftLength
from orchestrator.sources import BY_SOURCE, SourcedDraftLength, controller_for
from orchestrator.store import SessionState
from specdec.core.policy import PolicyConfig, initial_state
from specdec.core.sampling import SamplingParams
from specdec.errors import InvalidArgument
from specdec.runtime.batching import BatchConfig, Batcher
from specdec.runtime.drafting import Drafter
from specdec.runtime.grammars import SessionGrammars
from specdec.runtime.kv import SessionCaches
from specdec.runtime.models import load_model
from specdec.runtime.proposers import HybridProposer, ModelProposer, SuffixProposer
from specdec.server.metrics import OrchestratorMetrics, SpecDecodingStats
from specdec.v1 import orchestrator_pb2 as pb

REPEATING = [5, 6, 7, 8, 9, 5, 6, 7]  # the end "5 6 7" was followed by "8 9": suffix speculation is sure
FRESH = [5, 6, 7, 8, 9, 10, 11, 12]  # nothing repeats: suffix speculation proposes nothing
SAMPLING = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return load_model(str(tiny_models["poor_draft"]), dtype="float64", progress=False)


def hybrid(loaded, grammars: SessionGrammars | None = None) -> tuple[Drafter, SessionCaches]:
    batcher = Batcher(SessionCaches(loaded.model, 512), BatchConfig(max_batch=4, window_s=0.0))
    proposer = HybridProposer(ModelProposer.batched(batcher), SuffixProposer())
    return Drafter(proposer, "fp", "tiny", grammars=grammars), batcher.caches


async def drafts(drafter: Drafter, session: str, history: list[int], k: int, params: SamplingParams, seed: int = 0):
    return [d async for d, _ in drafter.stream(session, history, k, params, seed, None, time.monotonic())]


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLING])
async def test_a_confident_suffix_drafts_the_block_deterministically_without_the_model(loaded, params):
    drafter, caches = hybrid(loaded)
    got = await drafts(drafter, "s", REPEATING, 4, params)
    assert [d.token_id for d in got] == [8, 9, 5, 6]
    assert all(d.source == "suffix" and d.probs is None for d in got)  # q one-hot: no probs on the wire
    assert caches.cached_tokens == 0  # no forward pass


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLING])
async def test_otherwise_the_model_drafts_as_a_model_proposer_alone_would(loaded, params):
    drafter, _ = hybrid(loaded)
    alone = Drafter(ModelProposer.batched(Batcher(SessionCaches(loaded.model, 512), BatchConfig(4, 0.0))), "fp",
                    "tiny")
    got = await drafts(drafter, "s", FRESH, 4, params, seed=3)
    expected = await drafts(alone, "s", FRESH, 4, params, seed=3)
    assert [d.token_id for d in got] == [d.token_id for d in expected] and len(got) == 4
    assert all(d.source == "model" for d in got)
    assert all((d.probs is None) == params.greedy for d in got)  # q rows when sampling


async def test_the_corpus_drafts_only_requests_of_the_outputs_own_group(loaded):
    """A corpus output is proposed to requests of its corpus group (ProposeRequest.corpus_group);
    another group's request is drafted by the model, as if the corpus were empty."""
    drafter, _ = hybrid(loaded)
    drafter.proposer.add_output([9, 1, 2, 3, 4, 5, 6], group="alice")
    history = [7, 1, 2, 3]

    async def stream(group: str) -> list:
        return [d async for d, _ in drafter.stream(group + "-session", history, 3, SamplingParams(), 0, None,
                                                   time.monotonic(), corpus_group=group)]

    own = await stream("alice")
    assert [d.token_id for d in own] == [4, 5, 6] and {d.source for d in own} == {"suffix"}
    assert {d.source for d in await stream("mallory")} == {"model"}


async def test_the_models_cache_catches_up_after_rounds_the_suffix_drafted(loaded):
    """Skipping the model for a round leaves its cache behind: the next model round re-prefills what
    it missed and proposes exactly what a fresh model proposes on that history."""
    drafter, caches = hybrid(loaded)
    first = await drafts(drafter, "s", FRESH, 3, SAMPLING, seed=1)
    assert first[0].source == "model"
    history = FRESH + [first[0].token_id] + FRESH  # the text repeats: the suffix drafts the next rounds
    suffix_round = await drafts(drafter, "s", history[:-2], 3, SAMPLING, seed=1)
    assert suffix_round and all(d.source == "suffix" for d in suffix_round)
    history += [99, 98]  # then it stops repeating: the model again
    again = await drafts(drafter, "s", history, 3, SAMPLING, seed=1)
    assert all(d.source == "model" for d in again)
    assert again[0].prefill_tokens > 1  # it re-prefilled the tokens the suffix rounds added
    fresh, _ = hybrid(loaded)
    expected = await drafts(fresh, "other", history, 3, SAMPLING, seed=1)
    assert [d.token_id for d in again] == [d.token_id for d in expected]
    for mine, theirs in zip(again, expected):
        np.testing.assert_allclose(mine.probs, theirs.probs, atol=1e-6)
    assert caches.release("s")


async def test_forced_tokens_leading_a_suffix_block_carry_no_q_either(loaded):
    """With a grammar, the block is all rows or none: tokens the grammar forces before a suffix proposal
    are one-hot too (a model block sends q rows for them when sampling)."""
    schema = json.dumps({"type": "object", "properties": {"t": {"type": "integer"}}, "required": ["t"],
                         "additionalProperties": False})
    grammars = SessionGrammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    drafter, _ = hybrid(loaded, grammars)
    encode = loaded.tokenizer.convert_tokens_to_ids
    prompt = [encode(c) for c in 'x {"t": 42} y ']
    params = SamplingParams(temperature=1.0, grammar_kind="json_schema", grammar_text=schema,
                            output_start=len(prompt))
    got = await drafts(drafter, "g", prompt, 10, params)
    text = loaded.tokenizer.decode([d.token_id for d in got])
    assert text.startswith('{"t": 42'), text  # forced, then the suffix's "42}"
    assert all(d.source == "suffix" and d.probs is None for d in got)
    model_block = await drafts(drafter, "g2", [encode(c) for c in "y "], 10,
                               SamplingParams(temperature=1.0, grammar_kind="json_schema", grammar_text=schema,
                                              output_start=2))
    assert all(d.source == "model" and d.probs is not None for d in model_block)


async def test_a_hybrid_proposer_needs_a_batcher_for_its_model(loaded):
    drafter = Drafter(HybridProposer(ModelProposer(SessionCaches(loaded.model, 64)), SuffixProposer()), "fp", "tiny")
    with pytest.raises(ValueError, match="drafts through a batcher"):
        await drafts(drafter, "s", FRESH, 4, SamplingParams())


# -- flags ---------------------------------------------------------------------------------------

def test_the_proposer_choices_are_the_registrys():
    import typing

    from draft_service.config import PROPOSER_OPTIONS
    from draft_service.registry import PROPOSERS

    choices = set(typing.get_args(DraftConfig.model_fields["proposer"].annotation))
    assert choices == set(PROPOSER_OPTIONS) == set(PROPOSERS)


def test_hybrid_takes_the_suffix_options_the_stream_and_snapshots():
    config = DraftConfig(proposer="hybrid", suffix_min_prob=0.5, suffix_redis_url="redis://127.0.0.1:1/0",
                         snapshot_redis_url="redis://127.0.0.1:1/0")
    assert config.proposer == "hybrid" and config.suffix_min_prob == 0.5


@pytest.mark.parametrize("fields,flags", [
    (dict(proposer="model", suffix_min_prob=0.5), "--suffix-min-prob"),
    (dict(proposer="model", suffix_redis_url="redis://127.0.0.1:1/0"), "--suffix-redis-url"),
    (dict(proposer="ngram", suffix_max_depth=8, suffix_min_match=3), "--suffix-max-depth, --suffix-min-match"),
])
def test_suffix_options_without_suffix_speculation_are_refused_naming_hybrid(fields, flags):
    with pytest.raises(ValidationError, match="use --proposer suffix .* or --proposer hybrid") as caught:
        DraftConfig(**fields)
    assert flags in str(caught.value)


def test_specdec_up_refuses_an_unknown_proposer(capsys):
    from specdec.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["up", "--proposer", "hybird"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'hybird'" in capsys.readouterr().err


def test_the_launcher_feeds_a_hybrid_drafts_suffix_index_from_the_pipelines_redis():
    from specdec.launcher import PipelineSpec

    draft = PipelineSpec(proposer="hybrid", redis_port=6399).commands()["draft"]
    assert draft[draft.index("--proposer") + 1] == "hybrid"
    assert draft[draft.index("--suffix-redis-url") + 1] == "redis://127.0.0.1:6399/0"
    assert "--suffix-redis-url" not in PipelineSpec(proposer="model").commands()["draft"]


@pytest.mark.parametrize("proposer", ["suffix", "model", "hybrid"])
def test_prompt_lookup_options_with_another_proposer_are_refused(proposer):
    with pytest.raises(ValidationError, match=f"--ngram-max, --ngram-min configure prompt lookup, which --proposer "
                                              f"{proposer} does not run: use --proposer ngram"):
        DraftConfig(proposer=proposer, ngram_min=1, ngram_max=4)
    assert DraftConfig(proposer="ngram", ngram_min=1).ngram_min == 1


def test_specdec_up_refuses_prompt_lookup_options_for_another_proposer(capsys):
    from specdec.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["up", "--ngram-min", "1"])  # the default proposer is suffix speculation; nothing starts
    assert exit_info.value.code == 2
    assert "--ngram-min: options of --proposer ngram, which --proposer suffix does not run" in capsys.readouterr().err


def test_the_launcher_passes_each_proposer_only_its_own_options():
    from specdec.launcher import PipelineSpec

    default = PipelineSpec(redis_port=6399).commands()["draft"]
    assert default[default.index("--proposer") + 1] == "suffix"
    assert default[default.index("--suffix-redis-url") + 1] == "redis://127.0.0.1:6399/0"
    assert "--ngram-min" not in default
    ngram = PipelineSpec(proposer="ngram", ngram_min=1).commands()["draft"]
    assert ngram[ngram.index("--ngram-min") + 1] == "1"
    assert not [a for a in ngram if a.startswith("--suffix-")]


def test_the_launcher_passes_the_weights_flags_to_the_services_that_read_them():
    from specdec.launcher import PipelineSpec

    plain = PipelineSpec().commands()
    assert "--weights" not in plain["target"] and "--quantize" not in plain["draft"]
    gguf = PipelineSpec(target_weights="gguf").commands()["target"]
    assert gguf[gguf.index("--weights") + 1] == "gguf"
    copy = PipelineSpec(proposer="model", draft_quantize="int4", draft_quantize_group=64).commands()["draft"]
    assert copy[copy.index("--quantize") + 1] == "int4" and copy[copy.index("--quantize-group") + 1] == "64"
    assert copy[copy.index("--dtype") + 1] == "float32"  # the quantized kernels take float32 activations
    assert "--quantize" not in PipelineSpec(proposer="suffix", draft_quantize="int4").commands()["draft"]


def test_specdec_up_refuses_draft_quantize_without_a_draft_model(capsys):
    from specdec.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["up", "--draft-quantize", "int4"])
    assert exit_info.value.code == 2
    assert ("--draft-quantize: options of --proposer model or hybrid, which --proposer suffix does not run"
            in capsys.readouterr().err)


def test_the_outputs_stream_password_comes_from_the_environment_unless_the_url_has_one(monkeypatch):
    from draft_service.server import redis_password

    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    assert redis_password("redis://h:6379/0") == {}
    monkeypatch.setenv("REDIS_PASSWORD", "from-secret")
    assert redis_password("redis://h:6379/0") == {"password": "from-secret"}
    assert redis_password("redis://:in-url@h:6379/0") == {}  # the URL's own wins


# -- the orchestrator: one controller state per source --------------------------------------------

CONFIG = PolicyConfig(k_max=8)


def round_stats(k: int, proposed: int, accepted: int) -> pb.RoundStats:
    return pb.RoundStats(draft_length=k, proposed=proposed, accepted=accepted, draft_ns=2_000_000,
                         draft_compute_ns=1_000_000, verify_ns=20_000_000, verify_compute_ns=15_000_000,
                         drafted=proposed)


def sourced() -> tuple[SourcedDraftLength, SessionState]:
    state = SessionState(session_id="s", seed=0, draft_length=-1)
    main = DraftLength(0, initial_state(CONFIG), CONFIG)
    lengths = SourcedDraftLength(main, "model", {"suffix": initial_state(CONFIG)}, CONFIG)
    return lengths, state


def test_each_source_learns_its_own_acceptance_and_prices_the_round_it_is_predicted_to_draft():
    lengths, state = sourced()
    for _ in range(12):
        lengths.observe(state, round_stats(4, 4, 4), 0.001, "suffix")  # a repeated text: all accepted
        lengths.observe(state, round_stats(4, 4, 0), 0.001, "model")  # a poor model: all rejected
    alpha = lengths.acceptance()
    assert alpha["suffix"] > 0.9 and alpha["model"] < 0.1
    assert lengths.next_source == "model" and lengths.wanted == lengths.main.policy.k
    lengths.observe(state, round_stats(4, 4, 4), 0.001, "suffix")
    assert lengths.next_source == "suffix" and lengths.wanted == lengths.others["suffix"].k
    assert lengths.others["suffix"].k > lengths.main.policy.k  # the sure source gets the longer block
    # Both travel with the session: the model's as usual, the suffix's beside it.
    assert state.policy["alpha"] == lengths.main.policy.alpha
    assert state.policy[BY_SOURCE]["suffix"]["alpha"] == lengths.others["suffix"].alpha


def test_a_round_that_drafted_nothing_teaches_every_source():
    lengths, state = sourced()
    before = (lengths.main.policy.rounds, lengths.others["suffix"].rounds)
    lengths.observe(state, pb.RoundStats(draft_length=2, draft_fallback=True, verify_ns=20_000_000,
                                         verify_compute_ns=15_000_000), 0.001, "")
    assert (lengths.main.policy.rounds, lengths.others["suffix"].rounds) == (before[0] + 1, before[1] + 1)
    assert lengths.main.policy.backoff > 0 and lengths.others["suffix"].backoff > 0  # a failed draft backs both off
    assert lengths.next_source == "model"


async def test_a_stored_suffix_state_is_restored_and_a_new_one_starts_from_the_models_costs():
    class Store:
        async def load_prior(self):
            return None

    lengths, state = sourced()
    for _ in range(3):
        lengths.observe(state, round_stats(4, 4, 4), 0.001, "suffix")
    restored = await controller_for(state, Store(), CONFIG, True, ("model", "suffix"))
    assert isinstance(restored, SourcedDraftLength)
    assert restored.others == lengths.others and restored.main.policy == lengths.main.policy
    plain = SessionState(session_id="p", seed=0, draft_length=-1, policy=lengths.main.policy.to_dict())
    fresh = await controller_for(plain, Store(), CONFIG, True, ("model", "suffix"))
    assert fresh.others["suffix"].alpha is None and fresh.others["suffix"].verify_s == lengths.main.policy.verify_s
    one = await controller_for(state, Store(), CONFIG, True, ("model",))  # one source: one state, read as ever
    assert isinstance(one, DraftLength) and one.policy == lengths.main.policy


def test_rounds_are_counted_by_source_in_the_metrics():
    metrics = OrchestratorMetrics()
    metrics.observe_round(SpecDecodingStats.of_round(round_stats(4, 4, 3), 4, "suffix"))
    metrics.observe_round(SpecDecodingStats.of_round(round_stats(4, 4, 1), 2, "model"))
    metrics.observe_round(SpecDecodingStats.of_round(round_stats(4, 2, 2), 3, ""))
    value = metrics.registry.get_sample_value
    assert value("specdec_spec_decode_num_draft_tokens_by_source_total",
                 {"service": "orchestrator", "source": "suffix"}) == 4
    assert value("specdec_spec_decode_num_accepted_tokens_by_source_total",
                 {"service": "orchestrator", "source": "model"}) == 1
    assert value("specdec_spec_decode_num_drafts_by_source_total",
                 {"service": "orchestrator", "source": "unspecified"}) == 1


async def test_a_block_asked_of_one_source_comes_from_it_or_is_empty(loaded):
    """`sources` names the suffix alone: its match, or nothing, and the model never runs; the model
    alone: its block even where the suffix is sure. A source the draft lacks is refused by name."""
    drafter, caches = hybrid(loaded)

    async def asked(session: str, history: list[int], sources: tuple[str, ...]):
        return [d async for d, _ in drafter.stream(session, history, 4, SamplingParams(), 0, None, time.monotonic(),
                                                   0, "", sources)]

    sure = await asked("a", REPEATING, ("suffix",))
    assert [d.token_id for d in sure] == [8, 9, 5, 6] and {d.source for d in sure} == {"suffix"}
    assert await asked("b", FRESH, ("suffix",)) == [] and caches.cached_tokens == 0  # no forward pass
    model = await asked("c", REPEATING, ("model",))
    assert len(model) == 4 and {d.source for d in model} == {"model"} and caches.cached_tokens > 0
    assert drafter.check_sources(("suffix", "suffix")) == ("suffix",)
    with pytest.raises(InvalidArgument, match="'ngram'"):
        drafter.check_sources(("suffix", "ngram"))


def unpaid() -> tuple[SourcedDraftLength, SessionState]:
    """A session whose model does not pay (its state at k = 0), its suffix not measured yet."""
    lengths, state = sourced()
    lengths.main.policy = replace(lengths.main.policy, k=0)
    lengths.others["suffix"] = replace(lengths.others["suffix"], k=0)
    return lengths, state


def test_where_the_model_does_not_pay_the_suffix_is_asked_alone_and_then_prices_the_rounds():
    lengths, state = unpaid()
    assert (lengths.wanted, lengths.sources) == (2, ("suffix",))  # a first block, of the suffix alone
    model_rounds = lengths.main.policy.rounds
    lengths.observe(state, round_stats(2, 2, 2), 0.001, "suffix", ("suffix",))
    assert lengths.main.policy.rounds == model_rounds  # the model learnt nothing from the suffix's block
    assert lengths.next_source == "suffix" and lengths.sources == ("suffix",)
    assert lengths.wanted == lengths.others["suffix"].k > 0
    # While the model's own state would draft, nothing is restricted.
    lengths.main.policy, lengths.next_source = replace(lengths.main.policy, k=3), "model"
    assert (lengths.wanted, lengths.sources) == (3, ())


def test_a_suffix_that_finds_nothing_waits_for_its_probes_and_its_misses_are_plain_rounds_for_the_model():
    """Its first block found nothing (proposal rate 0 < UNMEASURED_MIN_RATE): it is not asked alone
    again; the model's exploration rounds (k = 1, any source: the draft decides) retry both."""
    lengths, state = unpaid()
    misses = 0
    while lengths.sources == ("suffix",) and misses < 20:
        before = lengths.main.policy.rounds
        lengths.observe(state, round_stats(2, 0, 0), 0.001, "", ("suffix",))
        misses += 1
        assert lengths.main.policy.rounds == before + 1  # a plain round for the model ...
        assert lengths.main.policy.proposal_rate is None  # ... which was not asked to propose
    assert misses == 1 and lengths.others["suffix"].proposal_rate == 0.0
    assert (lengths.wanted, lengths.sources) == (0, ())
    plans = []
    for _ in range(CONFIG.explore_every):
        plans.append((lengths.wanted, lengths.sources))
        lengths.observe(state, round_stats(lengths.wanted, 0, 0), 0.001, "", lengths.sources)
    assert sorted(plans) == [(0, ())] * (CONFIG.explore_every - 1) + [(1, ())]
