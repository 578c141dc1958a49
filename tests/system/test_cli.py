"""The `specdec` command against a real pipeline: chat (stdin piped in), generate --json, status."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from specdec import Client, errors
from specdec.launcher import free_port
from tests.conftest import orchestrator_address


def specdec(*args: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def test_chat_keeps_one_session_across_turns(tiny_pipeline):
    address = orchestrator_address(tiny_pipeline)
    run = specdec("chat", "--address", address, "--json", "--max-new-tokens", "6", "--temperature", "0",
                  stdin="Hello\n\nHow are you?\n/exit\nnot sent\n")
    assert run.returncode == 0, run.stderr
    turns = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(turns) == 2  # the empty line is skipped, and nothing after /exit is sent
    assert turns[0]["session_id"] == turns[1]["session_id"]
    first, second = turns[0]["stats"], turns[1]["stats"]
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]  # history kept
    with Client(address) as client:  # the first reply is what the SDK gets for the same first turn
        assert client.chat([{"role": "user", "content": "Hello"}], max_new_tokens=6, temperature=0).text \
            == turns[0]["text"]


def test_chat_streams_text_and_names_the_session(tiny_pipeline):
    run = specdec("chat", "--address", orchestrator_address(tiny_pipeline), "--max-new-tokens", "5",
                  "--temperature", "0", "--stats", "--system", "Be brief.", stdin="Hi\nAgain\n")
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.splitlines()) == 2  # one reply a line
    assert run.stderr.count("tokens in") == 2 and "continue it with: specdec chat --session " in run.stderr


def test_generate_json(tiny_pipeline):
    run = specdec("generate", "Once upon a time", "--address", orchestrator_address(tiny_pipeline), "--json",
                  "--max-new-tokens", "7", "--temperature", "0")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    with Client(orchestrator_address(tiny_pipeline)) as client:
        ref = client.generate("Once upon a time", max_new_tokens=7, temperature=0)
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text and out["resumes"] == 0
    assert out["stats"]["completion_tokens"] == len(ref.token_ids) and isinstance(out["stats"]["seed"], int)


def test_generate_with_a_grammar_penalties_and_logprobs(tiny_pipeline):
    run = specdec("generate", "Code:", "--address", orchestrator_address(tiny_pipeline), "--json",
                  "--regex", "[a-z]{3}-[0-9]{2}", "--logprobs", "2", "--presence-penalty", "0.5",
                  "--temperature", "1", "--seed", "3", "--max-new-tokens", "20")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", out["text"]) and out["finish_reason"] == "eos"
    assert [e["token_id"] for e in out["logprobs"]] == out["token_ids"]
    assert all(len(e["top"]) == 2 for e in out["logprobs"])
    bad = specdec("generate", "x", "--address", orchestrator_address(tiny_pipeline), "--regex", "(")
    assert bad.returncode != 0 and "regex" in bad.stderr


def test_status(tiny_pipeline):
    address = orchestrator_address(tiny_pipeline)
    run = specdec("status", "--address", address, "--json")
    assert run.returncode == 0, run.stderr
    (report,) = json.loads(run.stdout)["orchestrators"]
    assert report["address"] == address and report["healthy"] is True
    assert {b["role"] for b in report["backends"]} == {"target", "draft"}
    text = specdec("status", "--address", address)
    assert text.returncode == 0
    lines = text.stdout.splitlines()
    assert lines[0].startswith(f"orchestrator {address}  healthy")
    assert any(line.split()[:1] == ["target"] and "healthy" in line and "float64" in line for line in lines)
    assert any(line.strip().startswith("acceptance") for line in lines)
    assert not any("shared outputs" in line for line in lines)  # a model draft reads no outputs stream
    with Client(address) as client, pytest.raises(errors.FailedPrecondition, match="share_output"):
        client.generate("Hi", max_new_tokens=2, share_output=True)  # a model draft keeps no corpus to join


def test_unreachable_server_says_what_to_run():
    dead = f"127.0.0.1:{free_port()}"
    run = specdec("status", "--address", dead, "--timeout", "5")
    assert run.returncode == 2 and f"orchestrator {dead}  UNREACHABLE" in run.stdout
    assert "specdec up" in run.stderr
    run = specdec("generate", "hi", "--address", dead)
    assert run.returncode == 2 and dead in run.stderr and "specdec up" in run.stderr
    run = specdec("chat", "--address", dead, stdin="hi\n")
    assert run.returncode == 2 and "specdec up" in run.stderr


def test_up_flags_default_to_an_http_gateway():
    from specdec.cli import build_parser

    args = build_parser().parse_args(["up"])
    assert args.http_port == 8000
    assert build_parser().parse_args(["up", "--http-port", "0"]).http_port == 0
