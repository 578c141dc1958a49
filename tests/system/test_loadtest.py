"""`specdec loadtest` against a real pipeline of tiny models: gRPC and HTTP runs whose reports add
up, a clear error when nothing answers, and chaos (the draft SIGKILLed and restarted mid-run)
with no client-visible error, fallback rounds seen and speculation resumed."""

from __future__ import annotations

import asyncio
import json

import pytest

from loadtest.chaos import DraftChaos
from loadtest.clients import GrpcLoadClient
from loadtest.runner import Load, LoadTestConfig, run_loadtest
from specdec.launcher import free_port
from tests.conftest import orchestrator_address, run_loadtest_cli, start_tiny_pipeline

SMALL = ["--max-tokens", "12", "--input-words", "6", "--warmup", "1", "--no-progress"]


@pytest.fixture(scope="module")
def pipeline(tiny_models, tmp_path_factory):
    """Tiny target + good draft, with the HTTP gateway; the chaos test (last) restarts its draft."""
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-loadtest"), tiny_models, "good_draft",
                                   http_port=free_port())
    yield pipeline
    pipeline.stop()




def test_grpc_closed_loop_comparison_reports_add_up(pipeline, tmp_path):
    out = tmp_path / "grpc"
    code = run_loadtest_cli(["--address", orchestrator_address(pipeline), "--modes", "0,4,auto", "--concurrency", "1,2",
                    "--num-requests", "3", "--slo", "ttft=30", "--slo", "tpot=5", "--out", str(out), *SMALL])
    assert code == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["api"] == "grpc"
    assert [(r["load"], r["mode"]) for r in result["runs"]] == [
        (load, mode) for load in ("c=1", "c=2") for mode in ("0", "4", "auto")]
    records = result["records"]
    assert len(records) == 2 * 3 * 3
    for run in result["runs"]:
        s = run["summary"]
        mine = [r for r in records if r["load"] == run["load"] and r["mode"] == run["mode"]]
        assert s["requests"] == len(mine) == 3
        assert s["completed"] + s["failed"] == s["requests"] and s["failed"] == 0
        assert s["output_tokens"] == sum(r["output_tokens"] for r in mine) > 0
        assert s["duration_s"] == pytest.approx(sum(p["end"] - p["start"] for p in run["phases"]))
        assert s["output_throughput"] == pytest.approx(s["output_tokens"] / s["duration_s"])
        assert s["requests_meeting_slos"] == s["completed"]  # generous SLOs: every request is good
        assert s["ttft"]["count"] == s["e2el"]["count"] == 3
        assert s["itl"]["count"] == sum(r["output_tokens"] - 1 for r in mine)
        for r in mine:  # one streamed chunk per round, one round stat per chunk with tokens
            assert len(r["k_per_round"]) == r["rounds"] == sum(1 for _, n in r["chunks"] if n)
            assert sum(n for _, n in r["chunks"]) == r["output_tokens"]
            assert 0 < r["ttft"] <= r["e2el"]
    by_mode = {(r["load"], r["mode"]): r["summary"]["speculation"] for r in result["runs"]}
    assert by_mode[("c=1", "0")]["k_distribution"].keys() == {"0"} and by_mode[("c=1", "0")]["draft_tokens"] == 0
    assert by_mode[("c=1", "4")]["draft_tokens"] > 0 and "4" in by_mode[("c=1", "4")]["k_distribution"]
    # Every mode ran the same prompts at each load.
    for load in ("c=1", "c=2"):
        prompts = {m: sorted(r["prompt_id"] for r in records if r["load"] == load and r["mode"] == m)
                   for m in ("0", "4", "auto")}
        assert prompts["0"] == prompts["4"] == prompts["auto"]
    md = out.with_suffix(".md").read_text()
    assert "## At c=1" in md and "| **auto** |" in md
    assert md.count("| c=2 |") == 3 + 3 + 2  # load and speculation tables, and k > 0 modes by workload kind
    assert f"Command: `specdec loadtest --address {orchestrator_address(pipeline)} --concurrency 1,2" in md
    assert "Failures: none." in md
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_http_open_loop_run(pipeline, tmp_path):
    out = tmp_path / "http"
    code = run_loadtest_cli(["--api", "http", "--http-url", pipeline.plan.http_url(), "--modes", "0,4", "--rate", "4",
                    "--arrival", "gamma", "--burstiness", "0.5", "--num-requests", "3", "--out", str(out),
                    "--no-plot", *SMALL])
    assert code == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["api"] == "http" and result["server"]["model"]
    assert len(result["records"]) == 6 and not out.with_suffix(".png").exists()
    for run in result["runs"]:
        s = run["summary"]
        assert run["load"] == "4 req/s"
        assert s["completed"] == 3 and s["failed"] == 0
        assert s["output_tokens"] == sum(r["output_tokens"] for r in result["records"]
                                         if r["mode"] == run["mode"]) > 0
        assert s["ttft"]["count"] == 3 and s["chunk_itl"]["count"] > 0
        assert s["itl"]["count"] == 0  # tokens per SSE event are not on the wire
    spec = {r["mode"]: r["summary"]["speculation"] for r in result["runs"]}
    assert spec["0"]["draft_tokens"] == 0 and spec["4"]["draft_tokens"] > 0  # from usage.speculation
    assert spec["4"]["acceptance_rate"] is not None


def test_a_missing_server_is_named_with_what_to_run(tmp_path, capsys):
    address = f"127.0.0.1:{free_port()}"
    assert run_loadtest_cli(["--address", address, "--out", str(tmp_path / "x"), *SMALL]) == 2
    err = capsys.readouterr().err
    assert address in err and "specdec up" in err and "--start-pipeline" in err
    assert not (tmp_path / "x.json").exists()


def test_chaos_kill_and_restart_of_the_draft(pipeline, tmp_path):
    """Runs last in this module: the draft it leaves behind is the restarted one."""
    config = LoadTestConfig(modes=["4"], loads=[Load("concurrency", 2)], num_requests=4, max_tokens=16,
                            input_words=6, warmup=1)
    killed_pid = pipeline.procs["draft"].pid

    async def go():
        client = GrpcLoadClient(orchestrator_address(pipeline))
        try:
            return await run_loadtest(config, client, progress=False, chaos_factory=lambda clock: DraftChaos(
                pipeline, 0.3, clock, max_kills=1, settle_timeout_s=240))
        finally:
            await client.close()

    result = asyncio.run(go())
    chaos = result["chaos"]
    assert chaos["errors"] == 0 and chaos["failures"] == {}
    assert all(r["ok"] for r in result["records"])
    assert (chaos["kills"], chaos["restarts_healthy"], chaos["recovered"]) == (1, 1, 1)
    event = chaos["events"][0]
    assert event["pid"] == killed_pid and event["new_pid"] == pipeline.procs["draft"].pid != killed_pid
    assert pipeline.procs["draft"].poll() is None  # the restarted draft is alive and owned by the pipeline
    assert chaos["fallback_rounds"] >= 1 and event["fallback_rounds"] >= 1
    assert event["killed_at"] < event["healthy_at"] <= event["resumed_at"]
    assert event["recovery_s"] == pytest.approx(event["resumed_at"] - event["healthy_at"])
    # The same fallbacks are in the generation totals the server reported.
    summary = result["runs"][0]["summary"]
    assert summary["speculation"]["fallback_rounds"] >= chaos["fallback_rounds"]
    assert len(result["records"]) >= 4  # the run went on past its 4 requests until speculation resumed
