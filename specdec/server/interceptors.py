"""Server interceptor plumbing shared by auth, tracing and input limits.

`wrap_handler` runs a scope (a context manager, e.g. a span, or a function that sets context
variables) around a method's behaviour, inside the call's own task, so what it sets is seen by the
servicer. `DecodeGuard` turns a request that does not parse (invalid UTF-8 in a string field, a
truncated message) into INVALID_ARGUMENT; gRPC itself would answer UNKNOWN.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

# Services every caller may use: Kubernetes probes, grpcurl's listing.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


def is_open_method(method: str | bytes) -> bool:
    if isinstance(method, bytes):
        method = method.decode()
    return method.startswith(OPEN_SERVICES)


def method_handler(handler, unary_unary=None, unary_stream=None, deserializer=None, stream_stream=None):
    """A method handler of the same shape as `handler` (unary or streamed request, unary or streamed
    response; none of ours streams requests into one response), with some of its parts replaced."""
    deserializer = deserializer or handler.request_deserializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary_unary or handler.unary_unary, deserializer,
                                                   handler.response_serializer)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(stream_stream or handler.stream_stream, deserializer,
                                                     handler.response_serializer)
    return grpc.unary_stream_rpc_method_handler(unary_stream or handler.unary_stream, deserializer,
                                                handler.response_serializer)


def wrap_handler(handler, scope: Callable[[Any, Any], Any],
                 observe: Callable[[Any], None] | None = None):
    """The same method with `scope(request, context)` around its behaviour.

    `scope` returns a context manager (entered around the whole call, every streamed message
    included) or None. `observe` sees every streamed response message. Client-streaming methods
    (the target's VerifyStream) are returned unchanged: one call carries many requests, so no
    scope fits them all.
    """
    if handler.request_streaming:
        return handler

    def enter(stack: contextlib.ExitStack, request, context) -> None:
        cm = scope(request, context)
        if cm is not None:
            stack.enter_context(cm)

    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary(request, context):
            with contextlib.ExitStack() as stack:
                enter(stack, request, context)
                return await inner(request, context)

        return method_handler(handler, unary_unary=unary)

    inner = handler.unary_stream
    if inspect.isasyncgenfunction(inner):
        async def stream(request, context):
            with contextlib.ExitStack() as stack:
                enter(stack, request, context)
                # Closed when this wrapper is: a client that goes away closes the outermost
                # generator, and each layer must close the one it wraps for its cleanup to run now.
                async with contextlib.aclosing(inner(request, context)) as items:
                    async for item in items:
                        if observe is not None:
                            observe(item)
                        yield item
    else:  # a coroutine that writes with context.write
        async def stream(request, context):
            with contextlib.ExitStack() as stack:
                enter(stack, request, context)
                return await inner(request, context)

    return method_handler(handler, unary_stream=stream)


def deny_handler(handler, code: grpc.StatusCode, message: str):
    """A method of the same shape that refuses every call with `code`."""

    async def unary(request, context):
        await context.abort(code, message)

    async def stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises

    return method_handler(handler, unary_unary=unary, unary_stream=stream, stream_stream=stream)


class BadRequest:
    """Stands in for a request that did not parse; the behaviour answers INVALID_ARGUMENT."""

    def __init__(self, message: str) -> None:
        self.message = message


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Requests that do not parse are answered INVALID_ARGUMENT (gRPC would say UNKNOWN)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def deserialize(raw: bytes):
            try:
                return parse(raw)
            except (DecodeError, ValueError, UnicodeError) as exc:
                return BadRequest(f"the request is not a valid message: {exc}")

        if handler.request_streaming:
            inner_bidi = handler.stream_stream
            if inner_bidi is None or not inspect.isasyncgenfunction(inner_bidi):
                return handler

            async def bidi(requests, context):
                async def parsed():  # the first request that did not parse ends the call
                    async for request in requests:
                        if isinstance(request, BadRequest):
                            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                        yield request

                async with contextlib.aclosing(parsed()) as checked, \
                        contextlib.aclosing(inner_bidi(checked, context)) as items:
                    async for item in items:
                        yield item

            return method_handler(handler, stream_stream=bidi, deserializer=deserialize)

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, BadRequest):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return await inner(request, context)

            return method_handler(handler, unary_unary=unary, deserializer=deserialize)
        inner_stream = handler.unary_stream
        if not inspect.isasyncgenfunction(inner_stream):
            return handler

        async def stream(request, context):
            if isinstance(request, BadRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for item in inner_stream(request, context):
                yield item

        return method_handler(handler, unary_stream=stream, deserializer=deserialize)
