"""Load-test reports (Markdown, JSON, PNG), chaos recovery analysis and the CLI's refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from loadtest.chaos import ChaosEvent, DraftChaos, recovery
from loadtest.metrics import RequestRecord, Round, summarize
from loadtest.report import headline_rows, headline_table, kind_table, markdown, write_reports


def _records(mode: str, load: str, tokens: int, e2el: float, n: int = 2) -> list[RequestRecord]:
    k = 0 if mode == "0" else 4
    out = []
    for i in range(n):
        rec = RequestRecord(mode, load, f"p{i}", "chat", "grpc", float(i), ok=True, ttft=0.1, e2el=e2el,
                            output_tokens=tokens, rounds=tokens // (2 if k else 1),
                            draft_tokens=k * tokens // 2 if k else 0, accepted_tokens=tokens // 2 if k else 0,
                            chunks=[(0.1, 1), (e2el, tokens - 1)])
        rec.round_stats = [Round(float(i), k, k, 1 if k else 0, False)] * rec.rounds
        out.append(rec)
    return out


def fake_result(chaos: dict | None = None) -> dict:
    runs = []
    for load, value, scale in (("c=1", 1, 1.0), ("c=2", 2, 1.6)):
        for mode, seconds in (("0", 10.0), ("4", 8.0), ("auto", 5.0)):
            recs = _records(mode, load, 20, 1.0)
            if mode == "auto" and load == "c=2":
                recs.append(RequestRecord(mode, load, "p9", "chat", "grpc", 3.0, ok=False, status="UNAVAILABLE"))
            summary = summarize(recs, seconds / scale, {"ttft": 0.5})
            summary["paired_vs_k0"] = {"median": 10.0 / seconds}
            runs.append({"load": load, "load_kind": "concurrency", "load_value": value, "mode": mode, "phases": [],
                         "summary": summary})
    m = {"cpus": 2, "platform": "Linux", "python": "3.11", "loadavg_1m": 1.0, "loadavg_5m": 1.0}
    return {
        "api": "grpc", "started_at": "now", "wall_s": 60.0, "measured_s": 55.0,
        "config": {"modes": ["0", "4", "auto"], "num_requests": 2, "duration_s": None, "warmup": 1, "max_tokens": 20,
                   "temperature": 0.0, "input_words": None, "seed": 0, "slos": {"ttft": 0.5}},
        "workload": {"items": 18, "kinds": ["chat", "code", "grounded"], "ids": []},
        "machine": {"before": m, "after": m},
        "server": {"address": "127.0.0.1:1", "backends": [{"role": "target", "model": "tiny", "kind": "model",
                                                           "dtype": "float32"}]},
        "runs": runs, "records": [], **({"chaos": chaos} if chaos else {}),
    }


def test_headline_rows_compare_against_k0_at_the_first_load():
    rows = {r["mode"]: r for r in headline_rows(fake_result())}
    assert rows["0"]["output_throughput"] == pytest.approx(4.0)  # 40 tokens in 10 s
    assert rows["4"]["vs_k0"] == pytest.approx(10 / 8)
    assert rows["auto"]["vs_k0"] == pytest.approx(2.0)
    assert rows["4"]["acceptance_rate"] == pytest.approx(0.25) and rows["0"]["acceptance_rate"] is None
    at_c2 = {r["mode"]: r for r in headline_rows(fake_result(), "c=2")}
    assert at_c2["0"]["output_throughput"] == pytest.approx(6.4)
    table = headline_table(fake_result())
    assert "| k = 0 (plain decoding) | 4.00 | 1.00 | 1.00 |" in table and "| **auto** | 8.00 | 2.00 | 2.00 |" in table
    assert rows["4"]["paired_vs_k0"] == pytest.approx(1.25)


def test_markdown_has_every_section_and_row():
    md = markdown(fake_result(), command="specdec loadtest --x")
    assert "Command: `specdec loadtest --x`" in md
    assert "## At c=1" in md and "## Throughput and latency against load" in md and "## Speculation" in md
    assert md.count("| c=1 |") == 6 and md.count("| c=2 |") == 6  # load table + speculation table
    assert "Failures by status: UNAVAILABLE × 1." in md
    assert "target: tiny model float32" in md
    assert "4: 100 %" in md and "Chaos" not in md
    assert "outputs offered to the suffix drafts' corpus: every request's (the server's setting)" in md  # an old file
    planned = markdown({**fake_result(), "shared_outputs": 7})
    assert "corpus: 7 requests', each the last send of its prompt" in planned


def test_kind_table_pairs_each_request_with_its_twin_at_k0():
    def rec(mode, kind, index, e2el):
        return RequestRecord(mode, "c=1", f"{kind}-{index}", kind, "grpc", 0.0, ok=True, ttft=0.1, e2el=e2el,
                             output_tokens=10, index=index).to_json()

    result = fake_result()
    result["records"] = [rec("0", "chat", 0, 1.0), rec("0", "code", 1, 2.0), rec("0", "code", 2, 2.0),
                         rec("4", "chat", 0, 2.0), rec("4", "code", 1, 1.0), rec("4", "code", 2, 0.5),
                         rec("auto", "chat", 0, 1.0)]
    table = kind_table(result)
    assert table.splitlines()[0] == "| load | mode | chat | code |"
    assert "| c=1 | k = 4 | 0.50 (1) | 3.00 (2) |" in table  # code: ratios 2 and 4, median 3
    assert "| c=1 | auto | 1.00 (1) | – |" in table
    assert "by workload kind" in markdown(result) and "by workload kind" not in markdown(fake_result())


def test_records_survive_json():
    rec = RequestRecord("4", "c=1", "p", "code", "grpc", 1.5, ok=True, ttft=0.2, e2el=1.0, output_tokens=5, index=3,
                        chunks=[(0.2, 1), (1.0, 4)], round_stats=[Round(1.0, 4, 4, 3, False)])
    back = RequestRecord.from_json(json.loads(json.dumps(rec.to_json())))
    assert back.chunks == rec.chunks and back.index == 3 and back.kind == "code" and back.round_stats == []
    assert {k: v for k, v in back.__dict__.items() if k != "round_stats"} == \
        {k: v for k, v in rec.__dict__.items() if k != "round_stats"}


def test_markdown_chaos_section():
    events = [ChaosEvent(killed_at=5.0, pid=1, restarted_at=5.1, healthy_at=9.0, new_pid=2)]
    rounds = [Round(6.0, 4, 0, 0, True), Round(10.0, 4, 4, 2, False)]
    chaos = {"every_s": 5.0, **recovery(events, rounds), "errors": 0, "failures": {}}
    md = markdown(fake_result(chaos))
    assert "## Chaos: the draft SIGKILLed every 5 s" in md
    assert "client-visible errors: 0" in md and "(draft_fallback): 1" in md
    assert "| 5.0 | 9.0 | 10.0 | 1.00 | 1 | – |" in md


def test_write_reports_writes_json_markdown_and_png(tmp_path):
    paths = write_reports(fake_result(), tmp_path / "sub" / "lt.json", command="cmd")
    assert {p.name for p in paths.values()} == {"lt.json", "lt.md", "lt.png"}
    assert json.loads(paths["json"].read_text())["command"] == "cmd"
    assert paths["md"].read_text().startswith("# Load test:")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "png" not in write_reports(fake_result(), tmp_path / "nop", plots=False)


# -- chaos ---------------------------------------------------------------------------------------------


def test_recovery_per_kill():
    events = [ChaosEvent(killed_at=10.0, pid=1, healthy_at=14.0), ChaosEvent(killed_at=30.0, pid=2, healthy_at=33.0)]
    rounds = [
        Round(9.0, 4, 4, 4, False),  # before any kill: not counted
        Round(11.0, 4, 0, 0, True), Round(12.0, 4, 0, 0, True),
        Round(13.0, 4, 3, 1, False),  # before the new draft was healthy: not a resumption
        Round(15.0, 0, 0, 0, False),  # the controller held k = 0
        Round(16.0, 4, 0, 0, True), Round(17.5, 2, 2, 2, False), Round(20.0, 4, 4, 4, False),
        Round(31.0, 4, 0, 0, True),  # second kill: never resumed
    ]
    out = recovery(events, list(reversed(rounds)))  # order does not matter
    first, second = out["events"]
    assert first["resumed_at"] == 17.5 and first["recovery_s"] == pytest.approx(3.5)
    assert first["outage_s"] == pytest.approx(7.5)
    assert first["fallback_rounds"] == 3 and first["rounds_at_k0"] == 4
    assert second["resumed_at"] is None and second["recovery_s"] is None and second["fallback_rounds"] == 1
    assert (out["kills"], out["restarts_healthy"], out["recovered"], out["fallback_rounds"]) == (2, 2, 1, 4)
    assert out["recovery_s"]["median"] == pytest.approx(3.5)


def test_recovery_without_a_healthy_restart():
    events = [ChaosEvent(killed_at=1.0, pid=1, error="TimeoutError: no")]
    out = recovery(events, [Round(2.0, 4, 0, 0, True), Round(3.0, 4, 4, 4, False)])
    assert out["recovered"] == 0 and out["restarts_healthy"] == 0 and out["events"][0]["fallback_rounds"] == 1
    assert recovery([], [Round(1.0, 4, 0, 0, True)])["kills"] == 0


def test_draft_chaos_settles_only_after_speculation_resumed():
    now = [0.0]
    pipeline = SimpleNamespace(procs={"draft": None})
    unlimited = DraftChaos(pipeline, 5.0, lambda: now[0])
    assert unlimited.settled()  # without max_kills the run keeps its own bounds
    chaos = DraftChaos(pipeline, 5.0, lambda: now[0], max_kills=1, settle_timeout_s=100)
    assert not chaos.settled()  # the kill has not happened yet
    chaos.events.append(ChaosEvent(killed_at=5.0, pid=1))
    assert not chaos.settled()
    chaos.events[-1].healthy_at = 8.0
    chaos.observe([Round(7.0, 4, 4, 4, False), Round(9.0, 4, 0, 0, True), Round(9.5, 0, 0, 0, False)])
    assert not chaos.settled()  # nothing drafted since the draft came back
    chaos.observe([Round(10.0, 2, 2, 1, False)])
    assert chaos.settled()
    stuck = DraftChaos(pipeline, 5.0, lambda: now[0], max_kills=1, settle_timeout_s=100)
    stuck.events.append(ChaosEvent(killed_at=5.0, pid=1, healthy_at=8.0))
    now[0] = 104.0
    assert not stuck.settled()
    now[0] = 106.0
    assert stuck.settled()  # gave up waiting
    failed = DraftChaos(pipeline, 5.0, lambda: now[0], max_kills=1)
    failed.events.append(ChaosEvent(killed_at=5.0, pid=1, error="boom"))
    assert failed.settled()


@pytest.mark.parametrize("kwargs", [dict(every_s=0), dict(every_s=1, max_kills=0)])
def test_draft_chaos_refuses_bad_settings(kwargs):
    with pytest.raises(ValueError):
        DraftChaos(SimpleNamespace(procs={"draft": None}), clock=lambda: 0.0, **kwargs)
    with pytest.raises(ValueError, match="draft service"):
        DraftChaos(SimpleNamespace(procs={}), 1.0, lambda: 0.0)


# -- CLI ------------------------------------------------------------------------------------------------


def test_loadtest_is_a_specdec_command():
    from loadtest.cli import cmd_loadtest
    from specdec.cli import build_parser

    args = build_parser().parse_args(["loadtest", "--rate", "0.5,1", "--slo", "tpot=50ms", "--modes", "0,auto"])
    assert args.func is cmd_loadtest
    assert args.rate == [0.5, 1.0] and args.slo == [("tpot", 0.05)]


@pytest.mark.parametrize("argv,message", [
    (["--chaos-kill-draft-every", "5"], "needs --start-pipeline"),
    (["--modes", "0,x"], "mode is auto"),
    (["--concurrency", "0"], "concurrency"),
])
def test_cli_refuses_bad_runs_before_connecting(argv, message, capsys):
    from loadtest.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--address", "127.0.0.1:1", "--no-progress", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_command_line_names_every_flag_that_is_not_the_default():
    import argparse

    from loadtest.cli import add_arguments, command_line

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--start-pipeline", "--concurrency", "1,2", "--slo", "ttft=0.5", "--slo", "tpot=50ms", "--modes",
            "0,auto", "--out", "a b", "--max-tokens", "32"]
    line = command_line(parser.parse_args(argv))
    assert line == ("specdec loadtest --start-pipeline --concurrency 1,2 --modes 0,auto --max-tokens 32 "
                    "--slo ttft=0.5 --slo tpot=0.05 --out 'a b'")
    assert command_line(parser.parse_args([])) == "specdec loadtest"


def test_cli_rejects_a_bad_slo(capsys):
    from loadtest.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--slo", "itl=1"])
    assert exit_.value.code == 2 and "METRIC=SECONDS" in capsys.readouterr().err


def test_cli_renders_reports_again_from_a_result_json(tmp_path, capsys):
    from loadtest.cli import main

    path = tmp_path / "run.json"
    path.write_text(json.dumps({**fake_result(), "command": "specdec loadtest --earlier"}))
    with pytest.raises(SystemExit) as exit_:
        main(["--from-json", str(path), "--no-plot"])
    assert exit_.value.code == 0
    assert "Command: `specdec loadtest --earlier`" in (tmp_path / "run.md").read_text()
    assert not (tmp_path / "run.png").exists()
    with pytest.raises(SystemExit) as exit_:
        main(["--from-json", str(tmp_path / "missing.json")])
    assert exit_.value.code == 2 and "cannot read" in capsys.readouterr().err
