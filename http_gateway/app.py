"""The HTTP routes: thin translation between the OpenAI wire format and `specdec.AsyncClient`."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from http_gateway.config import GatewayConfig
from http_gateway.openai_api import (
    ApiError, ChatRequest, CompletionRequest, Reply, api_error, chat_kwargs, completion_kwargs, retry_after_s,
    validation_error,
)
from specdec.client import AsyncClient, AsyncStream, Chunk
from specdec.errors import SpecdecError


def _error_response(err: ApiError) -> JSONResponse:
    retry = retry_after_s(err.status)
    return JSONResponse(err.body(), status_code=err.status, headers={"Retry-After": str(retry)} if retry else None)


class Gateway:
    """What the routes share: the orchestrator client and the served model's id."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.client: AsyncClient | None = None
        self._model = config.model_name

    async def status(self) -> dict[str, Any]:
        try:
            return await self.client.status(timeout=self.config.health_timeout_s)
        except SpecdecError as exc:
            raise api_error(exc) from None

    async def model(self) -> str:
        """The served model id: configured, or the target's model as the orchestrator reports it."""
        if not self._model:
            status = await self.status()
            target = next((b for b in status["backends"] if b["role"] == "target" and b["healthy"]), None)
            if target is None:
                raise ApiError(503, "the target service is not healthy; see GET /health",
                               type="service_unavailable_error", code="unavailable")
            self._model = target["model"]
        return self._model

    async def check_model(self, requested: str) -> str:
        served = await self.model()
        if requested != served:
            raise ApiError(404, f"the model {requested!r} does not exist; this server serves {served!r} "
                           "(GET /v1/models)", param="model", code="model_not_found")
        return served

    async def respond(self, reply: Reply, kwargs: dict[str, Any], stream: bool, include_usage: bool):
        if not stream:
            try:
                out = await self.client.generate(**kwargs)
            except (SpecdecError, ValueError, TypeError) as exc:
                raise api_error(exc) from None
            return reply.whole(out.text, out.finish_reason, out.stats, out.session_id)
        try:
            chunks = self.client.stream(**kwargs)
        except (ValueError, TypeError) as exc:
            raise api_error(exc) from None
        try:  # bad input and outages show before the first token: answer them with a real HTTP status
            first = await anext(chunks)
        except SpecdecError as exc:
            await chunks.aclose()
            raise api_error(exc) from None
        return EventSourceResponse(self._events(reply, chunks, first, include_usage), ping=15)

    @staticmethod
    async def _events(reply: Reply, chunks: AsyncStream, first: Chunk, include_usage: bool) -> AsyncIterator[dict]:
        def event(obj: dict[str, Any]) -> dict[str, str]:
            return {"data": json.dumps(obj)}

        stats: dict[str, Any] = {}
        try:
            if reply.kind == "chat":
                yield event(reply.opening(first.session_id))
            chunk: Chunk | None = first
            while chunk is not None:
                if chunk.text or chunk.finish_reason:
                    yield event(reply.delta(chunk))
                stats = chunk.stats or stats
                chunk = await anext(chunks, None)
            if include_usage:
                yield event(reply.usage_event(stats, first.session_id))
            yield {"data": "[DONE]"}
        except SpecdecError as exc:  # the stream broke after it started: an error event ends it
            yield event(api_error(exc).body())
        finally:
            await chunks.aclose()


def create_app(config: GatewayConfig) -> FastAPI:
    gateway = Gateway(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gateway.client = AsyncClient(config.orchestrator, timeout=config.request_timeout_s)
        try:
            yield
        finally:
            await gateway.client.close()

    app = FastAPI(title="specdec OpenAI-compatible API", lifespan=lifespan)
    app.state.gateway = gateway

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, exc: RequestValidationError):
        return _error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return _error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                        code=code))

    @app.get("/health")
    async def health():
        """200 while the orchestrator answers and its target is healthy (a missing draft only slows it)."""
        try:
            status = await gateway.status()
        except ApiError as err:
            return _error_response(err)
        backends = [{k: b[k] for k in ("role", "address", "healthy", "error")} for b in status["backends"]]
        ok = any(b["role"] == "target" and b["healthy"] for b in backends)
        degraded = not all(b["healthy"] for b in backends)
        body = {"status": ("degraded" if degraded else "ok") if ok else "unavailable",
                "orchestrator": status["address"], "backends": backends}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        model = await gateway.model()
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "specdec"}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        served = await gateway.check_model(model_id)
        return {"id": served, "object": "model", "created": 0, "owned_by": "specdec"}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        model = await gateway.check_model(body.model)
        kwargs = completion_kwargs(body, config.default_temperature)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await gateway.respond(Reply("completion", model), kwargs, bool(body.stream), include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        model = await gateway.check_model(body.model)
        kwargs = chat_kwargs(body, config.default_temperature)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await gateway.respond(Reply("chat", model), kwargs, bool(body.stream), include_usage)

    return app
