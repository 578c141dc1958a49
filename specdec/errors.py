"""Typed errors, and the one place where they are mapped to and from gRPC status codes.

Servers raise these (or let `ValueError` from validation escape); the `grpc_errors`
decorator turns them into a gRPC status with the message intact. The SDK turns a status back
into the same class with `from_rpc_error`; one service calling another reads the failure with
`from_backend_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Collection
from typing import Any

import grpc

log = logging.getLogger(__name__)

# How a client that leaves shows up in a server: the handler's task is cancelled at an await,
# or its response stream is closed while suspended at a yield.
CANCELLATIONS = (asyncio.CancelledError, GeneratorExit)


class SpecdecError(Exception):
    """Base class; `code` is the gRPC status code the error travels as."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN


class InvalidArgument(SpecdecError, ValueError):
    """The request is malformed; the message says which field and what to send instead."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SpecdecError):
    """A named resource (a session) does not exist or has expired."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(SpecdecError):
    """The system is not in a state to serve this (e.g. draft and target tokenizers differ)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(SpecdecError):
    """A concurrent update won; retry the request."""

    code = grpc.StatusCode.ABORTED


class Unavailable(SpecdecError):
    """A backend (target service, Redis) cannot be reached; retry later."""

    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(SpecdecError):
    """Admission refused: too many requests in flight."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(SpecdecError):
    """No valid bearer token came with the call (see `specdec.server.auth`)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class DeadlineExceeded(SpecdecError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(SpecdecError):
    code = grpc.StatusCode.CANCELLED


class Internal(SpecdecError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, FailedPrecondition, Aborted, Unavailable,
                ResourceExhausted, DeadlineExceeded, Cancelled, Internal, Unauthenticated)
}


def from_rpc_error(err: grpc.RpcError) -> SpecdecError:
    """The typed error for a failed call (client side)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, SpecdecError)
    exc = cls(details or code.name)
    exc.code = code
    return exc


def from_backend_error(err: grpc.RpcError, passed_on: Collection[grpc.StatusCode] = (),
                       request_deadline: str = "") -> SpecdecError:
    """Service to service: what a failed call from one of our services to another means.

    A code in `passed_on` is the request's own fault: its typed error, as `from_rpc_error`.
    DEADLINE_EXCEEDED, when the request's deadline cut the call short (`request_deadline` says
    what was under way), is DeadlineExceeded. CANCELLED is Cancelled: the server dropped the call
    (a cancel of our own raises CancelledError instead). Anything else is Unavailable: that
    backend failed, and another replica, or plain decoding, may take over.
    """
    code, details = err.code(), err.details()
    if code in passed_on:
        return from_rpc_error(err)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and request_deadline:
        return DeadlineExceeded(f"the request's deadline passed while {request_deadline}")
    if code == grpc.StatusCode.CANCELLED:
        return Cancelled(details)
    return Unavailable(f"{code.name}: {details}")


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, SpecdecError):
        return exc.code, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        # A downstream call failed: surface a backend outage as UNAVAILABLE, keep others.
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return grpc.StatusCode.UNAVAILABLE, f"backend unavailable: {exc.details()}; retry shortly"
        return code, exc.details() or code.name
    log.exception("internal error")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def grpc_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an async servicer method (unary or server-streaming) to map exceptions to status."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async with contextlib.aclosing(method(self, request, context)) as items:
                    async for item in items:  # closed with this wrapper, so its cleanup runs now
                        yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - this is the mapping point
                code, msg = _status_of(exc)
                await context.abort(code, msg)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - this is the mapping point
            code, msg = _status_of(exc)
            await context.abort(code, msg)

    return unary_wrapper
