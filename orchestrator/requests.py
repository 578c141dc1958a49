"""A GenerateRequest, validated: the `GenerationSpec` the loop runs, or an error that says why not."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from orchestrator.chat import first_turn, next_turn
from orchestrator.config import OrchestratorConfig
from specdec.core.grammar import DEFAULT_LIMITS, GrammarLimits, GrammarSpec
from specdec.core.logprobs import MAX_TOP_LOGPROBS
from specdec.core.sampling import SamplingParams
from specdec.errors import FailedPrecondition, InvalidArgument
from specdec.server.limits import check_session_id
from specdec.v1 import orchestrator_pb2 as pb

AUTO = -1  # draft_length value that selects the controller


@dataclass(frozen=True)
class GenerationSpec:
    """A validated request."""

    input_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    draft_length: int  # AUTO (-1) lets the controller choose k every round
    session_id: str
    resume_from: int | None = None  # resume the session's latest generation; the client holds this many
    # A chat turn that continues a session: the input to use when the history ends with an
    # end-of-sequence token, and when it does not (the end-of-turn marker is then added first).
    chat_after_eos: list[int] | None = None
    principal: str = ""  # who sends it (specdec.server.auth.principal_of): only they may continue its session
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    share_output: bool = True  # the output may join the suffix drafts' corpus (with the server's --share-outputs)


def parse_resume(request: pb.GenerateRequest) -> GenerationSpec:
    """A resume: the session's latest generation goes on with its original settings."""
    if not request.session_id:
        raise InvalidArgument("resume_from needs the session_id of the generation to resume")
    if request.WhichOneof("input") is not None:
        raise InvalidArgument("a resume continues the session's latest generation: leave prompt and "
                              "messages unset (its settings are the original request's)")
    return GenerationSpec(input_ids=[], max_new_tokens=0, params=SamplingParams(), seed=None, stop=(),
                          draft_length=0, session_id=request.session_id, resume_from=request.resume_from)


