"""Client authentication: bearer tokens on the public gRPC and HTTP APIs.

Tokens come from a file (one per line: `token` or `name:token`; blank lines and `#` comments
are skipped) and/or an environment variable (the same format, lines or commas). A request sends
`authorization: Bearer <token>` (gRPC metadata or the HTTP header); it is compared in constant
time (`hmac.compare_digest`) against every configured token, all of them every time.

The *identity* of a token is its name, or `token-<first 12 hex of its sha256>` for an unnamed
one, so logs never hold a token. Tokens that share a name are one identity (rotate a key by
listing the new one under the old name). Sessions are bound to the *principal*, a hash of the
identity (`principal_of`): a session opened with one identity is invisible to every other one.

With no token configured, authentication is off: every caller is the anonymous identity "" and
the principal is "" (so sessions are shared, as before).

Health and reflection stay open for probes and tools (`OPEN_SERVICES`).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from specdec.server.interceptors import deny_handler, is_open_method, wrap_handler

current_identity: contextvars.ContextVar[str] = contextvars.ContextVar("specdec_identity", default="")

UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token: send the header 'authorization: Bearer <token>'"


def principal_of(identity: str) -> str:
    """What a session record stores about its owner: a hash of the identity ("" when anonymous)."""
    if not identity:
        return ""
    return hashlib.sha256(b"specdec-principal\0" + identity.encode()).hexdigest()


def current_principal() -> str:
    return principal_of(current_identity.get())


def identity_of_token(token: str) -> str:
    return "token-" + hashlib.sha256(token.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class _Entry:
    secret: bytes
    identity: str


def parse_tokens(text: str, source: str) -> list[_Entry]:
    """Entries from lines (or comma-separated items) of `token` or `name:token`."""
    entries = []
    for n, raw in enumerate(text.replace(",", "\n").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, token = line.partition(":")
        if not sep:
            name, token = "", line
        name, token = name.strip(), token.strip()
        if not token:
            raise ValueError(f"{source}: entry {n} has an empty token")
        if len(token) < 16:
            raise ValueError(f"{source}: entry {n} ({name or 'unnamed'}) is shorter than 16 characters; use a long "
                             "random token (`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
        entries.append(_Entry(token.encode(), name or identity_of_token(token)))
    return entries


class Tokens:
    """The configured tokens; `identity(header)` tells who sent a request, or None."""

    def __init__(self, entries: Iterable[_Entry] = ()) -> None:
        self._entries = list(entries)

    @classmethod
    def load(cls, path: str = "", env: str = "") -> Tokens:
        """Tokens from a file and/or the environment variable named `env` (when set and not empty)."""
        entries: list[_Entry] = []
        if path:
            try:
                text = Path(path).read_text()
            except OSError as exc:
                raise ValueError(f"--auth-tokens-file {path}: cannot read it ({exc.strerror or exc})") from None
            entries += parse_tokens(text, f"--auth-tokens-file {path}")
            if not entries:
                raise ValueError(f"--auth-tokens-file {path} holds no token")
        if env and os.environ.get(env, "").strip():
            entries += parse_tokens(os.environ[env], f"${env}")
        return cls(entries)

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def first_token(self) -> str:
        return self._entries[0].secret.decode() if self._entries else ""

    def identity(self, authorization: str | None) -> str | None:
        """The identity behind an `authorization` value ("Bearer <token>"), or None if none matches.

        Every configured token is compared, in constant time each, whatever matched before.
        """
        token = bearer_token(authorization)
        if token is None:
            return None
        presented = token.encode("utf-8", "surrogateescape")
        found = None
        for entry in self._entries:
            if hmac.compare_digest(presented, entry.secret) and found is None:
                found = entry.identity
        return found


def bearer_token(authorization: str | None) -> str | None:
    """The token of "Bearer <token>" (the scheme is case-insensitive), or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def authorization_of(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid bearer token (UNAUTHENTICATED), except health and reflection.

    The caller's identity is put in `current_identity` for the handler; with no tokens
    configured every call passes as the anonymous identity.
    """

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not self.tokens.enabled or is_open_method(handler_call_details.method):
            return handler
        identity = self.tokens.identity(authorization_of(handler_call_details.invocation_metadata))
        if identity is None:
            return deny_handler(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

        def enter(request, context):
            current_identity.set(identity)

        return wrap_handler(handler, enter)
