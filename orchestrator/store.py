"""Session state: the must-not-lose record of every session, behind the `SessionStore` interface.

`RedisSessionStore` is the production store. Keys are namespaced, versioned and hash-tagged
by session id, so a session's keys share a cluster slot: `specdec:v1:{<session>}:meta` (a hash:
`version`, `state` as JSON) and `specdec:v1:{<session>}:tokens` (a list of token ids). Every write
is one Lua script, atomic and checked against the version the writer read (optimistic
concurrency), and refreshes both TTLs. Nothing is pickled.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

import redis.asyncio as redis
from redis.exceptions import RedisError

from specdec.errors import Aborted, Unavailable
from specdec.server.keys import PRIOR_KEY, session_meta_key, session_tokens_key

# KEYS: meta, tokens. ARGV: expected version ("0" = must not exist), new state JSON, ttl, tokens...
_APPEND = """
local current = redis.call('HGET', KEYS[1], 'version')
if current == false then current = '0' end
if current ~= ARGV[1] then return -1 end
local version = tonumber(current) + 1
redis.call('HSET', KEYS[1], 'version', version, 'state', ARGV[2])
if #ARGV > 3 then redis.call('RPUSH', KEYS[2], unpack(ARGV, 4)) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[3]) end
return version
"""


PRIOR_TTL_S = 7 * 24 * 3600


@dataclass
class GenerationRecord:
    """The session's latest generation: enough to resume its stream on any orchestrator replica.

    `finish` is 0 while it runs (or after it was interrupted) and a FinishReason once it ended.
    `lease_until` (epoch seconds) marks it as owned by a running request: another request on the
    session is refused until then, unless it resumes this very generation.
    """

    id: str
    start: int  # index into SessionState.tokens of its first generated token
    prompt_tokens: int
    max_new_tokens: int
    stop: list[str] = field(default_factory=list)
    finish: int = 0
    lease_until: float = 0.0
    owner: str = ""  # the request holding the lease (a resume becomes the new owner)
    started_at: float = field(default_factory=time.time)
    first_token_s: float = 0.0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    fallbacks: int = 0
    overlapped: int = 0

    def leased(self, now: float | None = None) -> bool:
        return self.finish == 0 and self.lease_until > (time.time() if now is None else now)


_NOT_IN_RECORD = frozenset({"tokens", "version", "session_id"})


@dataclass
class SessionState:
    """Everything needed to continue a session on any orchestrator replica."""

    session_id: str
    seed: int
    tokens: list[int] = field(default_factory=list)  # the whole history: prompts and generated
    version: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    sampling: dict[str, float] = field(default_factory=dict)  # of the latest request
    draft_length: int = 0  # of the latest request (-1 = auto)
    policy: dict = field(default_factory=dict)  # draft-length controller state (PolicyState.to_dict)
    created_at: float = field(default_factory=time.time)
    generation: GenerationRecord | None = None  # the latest generation
    principal: str = ""  # hash of the identity that opened it (specdec.server.auth.principal_of; "" = anonymous)

    def record(self) -> str:
        """The JSON record of everything but the history (kept as a Redis list) and the key.

        Written every round: built field by field, since `asdict` would deep-copy the whole
        history only to drop it (O(history) per round)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_IN_RECORD}
        if self.generation is not None:
            data["generation"] = asdict(self.generation)
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_record(cls, session_id: str, version: int, tokens: list[int], raw: bytes) -> SessionState:
        data: dict[str, Any] = json.loads(raw)
        generation = data.pop("generation", None)
        return cls(session_id=session_id, version=version, tokens=tokens,
                   generation=GenerationRecord(**generation) if generation else None, **data)


class SessionStore(Protocol):
    """Where sessions live. `save` is optimistic: it raises Aborted when the stored version is
    not `state.version` (another request wrote since this one loaded) and bumps it on success.
    `load` returns a fresh copy: changing it changes nothing stored until `save`. Failures of the
    store itself raise Unavailable."""

    async def ping(self) -> None: ...

    async def load(self, session_id: str) -> SessionState | None: ...

    async def save(self, state: SessionState, new_tokens: list[int]) -> None:
        """Append `new_tokens` (already in `state.tokens`) and write the record."""

    async def delete(self, session_id: str) -> bool: ...

    async def load_prior(self) -> dict | None:
        """The global draft-length prior that new sessions start from, if any."""

    async def save_prior(self, prior: dict) -> None: ...

    async def close(self) -> None: ...


class RedisSessionStore:
    """The production `SessionStore`."""

    def __init__(self, url: str, ttl_s: int, **connection: Any) -> None:
        """`connection`: more redis-py options, e.g. password, ssl_ca_certs, ssl_certfile, ssl_keyfile."""
        self.url = re.sub(r"//[^/@]*@", "//", url)  # as named in messages: no credentials
        self.ttl_s = ttl_s
        self.redis = redis.Redis.from_url(url, **connection)
        self._append = self.redis.register_script(_APPEND)

    async def ping(self) -> None:
        await self._call(self.redis.ping())

    async def load(self, session_id: str) -> SessionState | None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(session_meta_key(session_id))
        pipe.lrange(session_tokens_key(session_id), 0, -1)
        meta, tokens = await self._call(pipe.execute())
        if not meta:
            return None
        return SessionState.from_record(session_id, int(meta[b"version"]), [int(t) for t in tokens], meta[b"state"])

    async def save(self, state: SessionState, new_tokens: list[int]) -> None:
        """Append `new_tokens` and write the record, if nobody else wrote since we read.

        `state.tokens` must already include `new_tokens`; `state.version` is bumped on success.
        """
        result = await self._call(self._append(
            keys=[session_meta_key(state.session_id), session_tokens_key(state.session_id)],
            args=[state.version, state.record(), self.ttl_s, *new_tokens],
        ))
        if result == -1:
            raise Aborted(f"session {state.session_id} was changed by another request; retry")
        state.version = int(result)

    async def load_prior(self) -> dict | None:
        """The global draft-length prior that new sessions start from (evictable; JSON)."""
        raw = await self._call(self.redis.get(PRIOR_KEY))
        return json.loads(raw) if raw else None

    async def save_prior(self, prior: dict) -> None:
        await self._call(self.redis.set(PRIOR_KEY, json.dumps(prior, separators=(",", ":")), ex=PRIOR_TTL_S))

    async def delete(self, session_id: str) -> bool:
        removed = await self._call(self.redis.delete(session_meta_key(session_id), session_tokens_key(session_id)))
        return removed > 0

    async def close(self) -> None:
        await self.redis.aclose()

    async def _call(self, awaitable):
        try:
            return await awaitable
        except RedisError as exc:
            raise Unavailable(f"session store unavailable (redis at {self.url}): {exc}") from exc
