"""The one place where typed errors (`specdec.errors`) meet gRPC status codes.

Servers raise the typed errors (or let `ValueError` from validation escape); the `grpc_errors`
decorator turns them into a gRPC status with the message intact. The SDK turns a status back
into the same class with `from_rpc_error`; one service calling another reads the failure with
`from_backend_error`. Both halves need only grpcio, so the SDK and the servers share this module.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Collection
from typing import Any

import grpc

from specdec.errors import BY_CODE, Cancelled, DeadlineExceeded, SpecdecError, Unavailable

log = logging.getLogger(__name__)


def status_code(exc: SpecdecError) -> grpc.StatusCode:
    """The gRPC status a typed error travels as."""
    return grpc.StatusCode[exc.code]


def from_rpc_error(err: grpc.RpcError) -> SpecdecError:
    """The typed error for a failed call (client side)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = BY_CODE.get(code.name, SpecdecError)
    exc = cls(details or code.name)
    exc.code = code.name
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
        return status_code(exc), str(exc)
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
