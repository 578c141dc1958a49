"""`specdec loadtest` on the workloads built from public data, against a real pipeline of tiny models
(4096-character context): sharegpt-chat sessions whose second turn carries the first turn and the
model's answer, over gRPC and HTTP, and shared-system sessions whose report compares the TTFT of
each phase's first request with the later ones'."""

from __future__ import annotations

import json

import pytest

from specdec.launcher import free_port
from tests.conftest import orchestrator_address, run_loadtest_cli, start_tiny_pipeline

COMMON = ["--modes", "0,4", "--concurrency", "1", "--max-tokens", "8", "--warmup", "1", "--no-progress", "--no-plot"]


@pytest.fixture(scope="module")
def pipeline(long_models, tmp_path_factory):
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-loadtest-real"), long_models, "poor_draft",
                                   http_port=free_port())
    yield pipeline
    pipeline.stop()




def check_two_turn_sessions(result: dict) -> None:
    records = result["records"]
    assert len(records) == 2 * 2 * 2  # 2 modes × 2 conversations × 2 turns
    assert all(r["ok"] for r in records), [r["error"] for r in records if not r["ok"]]
    for run in result["runs"]:
        assert run["summary"]["requests"] == 4 and run["summary"]["failed"] == 0
        assert "ttft_first_s" not in run["summary"]
    turns = {(r["mode"], r["prompt_id"], r["turn"]): r for r in records}
    assert len({p for _, p, _ in turns}) == 2
    for (mode, prompt, turn), first in turns.items():
        if turn == 0:  # the second turn carried the first turn and its answer
            second = turns[(mode, prompt, 1)]
            assert second["prompt_tokens"] > first["prompt_tokens"] + first["output_tokens"] > 0
            assert second["start"] >= first["start"] + first["e2el"]


def test_sharegpt_chat_replays_each_conversation_in_one_session(pipeline, tmp_path):
    out = tmp_path / "chat"
    code = run_loadtest_cli(["--address", orchestrator_address(pipeline), "--workload", "sharegpt-chat", "--turns", "2",
                    "--num-requests", "2", "--input-words", "10", "--out", str(out), *COMMON])
    assert code == 0
    result = json.loads(out.with_suffix(".json").read_text())
    check_two_turn_sessions(result)
    md = out.with_suffix(".md").read_text()
    assert "## Multi-turn sessions" in md and "--workload sharegpt-chat --turns 2" in md


def test_sharegpt_chat_over_http(pipeline, tmp_path):
    out = tmp_path / "chat-http"
    code = run_loadtest_cli(["--api", "http", "--http-url", pipeline.plan.http_url(), "--workload", "sharegpt-chat",
                    "--turns", "2", "--num-requests", "2", "--input-words", "10", "--out", str(out), *COMMON])
    assert code == 0
    check_two_turn_sessions(json.loads(out.with_suffix(".json").read_text()))


def test_shared_system_sessions_report_first_against_later_ttft(pipeline, tmp_path):
    out = tmp_path / "shared"
    code = run_loadtest_cli(["--address", orchestrator_address(pipeline), "--workload", "shared-system",
                             "--num-requests", "3", "--block", "3", "--system-words", "120", "--out", str(out),
                             *COMMON])
    assert code == 0
    result = json.loads(out.with_suffix(".json").read_text())
    records = result["records"]
    assert len(records) == 2 * 3 and all(r["ok"] for r in records), [r["error"] for r in records]
    assert {r["kind"] for r in records} == {"shared-system"}
    assert len({r["prompt_id"] for r in records}) == 3
    assert all(r["prompt_tokens"] > 120 for r in records)  # the shared system prompt is in every request
    for run in result["runs"]:
        s = run["summary"]
        assert s["completed"] == 3 and s["ttft_first_s"] > 0 and s["ttft_rest_median_s"] > 0
        assert (s["ttft_first_count"], s["ttft_rest_count"]) == (1, 2)
    md = out.with_suffix(".md").read_text()
    assert "## Shared system prompt" in md
