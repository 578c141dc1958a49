"""OpenAI wire format <-> specdec, as pure conversions (no server)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from http_gateway.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    api_error,
    chat_choices,
    chat_kwargs,
    completion_choices,
    completion_kwargs,
    retry_after_s,
    tool_mode,
    usage,
    validation_error,
)
from specdec import errors
from specdec.client import Chunk, Generation, Logprob, build_request

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
STATS = {"prompt_tokens": 7, "completion_tokens": 5, "rounds": 3, "draft_tokens": 8, "accepted_tokens": 2,
         "acceptance_rate": 0.25, "mean_accepted_length": 1.67, "draft_fallbacks": 0,
         "time_to_first_token_s": 0.1, "tokens_per_second": 20.0}


def test_completion_request_to_generate_request():
    req = CompletionRequest(model="m", prompt=["Hi"], max_tokens=9, temperature=0, top_p=0.5, seed=3, stop="\n",
                            top_k=4, draft_length="auto", user="ignored-field")
    msg = build_request(**completion_kwargs(req))
    assert msg.prompt == "Hi" and msg.max_new_tokens == 9 and msg.temperature == 0 and msg.top_p == 0.5
    assert msg.seed == 3 and list(msg.stop) == ["\n"] and msg.top_k == 4 and msg.draft_length == -1
    assert msg.session_id == "" and not msg.HasField("share_output")
    kept = build_request(**completion_kwargs(CompletionRequest(model="m", prompt="Hi", share_output=False)))
    assert kept.HasField("share_output") and kept.share_output is False


def test_openai_defaults():
    msg = build_request(**completion_kwargs(CompletionRequest(model="m", prompt="Hi"), default_temperature=1.0))
    assert msg.max_new_tokens == 16 and msg.temperature == 1.0  # OpenAI's documented defaults
    assert not msg.HasField("top_p") and not msg.HasField("seed") and not msg.HasField("draft_length")
    chat = build_request(**chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}]),
                                       default_temperature=0.0))
    assert not chat.HasField("max_new_tokens") and chat.temperature == 0.0  # chat: the server's length limit


def test_chat_request_to_generate_request():
    req = ChatRequest(model="m", max_tokens=5, max_completion_tokens=7, stop=["a", "b"], session_id="s",
                      messages=[{"role": "developer", "content": "Be brief."},
                                {"role": "user", "content": [{"type": "text", "text": "Hel"},
                                                             {"type": "text", "text": "lo"}]},
                                {"role": "assistant", "content": None}])
    msg = build_request(**chat_kwargs(req))
    assert [(m.role, m.content) for m in msg.messages.messages] == [("system", "Be brief."), ("user", "Hello"),
                                                                     ("assistant", "")]
    assert msg.max_new_tokens == 7 and list(msg.stop) == ["a", "b"] and msg.session_id == "s"


@pytest.mark.parametrize("build,param", [
    (lambda: completion_choices(CompletionRequest(model="m", prompt="x", n=0)), "n"),
    (lambda: completion_choices(CompletionRequest(model="m", prompt=["a", "b"], n=65)), "n"),
    (lambda: chat_choices(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], n=2,
                                      session_id="s")), "session_id"),
    (lambda: completion_choices(CompletionRequest(model="m", prompt=[[1, 2], []])), "prompt"),
    (lambda: completion_kwargs(CompletionRequest(model="m", prompt=[])), "prompt"),
    (lambda: completion_kwargs(CompletionRequest(model="m", prompt="x", logprobs=21)), "logprobs"),
    (lambda: completion_kwargs(CompletionRequest(model="m", prompt="x", best_of=3)), "best_of"),
    (lambda: completion_kwargs(CompletionRequest(model="m", prompt="x", logit_bias={"a": 1})), "logit_bias"),
    (lambda: completion_kwargs(CompletionRequest(model="m", prompt="x", seed=-5)), "seed"),
    (lambda: completion_kwargs(CompletionRequest(model="m", prompt="x", seed=2**64)), "seed"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "robot", "content": "x"}])), "messages[0].role"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "tool", "content": "x"}])),
     "messages[0].tool_call_id"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[TOOL],
                                     tool_choice={"type": "function", "function": {"name": "nope"}})), "tool_choice"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[TOOL],
                                     tool_choice="required", response_format={"type": "json_object"})),
     "tool_choice"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
     "messages[0].content"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], top_logprobs=2)),
     "top_logprobs"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True,
                                     top_logprobs=21)), "top_logprobs"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[{}])), "tools"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], functions=[{}])),
     "functions"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                     function_call="auto")), "function_call"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                     tool_choice="required")), "tool_choice"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                     tool_choice={"type": "function", "function": {"name": "f"}})), "tool_choice"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                     response_format={"type": "yaml"})), "response_format"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                     response_format={"type": "json_object"}, guided_regex="a+")), "guided_regex"),
    (lambda: chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                     response_format={"type": "json_schema", "json_schema": {"name": "a"}})),
     "response_format"),
])
def test_unsupported_or_invalid_requests_are_400_naming_the_parameter(build, param):
    with pytest.raises(ApiError) as info:
        build()
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["param"] == param


def test_an_empty_conversation_does_not_parse():
    with pytest.raises(ValidationError) as info:
        ChatRequest(model="m", messages=[])
    err = validation_error(info.value.errors())
    assert err.status == 400 and err.param == "messages" and err.message.startswith("messages:")


@pytest.mark.parametrize("exc,status,type_,param,code", [
    (errors.InvalidArgument("max_new_tokens must be between 1 and 4096, got 0"), 400, "invalid_request_error",
     "max_tokens", "invalid_value"),
    (errors.InvalidArgument("orchestrator 10.0.0.1:50051: top_p must lie in (0, 1]"), 400, "invalid_request_error",
     "top_p", "invalid_value"),
    (errors.FailedPrecondition("the model has no chat template"), 400, "invalid_request_error", None,
     "failed_precondition"),
    (errors.NotFound("session 'x' does not exist"), 404, "invalid_request_error", "session_id", "session_not_found"),
    (errors.Aborted("session 'x' is busy"), 409, "conflict_error", "session_id", "session_busy"),
    (errors.ResourceExhausted("too many requests"), 429, "rate_limit_error", None, "overloaded"),
    (errors.Unavailable("target down"), 503, "service_unavailable_error", None, "unavailable"),
    (errors.DeadlineExceeded("late"), 504, "timeout_error", None, "deadline_exceeded"),
    (errors.Internal("boom"), 500, "server_error", None, "internal_error"),
    (ValueError("Value out of range: -1"), 400, "invalid_request_error", None, "invalid_value"),
])
def test_error_mapping(exc, status, type_, param, code):
    err = api_error(exc)
    body = err.body()["error"]
    assert (err.status, body["type"], body["param"], body["code"]) == (status, type_, param, code)
    assert "orchestrator 10.0.0.1" not in body["message"]  # internal addresses stay inside
    assert "max_new_tokens" not in body["message"]  # the client's parameter is max_tokens


def test_retry_after_for_overload_and_outage_only():
    assert retry_after_s(429) == retry_after_s(503) == 1
    assert retry_after_s(400) is None and retry_after_s(504) is None


def test_usage_carries_the_speculation_extension():
    u = usage(STATS)
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (7, 5, 12)
    assert u["speculation"] == {**u["speculation"], "acceptance_rate": 0.25, "mean_accepted_length": 1.67,
                                "draft_tokens": 8, "accepted_tokens": 2, "rounds": 3}


def test_reply_objects():
    chat = Reply("chat", "m")
    whole = chat.whole([Generation("s1", "Hi", [5], "eos", STATS)])
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
    assert whole["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                                 "finish_reason": "stop", "logprobs": None}]
    assert whole["specdec"] == {"session_id": "s1"} and whole["usage"]["total_tokens"] == 12
    assert chat.opening("s1")["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = chat.delta(Chunk("s1", [5], "!", {}, finish_reason="length", stats=STATS))
    assert last["choices"][0] == {"index": 0, "delta": {"content": "!"}, "finish_reason": "length", "logprobs": None}
    assert last["id"] == whole["id"]  # one id for every event of a response
    assert chat.delta(Chunk("s1", [5], "", {}))["choices"][0]["delta"] == {}
    text = Reply("completion", "m")
    assert text.whole([Generation("s1", "Hi", [5], "stop", STATS)])["choices"][0] == {
        "index": 0, "text": "Hi", "finish_reason": "stop", "logprobs": None}
    assert text.delta(Chunk("s1", [1], "x", {}))["object"] == "text_completion"
    final = text.usage_event([STATS], "s1")
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5


def test_the_grpc_codes_we_map_are_the_sdk_codes():
    from http_gateway.openai_api import HTTP_ERRORS

    for cls in (errors.InvalidArgument, errors.NotFound, errors.Aborted, errors.ResourceExhausted,
                errors.Unavailable, errors.DeadlineExceeded, errors.FailedPrecondition):
        assert cls.code in HTTP_ERRORS
    assert "INTERNAL" not in HTTP_ERRORS  # the 500 fallback


def test_invalid_json_names_where_but_no_param():
    # What FastAPI reports for `{"model": }`: the location is a character offset, not a field.
    err = validation_error([{"type": "json_invalid", "loc": ("body", 10), "msg": "JSON decode error",
                             "ctx": {"error": "Expecting value"}}])
    assert err.status == 400 and err.param is None and err.code == "invalid_json"
    assert err.message == "the body is not valid JSON: Expecting value at character 10"


@pytest.mark.parametrize("model,field,hint", [
    (ChatRequest, "max_token", "'max_tokens'"),
    (CompletionRequest, "promt", "'prompt'"),
    (ChatRequest, "zzzzzz", None),
])
def test_an_unknown_field_is_refused_naming_the_nearest(model, field, hint):
    body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}], field: 5}
    body.pop("prompt" if model is ChatRequest else "messages")
    with pytest.raises(ValidationError) as info:
        model(**body)
    err = validation_error(info.value.errors(), model)
    assert err.status == 400 and err.param == field and err.code == "unknown_parameter"
    assert (hint in err.message) if hint else "did you mean" not in err.message


def test_fields_openai_clients_send_are_accepted():
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "x", "name": "ann"}], user="u",
                       metadata={"k": "v"}, store=False, service_tier="auto", stream_options={"include_usage": True},
                       tool_choice="none", parallel_tool_calls=False, response_format={"type": "text"},
                       prompt_cache_key="k", safety_identifier="s")
    assert chat_kwargs(chat)["messages"] == [{"role": "user", "content": "x"}]
    completion = CompletionRequest(model="m", prompt="x", user="u", metadata={"k": "v"})
    assert completion_kwargs(completion)["prompt"] == "x"


def test_processors_logprobs_and_token_prompts_reach_the_request():
    kwargs = completion_kwargs(CompletionRequest(
        model="m", prompt=[[5, 6, 7]], logprobs=0, presence_penalty=0.5, frequency_penalty=-1, logit_bias={"9": -100},
        min_p=0.1, repetition_penalty=1.2, min_tokens=3, ignore_eos=True, stop_token_ids=[4]))
    msg = build_request(**kwargs)
    assert list(msg.token_ids.ids) == [5, 6, 7] and msg.logprobs and msg.top_logprobs == 0
    assert (msg.presence_penalty, msg.frequency_penalty, dict(msg.logit_bias)) == (0.5, -1.0, {9: -100.0})
    assert abs(msg.min_p - 0.1) < 1e-7 and abs(msg.repetition_penalty - 1.2) < 1e-6 and msg.min_tokens == 3
    assert msg.ignore_eos and list(msg.stop_token_ids) == [4]
    chat = chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True,
                                   top_logprobs=3))
    assert build_request(**chat).top_logprobs == 3
    plain = build_request(**chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}])))
    assert not plain.logprobs and not plain.HasField("presence_penalty") and not plain.HasField("min_tokens")


def test_logprobs_in_openais_shapes():
    entries = [Logprob(7, " a", -0.25, 1, [(7, " a", -0.25), (8, "b", -2.0)]), Logprob(9, "bc", -3.0, 4, [])]
    chat = Reply("chat", "m", logprobs=True).whole([Generation("s", " abc", [7, 9], "eos", {}, 0, entries)])
    chat = chat["choices"][0]["logprobs"]
    assert chat["content"][0] == {"token": " a", "logprob": -0.25, "bytes": [32, 97], "top_logprobs": [
        {"token": " a", "logprob": -0.25, "bytes": [32, 97]}, {"token": "b", "logprob": -2.0, "bytes": [98]}]}
    reply = Reply("completion", "m", logprobs=True)
    first = reply.delta(Chunk("s", [7], " a", {}, logprobs=entries[:1]))["choices"][0]["logprobs"]
    second = reply.delta(Chunk("s", [9], "bc", {}, logprobs=entries[1:]))["choices"][0]["logprobs"]
    assert first == {"tokens": [" a"], "token_logprobs": [-0.25], "top_logprobs": [{" a": -0.25, "b": -2.0}],
                     "text_offset": [0]}
    assert second["text_offset"] == [2] and second["top_logprobs"] == [{"bc": -3.0}]
    assert Reply("chat", "m").whole([Generation("s", "x", [7, 9], "eos", {}, 0, entries)])["choices"][0][
        "logprobs"] is None


def test_structured_output_fields_become_the_request_grammar():
    def grammar(**fields):
        msg = build_request(**chat_kwargs(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                                      **fields)))
        return (msg.grammar.kind, msg.grammar.text)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert grammar(response_format={"type": "json_object"}) == ("json_object", "")
    assert grammar(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema,
                                                                           "strict": True}}) == (
        "json_schema", json.dumps(schema))
    assert grammar(guided_regex="[a-z]+") == ("regex", "[a-z]+")
    assert grammar(guided_choice=["yes", "no"]) == ("choice", '["yes", "no"]')
    assert grammar(guided_grammar="start: \"a\"") == ("lark", 'start: "a"')
    assert grammar(response_format={"type": "text"}) == ("", "")


def test_n_choices_and_prompt_batches_fan_out_with_their_own_seeds():
    batch = completion_choices(CompletionRequest(model="m", prompt=["a", "b"], n=3, seed=2**64 - 2))
    assert [(k["prompt"], k["seed"]) for k in batch] == [
        ("a", 2**64 - 2), ("a", 2**64 - 1), ("a", 0), ("b", 2**64 - 2), ("b", 2**64 - 1), ("b", 0)]
    unseeded = chat_choices(ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], n=2))
    assert len(unseeded) == 2 and all(k["seed"] is None for k in unseeded)
    ids = completion_choices(CompletionRequest(model="m", prompt=[[1, 2], [3]]))
    assert [k["prompt"] for k in ids] == [[1, 2], [3]]


def test_usage_counts_each_prompt_once_and_sums_the_choices():
    stats = [dict(STATS, completion_tokens=c, draft_tokens=4, accepted_tokens=a, rounds=2) for c, a in ((5, 3), (7, 1))]
    total = usage(stats, prompts=1)
    assert total["prompt_tokens"] == STATS["prompt_tokens"] and total["completion_tokens"] == 12
    assert total["speculation"]["acceptance_rate"] == 0.5 and total["speculation"]["mean_accepted_length"] == 3.0
    whole = Reply("completion", "m", prompts=1).whole([Generation("s", "x", [1], "eos", st) for st in stats])
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert [c["speculation"]["accepted_tokens"] for c in whole["choices"]] == [3, 1]
    assert usage(stats, prompts=2)["prompt_tokens"] == 2 * STATS["prompt_tokens"]


def test_tool_choice_forces_a_call_through_the_grammar_and_replies_carry_tool_calls():
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    named = chat_kwargs(ChatRequest(model="m", messages=messages, tools=[TOOL],
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    kind, text = named["grammar"]
    assert kind == "json_schema" and json.loads(text)["properties"]["name"] == {"const": "get_weather"}
    assert named["tools"] == [TOOL]
    auto = ChatRequest(model="m", messages=messages, tools=[TOOL])
    assert chat_kwargs(auto)["grammar"] is None and tool_mode(auto).forced is False
    assert tool_mode(ChatRequest(model="m", messages=messages, tools=[TOOL], tool_choice="none")) is None
    forced = Reply("chat", "m", tools=tool_mode(ChatRequest(model="m", messages=messages, tools=[TOOL],
                                                               tool_choice="required")))
    whole = forced.whole([Generation("s", '{"name": "get_weather", "arguments": {"city": "Oslo"}}', [1], "eos", {})])
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    free = Reply("chat", "m", tools=tool_mode(auto))
    said = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    assert free.delta(Chunk("s", [1], said[:20], {}), 0) is None  # held until the choice ends
    last = free.delta(Chunk("s", [2], said[20:], {}, finish_reason="eos"), 0)["choices"][0]
    assert last["finish_reason"] == "tool_calls" and last["delta"]["content"] == "Let me check."
    assert last["delta"]["tool_calls"][0]["index"] == 0
    assert json.loads(last["delta"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    plain = free.whole([Generation("s", "Sunny, I think.", [1], "eos", {})])["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "Sunny, I think."} and plain["finish_reason"] == "stop"


def test_parallel_tool_calls_false_keeps_one_call():
    messages = [{"role": "user", "content": "Weather in Oslo and Rome?"}]
    said = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    both = Reply("chat", "m", tools=tool_mode(ChatRequest(model="m", messages=messages, tools=[TOOL])))
    one = Reply("chat", "m", tools=tool_mode(ChatRequest(model="m", messages=messages, tools=[TOOL],
                                                             parallel_tool_calls=False)))
    assert len(both.whole([Generation("s", said, [1], "eos", {})])["choices"][0]["message"]["tool_calls"]) == 2
    assert len(one.whole([Generation("s", said, [1], "eos", {})])["choices"][0]["message"]["tool_calls"]) == 1
