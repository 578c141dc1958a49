"""A built draft served by a real draft service process, and the profile's end-to-end runs."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from drafts.build import BuildConfig, build_draft
from drafts.profile import ProfileConfig, profile_drafts
from specdec import Client
from specdec.runtime.models import load_model
from specdec.v1 import common_pb2, draft_pb2_grpc
from tests.conftest import orchestrator_address, start_pipeline
from tests.reference import Reference
from tests.unit.test_drafts import HELDOUT, make_tied_tiny_model

PROMPTS = ["Once upon a time", "The quick brown fox", "def main():\n", "Hello, world!"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts-system")
    target = make_tied_tiny_model(root / "target")
    heldout = root / "heldout.txt"
    heldout.write_text("\n".join(HELDOUT) + "\n")
    out = root / "draft"
    build_draft(BuildConfig(target=str(target), layers="0,1", out=str(out), budget_min=3 / 60, invent=64,
                            heldout=str(heldout), max_new_tokens=48, heldout_tokens=32, cache=str(root / "cache"),
                            threads=1, progress=False, lr=2e-3))
    return {"root": root, "target": target, "draft": out, "heldout": heldout}


def test_draft_service_serves_a_built_draft(built, tmp_path_factory):
    pipeline = start_pipeline(tmp_path_factory.mktemp("logs-built-draft"), target_model=str(built["target"]),
                              target_dtype="float64", target_threads=1, draft_model=str(built["draft"]),
                              draft_dtype="float64", draft_threads=1, proposer="model", draft_length=4)
    try:
        args = pipeline.procs["draft"].args  # python -m draft_service --proposer model --model DIR ...
        assert args[1:3] == ["-m", "draft_service"] and args[args.index("--model") + 1] == str(built["draft"])
        assert args[args.index("--proposer") + 1] == "model"
        with grpc.insecure_channel(pipeline.plan.grpc_addresses()["draft"]) as channel:
            info = draft_pb2_grpc.DraftServiceStub(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        expected_fingerprint = load_model(str(built["target"]), progress=False).fingerprint
        assert info.kind == "model" and info.model == built["draft"].name  # the directory it loaded
        assert info.tokenizer_fingerprint == expected_fingerprint
        reference = Reference(str(built["target"]))
        drafted = accepted = 0
        with Client(orchestrator_address(pipeline)) as client:
            for prompt in PROMPTS:
                out = client.generate(prompt, max_new_tokens=MAX_NEW, draft_length=4)
                assert out.token_ids == reference.greedy(prompt, MAX_NEW), prompt
                drafted += out.stats["draft_tokens"]
                accepted += out.stats["accepted_tokens"]
        assert drafted > 0 and accepted > 0  # the built draft really proposed, and was right sometimes
    finally:
        pipeline.stop()


def test_profile_runs_the_pipeline_per_candidate(built):
    out = built["root"] / "profile.json"
    profile_drafts(ProfileConfig(
        target=str(built["target"]), drafts=[str(built["draft"])], copy=False, ngram=True, draft_dtype="float64",
        target_dtype="float64", k=4, heldout=str(built["heldout"]), heldout_tokens=32, latency_steps=4, threads=1,
        target_device="cpu", draft_device="cpu", e2e=True, e2e_tokens=12, e2e_prompts=2, target_threads=1,
        draft_threads=1, out=str(out), cache=str(built["root"] / "cache"), progress=False))
    saved = json.loads(out.read_text())
    assert saved["e2e_prompts"] == ["line-1", "line-2"]
    assert saved["target"]["device"] == "cpu"
    for cand in saved["candidates"]:
        # --target-device / --draft-device reached the services: they say so through GetStatus.
        assert {role: device.split(" ")[0] for role, device in cand["e2e_devices"].items()} == \
            {"target": "cpu", "draft": "cpu"}
        e2e = cand["e2e"]
        assert set(e2e) == {"0", "4", "auto"}
        assert e2e["0"]["summary"]["acceptance_rate"] is None  # k = 0 drafts nothing
        assert e2e["4"]["summary"]["acceptance_rate"] is not None
        for mode in ("0", "4", "auto"):
            summary = e2e[mode]["summary"]
            assert summary["tokens"] > 0 and summary["tokens_per_s"] > 0
            assert summary["identical_to_target_greedy"], (cand["name"], mode)
            assert [r["prompt"] for r in e2e[mode]["runs"]] == ["line-1", "line-2"]
        assert e2e["4"]["speedup"] > 0 and e2e["auto"]["speedup_total"] > 0
    goal = saved["goal"]["drafts"]["distilled-L2"]
    assert set(goal) >= {"latency_ok", "acceptance_ok", "speedup_ok", "reached"}
    assert goal["best_untrained_speedup"] == max(saved["candidates"][1]["e2e"][m]["speedup"] for m in ("4", "auto"))
    assert out.with_suffix(".png").is_file()


def test_profile_serves_the_quantized_copy_suffix_and_hybrid_it_measured(built):
    """The pipelines run what was measured in process: the int8 copy through --quantize, suffix
    speculation reading the shared outputs, the hybrid of both; every output the target's."""
    out = built["root"] / "sources.json"
    profile_drafts(ProfileConfig(
        target=str(built["target"]), copy=False, copy_quantize=["int8"], suffix=True, hybrid="int8",
        draft_dtype="float64", target_dtype="float64", k=4, heldout=str(built["heldout"]), heldout_tokens=16,
        latency_steps=2, latency_rounds=1, threads=1, device="cpu", e2e=True, e2e_tokens=12, e2e_prompts=2,
        target_threads=1, draft_threads=1, out=str(out), cache=str(built["root"] / "cache"), progress=False))
    saved = {c["name"]: c for c in json.loads(out.read_text())["candidates"]}
    assert list(saved) == ["target-copy-int8g32", "suffix", "hybrid-suffix+int8g32"]
    served = {name: cand["e2e_served"]["draft"] for name, cand in saved.items()}
    measured = saved["target-copy-int8g32"]["weights"]  # int8 at 32: "q8_0", byte for byte
    assert served["target-copy-int8g32"]["weights"] == served["hybrid-suffix+int8g32"]["weights"] == measured
    assert saved["target-copy-int8g32"]["weights_fingerprint"] == saved["hybrid-suffix+int8g32"]["weights_fingerprint"]
    assert (served["suffix"]["kind"], served["hybrid-suffix+int8g32"]["kind"]) == ("suffix", "hybrid")
    assert served["suffix"]["reads_shared_outputs"] and served["hybrid-suffix+int8g32"]["reads_shared_outputs"]
    for cand in saved.values():
        for mode in ("0", "4", "auto"):
            assert cand["e2e"][mode]["summary"]["identical_to_target_greedy"], (cand["name"], mode)
