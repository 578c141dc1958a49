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


def chat_parser(**config) -> RequestParser:
    """A parser whose tokenizer has a chat template (one character a token)."""
    from specdec.testing.tiny import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    return RequestParser(OrchestratorConfig(target="fake:1", **config), tokenizer, max_context=100_000,
                         eos_ids={tokenizer.eos_token_id})


@pytest.mark.parametrize("calls, field", [
    ('[{"function": "f"}]', r"messages\[1\].tool_calls\[0\].function"),
    ('[{"function": null}]', r"messages\[1\].tool_calls\[0\].function"),
    ('[{"function": ["f"]}]', r"messages\[1\].tool_calls\[0\].function"),
    ('[{"function": {"name": 3, "arguments": "{}"}}]', r"messages\[1\].tool_calls\[0\].function.name"),
    ('[{"function": {"name": "f", "arguments": 3}}]', r"messages\[1\].tool_calls\[0\].function.arguments"),
    ('[{"function": {"name": "f", "arguments": "[1]"}}]', r"messages\[1\].tool_calls\[0\].function.arguments"),
    ('["f"]', r"messages\[1\].tool_calls\[0\]"),
    ('[null]', r"messages\[1\].tool_calls\[0\]"),
    ('{"function": {}}', r"messages\[1\].tool_calls must be a JSON list"),
])
def test_malformed_tool_calls_are_invalid_arguments_naming_the_field(calls, field):
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi"),
                                         pb.ChatMessage(role="assistant", tool_calls_json=calls)])
    with pytest.raises(InvalidArgument, match=field):
        chat_parser().parse(pb.GenerateRequest(messages=messages))


def test_a_well_formed_tool_call_reaches_the_template_with_its_arguments_as_an_object():
    calls = '[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\\"a\\": 1}"}}]'
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi"),
                                         pb.ChatMessage(role="assistant", tool_calls_json=calls)])
    assert chat_parser().parse(pb.GenerateRequest(messages=messages)).input_ids


@pytest.mark.parametrize("depth", [70, 5_000, 200_000])
def test_deeply_nested_tools_are_an_invalid_argument_not_a_recursion_error(depth):
    nested = "[" * depth + "]" * depth
    tools = f'[{{"type": "function", "function": {{"name": "f", "parameters": {{"x": {nested}}}}}}}]'
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")], tools_json=tools)
    with pytest.raises(InvalidArgument, match=r"tools is nested deeper than 64 levels"):
        chat_parser().parse(pb.GenerateRequest(messages=messages))
    calls = f'[{{"function": {{"name": "f", "arguments": {{"x": {nested}}}}}}}]'
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi"),
                                         pb.ChatMessage(role="assistant", tool_calls_json=calls)])
    with pytest.raises(InvalidArgument, match=r"messages\[1\].tool_calls is nested deeper than 64 levels"):
        chat_parser().parse(pb.GenerateRequest(messages=messages))


@pytest.mark.parametrize("tools, field", [
    ('["f"]', r"tools\[0\] must be a JSON object"),
    ('[null]', r"tools\[0\] must be a JSON object"),
])
def test_tools_that_are_not_objects_are_named(tools, field):
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")], tools_json=tools)
    with pytest.raises(InvalidArgument, match=field):
        chat_parser().parse(pb.GenerateRequest(messages=messages))


# -- request-constant state: capped, named ------------------------------------------------------------


def test_a_logit_bias_over_its_limit_is_refused_naming_the_field_and_flag():
    bias = {t: 1.0 for t in range(33, 33 + 9)}
    with pytest.raises(InvalidArgument, match=r"^logit_bias has 9 entries; the limit is --max-logit-bias=8"):
        parser(max_logit_bias=8).parse(pb.GenerateRequest(prompt="hi", logit_bias=bias))
    assert parser(max_logit_bias=9).parse(pb.GenerateRequest(prompt="hi", logit_bias=bias)).params.logit_bias


def test_a_grammar_over_its_limit_is_refused_naming_the_field_and_flag():
    text = '{"type": "string", "description": "' + "x" * 2000 + '"}'
    request = pb.GenerateRequest(prompt="hi", grammar=pb.Grammar(kind="json_schema", text=text))
    with pytest.raises(InvalidArgument, match=r"^grammar text has 20\d\d bytes; the limit is --max-grammar-bytes=1024"):
        parser(max_grammar_bytes=1024).parse(request)
    assert parser(max_grammar_bytes=4096).parse(request).params.grammar_text == text


def test_stop_token_ids_over_their_limit_are_refused_naming_the_flag():
    with pytest.raises(InvalidArgument, match=r"^stop_token_ids has 5 ids; the limit is --max-stop-token-ids=4"):
        parser(max_stop_token_ids=4).parse(pb.GenerateRequest(prompt="hi", stop_token_ids=[40, 41, 42, 43, 44]))
