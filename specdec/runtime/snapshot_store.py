"""Where KV-cache snapshots are kept: a small store interface, and Redis as its implementation.

A snapshot moves a session's cache to another replica instead of re-prefilling it (the blob's
format: `specdec.runtime.snapshot_codec`). Redis holds a blob under the session's hash tag,
chunked (Redis strings are capped, and large values block the server), written to temporary
keys and renamed into place so a reader never sees half a snapshot, with a TTL (key names:
`specdec.keys`):

    specdec:v1:{<session>}:kv:<role>:meta    hash: chunks, bytes, tokens, model, written_at
    specdec:v1:{<session>}:kv:<role>:<i>     chunk i of the blob

The role ("target" or "draft") keeps the two services' snapshots of a session apart: a draft
never reads, overwrites or deletes the target's, even when both use the same Redis.

Restoring pays off only past a context length that depends on the hardware (prefill compute
against Redis transfer); `bench/snapshot.py` measures both and the services take the threshold
as a flag.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from specdec.keys import snapshot_chunk_key, snapshot_meta_key
from specdec.runtime.snapshot_codec import SnapshotIdentity

CHUNK_BYTES = 4 * 1024 * 1024


class SnapshotStore(Protocol):
    """Snapshot blobs of one role's caches, by session id (blocking: called from the compute thread)."""

    def put(self, session_id: str, blob: bytes, tokens: int) -> None: ...

    def get(self, session_id: str) -> bytes | None: ...

    def tokens(self, session_id: str) -> int:
        """Tokens the stored snapshot covers (0 if none): lets a caller decide before fetching."""
        ...

    def delete(self, session_id: str) -> None: ...


@dataclass
class SnapshotPolicy:
    """How a service uses snapshots: where, for which model, and from what length they pay."""

    store: SnapshotStore
    identity: SnapshotIdentity
    min_tokens: int  # below this many tokens a re-prefill is as cheap (bench/snapshot.py)
    saves: int = 0
    restores: int = 0


# KEYS: meta, then the temporary chunk keys, then the final chunk keys (as many).
# ARGV: ttl, meta JSON fields as alternating name/value. Renames all chunks and writes the meta
# in one step; drops chunks of a longer earlier snapshot.
_PUBLISH = """
local n = (#KEYS - 1) / 2
local old = tonumber(redis.call('HGET', KEYS[1], 'chunks') or '0')
for i = 1, n do
  redis.call('RENAME', KEYS[1 + i], KEYS[1 + n + i])
  redis.call('EXPIRE', KEYS[1 + n + i], ARGV[1])
end
local base = string.sub(KEYS[1], 1, #KEYS[1] - 4)
for i = n, old - 1 do redis.call('DEL', base .. i) end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return n
"""


class RedisSnapshotStore:
    """The `SnapshotStore` of one role ("target" or "draft") in Redis.

    `client`: a blocking redis-py client the service built (`specdec.server.redis.connect`: TLS,
    password, timeouts); the store only issues commands on it."""

    def __init__(self, client: Any, role: str, ttl_s: int = 3600, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.redis = client
        self.role = role
        self.ttl_s = ttl_s
        self.chunk_bytes = chunk_bytes
        self._publish = self.redis.register_script(_PUBLISH)

    def put(self, session_id: str, blob: bytes, tokens: int) -> None:
        chunks = [blob[i:i + self.chunk_bytes] for i in range(0, len(blob), self.chunk_bytes)] or [b""]
        tag = f"tmp-{uuid.uuid4().hex[:8]}-"
        temp = [snapshot_chunk_key(session_id, self.role, i, tag) for i in range(len(chunks))]
        final = [snapshot_chunk_key(session_id, self.role, i) for i in range(len(chunks))]
        pipe = self.redis.pipeline(transaction=False)
        for key, chunk in zip(temp, chunks):
            pipe.set(key, chunk, ex=60)  # expires on its own if the writer dies before publishing
        pipe.execute()
        fields = {"chunks": len(chunks), "bytes": len(blob), "tokens": tokens, "written_at": time.time()}
        args = [self.ttl_s] + [x for kv in fields.items() for x in kv]
        self._publish(keys=[snapshot_meta_key(session_id, self.role), *temp, *final], args=args)

    def get(self, session_id: str) -> bytes | None:
        meta = self.redis.hgetall(snapshot_meta_key(session_id, self.role))
        if not meta:
            return None
        n = int(meta[b"chunks"])
        parts = self.redis.mget([snapshot_chunk_key(session_id, self.role, i) for i in range(n)])
        chunks = [p for p in parts if isinstance(p, bytes)]
        if len(chunks) != n:
            return None  # expired or replaced while reading: treat as absent
        blob = b"".join(chunks)
        return blob if len(blob) == int(meta[b"bytes"]) else None

    def tokens(self, session_id: str) -> int:
        """Tokens the stored snapshot covers (0 if none): lets a caller decide before fetching."""
        value = self.redis.hget(snapshot_meta_key(session_id, self.role), "tokens")
        return int(value) if value else 0

    def delete(self, session_id: str) -> None:
        meta = snapshot_meta_key(session_id, self.role)
        n = int(self.redis.hget(meta, "chunks") or 0)
        self.redis.delete(meta, *[snapshot_chunk_key(session_id, self.role, i) for i in range(n)])
