"""What the OpenAPI document (GET /openapi.json) says the routes answer: the real statuses, the
OpenAI error object, the 200 bodies, and `text/event-stream` for `stream: true`.

The models here describe responses for the document only; `openai_api.Reply` builds them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorObject(BaseModel):
    """Every error, whatever its status: OpenAI's error object."""

    error: ErrorDetail


class Speculation(BaseModel):
    acceptance_rate: float
    mean_accepted_length: float
    draft_tokens: int
    accepted_tokens: int
    rounds: int
    draft_fallbacks: int
    time_to_first_token_s: float
    tokens_per_second: float


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculation: Speculation


class Specdec(BaseModel):
    session_id: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: ChatLogprobs | None
    speculation: Speculation | None = None  # per choice, when there are several


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    specdec: Specdec


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None
    speculation: Speculation | None = None  # per choice, when there are several


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    specdec: Specdec


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    weights: dict[str, str] = Field(
        default_factory=dict, description="specdec: the weights each backend serves (\"target\", \"draft\": e.g. "
        "\"gguf:q4_1+q8_0\", \"int4g64\", \"float32\"; \"target_fingerprint\", \"draft_fingerprint\": their "
        "fingerprints); empty when the orchestrator cannot say.")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok", "degraded", "unavailable"]
    # Only for callers with a token the gateway accepts (or from a gateway that checks none and holds none).
    orchestrator: str | None = None
    backends: list[dict[str, Any]] | None = None


_ERRORS = {
    400: "Invalid body, unknown or unsupported parameter",
    401: "Missing or unknown bearer token (when the gateway checks tokens)",
    404: "Unknown model or session",
    409: "The session is still generating",
    413: "The body is over --max-body-bytes",
    429: "Overloaded (with Retry-After)",
    503: "A backend is down (with Retry-After)",
    504: "The generation's deadline passed",
}
_SSE = {"text/event-stream": {"schema": {"type": "string", "description": (
    "`stream: true`: server-sent events, each `data: <chunk JSON>`, the last `data: [DONE]`")}}}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorObject, "description": _ERRORS[status]} for status in statuses}


def generation_responses(body: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a generation route: `body` as JSON, or the event stream."""
    return {200: {"model": body, "description": "The answer (JSON), or with `stream: true` its event stream",
                  "content": _SSE}, **_errors(400, 401, 404, 409, 413, 429, 503, 504)}


MODEL_RESPONSES = _errors(401, 404, 503)
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": Health, "description": "The orchestrator answers and its target is healthy"},
    503: {"model": Health | ErrorObject, "description": "The target is down, or the orchestrator does not answer"}}


def drop_validation_errors(document: dict[str, Any]) -> dict[str, Any]:
    """FastAPI lists 422 on every route with parameters; this server answers 400 instead, never 422."""
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        document.get("components", {}).get("schemas", {}).pop(name, None)
    return document
