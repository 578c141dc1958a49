"""Request validation (orchestrator.requests): defaults, limits, and what each refusal says."""

from __future__ import annotations

import pytest

from orchestrator.config import OrchestratorConfig
from orchestrator.requests import AUTO, RequestParser
from specdec.core.sampling import SamplingParams
from specdec.errors import FailedPrecondition, InvalidArgument
from specdec.v1 import orchestrator_pb2 as pb
from tests.unit.fakes import EOS, CharTokenizer, tokens


def parser(**config) -> RequestParser:
    return RequestParser(OrchestratorConfig(target="fake:1", **config), CharTokenizer(), max_context=64,
                         eos_ids={EOS})


def test_defaults_come_from_the_config():
    spec = parser(default_max_new_tokens=7, draft_length=3).parse(pb.GenerateRequest(prompt="hi"), principal="p")
    assert spec.input_ids == tokens("hi") and spec.max_new_tokens == 7 and spec.draft_length == 3
    assert spec.params == SamplingParams() and spec.seed is None and spec.stop == () and spec.principal == "p"
    assert parser().parse(pb.GenerateRequest(prompt="hi")).draft_length == AUTO


def test_a_resume_carries_only_the_session_and_the_count_held():
    spec = parser().parse(pb.GenerateRequest(session_id="ab" * 16, resume_from=4), principal="p")
    assert (spec.session_id, spec.resume_from, spec.principal, spec.input_ids) == ("ab" * 16, 4, "p", [])
    with pytest.raises(InvalidArgument, match="needs the session_id"):
        parser().parse(pb.GenerateRequest(resume_from=4))


@pytest.mark.parametrize("fields, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be between 1 and"),
    (dict(temperature=-1.0), "temperature must be a finite number"),
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(draft_length=99), "draft_length must be -1"),
    (dict(stop=[""]), "each stop string must have 1 to"),
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt="x" * 64), "the model's context holds 64"),
    (dict(prompt=None), "set one of prompt, messages or token_ids"),
])
def test_each_bad_field_is_named(fields, message):
    fields = {"prompt": "hi", **fields}
    if fields["prompt"] is None:
        del fields["prompt"]
    with pytest.raises(InvalidArgument, match=message):
        parser().parse(pb.GenerateRequest(**fields))


def test_configured_limits_are_named_by_their_flag():
    with pytest.raises(InvalidArgument, match="--max-prompt-tokens=3"):
        parser(max_prompt_tokens=3).parse(pb.GenerateRequest(prompt="four"))
    with pytest.raises(InvalidArgument, match="--max-stop-strings"):
        parser(max_stop_strings=1).parse(pb.GenerateRequest(prompt="hi", stop=["a", "b"]))


def test_messages_need_a_chat_template_and_known_roles():
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    with pytest.raises(FailedPrecondition, match="no chat template"):
        parser().parse(pb.GenerateRequest(messages=messages))
    bad = pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="hi")])
    with pytest.raises(InvalidArgument, match=r"messages\[0\].role"):
        parser().parse(pb.GenerateRequest(messages=bad))
