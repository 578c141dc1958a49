"""Input and usage limits of the public API that are not plain field checks.

- `check_session_id`: a session id is one we issued (letters, digits, `-`, `_`; at most 64), so a
  client cannot make the store build keys from arbitrary bytes.
- `PerIdentityLimit`: generations one token (identity) may run at once on this orchestrator
  replica; the next one gets RESOURCE_EXHAUSTED naming the limit. `ConcurrencyLimit` applies it
  to the generation methods as a server interceptor (after `specdec.server.auth.AuthInterceptor`).
- `PerIdentityRate`: calls one identity (or, without tokens, one client address) may make per
  second, a token bucket holding twice as many; `RateLimit` applies it to CloseSession, whose
  Release goes to every replica, and refuses past it with RESOURCE_EXHAUSTED and a
  `retry-after-ms` hint.

Message size is a server option (`--max-message-bytes`, gRPC answers RESOURCE_EXHAUSTED);
prompt tokens, new tokens and stop strings are checked with the request
(`orchestrator.requests.RequestParser`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Iterable, Iterator

import grpc

from specdec.errors import InvalidArgument, ResourceExhausted
from specdec.rpc_errors import status_code
from specdec.server.admission import RETRY_AFTER_KEY
from specdec.server.auth import current_identity
from specdec.server.interceptors import method_handler

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_session_id(session_id: str) -> str:
    if not SESSION_ID.fullmatch(session_id):
        raise InvalidArgument("session_id is not a session id: send the id a previous response returned "
                              "(letters, digits, '-' or '_', at most 64 characters)")
    return session_id


class PerIdentityLimit:
    """Counts the generations each identity runs; the anonymous identity ("", auth off) is not limited."""

    def __init__(self, limit: int, flag: str = "--max-concurrent-per-token") -> None:
        self.limit = limit
        self.flag = flag
        self.running: Counter[str] = Counter()

    def acquire(self, identity: str) -> None:
        """Take a slot, or raise ResourceExhausted naming the limit."""
        if identity and self.limit and self.running[identity] >= self.limit:
            raise ResourceExhausted(
                f"too many generations at once for this token: the limit is {self.flag}={self.limit} "
                "per orchestrator replica; wait for one to finish"
            )
        self.running[identity] += 1

    def release(self, identity: str) -> None:
        self.running[identity] -= 1
        if self.running[identity] <= 0:
            del self.running[identity]

    @contextlib.contextmanager
    def hold(self, identity: str) -> Iterator[None]:
        self.acquire(identity)
        try:
            yield
        finally:
            self.release(identity)


GENERATION_METHODS = ("/specdec.v1.Orchestrator/Generate", "/specdec.v1.Orchestrator/GenerateUnary")


class ConcurrencyLimit(grpc.aio.ServerInterceptor):
    """Holds a `PerIdentityLimit` slot for the caller's identity while a generation method runs."""

    def __init__(self, limit: PerIdentityLimit, methods: Iterable[str] = GENERATION_METHODS) -> None:
        self.limit = limit
        self.methods = set(methods)

    @contextlib.asynccontextmanager
    async def _held(self, context) -> AsyncIterator[None]:
        """The caller's slot for the call's duration; a caller over its limit is refused with
        RESOURCE_EXHAUSTED (the call then ends at `abort`, which raises)."""
        identity = current_identity.get()
        try:
            self.limit.acquire(identity)
        except ResourceExhausted as exc:
            await context.abort(status_code(exc), str(exc))
        try:
            yield
        finally:
            self.limit.release(identity)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.methods or handler.request_streaming:
            return handler
        held = self._held
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                async with held(context):
                    return await inner(request, context)

            return method_handler(handler, unary_unary=unary)
        inner_stream = handler.unary_stream
        if not inspect.isasyncgenfunction(inner_stream):
            return handler

        async def stream(request, context):
            async with held(context):
                async for item in inner_stream(request, context):
                    yield item

        return method_handler(handler, unary_stream=stream)


class PerIdentityRate:
    """A token bucket per key: `per_s` calls a second, up to twice as many at once; 0 = no limit.
    Buckets are kept for the `max_keys` keys used last (one forgotten starts full again)."""

    def __init__(self, per_s: float, flag: str = "the rate limit", clock=time.monotonic,
                 max_keys: int = 10_000) -> None:
        self.per_s = per_s
        self.capacity = max(1.0, 2 * per_s)
        self.flag = flag
        self.clock = clock
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str) -> float | None:
        """Take one call for `key`: None when allowed, else the seconds until the next one is."""
        if not self.per_s:
            return None
        now = self.clock()
        tokens, at = self._buckets.pop(key, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - at) * self.per_s)
        allowed = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return None if allowed else (1.0 - tokens) / self.per_s


CLOSE_METHODS = ("/specdec.v1.Orchestrator/CloseSession",)


class RateLimit(grpc.aio.ServerInterceptor):
    """Refuses calls of `methods` past the caller's `PerIdentityRate` (by identity; without tokens,
    by client address) with RESOURCE_EXHAUSTED and a `retry-after-ms` hint."""

    def __init__(self, rate: PerIdentityRate, methods: Iterable[str] = CLOSE_METHODS) -> None:
        self.rate = rate
        self.methods = set(methods)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or handler_call_details.method not in self.methods or handler.unary_unary is None
                or not self.rate.per_s):
            return handler
        inner, rate = handler.unary_unary, self.rate

        async def unary(request, context):
            key = current_identity.get() or "peer:" + (context.peer() or "").rsplit(":", 1)[0]
            wait = rate.take(key)
            if wait is not None:
                hint = max(1, math.ceil(wait * 1000))
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(hint)),))
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"too many calls of {handler_call_details.method.rsplit('/', 1)[-1]}: the limit is "
                                    f"{rate.flag}={rate.per_s:g} per token and orchestrator replica; retry in "
                                    f"about {hint} ms")
            return await inner(request, context)

        return method_handler(handler, unary_unary=unary)
