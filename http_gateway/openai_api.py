"""The OpenAI wire format, as pure functions: requests in, SDK arguments out; chunks in, JSON out.

Nothing here does I/O, so every conversion is tested without a server (tests/unit/test_openai_api.py).

Supported: `model`, `prompt` (one string) or `messages` (text content), `max_tokens`
(`max_completion_tokens` for chat), `temperature`, `top_p`, `seed`, `stop` (string or list),
`n` = 1, `stream`, `stream_options.include_usage`. Extensions (send them in the body, e.g. with the
openai client's `extra_body`): `top_k`, `draft_length` ("auto" or k), `session_id` (continue a
specdec session), `share_output` (false: the output does not join the suffix drafts' corpus).
Features the pipeline does not have (`best_of` > 1, `suffix`, content parts other than text, the
legacy `functions`) are refused with a 400 naming the parameter, never silently ignored; so is an
unknown field (the message names the nearest known one). Fields that describe the caller (`user`,
`metadata`, `store`, `service_tier`, ...) are accepted and ignored.

Responses carry `usage` with a `speculation` object (acceptance_rate, mean_accepted_length,
draft_tokens, accepted_tokens, rounds, ...) and a top-level `specdec` object with the session id.
"""

from __future__ import annotations

import difflib
import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from http_gateway.tools import ToolError, ToolMode, forcing_grammar, functions, parse_calls
from specdec.client import Chunk, Generation, Logprob

MAX_SEED = 2**64 - 1
MAX_TOP_LOGPROBS = 20  # as the orchestrator allows (specdec.core.logprobs)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    """An error answered as an OpenAI error object with this HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- requests -----------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints share. An unknown field is refused (400 naming the nearest known one):
    a misspelled `max_token` must not silently fall back to a default."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # extensions, as vLLM names them
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark (start rule `start`)
    # specdec extensions
    draft_length: int | Literal["auto"] | None = None
    session_id: str | None = None
    share_output: bool | None = None
    # accepted and ignored by design: they describe the caller, not the generation
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # accepted by design: a cache-routing hint and a caller identifier; neither changes the generation
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


