"""Tool calls in OpenAI's shape, as pure functions: the grammar that forces a call, and the calls
found in a model's answer.

`tool_choice` "required" or a named function: the answer is forced (through the grammar engine,
on both sides of speculation) to be one JSON object `{"name": ..., "arguments": {...}}` whose
arguments follow the function's parameter schema. "auto": the model answers freely and a call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in its text (the convention of Hermes-
and Qwen-style chat templates, and what the orchestrator asks of templates that take no tools).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolError(ValueError):
    """A `tools` or `tool_choice` the gateway cannot use; the message names what is wrong."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolMode:
    """How a request's answer may hold tool calls."""

    names: tuple[str, ...]
    forced: bool  # the grammar makes the whole answer one call
    parallel: bool = True  # parallel_tool_calls: with auto, more than one call may come back


def functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> parameter schema, checking OpenAI's `tools` shape."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolError("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError("tools", f"tools[{i}].function.name must be a non-empty string")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ToolError("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        out[name] = parameters
    return out


def call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def forcing_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> tuple[str, str]:
    """The json_schema grammar for tool_choice "required" (any one function) or a named function."""
    schemas = functions(tools)
    if choice == "required":
        options = [call_schema(name, params) for name, params in schemas.items()]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return "json_schema", json.dumps(schema)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if name not in schemas:
        raise ToolError("tool_choice", f"tool_choice names function {name!r}, which is not in tools "
                        f"({', '.join(schemas)})")
    return "json_schema", json.dumps(call_schema(name, schemas[name]))


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def parse_calls(text: str, mode: ToolMode) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer's text outside tool calls (None when nothing else), and its calls."""
    if mode.forced:  # the grammar made the answer exactly one call
        try:
            call = json.loads(text)
            return None, [_call(call["name"], call["arguments"])]
        except (ValueError, KeyError, TypeError):
            return text, []  # cut short by max_tokens: no complete call
    calls = []
    for match in _TAGGED.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") in mode.names and isinstance(call.get("arguments"), dict):
            calls.append(_call(call["name"], call["arguments"]))
    if not calls:
        return text, []
    if not mode.parallel:
        calls = calls[:1]
    rest = _TAGGED.sub("", text).strip()
    return rest or None, calls
