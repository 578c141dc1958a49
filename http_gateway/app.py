"""The HTTP routes: thin translation between the OpenAI wire format and `specdec.AsyncClient`."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from opentelemetry import propagate
from opentelemetry.trace import SpanKind
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from http_gateway import openapi
from http_gateway.config import GatewayConfig
from http_gateway.metrics import GatewayMetrics, MetricsMiddleware
from http_gateway.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    api_error,
    chat_choices,
    completion_choices,
    prompts_of,
    retry_after_s,
    tool_mode,
    validation_error,
)
from specdec.client import AsyncClient, AsyncStream, Chunk
from specdec.errors import Internal, SpecdecError, Unauthenticated
from specdec.server import logs
from specdec.server.auth import UNAUTHENTICATED_MESSAGE, Tokens, bearer_token
from specdec.server.tracing import tracer

T = TypeVar("T")
log = logging.getLogger("specdec.http")


def _error_response(err: ApiError) -> JSONResponse:
    retry = retry_after_s(err.status)
    headers = {"Retry-After": str(retry)} if retry else {}
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(err.body(), status_code=err.status, headers=headers or None)


class _BodyTooLarge(Exception):
    """Raised into the app by `RequestContext`'s receive once the body passes the limit (413 already sent)."""


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body has {size} bytes; the limit is --max-body-bytes={limit}",
                    code="request_too_large")


class RequestContext:
    """ASGI middleware: request id (X-Request-Id in and out), a SERVER span, and the body size limit.

    The limit holds for chunked bodies too: received bytes are counted, and the first chunk past
    the limit answers 413 and stops the app reading (whatever the app then sends is dropped).
    """

    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        rid = headers.get("x-request-id", "")
        rid = rid if rid and len(rid) <= 128 and rid.isprintable() else logs.new_request_id()
        logs.request_id.set(rid)
        logs.session_id.set("")
        refused = False
        received = 0

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        async def send_unless_refused(message):
            if not refused:
                await send_with_id(message)

        async def receive_within_limit():
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes and not refused:
                    refused = True
                    err = _too_large(f"more than {self.max_body_bytes}", self.max_body_bytes)
                    await _error_response(err)(scope, receive, send_with_id)
                    raise _BodyTooLarge()
            return message

        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await _error_response(_too_large(length, self.max_body_bytes))(scope, receive, send_with_id)
        with tracer().start_as_current_span(f"{scope.get('method', 'HTTP')} {scope.get('path', '')}",
                                            context=propagate.extract(headers), kind=SpanKind.SERVER,
                                            attributes={"specdec.request_id": rid}):
            try:
                await self.app(scope, receive_within_limit, send_unless_refused)
            except _BodyTooLarge:
                pass


async def _disconnected(request: Request) -> None:
    """Return once the client hangs up (after the body, the next ASGI message is http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; cancelled (so the orchestrator stops generating at once) when the client hangs up first."""
    task = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, hangup):
            pending.cancel()
        await asyncio.gather(task, hangup, return_exceptions=True)
    if task.cancelled():  # nobody is left to read an answer; this status only reaches the access log
        raise ApiError(499, "the client closed the connection before the answer was ready",
                       code="client_closed_request")
    return task.result()


