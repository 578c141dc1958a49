"""Typed errors: what the SDK raises and what the services raise, with no gRPC in sight.

Each class names the gRPC status it travels as (`code`, a status name such as
"INVALID_ARGUMENT"), so that `import specdec.errors` loads neither gRPC nor the client. The
mapping to and from real gRPC statuses is in one place, `specdec.rpc_errors`: servers decorate
their methods with its `grpc_errors`, the SDK turns a failed call back into these classes with
its `from_rpc_error`.
"""

from __future__ import annotations

import asyncio

# How a client that leaves shows up in a server: the handler's task is cancelled at an await,
# or its response stream is closed while suspended at a yield.
CANCELLATIONS = (asyncio.CancelledError, GeneratorExit)


class SpecdecError(Exception):
    """Base class; `code` names the gRPC status the error travels as (`grpc.StatusCode[code]`)."""

    code: str = "UNKNOWN"


class InvalidArgument(SpecdecError, ValueError):
    """The request is malformed; the message says which field and what to send instead."""

    code = "INVALID_ARGUMENT"


class NotFound(SpecdecError):
    """A named resource (a session) does not exist or has expired."""

    code = "NOT_FOUND"


class FailedPrecondition(SpecdecError):
    """The system is not in a state to serve this (e.g. draft and target tokenizers differ)."""

    code = "FAILED_PRECONDITION"


class Aborted(SpecdecError):
    """A concurrent update won; retry the request."""

    code = "ABORTED"


class Unavailable(SpecdecError):
    """A backend (target service, Redis) cannot be reached; retry later."""

    code = "UNAVAILABLE"


class ResourceExhausted(SpecdecError):
    """Admission refused: too many requests in flight."""

    code = "RESOURCE_EXHAUSTED"


class Unauthenticated(SpecdecError):
    """No valid bearer token came with the call (see `specdec.server.auth`)."""

    code = "UNAUTHENTICATED"


class DeadlineExceeded(SpecdecError):
    """The request's deadline passed before it finished."""

    code = "DEADLINE_EXCEEDED"


class Cancelled(SpecdecError):
    """The call was cancelled (by the client, or by a server that dropped it)."""

    code = "CANCELLED"


class Internal(SpecdecError):
    """A bug or an unexpected state on the server; the message says what failed."""

    code = "INTERNAL"


TYPED = (InvalidArgument, NotFound, FailedPrecondition, Aborted, Unavailable, ResourceExhausted, DeadlineExceeded,
         Cancelled, Internal, Unauthenticated)
BY_CODE: dict[str, type[SpecdecError]] = {cls.code: cls for cls in TYPED}
