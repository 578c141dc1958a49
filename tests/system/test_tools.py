"""Tool calls through the gateway with the `openai` client: a named function and "required" are
enforced by the grammar (the arguments follow the function's schema, under speculation), the
calls come back in OpenAI's shape, streamed or not, and a conversation goes on with the tool's
answer."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 9}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [  # the tiny models' template takes no tools: they are described in text, a character a token
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def tools_api(long_pipeline):
    """The long-context pipeline's gateway: the tools' description alone is ~400 tokens here."""
    client = OpenAI(base_url=long_pipeline.plan.http_url(), api_key="unused", max_retries=0, timeout=120)
    return client, client.models.list().data[0].id


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(tools_api):
    api, model = tools_api
    for temperature in (0.0, 1.0):
        reply = api.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=temperature,
                                            seed=5, max_tokens=80,
                                            tool_choice={"type": "function", "function": {"name": "weather"}})
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_calls_one_of_the_tools_streamed(tools_api):
    api, model = tools_api
    stream = api.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         temperature=1.0, seed=9, max_tokens=80, stream=True)
    calls, finish = {}, None
    for event in stream:
        for choice in event.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1
    call = calls[0]
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
    jsonschema.validate(json.loads(call["arguments"]), schema)


def test_the_conversation_goes_on_with_the_tools_answer(tools_api):
    api, model = tools_api
    first = api.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=80,
                                        tool_choice={"type": "function", "function": {"name": "weather"}})
    call = first.choices[0].message.tool_calls[0]
    follow = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 7}'}]
    reply = api.chat.completions.create(model=model, messages=follow, tools=TOOLS, tool_choice="none",
                                        temperature=0, max_tokens=10)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.tool_calls is None
    alone = api.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                        temperature=0, max_tokens=1)
    # the call and the tool's answer are in the prompt
    assert reply.usage.prompt_tokens > alone.usage.prompt_tokens + len('{"temperature": 7}')