def _refuse(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends the token ids of `logit_bias` as JSON object keys (strings)."""
    if not bias:
        return None
    try:
        return {int(token): float(value) for token, value in bias.items()}
    except ValueError:
        raise ApiError(400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias",
                       code="invalid_value") from None


def _grammar(req: _Request) -> tuple[str, str] | None:
    """The grammar a request asks for: chat's `response_format`, or one of vLLM's `guided_*` fields."""
    asked: list[tuple[str, str, str]] = []  # (field, kind, text)
    response_format = getattr(req, "response_format", None) or {}
    kind = response_format.get("type", "text")
    if kind == "json_object":
        asked.append(("response_format", "json_object", ""))
    elif kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format", code="invalid_value")
        asked.append(("response_format", "json_schema", json.dumps(schema)))
    elif kind != "text":
        raise ApiError(400, f"response_format type {kind!r} is invalid: text, json_object or json_schema",
                       param="response_format", code="invalid_value")
    if req.guided_json is not None:
        text = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        asked.append(("guided_json", "json_schema", text))
    if req.guided_regex is not None:
        asked.append(("guided_regex", "regex", req.guided_regex))
    if req.guided_choice is not None:
        asked.append(("guided_choice", "choice", json.dumps(req.guided_choice)))
    if req.guided_grammar is not None:
        asked.append(("guided_grammar", "lark", req.guided_grammar))
    if len(asked) > 1:
        raise ApiError(400, f"{asked[0][0]} and {asked[1][0]} both constrain the output: send one",
                       param=asked[1][0], code="invalid_value")
    return (asked[0][1], asked[0][2]) if asked else None


MAX_CHOICES = 128  # n times the number of prompts, as OpenAI bounds n


def choices(kwargs: dict[str, Any], n: int, prompts: list | None = None) -> list[dict[str, Any]]:
    """One `build_request` kwargs per choice: each prompt (completions) `n` times, choice i of a
    prompt with seed `seed + i` (its own random stream, reproducible when a seed is given)."""
    prompts = prompts if prompts is not None else [kwargs.get("prompt")]
    if not 1 <= n * len(prompts) <= MAX_CHOICES:
        raise ApiError(400, f"n times the number of prompts must be between 1 and {MAX_CHOICES}, got "
                       f"{n} x {len(prompts)}", param="n", code="invalid_value")
    if n * len(prompts) > 1 and kwargs.get("session_id"):
        raise ApiError(400, "session_id continues one session: send it with one prompt and n=1",
                       param="session_id", code="invalid_value")
    seed = kwargs.get("seed")
    out = []
    for prompt in prompts:
        for i in range(n):
            one = dict(kwargs, seed=None if seed is None else (seed + i) & MAX_SEED)
            if "prompt" in kwargs:
                one["prompt"] = prompt
            out.append(one)
    return out


def _common_kwargs(req: _Request, max_tokens: int | None, default_temperature: float) -> dict[str, Any]:
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise ApiError(400, f"seed must be between 0 and {MAX_SEED}, got {req.seed}", param="seed",
                       code="invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return dict(
        max_new_tokens=max_tokens,
        temperature=req.temperature if req.temperature is not None else default_temperature,
        top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=stop, draft_length=req.draft_length,
        session_id=req.session_id or "", presence_penalty=req.presence_penalty or None,
        frequency_penalty=req.frequency_penalty or None, logit_bias=_logit_bias(req.logit_bias), min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, ignore_eos=bool(req.ignore_eos),
        stop_token_ids=list(req.stop_token_ids or ()), grammar=_grammar(req), share_output=req.share_output,
    )


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: one text or token-id list, or a batch of either."""
    prompt = req.prompt
    batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    if any(isinstance(p, list) and not p for p in batch) or (isinstance(prompt, list) and not prompt):
        raise ApiError(400, "prompt is empty", param="prompt", code="invalid_value")
    return list(batch)


def completion_choices(req: CompletionRequest, default_temperature: float = 1.0) -> list[dict[str, Any]]:
    """`build_request` kwargs for each choice of a /v1/completions request (prompts times n)."""
    return choices(completion_kwargs(req, default_temperature), 1 if req.n is None else req.n, prompts_of(req))


def chat_choices(req: ChatRequest, default_temperature: float = 1.0) -> list[dict[str, Any]]:
    """`build_request` kwargs for each of the n choices of a /v1/chat/completions request."""
    return choices(chat_kwargs(req, default_temperature), 1 if req.n is None else req.n)


def completion_kwargs(req: CompletionRequest, default_temperature: float = 1.0) -> dict[str, Any]:
    """Keyword arguments of `specdec.client.build_request` for a /v1/completions request (its first
    prompt: `completion_choices` makes one per choice)."""
    prompt = prompts_of(req)[0]
    if req.best_of not in (None, 1):
        raise _refuse("best_of", "only best_of=1 is supported")
    if req.suffix:
        raise _refuse("suffix", "not supported")
    logprobs: dict[str, Any] = {}
    if req.logprobs is not None:
        if not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.logprobs}",
                           param="logprobs", code="invalid_value")
        logprobs = dict(logprobs=True, top_logprobs=req.logprobs)
    if req.echo:  # the prompt's tokens come back scored (their texts make the echo of a token-id prompt)
        logprobs = dict(logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0, prompt_logprobs=True)
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens must be at least 1 (0 is for scoring the prompt: with echo)",
                       param="max_tokens", code="invalid_value")
    return dict(prompt=prompt, **_common_kwargs(req, max_tokens, default_temperature), **logprobs)


def _text_of(i: int, message: Message) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise _refuse(f"messages[{i}].content", f"only text content parts are supported, got {part.type!r}")
        texts.append(part.text)
    return "".join(texts)


def chat_kwargs(req: ChatRequest, default_temperature: float = 1.0) -> dict[str, Any]:
    """Keyword arguments of `specdec.client.build_request` for a /v1/chat/completions request."""
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {req.top_logprobs}",
                       param="top_logprobs", code="invalid_value")
    logprobs = dict(logprobs=True, top_logprobs=req.top_logprobs or 0) if req.logprobs else {}
    if req.functions or req.function_call is not None:
        raise _refuse("functions" if req.functions else "function_call",
                      "the deprecated functions API is not served: send tools and tool_choice")
    messages = [_chat_message(i, m) for i, m in enumerate(req.messages)]
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    kwargs = dict(messages=messages, **_common_kwargs(req, max_tokens, default_temperature), **logprobs)
    mode = tool_mode(req)
    if mode is not None:
        kwargs["tools"] = req.tools
        if mode.forced:
            if kwargs["grammar"] is not None:
                raise ApiError(400, "tool_choice forces a tool call, so the output cannot also follow "
                               "response_format or a guided_* grammar: send one", param="tool_choice",
                               code="invalid_value")
            try:
                kwargs["grammar"] = forcing_grammar(req.tools, req.tool_choice)
            except ToolError as exc:
                raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
    return kwargs