class Gateway:
    """What the routes share: the orchestrator client and the served model's id."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.client: AsyncClient | None = None
        self._model = config.model_name
        self.tokens = Tokens.load(config.auth_tokens_file, config.auth_tokens_env)
        self.own_token = self._own_token(config)
        self._health: tuple[float, asyncio.Future] | None = None  # when /health last asked, and the answer
        self._auth_checked = not self.tokens.enabled  # whether the orchestrator was seen refusing tokenless calls

    def _own_token(self, config: GatewayConfig) -> str:
        if config.token_file:
            return Path(config.token_file).read_text().strip()
        return os.environ.get("SPECDEC_TOKEN", "").strip() or self.tokens.first_token()

    def authorize(self, request: Request) -> str | None:
        """The caller's bearer token, to forward; 401 when this gateway checks tokens and it is not one."""
        header = request.headers.get("authorization")
        if self.tokens.enabled and self.tokens.identity(header) is None:
            raise ApiError(401, UNAUTHENTICATED_MESSAGE, code="invalid_api_key")
        return bearer_token(header)

    async def status(self, token: str | None = None) -> dict[str, Any]:
        try:
            return await self.client.status(timeout=self.config.health_timeout_s, token=token or self.own_token or "")
        except SpecdecError as exc:
            raise api_error(exc) from None

    async def health_status(self) -> dict[str, Any]:
        """The orchestrator's status behind /health, asked at most once per --health-cache-s (concurrent
        probes share the call; a failure is kept as long); raises ApiError."""
        now, asked = time.monotonic(), self._health
        if asked is None or (asked[1].done() and now - asked[0] >= self.config.health_cache_s):
            asked = self._health = (now, asyncio.ensure_future(self._health_fetch()))
        return asked[1].result() if asked[1].done() else await asyncio.shield(asked[1])

    async def _health_fetch(self) -> dict[str, Any]:
        status = await self.status()
        if not self._auth_checked:
            await self._check_orchestrator_auth()
        return status

    async def _check_orchestrator_auth(self) -> None:
        """A gateway that checks tokens warns (once) when the orchestrator serves a call without one:
        every key is then the same anonymous identity there, so sessions are not bound to keys and
        anything that reaches the orchestrator needs no token. Give it the same tokens."""
        try:
            await self.client.status(timeout=self.config.health_timeout_s, token="")
        except Unauthenticated:
            self._auth_checked = True
            return
        except SpecdecError:
            return  # unreachable for now: asked again with the next status
        self._auth_checked = True
        log.warning("this gateway checks bearer tokens but the orchestrator at %s serves calls without one: "
                    "sessions are not bound to API keys and its gRPC API is open; give the orchestrator the same "
                    "tokens (--auth-tokens-file)", self.config.orchestrator)

    def shows_details(self, request: Request) -> bool:
        """Whether /health may show this caller the backends' addresses and errors: one with a token this
        gateway accepts; without tokens here, anyone, unless the gateway holds a token of its own (the
        orchestrator then checks tokens, and /health cannot tell who may see what)."""
        if self.tokens.enabled:
            return self.tokens.identity(request.headers.get("authorization")) is not None
        return not self.own_token

    async def model(self, token: str | None = None) -> str:
        """The served model id: configured, or the target's model as the orchestrator reports it."""
        if not self._model:
            status = await self.status(token)
            target = next((b for b in status["backends"] if b["role"] == "target" and b["healthy"]), None)
            if target is None:
                raise ApiError(503, "the target service is not healthy; see GET /health",
                               type="service_unavailable_error", code="unavailable")
            self._model = target["model"]
        return self._model

    async def weights(self, token: str | None = None) -> dict[str, str]:
        """What each healthy backend serves ("target", "draft": ModelInfo.weights, with "_fingerprint"
        keys beside them), as the orchestrator reports it now; empty where it cannot say."""
        try:
            status = await self.status(token)
        except ApiError:
            return {}
        out: dict[str, str] = {}
        for b in status["backends"]:
            if b["healthy"] and b.get("weights") and b["role"] not in out:
                out[b["role"]], out[b["role"] + "_fingerprint"] = b["weights"], b.get("weights_fingerprint", "")
        return out

    async def check_model(self, requested: str, token: str | None = None) -> str:
        served = await self.model(token)
        if requested != served:
            raise ApiError(404, f"the model {requested!r} does not exist; this server serves {served!r} "
                           "(GET /v1/models)", param="model", code="model_not_found")
        return served

    async def respond(self, request: Request, reply: Reply, requests: list[dict[str, Any]], stream: bool,
                      include_usage: bool):
        """Run every choice's generation at once (the target batches them) and answer."""
        if not stream:
            try:
                outs = await unless_disconnected(request, asyncio.gather(
                    *(self.client.generate(**kwargs) for kwargs in requests)))
            except (SpecdecError, ValueError, TypeError) as exc:
                raise api_error(exc) from None
            return reply.whole(list(outs))
        streams: list[AsyncStream] = []
        try:
            streams = [self.client.stream(**kwargs) for kwargs in requests]
            # Bad input and outages show before the first token: answer them with a real HTTP status.
            firsts = await asyncio.gather(*(anext(chunks) for chunks in streams))
        except (SpecdecError, ValueError, TypeError) as exc:
            await asyncio.gather(*(chunks.aclose() for chunks in streams), return_exceptions=True)
            raise api_error(exc) from None
        return EventSourceResponse(self._events(reply, streams, list(firsts), include_usage), ping=15)

    @staticmethod
    async def _events(reply: Reply, streams: list[AsyncStream], firsts: list[Chunk],
                      include_usage: bool) -> AsyncIterator[dict]:
        def event(obj: dict[str, Any]) -> dict[str, str]:
            return {"data": json.dumps(obj)}

        stats: list[dict[str, Any]] = [{} for _ in streams]
        merged = _merge(streams, firsts)
        try:
            if reply.kind == "chat":
                for index, first in enumerate(firsts):
                    yield event(reply.opening(first.session_id, index))
            async for index, chunk in merged:
                if chunk.text or chunk.finish_reason or chunk.prompt_logprobs or (reply.logprobs and chunk.token_ids):
                    delta = reply.delta(chunk, index)
                    if delta is not None:
                        yield event(delta)
                stats[index] = chunk.stats or stats[index]
            if include_usage:
                yield event(reply.usage_event(stats, firsts[0].session_id))
            yield {"data": "[DONE]"}
        except SpecdecError as exc:  # the stream broke after it started: an error event ends it
            yield event(api_error(exc).body())
        finally:
            await merged.aclose()


