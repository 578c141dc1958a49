"""Load-test workloads (bundled sets, input lengths, request order) and the run configuration."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from loadtest.runner import Load, LoadTestConfig
from loadtest.workloads import (
    BUNDLED,
    WorkItem,
    bundled,
    filler_words,
    fit_document,
    load_workload,
    request_order,
    shape_inputs,
)


def test_bundled_sets_are_well_formed_and_distinct():
    all_items = load_workload("all")
    assert len(all_items) == sum(len(bundled(k)) for k in BUNDLED) >= 18
    assert len({x.id for x in all_items}) == len(all_items)
    for kind in BUNDLED:
        items = bundled(kind)
        assert len(items) >= 6 and {x.kind for x in items} == {kind}
    # Grounded prompts carry the text they work on; that is what prompt lookup copies from.
    assert all(len(x.document.split()) >= 50 for x in bundled("grounded"))
    assert any(x.document for x in bundled("code")) and any(not x.document for x in bundled("code"))


def test_messages_join_instruction_and_document():
    item = WorkItem("a", "grounded", "Summarise:", "Some text.")
    assert item.messages() == [{"role": "user", "content": "Summarise:\n\nSome text."}]
    assert WorkItem("b", "chat", "Hi").messages() == [{"role": "user", "content": "Hi"}]


def test_load_workload_from_names_and_files(tmp_path):
    assert [x.kind for x in load_workload("code, chat")] == ["code"] * 6 + ["chat"] * 6
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"id": "x", "instruction": "Say hi."}) + "\n\n" +
                    json.dumps({"id": "y", "kind": "code", "instruction": "f", "document": "def f(): pass"}) + "\n")
    items = load_workload(f"{path},chat")
    assert items[0] == WorkItem("x", "chat", "Say hi.") and items[1].document == "def f(): pass"
    assert len(items) == 8


@pytest.mark.parametrize("spec,match", [("nope", "neither"), ("", "no prompts"), (",", "no prompts")])
def test_load_workload_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        load_workload(spec)


def test_load_workload_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "x", "instruction": "ok"}\n{"id": "y"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_workload(str(path))


def test_fit_document_cuts_keeping_whitespace():
    code = "def f(a):\n    return a + 1\n"
    assert fit_document(code, 4, ["x"]) == "def f(a):\n    return a"
    assert fit_document("one two three", 3, ["x"]) == "one two three"
    assert fit_document("one two three", 0, ["x"]) == ""


def test_fit_document_pads_with_filler_from_an_offset():
    out = fit_document("one two", 5, ["a", "b", "c"], offset=2)
    assert out == "one two\n\nc a b"
    assert fit_document("", 2, ["a", "b"]) == "a b"
    with pytest.raises(ValueError):
        fit_document("", 2, [])
    with pytest.raises(ValueError):
        fit_document("x", -1, ["a"])


@pytest.mark.parametrize("words", [0, 7, 40, 400])
def test_shape_inputs_sets_every_document_length(words):
    items = shape_inputs(load_workload("all"), words, seed=3)
    assert all(len(x.document.split()) == words for x in items)
    assert [x.instruction for x in items] == [x.instruction for x in load_workload("all")]
    assert shape_inputs(load_workload("all"), words, seed=3) == items  # seeded
    assert shape_inputs(load_workload("chat"), None) == load_workload("chat")
    assert len(filler_words()) > 200


def test_request_order_is_seeded_balanced_and_endless():
    items = load_workload("all")
    first = list(itertools.islice(request_order(items, seed=1), 60))
    assert first == list(itertools.islice(request_order(items, seed=1), 60))
    assert first != list(itertools.islice(request_order(items, seed=2), 60))
    assert [x.kind for x in first[:6]] == ["chat", "grounded", "code"] * 2  # kinds take turns
    assert Counter(x.id for x in first).most_common()[-1][1] >= 3  # every prompt comes round again
    # Within one pass every item of a kind appears once before any repeats.
    chats = [x.id for x in first if x.kind == "chat"]
    assert len(set(chats[:6])) == 6
    with pytest.raises(ValueError):
        next(request_order([]))


def test_config_defaults_and_validation():
    cfg = LoadTestConfig()
    cfg.validate()
    assert cfg.requests_per_run() == 12
    assert LoadTestConfig(duration_s=5).requests_per_run() is None
    assert cfg.block_size(Load("concurrency", 3)) == 6
    assert cfg.block_size(Load("rate", 0.2)) == 4 and cfg.block_size(Load("rate", 2.0)) == 20
    assert LoadTestConfig(block=5).block_size(Load("concurrency", 3)) == 5
    assert Load("concurrency", 2).label == "c=2" and Load("rate", 0.5).label == "0.5 req/s"


@pytest.mark.parametrize("fields,match", [
    (dict(modes=[]), "at least one mode"), (dict(modes=["-1"]), "mode is auto"), (dict(modes=["x"]), "mode is auto"),
    (dict(modes=["4", "4"]), "repeat"), (dict(loads=[]), "at least one load"),
    (dict(loads=[Load("concurrency", 0)]), "whole number"), (dict(loads=[Load("concurrency", 1.5)]), "whole number"),
    (dict(loads=[Load("rate", 0)]), "positive"), (dict(loads=[Load("rate", 1), Load("concurrency", 1)]), "all"),
    (dict(num_requests=0), "num_requests"), (dict(duration_s=0), "duration"), (dict(block=0), "block"),
    (dict(arrival="uniform"), "arrival"), (dict(burstiness=0), "burstiness"), (dict(max_tokens=0), "max_tokens"),
    (dict(slos={"itl": 1.0}), "SLOs"),
])
def test_config_validation_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        LoadTestConfig(**fields).validate()
