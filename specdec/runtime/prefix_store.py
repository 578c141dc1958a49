"""Shared prefix blocks across replicas: published to Redis, fetched by a replica that lacks them.

A segment the local prefix cache publishes (`prefix_cache.PrefixCache.publish`) is also written
to Redis in the background: its keys/values as a KV snapshot blob (`snapshot_codec`: safetensors,
the model/dtype/tokenizer identity checked on read; chunked, atomically published, with a TTL, by
`snapshot_store.RedisSnapshotStore` under the role `<role>-prefix` and the segment's id), and one
small key per block (`keys.prefix_block_key`) saying which segment holds it and where. The block
names are the prefix cache's chained hashes, so a replica finds the longest run of its history's
blocks in Redis with one MGET, fetches the segments holding them, checks that their tokens are
the history's, and registers them in its own prefix cache as if it had computed them.

A fetch pays only past some length (transfer against prefill: `bench/snapshot.py` measures the
same trade for snapshots), hence `min_tokens`. Every Redis failure falls back to a prefill.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from specdec.keys import prefix_block_key
from specdec.runtime.snapshot_codec import SnapshotIdentity, decode_layers, encode_layers
from specdec.runtime.snapshot_store import RedisSnapshotStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedRun:
    """Keys/values another replica computed for `tokens` at positions start .. start + len(tokens) - 1:
    per layer `(keys, values)` `[kv_heads, n, head_dim]` (views of a decoded blob)."""

    start: int
    tokens: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def data(self, skip: int = 0) -> torch.Tensor:
        """`[2, layers, kv_heads, n - skip, head_dim]`: the run from position start + skip on, as one
        tensor the prefix cache can own (a copy: made on the model thread, which installs it)."""
        return torch.stack([torch.stack([k[:, skip:], v[:, skip:]]) for k, v in self.layers], dim=1)


@dataclass(frozen=True)
class RemoteRun:
    """Consecutive blocks of one remote segment: its id, the first block's index in it, how many."""

    segment: str
    first: int
    blocks: int


class RedisPrefixStore:
    """Prefix segments of one role's model in Redis (blocking calls; uploads on a worker thread).

    `client`: a blocking redis-py client the service built (`specdec.server.redis.connect`)."""

    def __init__(self, client: Any, role: str, identity: SnapshotIdentity, ttl_s: int = 3600,
                 min_tokens: int = 256) -> None:
        self.blobs = RedisSnapshotStore(client, f"{role}-prefix", ttl_s)
        self.redis = client
        self.role, self.identity, self.ttl_s, self.min_tokens = role, identity, ttl_s, min_tokens
        meta = "|".join(f"{k}={v}" for k, v in sorted(identity.as_metadata().items()))
        self.identity_hash = hashlib.blake2b(meta.encode(), digest_size=8).hexdigest()
        self._uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{role}-prefix-upload")
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self.uploads = 0  # segments written
        self.fetches = 0  # segments read and used
        self.fetched_tokens = 0

    def _block_key(self, name: bytes) -> str:
        return prefix_block_key(self.role, self.identity_hash, name.hex())

    # -- writing --------------------------------------------------------------------------------

    def upload(self, names: list[bytes], tokens: list[int], data: torch.Tensor) -> None:
        """Write a segment (`data` `[2, layers, H, n, D]` of `tokens`, blocks named `names`) in the
        background; the tensor must not change afterwards (prefix segments never do)."""
        future = self._uploads.submit(self._write, list(names), list(tokens), data)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)
        if future.exception() is not None:
            log.warning("prefix segment not written to Redis (%s)", future.exception())

    def _write(self, names: list[bytes], tokens: list[int], data: torch.Tensor) -> None:
        segment = f"{self.identity_hash}-{names[-1].hex()}"
        layers = [(data[0, i][None], data[1, i][None]) for i in range(data.shape[1])]
        self.blobs.put(segment, encode_layers(layers, tokens, self.identity), len(tokens))
        pipe = self.redis.pipeline(transaction=False)
        for index, name in enumerate(names):
            # an existing key keeps pointing at the copy already there (NX), and lives on (EXPIRE)
            pipe.set(self._block_key(name), f"{segment}:{index}", ex=self.ttl_s, nx=True)
            pipe.expire(self._block_key(name), self.ttl_s)
        pipe.execute()
        self.uploads += 1

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the uploads queued so far (tests, shutdown)."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.exception(timeout=timeout)

    # -- reading --------------------------------------------------------------------------------

    def lookup(self, names: list[bytes]) -> list[RemoteRun]:
        """The longest leading run of `names` held in Redis, as runs of consecutive blocks per segment."""
        if not names:
            return []
        runs: list[RemoteRun] = []
        for value in self.redis.mget([self._block_key(name) for name in names]):
            if not isinstance(value, bytes):
                break
            segment, _, index = value.decode().rpartition(":")
            if runs and runs[-1].segment == segment and runs[-1].first + runs[-1].blocks == int(index):
                runs[-1] = RemoteRun(segment, runs[-1].first, runs[-1].blocks + 1)
            else:
                runs.append(RemoteRun(segment, int(index), 1))
        return runs

    def fetch(self, run: RemoteRun, block_tokens: int, start: int, expected: list[int]) -> FetchedRun | None:
        """The run's keys/values, for the history's positions from `start` on, or None if the segment
        is gone, belongs to another model, or does not hold `expected` (the history's tokens there).
        Decoded, not copied: `FetchedRun.data` makes the tensor the prefix cache keeps."""
        blob = self.blobs.get(run.segment)
        if blob is None:
            return None
        tokens, layers = decode_layers(blob, self.identity)  # refuses another model/dtype/tokenizer
        lo, hi = run.first * block_tokens, (run.first + run.blocks) * block_tokens
        if tokens[lo:hi] != expected:
            return None
        return FetchedRun(start, list(expected), [(k[0, :, lo:hi], v[0, :, lo:hi]) for k, v in layers])

    def close(self) -> None:
        """Finish the queued uploads (the client is the service's to close)."""
        self._uploads.shutdown(wait=True)