async def _merge(streams: list[AsyncStream], firsts: list[Chunk]) -> AsyncIterator[tuple[int, Chunk]]:
    """The chunks of several streams as they come, as (stream index, chunk); `firsts` already read.
    Closing it closes every stream (their generations stop)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, chunks: AsyncStream) -> None:
        ended: SpecdecError | None = Internal(f"choice {index}'s stream stopped unexpectedly")
        try:
            async for chunk in chunks:
                await queue.put((index, chunk))
            ended = None
        except SpecdecError as exc:  # handed to the reader, which raises it
            ended = exc
        finally:
            queue.put_nowait((index, ended))  # None: the stream ended

    for index, first in enumerate(firsts):
        queue.put_nowait((index, first))
    tasks = [asyncio.ensure_future(pump(i, chunks)) for i, chunks in enumerate(streams)]
    running = len(streams)
    try:
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, SpecdecError):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(chunks.aclose() for chunks in streams), return_exceptions=True)


def _lifespan(gateway: Gateway):
    """The app's lifespan: the orchestrator client opens with the app and closes with it."""
    config = gateway.config

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gateway.client = AsyncClient(config.orchestrator, timeout=config.request_timeout_s,
                                     tls_ca=config.orchestrator_tls_ca or None,
                                     tls_cert=config.orchestrator_tls_cert or None,
                                     tls_key=config.orchestrator_tls_key or None)
        try:
            yield
        finally:
            await gateway.client.close()

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, ours, FastAPI's validation and Starlette's routing, as an OpenAI error object."""

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, exc: RequestValidationError):
        model = ChatRequest if request.url.path.endswith("/chat/completions") else CompletionRequest
        return _error_response(validation_error(exc.errors(), model))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return _error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                        code=code))

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi.drop_validation_errors(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = document


def _add_health_and_models(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/health", responses=openapi.HEALTH_RESPONSES)
    async def health(request: Request):
        """200 while the orchestrator answers and its target is healthy (a missing draft only slows it).
        The orchestrator's and backends' addresses and errors only for callers `shows_details` admits."""
        details = gateway.shows_details(request)
        try:
            status = await gateway.health_status()
        except ApiError as err:
            if not details:
                err = ApiError(err.status, "the orchestrator is unavailable", type=err.type, code=err.code)
            return _error_response(err)
        backends = [{k: b[k] for k in ("role", "address", "healthy", "error")} for b in status["backends"]]
        ok = any(b["role"] == "target" and b["healthy"] for b in backends)
        degraded = not all(b["healthy"] for b in backends)
        body: dict[str, Any] = {"status": ("degraded" if degraded else "ok") if ok else "unavailable"}
        if details:
            body.update(orchestrator=status["address"], backends=backends)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models", responses={200: {"model": openapi.ModelList}, **openapi.MODEL_RESPONSES})
    async def models(request: Request):
        token = gateway.authorize(request)
        model = await gateway.model(token)
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "specdec",
                                            "weights": await gateway.weights(token)}]}

    @app.get("/v1/models/{model_id:path}", responses={200: {"model": openapi.Model}, **openapi.MODEL_RESPONSES})
    async def model(model_id: str, request: Request):
        token = gateway.authorize(request)
        served = await gateway.check_model(model_id, token)
        return {"id": served, "object": "model", "created": 0, "owned_by": "specdec",
                "weights": await gateway.weights(token)}


def _add_generation_routes(app: FastAPI, gateway: Gateway) -> None:
    temperature = gateway.config.default_temperature

    @app.post("/v1/completions", responses=openapi.generation_responses(openapi.Completion))
    async def completions(body: CompletionRequest, request: Request):
        token = gateway.authorize(request)
        model = await gateway.check_model(body.model, token)
        requests = [dict(kwargs, token=token or "") for kwargs in completion_choices(body, temperature)]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        echo = [kwargs["prompt"] for kwargs in requests] if body.echo else None
        reply = Reply("completion", model, body.logprobs is not None, echo, prompts=len(prompts_of(body)))
        return await gateway.respond(request, reply, requests, bool(body.stream), include_usage)

    @app.post("/v1/chat/completions", responses=openapi.generation_responses(openapi.ChatCompletion))
    async def chat_completions(body: ChatRequest, request: Request):
        token = gateway.authorize(request)
        model = await gateway.check_model(body.model, token)
        requests = [dict(kwargs, token=token or "") for kwargs in chat_choices(body, temperature)]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        reply = Reply("chat", model, bool(body.logprobs), tools=tool_mode(body))
        return await gateway.respond(request, reply, requests, bool(body.stream), include_usage)


def create_app(config: GatewayConfig, metrics: GatewayMetrics | None = None) -> FastAPI:
    """The gateway's ASGI app; `metrics` (served by the caller on --metrics-port) observes every request."""
    gateway = Gateway(config)
    app = FastAPI(title="specdec OpenAI-compatible API", lifespan=_lifespan(gateway))
    app.state.gateway = gateway
    app.add_middleware(RequestContext, max_body_bytes=config.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics if metrics is not None else GatewayMetrics())  # outermost
    _add_error_handlers(app)
    _add_health_and_models(app, gateway)
    _add_generation_routes(app, gateway)
    return app