def tool_mode(req: ChatRequest) -> ToolMode | None:
    """How the answer may hold tool calls: None without tools or with tool_choice "none"."""
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    if not req.tools:
        if choice not in ("none", "auto"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        return None
    if choice == "none":
        return None
    if choice not in ("auto", "required") and not (isinstance(choice, dict) and choice.get("type") == "function"):
        raise ApiError(400, f"tool_choice must be none, auto, required or {{\"type\": \"function\", ...}}, got "
                       f"{choice!r}", param="tool_choice", code="invalid_value")
    try:
        names = tuple(functions(req.tools))
    except ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
    return ToolMode(names, forced=choice != "auto", parallel=req.parallel_tool_calls is not False)


def _chat_message(i: int, m: Message) -> dict[str, Any]:
    role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for system
    if role not in ("system", "user", "assistant", "tool"):
        raise ApiError(400, f"messages[{i}].role must be system, developer, user, assistant or tool, got "
                       f"{m.role!r}", param=f"messages[{i}].role", code="invalid_value")
    message: dict[str, Any] = {"role": role, "content": _text_of(i, m)}
    extra = m.model_extra or {}
    if role == "assistant" and extra.get("tool_calls"):
        message["tool_calls"] = extra["tool_calls"]
    if role == "tool":
        if not extra.get("tool_call_id"):
            raise ApiError(400, f"messages[{i}]: a tool message needs tool_call_id",
                           param=f"messages[{i}].tool_call_id", code="invalid_value")
        message.update(tool_call_id=extra["tool_call_id"], name=extra.get("name") or "")
    return message


# -- responses ----------------------------------------------------------------------------------


FINISH = {"eos": "stop", "stop": "stop", "length": "length", None: None}


def speculation(stats: dict[str, Any]) -> dict[str, Any]:
    """The speculation statistics of one generation (the `usage.speculation` extension)."""
    return {
        "acceptance_rate": stats.get("acceptance_rate", 0.0),
        "mean_accepted_length": stats.get("mean_accepted_length", 0.0),
        "draft_tokens": stats.get("draft_tokens", 0),
        "accepted_tokens": stats.get("accepted_tokens", 0),
        "rounds": stats.get("rounds", 0),
        "draft_fallbacks": stats.get("draft_fallbacks", 0),
        "time_to_first_token_s": stats.get("time_to_first_token_s", 0.0),
        "tokens_per_second": stats.get("tokens_per_second", 0.0),
    }


def usage(stats: dict[str, Any] | list[dict[str, Any]], prompts: int = 1) -> dict[str, Any]:
    """OpenAI `usage` of the choices whose generation statistics are `stats` (one dict per choice),
    with their speculation statistics in total. Each of the `prompts` distinct prompts is counted
    once, however many choices share it (as OpenAI counts `n`)."""
    per = [stats] if isinstance(stats, dict) else list(stats)
    if not per:
        per = [{}]
    share = max(1, len(per) // max(prompts, 1))  # choices per prompt
    prompt = sum(int(st.get("prompt_tokens", 0)) for st in per[::share])
    completion = sum(int(st.get("completion_tokens", 0)) for st in per)
    if len(per) == 1:
        total = speculation(per[0])
    else:
        draft, accepted = (sum(int(st.get(k, 0)) for st in per) for k in ("draft_tokens", "accepted_tokens"))
        rounds = sum(int(st.get("rounds", 0)) for st in per)
        elapsed = max((float(st.get("elapsed_s", 0.0)) for st in per), default=0.0)
        total = {
            "acceptance_rate": accepted / draft if draft else 0.0,
            "mean_accepted_length": completion / rounds if rounds else 0.0,
            "draft_tokens": draft, "accepted_tokens": accepted, "rounds": rounds,
            "draft_fallbacks": sum(int(st.get("draft_fallbacks", 0)) for st in per),
            "time_to_first_token_s": min(float(st.get("time_to_first_token_s", 0.0)) for st in per),
            "tokens_per_second": completion / elapsed if elapsed > 0 else 0.0,
        }
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "speculation": total}


def _top(entry: Logprob) -> list[dict[str, Any]]:
    return [{"token": text, "logprob": value, "bytes": list(text.encode())} for _, text, value in entry.top]


def chat_logprobs(entries: list[Logprob]) -> dict[str, Any]:
    """Chat's `logprobs`: each token with its log-probability, bytes and top alternatives."""
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
                         "top_logprobs": _top(e)} for e in entries], "refusal": None}