def parse_sampling(request: pb.GenerateRequest, end_ids: set[int] = frozenset(),
                   vocab_size: int | None = None, grammar_limits: GrammarLimits = DEFAULT_LIMITS) -> SamplingParams:
    """The request's sampling parameters and logits processors; `end_ids` are the tokens `min_tokens`
    holds back (end of sequence and the request's stop token ids). A grammar is checked here against
    `grammar_limits` only (size, nesting); compiling it is `specdec.runtime.grammars.check_grammar`'s
    work, off the event loop."""
    temperature = request.temperature if request.HasField("temperature") else 0.0
    top_p = request.top_p if request.HasField("top_p") else 1.0
    top_k = request.top_k if request.HasField("top_k") else 0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgument(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidArgument(f"top_p must lie in (0, 1] (1 disables it), got {top_p}")
    if top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0 (0 disables it), got {top_k}")
    def opt(name: str, default: float) -> float:
        return getattr(request, name) if request.HasField(name) else default
    min_tokens = request.min_tokens if request.HasField("min_tokens") else 0
    kind, text = request.grammar.kind, request.grammar.text
    if kind or text:
        try:
            GrammarSpec(kind, text).check(grammar_limits)
        except ValueError as exc:
            raise InvalidArgument(f"grammar: {exc}") from exc
    params = SamplingParams(
        grammar_kind=kind, grammar_text=text,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=opt("min_p", 0.0),
        presence_penalty=opt("presence_penalty", 0.0), frequency_penalty=opt("frequency_penalty", 0.0),
        repetition_penalty=opt("repetition_penalty", 1.0), logit_bias=tuple(request.logit_bias.items()),
        min_tokens=min_tokens, end_token_ids=tuple(end_ids) if min_tokens else (),
    )
    try:
        params.validate()
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    if vocab_size is not None and params.logit_bias and max(t for t, _ in params.logit_bias) >= vocab_size:
        raise InvalidArgument(f"logit_bias names token {max(t for t, _ in params.logit_bias)}, outside the "
                              f"vocabulary (ids below {vocab_size})")
    return params


class RequestParser:
    """Checks requests against the configured limits and the target's tokenizer and context."""

    def __init__(self, config: OrchestratorConfig, tokenizer, max_context: int, eos_ids: set[int],
                 vocab_size: int | None = None, learns_outputs: Callable[[], bool] = lambda: True) -> None:
        self.config = config
        self.learns_outputs = learns_outputs  # whether a draft keeps a corpus that outputs may join
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self.grammar_limits = GrammarLimits(max_bytes=config.max_grammar_bytes)

    def parse(self, request: pb.GenerateRequest, principal: str = "") -> GenerationSpec:
        if request.session_id:
            check_session_id(request.session_id)
        if request.HasField("resume_from"):
            return replace(parse_resume(request), principal=principal)
        score_only = request.prompt_logprobs and request.HasField("max_new_tokens") and request.max_new_tokens == 0
        max_new = 0 if score_only else self._max_new_tokens(request)
        stop_ids = self._token_ids("stop_token_ids", request.stop_token_ids)
        self._check_sizes(request, stop_ids)
        params = parse_sampling(request, self.eos_ids | set(stop_ids), self.vocab_size, self.grammar_limits)
        k = self._draft_length(request)
        share = self._share_output(request)
        stop = self._stop(request)
        input_ids, chat_after_eos = self._input(request)
        top = request.top_logprobs if request.HasField("top_logprobs") else 0
        if top > MAX_TOP_LOGPROBS or (top and not (request.logprobs or request.prompt_logprobs)):
            raise InvalidArgument(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS} and needs logprobs, "
                                  f"got {top}")
        return GenerationSpec(
            input_ids=input_ids, max_new_tokens=max_new, params=params,
            seed=request.seed if request.HasField("seed") else None,
            stop=stop, draft_length=k, session_id=request.session_id, chat_after_eos=chat_after_eos,
            principal=principal, ignore_eos=request.ignore_eos, stop_token_ids=tuple(stop_ids),
            logprobs=request.logprobs, top_logprobs=top, prompt_logprobs=request.prompt_logprobs,
            share_output=share,
        )

    def _check_sizes(self, request: pb.GenerateRequest, stop_ids: list[int]) -> None:
        """What a request keeps in its session and sends on with every round is bounded (the record
        and the calls must not grow with what a client chooses to send)."""
        cfg = self.config
        if len(stop_ids) > cfg.max_stop_token_ids:
            raise InvalidArgument(f"stop_token_ids has {len(stop_ids)} ids; the limit is "
                                  f"--max-stop-token-ids={cfg.max_stop_token_ids}")
        if len(request.logit_bias) > cfg.max_logit_bias:
            raise InvalidArgument(f"logit_bias has {len(request.logit_bias)} entries; the limit is "
                                  f"--max-logit-bias={cfg.max_logit_bias}")
        size = len(request.grammar.text.encode())
        if size > cfg.max_grammar_bytes:
            raise InvalidArgument(f"grammar text has {size} bytes; the limit is --max-grammar-bytes="
                                  f"{cfg.max_grammar_bytes}: send a smaller schema or grammar")

    def _share_output(self, request: pb.GenerateRequest) -> bool:
        if not request.HasField("share_output"):
            return self.config.share_outputs
        if request.share_output and not self.config.share_outputs:
            raise FailedPrecondition("share_output: this orchestrator does not share outputs (--share-outputs is "
                                     "off), so no output joins the suffix drafts' corpus; leave share_output unset "
                                     "or false")
        if request.share_output and not self.learns_outputs():
            raise FailedPrecondition("share_output: this orchestrator's draft keeps no corpus of outputs (a model "
                                     "or prompt-lookup draft, or none; only --proposer suffix or hybrid learns "
                                     "from them), so no output joins one; leave share_output unset or false")
        return request.share_output

    def _token_ids(self, name: str, ids) -> list[int]:
        ids = [int(t) for t in ids]
        if self.vocab_size is not None and ids and max(ids) >= self.vocab_size:
            raise InvalidArgument(f"{name} holds token {max(ids)}, outside the vocabulary (ids below "
                                  f"{self.vocab_size})")
        return ids

    def _max_new_tokens(self, request: pb.GenerateRequest) -> int:
        cfg = self.config
        if not request.HasField("max_new_tokens"):  # as many as allowed; the loop stops when the context is full
            return min(cfg.default_max_new_tokens or cfg.max_new_tokens_limit, cfg.max_new_tokens_limit)
        max_new = request.max_new_tokens
        if not 1 <= max_new <= cfg.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens must be between 1 and {cfg.max_new_tokens_limit}, got {max_new} "
                                  "(the limit is --max-new-tokens-limit)")
        return max_new

    def _draft_length(self, request: pb.GenerateRequest) -> int:
        cfg = self.config
        default_k = AUTO if cfg.draft_length == "auto" else cfg.draft_length
        k = request.draft_length if request.HasField("draft_length") else default_k
        if not (k == AUTO or 0 <= k <= cfg.max_draft_length):
            raise InvalidArgument(
                f"draft_length must be -1 (auto) or between 0 and {cfg.max_draft_length}, got {k}"
            )
        return k

    def _stop(self, request: pb.GenerateRequest) -> tuple[str, ...]:
        cfg = self.config
        stop = tuple(request.stop)
        if len(stop) > cfg.max_stop_strings:
            raise InvalidArgument(f"at most {cfg.max_stop_strings} stop strings are allowed, got {len(stop)} "
                                  "(the limit is --max-stop-strings)")
        for s in stop:
            if not s or len(s) > cfg.max_stop_length:
                raise InvalidArgument(f"each stop string must have 1 to {cfg.max_stop_length} characters, got {len(s)} "
                                      "(the limit is --max-stop-length)")
        return stop

    def _input(self, request: pb.GenerateRequest) -> tuple[list[int], list[int] | None]:
        """The input tokens, and for a chat turn that continues a session its variant after EOS."""
        continuing = bool(request.session_id)
        chat_after_eos = None
        which = request.WhichOneof("input")
        if which == "prompt":
            if not request.prompt:
                raise InvalidArgument("prompt is empty: send the text to continue, or use messages")
            encoded = self.tokenizer(request.prompt, add_special_tokens=not continuing)
            input_ids = self._check_length(encoded["input_ids"])
        elif which == "token_ids":
            input_ids = self._check_length(self._token_ids("token_ids", request.token_ids.ids))
        elif which == "messages":
            messages, tools = self._messages(request)
            if continuing:
                if tools:
                    raise InvalidArgument("tools on a continued session are not supported: send the whole "
                                          "conversation with its tools in a new session")
                input_ids, chat_after_eos = next_turn(self.tokenizer, messages, self.eos_ids)
                self._check_length(chat_after_eos)
            else:
                input_ids = first_turn(self.tokenizer, messages, tools)
            self._check_length(input_ids)
        else:
            raise InvalidArgument("set one of prompt, messages or token_ids")
        limit = self.config.max_prompt_tokens
        if limit is not None and len(input_ids) > limit:
            raise InvalidArgument(f"the input has {len(input_ids)} tokens; the limit is --max-prompt-tokens={limit}")
        return input_ids, chat_after_eos

    def _messages(self, request: pb.GenerateRequest) -> tuple[list[dict], list[dict] | None]:
        """The conversation as the chat template takes it, and its tools (None: none)."""
        messages = [self._message(i, m) for i, m in enumerate(request.messages.messages)]
        if not messages:
            raise InvalidArgument("messages is empty: send at least one message")
        if not getattr(self.tokenizer, "chat_template", None):
            raise FailedPrecondition("the model has no chat template; send a raw prompt instead")
        tools = _json_list(request.messages.tools_json, "tools") if request.messages.tools_json else None
        for j, tool in enumerate(tools or ()):
            if not isinstance(tool, dict):
                raise InvalidArgument(f"tools[{j}] must be a JSON object "
                                      '({"type": "function", "function": {"name": ..., "parameters": {...}}})')
        return messages, tools

    @staticmethod
    def _message(i: int, m: pb.ChatMessage) -> dict:
        if m.role not in ("system", "user", "assistant", "tool"):
            raise InvalidArgument(f"messages[{i}].role must be system, user, assistant or tool, got {m.role!r}")
        message: dict = {"role": m.role, "content": m.content}
        if m.tool_calls_json:
            if m.role != "assistant":
                raise InvalidArgument(f"messages[{i}]: only an assistant message has tool calls")
            calls = _json_list(m.tool_calls_json, f"messages[{i}].tool_calls")
            message["tool_calls"] = [_tool_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(calls)]
        if m.role == "tool":
            message.update(tool_call_id=m.tool_call_id, name=m.name)
        return message

    def _check_length(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidArgument("the input tokenizes to nothing; send some text")
        if len(ids) >= self.max_context:
            raise InvalidArgument(
                f"the input has {len(ids)} tokens but the model's context holds {self.max_context}; "
                "shorten the prompt"
            )
        return list(ids)


MAX_JSON_DEPTH = 64  # nesting of tools and tool calls: deeper than any real schema, far from Python's recursion limit


def _json_list(text: str, name: str) -> list:
    """A JSON list (tools, tool calls) nested at most MAX_JSON_DEPTH levels, or InvalidArgument naming `name`."""
    try:
        value = json.loads(text)
    except RecursionError:  # nested deeper than the parser's recursion allows
        raise InvalidArgument(_too_deep(name)) from None
    except ValueError:
        raise InvalidArgument(f"{name} must be a JSON list") from None
    if not isinstance(value, list):
        raise InvalidArgument(f"{name} must be a JSON list")
    _check_depth(value, name)
    return value


def _too_deep(name: str) -> str:
    return f"{name} is nested deeper than {MAX_JSON_DEPTH} levels; flatten it"


def _check_depth(value, name: str) -> None:
    """InvalidArgument if `value` nests lists and objects deeper than MAX_JSON_DEPTH (measured level by
    level, without recursion)."""
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise InvalidArgument(_too_deep(name))
        level = [child for item in level if isinstance(item, (list, dict))
                 for child in (item.values() if isinstance(item, dict) else item)]


def _tool_call(call, name: str) -> dict:
    """An assistant message's tool call as the chat template takes it (OpenAI sends the arguments as a
    JSON string; templates take an object), or InvalidArgument naming the field."""
    if not isinstance(call, dict):
        raise InvalidArgument(f'{name} must be a JSON object: {{"id": ..., "type": "function", "function": '
                              '{"name": ..., "arguments": "{...}"}}')
    function = call.get("function")
    if not isinstance(function, dict):
        raise InvalidArgument(f'{name}.function must be a JSON object: {{"name": ..., "arguments": "{{...}}"}}')
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidArgument(f"{name}.function.name must be a non-empty string")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None
    if not isinstance(arguments, dict):
        raise InvalidArgument(f"{name}.function.arguments must be a JSON object, or a string holding one")
    _check_depth(arguments, f"{name}.function.arguments")
    return {**call, "function": {**function, "arguments": arguments}}
