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

What Redis holds is not trusted. A segment's blob also records its first position and the name of
the block before it, so a reader recomputes the names of the segment's blocks from its own tokens
and uses a block only where that name is the one its history looked up: a block key pointing at the
wrong segment or index (even one holding the same tokens elsewhere, after other tokens) is caught,
not just one whose tokens differ. The blob's tensors are checked against the reader's model
(`snapshot_codec.KVLayout`). A block key or segment that is malformed is deleted from Redis and
counted (`rejected`); one of another model or format is left to its replicas.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from specdec.errors import FailedPrecondition
from specdec.keys import prefix_block_key
from specdec.runtime.prefix_cache import block_names
from specdec.runtime.snapshot_codec import (
    KVLayout,
    MalformedKV,
    SnapshotIdentity,
    decode_layers,
    encode_layers,
    metadata_of,
)
from specdec.runtime.snapshot_store import CHUNK_BYTES, RedisSnapshotStore

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

    `client`: a blocking redis-py client the service built (`specdec.server.redis.connect`);
    `max_bytes`: the largest segment blob this model can make (reads of more are refused);
    `max_pending_uploads`: segments waiting to be written at most (a Redis that stalls must not let
    them pile up in memory: beyond it a segment is not shared, and `skipped_uploads` counts it)."""

    def __init__(self, client: Any, role: str, identity: SnapshotIdentity, ttl_s: int = 3600,
                 min_tokens: int = 256, max_bytes: int = 1 << 32, max_pending_uploads: int = 4) -> None:
        self.blobs = RedisSnapshotStore(client, f"{role}-prefix", ttl_s, CHUNK_BYTES, max_bytes)
        self.redis = client
        self.role, self.identity, self.ttl_s, self.min_tokens = role, identity, ttl_s, min_tokens
        meta = "|".join(f"{k}={v}" for k, v in sorted(identity.as_metadata().items()))
        self.identity_hash = hashlib.blake2b(meta.encode(), digest_size=8).hexdigest()
        self.max_pending_uploads = max_pending_uploads
        self._uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{role}-prefix-upload")
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self.uploads = 0  # segments written
        self.skipped_uploads = 0  # segments not written: too many were waiting
        self.fetches = 0  # segments read and used
        self.fetched_tokens = 0
        self.rejected = 0  # block keys and segments found malformed (and deleted)

    def _block_key(self, name: bytes) -> str:
        return prefix_block_key(self.role, self.identity_hash, name.hex())

    # -- writing --------------------------------------------------------------------------------

    def upload(self, names: list[bytes], tokens: list[int], data: torch.Tensor, start: int = 0,
               parent: bytes = b"") -> None:
        """Write a segment (`data` `[2, layers, H, n, D]` of `tokens` at positions `start` on, after the
        block named `parent`; blocks named `names`) in the background; the tensor must not change
        afterwards (prefix segments never do)."""
        with self._lock:
            if len(self._pending) >= self.max_pending_uploads:
                self.skipped_uploads += 1
                log.warning("prefix segment of %d tokens not shared: %d uploads are still waiting for Redis",
                            len(tokens), len(self._pending))
                return
            future = self._uploads.submit(self._write, list(names), list(tokens), data, start, parent)
            self._pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)
        if future.exception() is not None:
            log.warning("prefix segment not written to Redis (%s)", future.exception())

    def _write(self, names: list[bytes], tokens: list[int], data: torch.Tensor, start: int, parent: bytes) -> None:
        segment = f"{self.identity_hash}-{names[-1].hex()}"
        layers = [(data[0, i][None], data[1, i][None]) for i in range(data.shape[1])]
        blob = encode_layers(layers, tokens, self.identity, {"start": str(start), "parent": parent.hex()})
        self.blobs.put(segment, blob, len(tokens))
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
        """The longest leading run of `names` held in Redis, as runs of consecutive blocks per segment.
        A block key that does not name a segment of this model and an index in it ends the run there,
        and is deleted."""
        if not names:
            return []
        runs: list[RemoteRun] = []
        for name, value in zip(names, self.redis.mget([self._block_key(name) for name in names])):
            if not isinstance(value, bytes):
                break
            place = self._place(value)
            if place is None:
                self._reject([name], f"block key {self._block_key(name)} holds {value[:80]!r}")
                break
            segment, index = place
            if runs and runs[-1].segment == segment and runs[-1].first + runs[-1].blocks == index:
                runs[-1] = RemoteRun(segment, runs[-1].first, runs[-1].blocks + 1)
            else:
                runs.append(RemoteRun(segment, index, 1))
        return runs

    def _place(self, value: bytes) -> tuple[str, int] | None:
        """(segment, block index) of a block key's value `<identity hash>-<hex name>:<index>`, or None."""
        try:
            segment, sep, index = value.decode("ascii").rpartition(":")
        except UnicodeDecodeError:
            return None
        owner, _, last = segment.partition("-")
        if not sep or owner != self.identity_hash or len(last) != 32 or not index.isdigit() or len(index) > 9:
            return None
        try:
            bytes.fromhex(last)
        except ValueError:
            return None
        return segment, int(index)

    def fetch(self, run: RemoteRun, block_tokens: int, start: int, expected: list[int], names: list[bytes],
              layout: KVLayout | None = None) -> FetchedRun | None:
        """The run's keys/values, for the history's positions from `start` on, or None if the segment is
        gone, belongs to another model, or does not hold the blocks `names` (the history's, whose tokens
        are `expected`) at the run's index: its blocks' names, recomputed from its own tokens and the
        block before it, must be these. `layout`: the model's, which the blob's tensors must fit.
        Malformed segments and misdirected block keys are deleted. Decoded, not copied:
        `FetchedRun.data` makes the tensor the prefix cache keeps."""
        lo, hi = run.first * block_tokens, (run.first + run.blocks) * block_tokens
        try:
            blob = self.blobs.get(run.segment)
            if blob is None:
                return None
            metadata = metadata_of(blob)
            if "parent" not in metadata or "start" not in metadata:
                return None  # written before segments recorded their chain: unverifiable, left to expire
            tokens, layers = decode_layers(blob, self.identity, layout)
            parent, first = bytes.fromhex(metadata["parent"]), int(metadata["start"])
        except FailedPrecondition:
            return None  # another model's, or another format: its replicas read it
        except (MalformedKV, ValueError) as exc:
            self.blobs.delete(run.segment)
            self._reject(names, f"prefix segment {run.segment} is malformed ({exc})")
            return None
        held = block_names(parent, tokens[:hi], block_tokens)[run.first:]  # the names of what it holds there
        if hi > len(tokens) or held != names or tokens[lo:hi] != expected:
            self._reject(names, f"block keys point at blocks {run.first}..{run.first + run.blocks - 1} of segment "
                                f"{run.segment}, which holds other blocks there")
            return None
        if first + lo != start:  # its own blocks, by their names, at another position: the segment is corrupt
            self.blobs.delete(run.segment)
            self._reject(names, f"prefix segment {run.segment} says it starts at {first}, its blocks are at "
                                f"{start - lo}")
            return None
        return FetchedRun(start, list(expected), [(k[0, :, lo:hi], v[0, :, lo:hi]) for k, v in layers])

    def _reject(self, names: list[bytes], why: str) -> None:
        """Delete block keys that led to something malformed, and count it."""
        self.rejected += 1
        log.warning("%s: dropped from Redis, the blocks are prefilled", why)
        self.redis.delete(*[self._block_key(name) for name in names])

    def close(self) -> None:
        """Finish the queued uploads (the client is the service's to close)."""
        self._uploads.shutdown(wait=True)