def completion_logprobs(entries: list[Logprob], text_offset: int) -> dict[str, Any]:
    """The legacy completions `logprobs`: parallel lists, the top alternatives as {token: logprob}
    (the sampled token always among them, as OpenAI does), each token's offset in the text. A
    sequence's first token (rank 0: nothing precedes it) has null for both, as OpenAI's echo."""
    offsets, at = [], text_offset
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob if e.rank else None for e in entries],
            "top_logprobs": [{**{text: value for _, text, value in e.top}, e.token: e.logprob} if e.rank else None
                             for e in entries],
            "text_offset": offsets}


class Reply:
    """Builds the JSON objects of one response (its id and creation time fixed up front), for any
    number of choices; choice i's events carry `index` i."""

    def __init__(self, kind: Literal["completion", "chat"], model: str, logprobs: bool = False,
                 echo: list[str | list[int]] | None = None, prompts: int = 1, tools: ToolMode | None = None) -> None:
        """`echo`: each choice's prompt, to put before its text (a token-id prompt's text is that of
        its scored tokens); `prompts`: how many distinct prompts the choices answer; `tools`: how the
        answers may hold tool calls (a streamed choice is then sent whole when it ends, its calls
        parsed)."""
        self.tools = tools
        self._held: dict[int, tuple[list[str], list[Logprob]]] = {}
        self.kind = kind
        self.model = model
        self.logprobs = logprobs
        self.echo = echo
        self.prompts = prompts
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # choice -> offset of its next token's text (completions)

    def _logprobs(self, index: int, entries: list[Logprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries)
        offset = self._offsets.get(index, 0)
        out = completion_logprobs(entries, offset)
        self._offsets[index] = offset + sum(len(e.token) for e in entries)
        return out

    def _echoed(self, index: int, text: str, prompt_logprobs: list[Logprob], logprobs: list[Logprob]
                ) -> tuple[str, list[Logprob]]:
        """With echo: the prompt's text before `text`, and its tokens before `logprobs`."""
        if self.echo is None or not prompt_logprobs:
            return text, logprobs
        prompt = self.echo[index]
        prompt = prompt if isinstance(prompt, str) else "".join(e.token for e in prompt_logprobs)
        return prompt + text, list(prompt_logprobs) + list(logprobs)

    def _envelope(self, obj: str, session_id: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "specdec": {"session_id": session_id}}

    def whole(self, outs: list[Generation]) -> dict[str, Any]:
        """The non-streaming answer: one choice per generation, with its own speculation statistics."""
        choices = []
        for index, out in enumerate(outs):
            finish = FINISH[out.finish_reason]
            if self.kind == "chat":
                message, finish = self._message(out.text, finish)
                choice = {"index": index, "message": message, "finish_reason": finish,
                          "logprobs": self._logprobs(index, out.logprobs)}
            else:
                text, logprobs = self._echoed(index, out.text, out.prompt_logprobs, out.logprobs)
                choice = {"index": index, "text": text, "finish_reason": finish,
                          "logprobs": self._logprobs(index, logprobs)}
            if len(outs) > 1:
                choice["speculation"] = speculation(out.stats)
            choices.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj, outs[0].session_id), "choices": choices,
                "usage": usage([out.stats for out in outs], self.prompts)}

    def opening(self, session_id: str, index: int = 0) -> dict[str, Any]:
        """The first event of a chat choice's stream: the assistant's role, no text yet."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                  "logprobs": None}
        return {**self._envelope("chat.completion.chunk", session_id), "choices": [choice]}

    def _message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of an answer, with its tool calls when the request allows them."""
        if self.tools is None:
            return {"role": "assistant", "content": text}, finish
        content, calls = parse_calls(text, self.tools)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def delta(self, chunk: Chunk, index: int = 0) -> dict[str, Any] | None:
        """One streamed event: the chunk's text, and on the last one why the generation ended. With
        tools, a choice's chunks are held and sent as one event when it ends (None until then)."""
        finish = FINISH[chunk.finish_reason]
        if self.kind == "chat" and self.tools is not None:
            texts, entries = self._held.setdefault(index, ([], []))
            texts.append(chunk.text)
            entries.extend(chunk.logprobs)
            if chunk.finish_reason is None:
                return None
            message, finish = self._message("".join(texts), finish)
            delta = {k: v for k, v in message.items() if k != "role" and v is not None}
            if "tool_calls" in delta:
                delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(delta["tool_calls"])]
            choice = {"index": index, "delta": delta, "finish_reason": finish,
                      "logprobs": self._logprobs(index, entries)}
            return {**self._envelope("chat.completion.chunk", chunk.session_id), "choices": [choice]}
        if self.kind == "chat":
            choice = {"index": index, "delta": {"content": chunk.text} if chunk.text else {}, "finish_reason": finish,
                      "logprobs": self._logprobs(index, chunk.logprobs)}
            out = self._envelope("chat.completion.chunk", chunk.session_id)
        else:
            text, logprobs = self._echoed(index, chunk.text, chunk.prompt_logprobs, chunk.logprobs)
            choice = {"index": index, "text": text, "finish_reason": finish,
                      "logprobs": self._logprobs(index, logprobs)}
            out = self._envelope("text_completion", chunk.session_id)
        return {**out, "choices": [choice]}

    def usage_event(self, stats: list[dict[str, Any]], session_id: str) -> dict[str, Any]:
        """The extra last event of `stream_options.include_usage`: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj, session_id), "choices": [], "usage": usage(stats, self.prompts)}


# -- errors -------------------------------------------------------------------------------------


# gRPC status of a failed generation (its name, as `specdec.errors` carries it) -> HTTP status,
# OpenAI error type, code.
HTTP_ERRORS: dict[str, tuple[int, str, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", "invalid_value"),
    "FAILED_PRECONDITION": (400, "invalid_request_error", "failed_precondition"),
    "OUT_OF_RANGE": (400, "invalid_request_error", "out_of_range"),
    "NOT_FOUND": (404, "invalid_request_error", "not_found"),
    "UNAUTHENTICATED": (401, "invalid_request_error", "invalid_api_key"),
    "ABORTED": (409, "conflict_error", "session_busy"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "overloaded"),
    "UNAVAILABLE": (503, "service_unavailable_error", "unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout_error", "deadline_exceeded"),
}

# The orchestrator names its own fields in messages; the client knows the OpenAI names.
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                "draft_length": "draft_length", "session": "session_id", "session_id": "session_id",
                "prompt": "prompt", "messages": "messages", "the input": "prompt", "each stop string": "stop",
                "at most": "stop", "seed": "seed", "grammar": "response_format", "min_p": "min_p",
                "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                "repetition_penalty": "repetition_penalty", "logit_bias": "logit_bias", "min_tokens": "min_tokens",
                "top_logprobs": "top_logprobs", "stop_token_ids": "stop_token_ids", "token_ids": "prompt",
                "share_output": "share_output"}
_PARAM_RE = re.compile(r"^(" + "|".join(map(re.escape, _PARAM_NAMES)) + r")\b")
_ADDRESS_PREFIX = re.compile(r"^orchestrator \S+: ")


def api_error(exc: Exception) -> ApiError:
    """The OpenAI error for an exception raised by the SDK (`specdec.errors`) or by validation."""
    if isinstance(exc, ApiError):
        return exc
    code = getattr(exc, "code", None)
    if code is None and isinstance(exc, (ValueError, TypeError)):  # a value protobuf refused (e.g. out of range)
        code = "INVALID_ARGUMENT"
    status, type_, code_name = HTTP_ERRORS.get(code, (500, "server_error", "internal_error"))
    message = _ADDRESS_PREFIX.sub("", str(exc)) or type(exc).__name__  # no internal addresses to HTTP clients
    if status == 500:
        message = f"internal error: {message}"
    match = _PARAM_RE.match(message) if status in (400, 404, 409) else None
    param = _PARAM_NAMES[match.group(1)] if match else None
    if match and match.group(1) == "max_new_tokens":  # say it in the client's words
        message = "max_tokens" + message[len("max_new_tokens"):]
    if status == 404 and param == "session_id":
        code_name = "session_not_found"
    return ApiError(status, message, type=type_, param=param, code=code_name)


def retry_after_s(status: int) -> int | None:
    """Seconds a client should wait before retrying (sent as Retry-After), for overload and outages."""
    return 1 if status in (429, 503) else None


def _nearest(field: str, known: list[str]) -> str:
    close = difflib.get_close_matches(field, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def validation_error(errors: list[dict[str, Any]], model: type[BaseModel] | None = None) -> ApiError:
    """A 400 for a body that does not parse (FastAPI would answer 422 in its own format).

    `model` is the request model, for the known field names an unknown field is compared with.
    """
    first = errors[0] if errors else {"loc": (), "msg": "invalid body"}
    if first.get("type") == "json_invalid":  # loc is ("body", character offset): not a field
        where = first.get("loc", ("body", "?"))[-1]
        why = (first.get("ctx") or {}).get("error", "invalid JSON")
        return ApiError(400, f"the body is not valid JSON: {why} at character {where}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden" and len(loc) == 1:
        hint = _nearest(loc[0], sorted(model.model_fields)) if model else ""
        return ApiError(400, f"unknown parameter {loc[0]!r}{hint}", param=param, code="unknown_parameter")
    return ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param, code="invalid_value")
