"""Shallow self-distilled drafts (drafts): layer choice, the loss, build, resume, profile, devices."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from drafts.build import REPORT_FILE, BuildConfig, build_draft
from drafts.cli import HELDOUT_SETS as CLI_HELDOUT_SETS
from drafts.data import TeacherData, cached_teacher_data, load_prompt_file
from drafts.distill import batch_logits, evaluate, topk_kl
from drafts.profile import (
    HELDOUT_SETS,
    SUFFIX_CORPUS,
    ProfileConfig,
    acceptance,
    agreement,
    candidates_of,
    expected_tokens,
    host_guesses,
    hybrid_guesses,
    hybrid_latency_ms,
    pipeline_spec,
    profile_drafts,
    shares_output,
    suffix_speculation,
)
from drafts.shallow import (
    choose_layers,
    freeze_shared,
    layers_equal,
    make_shallow,
    parse_layers,
    parse_width,
)
from specdec.cli import main as specdec_main
from specdec.runtime.models import load_model, resolve_device
from specdec.testing.tiny import make_char_tokenizer, make_tiny_model

HELDOUT = ["once upon a time", "good morning", "what is 2+2?", "tell me a story"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_tied_tiny_model(out: Path, *, seed: int = 0, hidden: int = 64, layers: int = 4) -> Path:
    """A tiny random Llama whose output layer is its embedding matrix (as in SmolLM2)."""
    tokenizer = make_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=1 / math.sqrt(hidden),
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0.0, 4.0 / math.sqrt(hidden))  # peaked logits
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts")
    heldout = root / "heldout.txt"
    heldout.write_text("\n".join(HELDOUT) + "\n")
    return {"root": root, "tied": make_tied_tiny_model(root / "tied"),
            "untied": make_tiny_model(root / "untied", layers=4), "heldout": heldout, "cache": root / "cache"}


def build(tiny: dict[str, Path], name: str, **fields) -> dict:
    options = {"target": str(tiny["tied"]), "layers": "2", "out": str(tiny["root"] / name), "budget_min": 0.0,
               "invent": 64, "heldout": str(tiny["heldout"]), "max_new_tokens": 48, "heldout_tokens": 32,
               "cache": str(tiny["cache"]), "threads": 1, "progress": False, "lr": 2e-3, "device": "cpu"}
    return build_draft(BuildConfig(**{**options, **fields}))


# --------------------------------------------------------------------------- pure pieces


@pytest.mark.parametrize("strategy, expected", [
    ("first", [0, 1, 2, 3]), ("first-last", [0, 1, 2, 29]), ("even", [0, 10, 19, 29]),
])
def test_choose_layers(strategy, expected):
    assert choose_layers(30, 4, strategy) == expected
    assert choose_layers(30, 1, "first-last") == [29]
    assert choose_layers(30, 30, "even") == list(range(30))


def test_layer_and_width_specs_are_validated():
    assert parse_layers("4", 30) == (4, None)
    assert parse_layers("0,1,2,29", 30) == (4, [0, 1, 2, 29])
    for bad in ("0", "31", "2,1", "0,0", "0,30", "four"):
        with pytest.raises(ValueError):
            parse_layers(bad, 30)
    with pytest.raises(ValueError):
        choose_layers(30, 4, "random")
    assert parse_width(None, 1536) is None
    assert parse_width("768", 1536) == 768
    assert parse_width("0.5", 1536) == 768
    assert parse_width("1536", 1536) is None
    with pytest.raises(ValueError):
        parse_width("2000", 1536)


def test_topk_kl_is_zero_for_the_target_and_exact_with_the_full_vocabulary():
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.randn(5, 50, generator=gen) * 3  # [N, V]
    q_logits = torch.randn(5, 50, generator=gen) * 3
    logp = torch.log_softmax(p_logits, -1)
    full = (logp.exp() * (logp - torch.log_softmax(q_logits, -1))).sum(-1)  # [N]
    top_logp, top_ids = torch.topk(logp, 50, -1)
    assert torch.allclose(topk_kl(q_logits, top_ids, top_logp), full, atol=1e-5)
    top_logp, top_ids = torch.topk(logp, 8, -1)
    assert torch.allclose(topk_kl(p_logits, top_ids, top_logp), torch.zeros(5), atol=1e-5)
    coarse = topk_kl(q_logits, top_ids, top_logp)
    assert (coarse > 0).all() and (coarse <= full + 1e-5).all()  # the bucketed KL bounds the full one from below


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert math.isclose(expected_tokens(0.5, 2), 1 + 0.5 + 0.25)


# --------------------------------------------------------------------------- shallow copy


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_make_shallow_copies_the_chosen_layers_and_freezes_the_shared_weights(tiny, which):
    target = load_model(str(tiny[which]), dtype="float32", progress=False).model
    draft = make_shallow(target, [0, 3])
    assert draft.config.num_hidden_layers == 2
    assert layers_equal(target, draft, [0, 3])
    assert not layers_equal(target, draft, [0, 1])  # the check can tell layers apart
    assert torch.equal(draft.get_input_embeddings().weight, target.get_input_embeddings().weight)
    assert torch.equal(draft.get_output_embeddings().weight, target.get_output_embeddings().weight)
    assert torch.equal(draft.model.norm.weight, target.model.norm.weight)
    tied = which == "tied"
    assert (draft.get_output_embeddings().weight.data_ptr() == draft.get_input_embeddings().weight.data_ptr()) == tied
    trainable = freeze_shared(draft)
    assert "model.embed_tokens.weight" not in trainable and "lm_head.weight" not in trainable
    assert "model.norm.weight" in trainable and "model.layers.1.mlp.down_proj.weight" in trainable


def test_width_keeps_the_strongest_mlp_units(tiny):
    target = load_model(str(tiny["tied"]), dtype="float32", progress=False).model
    draft = make_shallow(target, [1, 2], width=64)
    mlp, source = draft.model.layers[0].mlp, target.model.layers[1].mlp
    assert mlp.gate_proj.weight.shape == (64, 64) and mlp.down_proj.weight.shape == (64, 64)
    score = (source.gate_proj.weight.norm(dim=1) * source.up_proj.weight.norm(dim=1)
             * source.down_proj.weight.norm(dim=0))
    keep = torch.topk(score, 64).indices.sort().values
    assert torch.equal(mlp.up_proj.weight, source.up_proj.weight[keep])
    assert torch.equal(mlp.down_proj.weight, source.down_proj.weight[:, keep])
    with torch.no_grad():
        out = draft(torch.tensor([[5, 6, 7]])).logits
    assert out.shape == (1, 3, target.config.vocab_size) and torch.isfinite(out).all()


# --------------------------------------------------------------------------- build


def test_build_writes_a_loadable_draft_with_the_targets_tokenizer_and_layers(tiny):
    report = build(tiny, "explicit", layers="0,3")
    out = tiny["root"] / "explicit"
    target = load_model(str(tiny["tied"]), dtype="float32", progress=False)
    draft = load_model(str(out), dtype="float32", progress=False)
    assert draft.fingerprint == target.fingerprint
    assert draft.model.config.num_hidden_layers == 2 and draft.model.config.tie_word_embeddings
    assert layers_equal(target.model, draft.model, [0, 3])  # budget 0: the copied layers untouched
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json", REPORT_FILE):
        assert (out / name).is_file(), name
    saved = json.loads((out / REPORT_FILE).read_text())
    assert saved["layers"] == report["layers"] == [0, 3] and saved["strategy"] == "explicit"
    assert saved["loadable"] is True and saved["training"]["steps"] == 0
    assert saved["data"]["train_sequences"] == 64 - 16 and saved["data"]["heldout_positions"] > 0
    assert set(saved["heldout"]["before"]) == {"kl", "agreement", "positions"}


def test_a_depth_takes_evenly_spaced_layers_by_default(tiny):
    report = build(tiny, "even", layers="3")
    assert report["layers"] == [0, 2, 3] and report["strategy"] == "even"
    target = load_model(str(tiny["tied"]), dtype="float32", progress=False)
    assert layers_equal(target.model, load_model(str(tiny["root"] / "even"), progress=False).model, [0, 2, 3])


def test_training_prompts_exclude_the_heldout_set_and_the_text_is_cached(tiny):
    target = load_model(str(tiny["tied"]), dtype="float32", progress=False)
    heldout = load_prompt_file(tiny["heldout"])
    data, _ = cached_teacher_data(tiny["cache"], target, prompts=heldout + heldout[:1], invent=0, max_new_tokens=8,
                                  top_k=4, sampled_fraction=0.0, seed=0, exclude=heldout[:2], progress=False)
    assert [p["messages"][0]["content"] for p in data.prompts] == HELDOUT[2:]  # held-out ones dropped
    again, cached = cached_teacher_data(tiny["cache"], target, prompts=heldout + heldout[:1], invent=0,
                                        max_new_tokens=8, top_k=4, sampled_fraction=0.0, seed=0,
                                        exclude=heldout[:2], progress=False)
    assert cached and all(torch.equal(a, b) for a, b in zip(data.tokens, again.tokens))


def _heldout_text(tiny) -> TeacherData:
    target = load_model(str(tiny["tied"]), dtype="float32", progress=False)
    data, _ = cached_teacher_data(tiny["cache"], target, prompts=load_prompt_file(tiny["heldout"]), invent=0,
                                  max_new_tokens=32, top_k=32, sampled_fraction=0.0, seed=0, batch_size=1,
                                  progress=False, kind="heldout")
    return data


def test_distillation_lowers_the_heldout_kl_within_seconds(tiny):
    build(tiny, "untrained", layers="0,1")
    report = build(tiny, "trained", layers="0,1", budget_min=4 / 60)
    heldout = _heldout_text(tiny)
    untrained = load_model(str(tiny["root"] / "untrained"), dtype="float32", progress=False).model
    trained = load_model(str(tiny["root"] / "trained"), dtype="float32", progress=False).model
    before, after = evaluate(untrained, heldout), evaluate(trained, heldout)
    assert report["training"]["steps"] > 0 and report["training"]["seconds"] <= 4 + 2
    assert after["kl"] < 0.9 * before["kl"], (before, after)
    assert math.isclose(report["heldout"]["after"]["kl"], after["kl"], rel_tol=1e-4)
    # Only the layers and the norm moved: the shared embeddings / head are the target's own.
    assert torch.equal(trained.get_input_embeddings().weight, untrained.get_input_embeddings().weight)
    assert not torch.equal(trained.model.layers[0].mlp.up_proj.weight, untrained.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(trained.model.norm.weight, untrained.model.norm.weight)


def test_sampled_head_is_the_full_softmax_when_it_draws_every_token(tiny):
    target = load_model(str(tiny["tied"]), dtype="float32", progress=False)
    # In float64 (and `topk_kl` keeps it): the sampled head orders the columns differently from
    # the full head, and in float32 that alone moved a KL by more than 1e-5 now and then.
    draft = make_shallow(target.model, [0, 1]).double()
    text = _heldout_text(tiny)
    data = TeacherData(text.tokens, text.start, [t[:, :2] for t in text.top_ids], [t[:, :2] for t in text.top_logp])
    rows = list(range(len(data)))
    with torch.no_grad():
        full, ids, logp = batch_logits(draft, data, rows)  # [N, V]
        everything, e_ids, e_logp = batch_logits(draft, data, rows, head_sample=10_000,
                                                 generator=torch.Generator().manual_seed(1))
        small, s_ids, _ = batch_logits(draft, data, rows, head_sample=8, generator=torch.Generator().manual_seed(0))
    assert everything.shape == full.shape
    assert torch.allclose(topk_kl(everything, e_ids, e_logp), topk_kl(full, ids, logp), atol=1e-5)
    seen = torch.unique(ids)
    assert small.shape == (full.shape[0], len(seen) + 8) and len(seen) + 8 < full.shape[1]
    # the teacher's tokens: their own logits
    assert torch.allclose(small.gather(1, s_ids), full.gather(1, ids), atol=1e-5)
    # The 8 drawn columns stand in for all the others: their logits carry log(rest / 8).
    rest = full.shape[1] - len(seen)
    drawn = small[:, len(seen):] - math.log(rest / 8)  # [N, 8] plain logits of the drawn tokens
    assert all(any(torch.allclose(drawn[:, j], full[:, c], atol=1e-4)
                   for c in range(full.shape[1]) if c not in set(seen.tolist()))
               for j in range(8))


def test_the_build_ends_with_the_weights_of_the_lowest_validation_kl(tiny):
    target = load_model(str(tiny["tied"]), dtype="float32", progress=False)
    good = build(tiny, "validated", layers="0,1", budget_min=3 / 60)["training"]
    curve = good["validation_curve"]  # [elapsed, step, KL, agreement]: untrained first, last step last
    assert curve[0][1] == 0 and curve[-1][1] == good["steps"] > 0 and good["validation_sequences"] == 16
    assert good["best_step"] == min(curve, key=lambda point: point[2])[1] > 0
    # A destructive learning rate only makes things worse: the build hands back the untrained copy.
    bad = build(tiny, "diverged", layers="0,1", budget_min=2 / 60, lr=5.0)
    assert bad["training"]["steps"] > 0 and bad["training"]["best_step"] == 0
    assert layers_equal(target.model, load_model(str(tiny["root"] / "diverged"), progress=False).model, [0, 1])


def test_a_stopped_build_resumes_where_it_left_off(tiny):
    first = build(tiny, "resumable", layers="0,1", budget_min=1.5 / 60)
    steps = first["training"]["steps"]
    assert steps > 0 and (tiny["root"] / "resumable" / "resume-state" / "state.safetensors").is_file()
    second = build(tiny, "resumable", layers="2", budget_min=3 / 60, resume=True)  # layers come from the state
    assert second["layers"] == [0, 1] and second["strategy"] == "resumed"
    assert second["training"]["resumed_from_step"] == steps
    assert second["training"]["steps"] > steps
    assert second["training"]["seconds"] > first["training"]["seconds"]


# --------------------------------------------------------------------------- profile (no processes)


def test_profile_measures_every_candidate_and_writes_json_and_plot(tiny):
    build(tiny, "profiled", layers="0,1", budget_min=2 / 60)
    out = tiny["root"] / "profile.json"
    result = profile_drafts(ProfileConfig(
        target=str(tiny["tied"]), drafts=[str(tiny["root"] / "profiled")], copy=True, ngram=True,
        draft_dtype="float64", target_dtype="float64", k=3, heldout=str(tiny["heldout"]), heldout_tokens=32,
        latency_steps=4, threads=1, device="cpu", e2e=False, out=str(out), cache=str(tiny["cache"]), progress=False))
    saved = json.loads(out.read_text())
    assert saved["target"]["device"] == saved["machine"]["target_device"] == saved["machine"]["draft_device"] == "cpu"
    assert [c["device"] for c in saved["candidates"]] == ["cpu"] * 3
    assert saved["candidates"] == json.loads(json.dumps(result["candidates"]))
    assert [c["name"] for c in saved["candidates"]] == ["distilled-L2", "target-copy-float64", "prompt-lookup"]
    assert saved["target"]["step_ms"] > 0 and set(saved["target"]["verify_ms"]) >= {"0", "3"}
    for cand in saved["candidates"]:
        assert cand["step_ms"] >= 0 and cand["latency_ratio"] >= 0
        assert 0.0 <= cand["agreement"] <= 1.0 and cand["ideal_speedup"] >= 1.0
        acc = cand["acceptance"]
        assert acc["k"] == 3 and acc["tokens"] == saved["heldout"]["positions"] and acc["rounds"] > 0
        assert acc["accepted"] <= acc["drafted"] and acc["tokens_per_round"] >= 1.0
    draft, copy, lookup = saved["candidates"]
    assert draft["trained"] and draft["build"]["layers"] == [0, 1] and not copy["trained"]
    # The float64 copy of a float64 target is the target: everything is accepted.
    assert copy["agreement"] == 1.0 and copy["acceptance"]["acceptance_rate"] == 1.0
    assert copy["acceptance"]["mean_accepted_length"] > 2.0
    assert draft["agreement"] < 1.0 and draft["acceptance"]["acceptance_rate"] < 1.0
    assert draft["step_ms"] < copy["step_ms"] * 1.5  # half the layers: not slower (generous: shared CPU)
    assert lookup["kind"] == "ngram" and lookup["step_ms"] < draft["step_ms"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- every draft source


def test_the_config_names_a_candidate_for_every_draft_source():
    config = ProfileConfig(target="t", copy=True, copy_quantize=["int4", "int8"], copy_quantize_group=128,
                           ngram=True, suffix=True, hybrid="int4", draft_dtype="bfloat16")
    config.validate()
    cands = candidates_of(config)
    assert [(c["name"], c["kind"]) for c in cands] == [
        ("target-copy-bfloat16", "model"), ("target-copy-int4g128", "model"), ("target-copy-int8g128", "model"),
        ("prompt-lookup", "ngram"), ("suffix", "suffix"), ("hybrid-suffix+int4g128", "hybrid")]
    assert all(c["model"] == "t" and not c["trained"] for c in cands)
    hybrid = cands[-1]
    assert hybrid["pairs_with"] == "target-copy-int4g128" and hybrid["quantize"] == "int4"
    assert hybrid["suffix_corpus"] == cands[-2]["suffix_corpus"] == SUFFIX_CORPUS
    assert "quantize" not in cands[0] and cands[1]["quantize_group"] == 128
    assert HELDOUT_SETS == CLI_HELDOUT_SETS  # the CLI's copy (it loads no torch)


@pytest.mark.parametrize("fields, message", [
    ({"hybrid": "int4"}, "--hybrid int4 pairs suffix speculation with the int4 copy: add --copy-quantize int4"),
    ({"copy_quantize": ["int3"]}, "--copy-quantize takes int4 and int8"),
    ({"copy_quantize": ["int4", "int4"]}, "names a quantization twice"),
    ({"copy_quantize": ["int4"], "copy_quantize_group": 48}, "--copy-quantize-group must be a positive multiple"),
    ({"heldout_set": "wiki"}, "--heldout-set must be one of"),
    ({"heldout_set": "sharegpt-chat", "heldout": "p.txt"}, "not both"),
    ({"copy": False}, "nothing to profile"),
])
def test_bad_source_options_are_refused(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ProfileConfig(**{"target": "t", "device": "cpu", **fields}).validate()


def test_only_suffix_drafts_share_outputs_and_only_on_a_prompts_last_run():
    modes = ["0", "4", "auto"]
    assert [shares_output("suffix", m, modes) for m in modes] == [False, False, True]
    assert [shares_output("hybrid", m, modes) for m in modes] == [False, False, True]
    assert {shares_output(kind, m, modes) for kind in ("model", "ngram") for m in modes} == {None}


def test_each_candidate_gets_the_pipeline_its_source_is_served_by():
    config = ProfileConfig(target="t", target_weights="dense", copy_quantize=["int4"], copy_quantize_group=64,
                           suffix=True, hybrid="int4", draft_dtype="bfloat16")
    plans = {c["name"]: pipeline_spec(c, config, "logs") for c in candidates_of(config)}
    copy, suffix, hybrid = (plans[n].commands()["draft"] for n in
                            ("target-copy-int4g64", "suffix", "hybrid-suffix+int4g64"))
    assert {plan.target_weights for plan in plans.values()} == {"dense"}
    assert "--weights" in plans["suffix"].commands()["target"]
    for args in (copy, hybrid):
        assert args[args.index("--quantize") + 1: args.index("--quantize") + 4] == ["int4", "--quantize-group", "64"]
        assert args[args.index("--dtype") + 1] == "float32" and args[args.index("--model") + 1] == "t"
    assert hybrid[hybrid.index("--proposer") + 1] == "hybrid" and "--quantize" not in suffix
    assert suffix[suffix.index("--proposer") + 1] == "suffix"


def test_hybrid_guesses_and_latency_take_suffix_speculation_where_it_proposes():
    assert hybrid_guesses([[None, 7, None]], [[1, 2, 3]]) == [[1, 7, 3]]
    assert hybrid_latency_ms(10.0, 0.1, {"model": 3, "suffix": 1}) == pytest.approx(7.525)
    assert hybrid_latency_ms(10.0, 0.1, {}) == 10.0  # nothing drafted: the model's step


def _text(*sequences: tuple[list[int], list[int]]) -> TeacherData:
    tokens = [torch.tensor(prompt + answer) for prompt, answer in sequences]
    starts = [len(prompt) - 1 for prompt, _ in sequences]
    spans = [torch.zeros(len(answer), 1) for _, answer in sequences]  # [r, 1]: no teacher log-probs needed here
    return TeacherData(tokens, starts, [s.long() for s in spans], spans)


def test_suffix_speculation_learns_the_earlier_answers_only():
    """The second prompt's answer repeats the first's: its corpus has it, the first had nothing to go on."""
    answer = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    data = _text(([1, 2, 3], answer), ([4, 5, 6], answer))
    guesses = host_guesses(suffix_speculation(), data)
    assert all(g is None for g in guesses[0][:3])  # nothing seen yet
    assert guesses[1][2:] == answer[2:]  # two answer tokens in (--suffix-min-match), the corpus knows the rest
    assert agreement(guesses, data) > 0.4
    got = acceptance(suffix_speculation(), data, 4)
    assert got["drafted_by"] == {"suffix": got["drafted"]} and got["accepted"] == got["drafted"] > 0
    again = acceptance(suffix_speculation(), _text(([4, 5, 6], answer)), 4)  # alone: no corpus
    assert again["accepted"] < got["accepted"]


def test_profile_measures_quantized_copies_suffix_and_hybrid_as_served(tiny):
    out = tiny["root"] / "sources.json"
    result = profile_drafts(ProfileConfig(
        target=str(tiny["tied"]), copy=False, copy_quantize=["int8", "int4"], copy_quantize_group=64, suffix=True,
        hybrid="int4", draft_dtype="float32", target_dtype="float32", target_weights="dense", k=3,
        heldout=str(tiny["heldout"]), heldout_tokens=32, latency_steps=4, latency_rounds=1, threads=1,
        device="cpu", e2e=False, out=str(out), cache=str(tiny["cache"]), progress=False))
    assert result["target"]["weights"] == "float32"
    by_name = {c["name"]: c for c in result["candidates"]}
    assert list(by_name) == ["target-copy-int8g64", "target-copy-int4g64", "suffix", "hybrid-suffix+int4g64"]
    int8, int4, suffix, hybrid = by_name.values()
    assert (int8["weights"], int4["weights"], hybrid["weights"]) == ("int8g64", "int4g64", "int4g64")
    assert int8["dtype"] == "float32" and int8["weights_fingerprint"] != int4["weights_fingerprint"]
    assert hybrid["weights_fingerprint"] == int4["weights_fingerprint"]  # the hybrid drafts with that very copy
    assert int8["agreement"] >= int4["agreement"] - 0.05  # eight bits follow the target at least as well
    assert suffix["suffix_corpus"] == SUFFIX_CORPUS and suffix["weights"] == "none"
    assert suffix["step_ms"] < int4["step_ms"]
    drafted_by = hybrid["acceptance"]["drafted_by"]
    assert set(drafted_by) <= {"model", "suffix"} and drafted_by.get("model", 0) > 0
    assert hybrid["step_ms"] == pytest.approx(hybrid_latency_ms(hybrid["model_step_ms"], hybrid["suffix_step_ms"],
                                                                drafted_by))
    assert hybrid["agreement"] >= int4["agreement"] - 0.2 and 0 <= hybrid["suffix_guess_share"] <= 1
    for cand in result["candidates"]:
        acc = cand["acceptance"]
        assert acc["tokens"] == result["heldout"]["positions"] and sum(acc["drafted_by"].values()) == acc["drafted"]
    assert json.loads(out.read_text())["heldout"]["set"] == "file"


# --------------------------------------------------------------------------- devices (this machine: CPU only)


def _draft_cli(*argv: str) -> int:
    """`specdec draft ...` in process; its exit code."""
    with pytest.raises(SystemExit) as exited:
        specdec_main(["draft", *argv])
    return exited.value.code


def test_device_auto_builds_on_the_cpu_here_and_the_report_says_so(tiny):
    """No --device: auto, which is the CPU on a machine without a GPU; the same draft as --device cpu."""
    explicit = build(tiny, "on-cpu", layers="0,3")  # device="cpu"
    out = tiny["root"] / "on-auto"
    code = _draft_cli("build", "--target", str(tiny["tied"]), "--layers", "0,3", "--budget", "0", "--out", str(out),
                      "--invent", "64", "--heldout", str(tiny["heldout"]), "--max-new-tokens", "48",
                      "--heldout-tokens", "32", "--cache", str(tiny["cache"]), "--threads", "1", "--quiet")
    assert code == 0
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["config"]["device"] == "auto" and explicit["config"]["device"] == "cpu"
    expected = resolve_device("auto")
    assert report["machine"]["device"].split(" ")[0] == str(expected)
    assert explicit["machine"]["device"] == "cpu" and explicit["data"]["train_generated_on"] == "cpu"
    if expected.type == "cpu":
        assert report["machine"]["device"] == "cpu"
        assert report["heldout"]["before"] == explicit["heldout"]["before"]  # the same model, the same numbers
        assert report["layers"] == explicit["layers"] == [0, 3]


@pytest.mark.parametrize("argv, message", [
    (["build", "--layers", "2", "--budget", "0", "--device", "tpu"], "--device: unknown device 'tpu'"),
    (["build", "--layers", "2", "--budget", "0", "--device", "cuda"], "--device: device 'cuda' requested but"),
    (["profile", "--ngram", "--device", "cuda:1"], "--device: device 'cuda:1' requested but"),
    (["profile", "--ngram", "--target-device", "tpu"], "--target-device: unknown device 'tpu'"),
    (["profile", "--ngram", "--device", "cpu", "--draft-device", "cuda"], "--draft-device: device 'cuda' requested"),
])
def test_a_device_this_machine_lacks_fails_with_exit_2_before_any_work(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as here, even where a GPU exists
    out = tmp_path / ("draft" if argv[0] == "build" else "profile.json")
    missing = str(tmp_path / "no-such-model")  # loading it would fail with another message
    code = _draft_cli(*argv, "--target", missing, "--out", str(out), "--cache", str(tmp_path / "cache"), "--quiet")
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "no-such-model" not in err, err
    if "requested but" in message:
        assert "run with --device cpu" in err  # resolve_device's advice, passed on
    assert not out.exists() and not (tmp_path / "cache").exists()  # nothing loaded, generated or written


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())")
def test_build_and_profile_on_the_gpu(tiny):
    """On a GPU: the draft trains there, its state and files are host tensors, it loads and resumes anywhere."""
    report = build(tiny, "on-gpu", layers="0,1", budget_min=2 / 60, device="cuda", checkpoint_every_s=0.5)
    assert report["machine"]["device"].startswith("cuda:") and report["training"]["steps"] > 0
    assert report["loadable"]
    cpu = build(tiny, "on-cpu-again", layers="0,1")
    assert math.isclose(report["heldout"]["before"]["kl"], cpu["heldout"]["before"]["kl"], rel_tol=1e-3)
    resumed = build(tiny, "on-gpu", layers="0,1", budget_min=3 / 60, resume=True)  # a GPU build resumed on the CPU
    assert resumed["training"]["resumed_from_step"] == report["training"]["steps"] < resumed["training"]["steps"]
    out = tiny["root"] / "gpu-profile.json"
    result = profile_drafts(ProfileConfig(
        target=str(tiny["tied"]), drafts=[str(tiny["root"] / "on-gpu")], copy=True, draft_dtype="float64",
        target_dtype="float64", k=3, heldout=str(tiny["heldout"]), heldout_tokens=32, latency_steps=4,
        device="cuda", e2e=False, out=str(out), cache=str(tiny["cache"]), progress=False))
    assert result["target"]["device"].startswith("cuda:") and result["machine"]["draft_device"].startswith("cuda:")
    assert result["candidates"][1]["agreement"] == 1.0  # the float64 copy of the target is the target
