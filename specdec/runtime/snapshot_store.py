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

What Redis holds is not trusted: a `meta` whose fields do not parse, or name more bytes than this
model's largest snapshot (`max_bytes`) or more chunks than those take, is `MalformedKV` (the caller
drops it), and the chunks' lengths are read (STRLEN) before the chunks themselves, so a reader never
asks for more than `max_bytes`. Nothing a `meta` says makes a loop here, or in the publishing
script, longer than `max_chunks`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from specdec.keys import snapshot_chunk_key, snapshot_meta_key
from specdec.runtime.snapshot_codec import MalformedKV, SnapshotIdentity

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
# ARGV: ttl, the most chunks a snapshot has, meta JSON fields as alternating name/value. Renames all
# chunks and writes the meta in one step; drops chunks of a longer earlier snapshot (as many as its
# meta says, within the most there can be: a corrupt count must not make Redis loop for ever).
_PUBLISH = """
local n = (#KEYS - 1) / 2
local old = math.min(tonumber(redis.call('HGET', KEYS[1], 'chunks')) or 0, tonumber(ARGV[2]))
for i = 1, n do
  redis.call('RENAME', KEYS[1 + i], KEYS[1 + n + i])
  redis.call('EXPIRE', KEYS[1 + n + i], ARGV[1])
end
local base = string.sub(KEYS[1], 1, #KEYS[1] - 4)
for i = n, old - 1 do redis.call('DEL', base .. i) end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return n
"""


class RedisSnapshotStore:
    """The `SnapshotStore` of one role ("target" or "draft") in Redis.

    `client`: a blocking redis-py client the service built (`specdec.server.redis.connect`: TLS,
    password, timeouts); the store only issues commands on it. `max_bytes`: the largest blob this
    store reads or writes (the model's largest snapshot: `snapshot_max_bytes`)."""

    def __init__(self, client: Any, role: str, ttl_s: int = 3600, chunk_bytes: int = CHUNK_BYTES,
                 max_bytes: int = 1 << 32) -> None:
        self.redis = client
        self.role = role
        self.ttl_s = ttl_s
        self.chunk_bytes = chunk_bytes
        self.max_bytes = max_bytes
        self._publish = self.redis.register_script(_PUBLISH)

    @property
    def max_chunks(self) -> int:
        """The most chunks a snapshot of at most `max_bytes` has (chunks of at least 64 KiB: a reader
        takes what writers with a smaller `chunk_bytes` wrote)."""
        return max(1, -(-self.max_bytes // min(self.chunk_bytes, 64 * 1024)))

    def put(self, session_id: str, blob: bytes, tokens: int) -> None:
        if len(blob) > self.max_bytes:
            raise ValueError(f"a snapshot of {len(blob)} bytes exceeds this store's {self.max_bytes}")
        chunks = [blob[i:i + self.chunk_bytes] for i in range(0, len(blob), self.chunk_bytes)] or [b""]
        tag = f"tmp-{uuid.uuid4().hex[:8]}-"
        temp = [snapshot_chunk_key(session_id, self.role, i, tag) for i in range(len(chunks))]
        final = [snapshot_chunk_key(session_id, self.role, i) for i in range(len(chunks))]
        pipe = self.redis.pipeline(transaction=False)
        for key, chunk in zip(temp, chunks):
            pipe.set(key, chunk, ex=60)  # expires on its own if the writer dies before publishing
        pipe.execute()
        fields = {"chunks": len(chunks), "bytes": len(blob), "tokens": tokens, "written_at": time.time()}
        args = [self.ttl_s, self.max_chunks] + [x for kv in fields.items() for x in kv]
        self._publish(keys=[snapshot_meta_key(session_id, self.role), *temp, *final], args=args)

    def _count(self, value: Any, name: str, most: int) -> int:
        """A meta field that counts something: an integer in 0..most, else MalformedKV."""
        try:
            count = int(value.decode("ascii") if isinstance(value, bytes) else value)
        except (ValueError, UnicodeDecodeError, AttributeError, TypeError) as exc:
            raise MalformedKV(f"the snapshot's {name} is {value!r}") from exc
        if not 0 <= count <= most:
            raise MalformedKV(f"the snapshot's {name} is {count}, outside 0..{most}")
        return count

    def get(self, session_id: str) -> bytes | None:
        """The blob, or None if there is none (or it changed or expired while read); MalformedKV for a
        meta that does not describe a snapshot this store could have written."""
        meta = self.redis.hgetall(snapshot_meta_key(session_id, self.role))
        if not meta:
            return None
        n = self._count(meta.get(b"chunks"), "chunk count", self.max_chunks)
        size = self._count(meta.get(b"bytes"), "size", self.max_bytes)
        if n < 1 or n > max(1, size):  # no chunk is empty, but the only one of an empty blob
            raise MalformedKV(f"the snapshot's {n} chunks cannot hold {size} bytes")
        keys = [snapshot_chunk_key(session_id, self.role, i) for i in range(n)]
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        lengths = pipe.execute()
        if sum(lengths) != size or (size and 0 in lengths):
            return None  # expired or replaced while reading: treat as absent
        parts = self.redis.mget(keys)
        chunks = [p for p in parts if isinstance(p, bytes)]
        if len(chunks) != n:
            return None
        blob = b"".join(chunks)
        return blob if len(blob) == size else None

    def tokens(self, session_id: str) -> int:
        """Tokens the stored snapshot covers (0 if none): lets a caller decide before fetching;
        MalformedKV when the field is not a count."""
        value = self.redis.hget(snapshot_meta_key(session_id, self.role), "tokens")
        return self._count(value, "token count", self.max_bytes) if value else 0

    def delete(self, session_id: str) -> None:
        meta = snapshot_meta_key(session_id, self.role)
        try:
            n = self._count(self.redis.hget(meta, "chunks") or 0, "chunk count", self.max_chunks)
        except MalformedKV:
            n = 0  # the chunks, if any, expire with their TTL
        self.redis.delete(meta, *[snapshot_chunk_key(session_id, self.role, i) for i in range(n)])


def snapshot_max_bytes(layers: int, kv_heads: int, head_dim: int, element_bytes: int, max_tokens: int) -> int:
    """The largest snapshot blob of a model: its keys and values and token ids at its whole context,
    plus room for the header."""
    return max_tokens * (2 * layers * kv_heads * head_dim * element_bytes + 8) + 64 * 1024 + 200 * layers
