"""KV-cache snapshots in Redis: move a session's cache to another replica instead of re-prefilling.

A snapshot is one safetensors blob: per layer the keys and values `[1, H, T, D]`, plus the T
tokens they cover; its metadata names the model (tokenizer fingerprint, model name, dtype,
layer count) so a replica running anything else refuses it. Redis holds it under the session's
hash tag, chunked (Redis strings are capped, and large values block the server), written to
temporary keys and renamed into place so a reader never sees half a snapshot, with a TTL:

    specdec:v1:{<session>}:kv:<role>:meta    hash: chunks, bytes, tokens, model, written_at
    specdec:v1:{<session>}:kv:<role>:<i>     chunk i of the blob

The role ("target" or "draft") keeps the two services' snapshots of a session apart: a draft
never reads, overwrites or deletes the target's, even when both use the same Redis.

Restoring pays off only past a context length that depends on the hardware (prefill compute
against Redis transfer); `bench/snapshot.py` measures both and the services take the threshold
as a flag.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from transformers import DynamicCache

from specdec.errors import FailedPrecondition
from specdec.server.keys import snapshot_chunk_key, snapshot_meta_key

if TYPE_CHECKING:  # kv and batching import this module
    from specdec.server.config import SnapshotServiceConfig
    from specdec.runtime.batching import Batcher
    from specdec.runtime.kv import SessionCaches
    from specdec.runtime.models import LoadedModel

CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class SnapshotIdentity:
    """What must match between the replica that wrote a snapshot and the one restoring it."""

    model: str
    dtype: str
    fingerprint: str
    layers: int

    def as_metadata(self) -> dict[str, str]:
        return {"model": self.model, "dtype": self.dtype, "fingerprint": self.fingerprint, "layers": str(self.layers)}


def encode(cache: DynamicCache, tokens: list[int], identity: SnapshotIdentity) -> bytes:
    """The safetensors blob of a single-session cache covering `tokens`."""
    tensors: dict[str, torch.Tensor] = {"tokens": torch.tensor(tokens, dtype=torch.int64)}
    for i, layer in enumerate(cache.layers):
        if layer.keys is None or layer.keys.shape[-2] != len(tokens):
            raise ValueError(f"layer {i} covers {0 if layer.keys is None else layer.keys.shape[-2]} tokens, "
                             f"not {len(tokens)}")
        tensors[f"k.{i}"] = layer.keys.contiguous().cpu()
        tensors[f"v.{i}"] = layer.values.contiguous().cpu()
    return st_save(tensors, metadata=identity.as_metadata())


def decode(blob: bytes, identity: SnapshotIdentity, config,
           device: torch.device | str = "cpu") -> tuple[list[int], DynamicCache]:
    """The tokens and the cache of a blob, on `device`; FailedPrecondition if it was written for another model."""
    header_len = int.from_bytes(blob[:8], "little")
    metadata = json.loads(blob[8:8 + header_len]).get("__metadata__", {})
    expected = identity.as_metadata()
    wrong = {k: (metadata.get(k), v) for k, v in expected.items() if metadata.get(k) != v}
    if wrong:
        raise FailedPrecondition(
            "the KV snapshot was written by another model: "
            + ", ".join(f"{k} is {got!r}, this replica has {want!r}" for k, (got, want) in wrong.items())
        )
    tensors = st_load(blob)
    tokens = tensors["tokens"].tolist()
    cache = DynamicCache(config=config)
    for i in range(identity.layers):
        cache.update(tensors[f"k.{i}"].to(device), tensors[f"v.{i}"].to(device), i)
    return tokens, cache




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


@dataclass
class SnapshotPolicy:
    """How a service uses snapshots: where, for which model, and from what length they pay."""

    store: SnapshotStore
    identity: SnapshotIdentity
    min_tokens: int  # below this many tokens a re-prefill is as cheap (bench/snapshot.py)
    saves: int = 0
    restores: int = 0


class SnapshotStore:
    """Snapshots of one role's caches ("target" or "draft") in Redis (blocking client: the
    services call it from their compute thread)."""

    def __init__(self, url: str, role: str, ttl_s: int = 3600, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.redis = redis.Redis.from_url(url)
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
        if any(p is None for p in parts):
            return None  # expired or replaced while reading: treat as absent
        blob = b"".join(parts)
        return blob if len(blob) == int(meta[b"bytes"]) else None

    def tokens(self, session_id: str) -> int:
        """Tokens the stored snapshot covers (0 if none): lets a caller decide before fetching."""
        value = self.redis.hget(snapshot_meta_key(session_id, self.role), "tokens")
        return int(value) if value else 0

    def delete(self, session_id: str) -> None:
        meta = snapshot_meta_key(session_id, self.role)
        n = int(self.redis.hget(meta, "chunks") or 0)
        self.redis.delete(meta, *[snapshot_chunk_key(session_id, self.role, i) for i in range(n)])

    def close(self) -> None:
        self.redis.close()


def policy_of(config: SnapshotServiceConfig, loaded: LoadedModel, role: str) -> SnapshotPolicy | None:
    """The snapshot policy of a model service's config (None when it has no --snapshot-redis-url)."""
    if not config.snapshot_redis_url:
        return None
    dtype = str(loaded.dtype).removeprefix("torch.")  # "float32", as --dtype names it
    identity = SnapshotIdentity(loaded.name, dtype, loaded.fingerprint, loaded.model.config.num_hidden_layers)
    return SnapshotPolicy(SnapshotStore(config.snapshot_redis_url, role, config.snapshot_ttl_s), identity,
                          config.snapshot_min_tokens)


async def save_snapshot(batcher: Batcher, session_id: str) -> tuple[int, int]:
    """Snapshot a session's cache for the SaveSnapshot RPC: (tokens covered, bytes); (0, 0) when there is
    nothing worth saving. Only the encode runs on the model's thread (between steps); the Redis
    write runs beside it."""
    caches = batcher.caches
    tokens, blob = await batcher.call(caches.snapshot, session_id)
    if tokens:
        await asyncio.to_thread(caches.snapshots.store.put, session_id, blob, tokens)
        caches.snapshots.saves += 1
    return tokens, len(blob)


async def drop_snapshot(caches: SessionCaches, session_id: str) -> None:
    """Delete a session's snapshot of this role, if the service keeps snapshots (on Release)."""
    if caches.snapshots is not None:
        await asyncio.to_thread(caches.snapshots.store.delete, session_id)
