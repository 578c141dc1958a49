"""Where a session's keys/values can come from besides a prefill, and where an evicted session's go.

Two sources: the session's own snapshot (`snapshot_store`, restored by a replica that never saw
the session or lost it), and prefix blocks other replicas published (`prefix_store`, for a new
session whose history begins with them). And one sink: an evicted session's snapshot.

All of it is Redis I/O, and none of it runs on the model thread, where it would stall every
session's pass for one session's round trips:

- `fetch` runs before a job joins a pass: the batcher calls it on an I/O thread when the job is
  submitted (or admitted, for a session evicted meanwhile). What it finds waits here, fetched and
  decoded, until the session's pass `take`s it and the cache table installs it (a copy into the
  session's buffer or the prefix cache). A session whose snapshot is still being written (evicted
  a moment ago) waits for that write, then reads it.
- `save` takes an evicted session after it left the table and hands its buffers to a background
  writer, which copies them out (`snapshot_codec.host_join`: without starting OpenMP threads),
  encodes and writes them. At most `max_pending_saves` wait; beyond that an evicted session is
  not saved (the writer is behind; the session re-prefills if it comes back).

Every source is an optimisation: anything missing is prefilled, and a failure is logged, never
raised to a request. Nothing read is trusted: every tensor is checked against the model's
`KVLayout` as it is decoded, here, before anything is staged for a pass; a malformed snapshot is
deleted from Redis and counted (`rejected_snapshots`; the prefix store counts its own).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from specdec.errors import FailedPrecondition
from specdec.runtime.cache_table import Entry, common_prefix_length
from specdec.runtime.prefix_cache import PrefixCache
from specdec.runtime.prefix_store import FetchedRun, RedisPrefixStore
from specdec.runtime.snapshot_codec import KVLayout, MalformedKV, decode_layers, encode_layers, host_join
from specdec.runtime.snapshot_store import SnapshotPolicy

log = logging.getLogger(__name__)

MAX_STAGED = 64
"""Fetched results waiting for their pass at most (the oldest go first: their job was dropped)."""
PAUSE_S = (1.0, 30.0)
"""After a fetch fails (Redis down, or answering nothing within its timeout), no fetch is tried for the
first of these, doubling with each failure up to the second: fetches run one at a time on the I/O
thread, so against a Redis that does not answer, every new session would otherwise wait out its
calls' timeouts behind the others' instead of prefilling at once."""
STAGED_TTL_S = 60.0
"""A fetched result no pass took within this long is dropped (its job was cancelled or expired)."""


@dataclass(frozen=True)
class Restore:
    """A session's snapshot, fetched and decoded: the tokens it covers, per layer `[1, H, T, D]`."""

    tokens: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    def covers(self, history: list[int]) -> int:
        return common_prefix_length(self.tokens, history)


@dataclass(frozen=True)
class SharedPrefix:
    """Prefix blocks other replicas published for a session's history, fetched and decoded, in order."""

    runs: list[FetchedRun]

    def covers(self, history: list[int]) -> int:
        return self.runs[-1].end if self.runs else 0


Fetched = Restore | SharedPrefix


def _nbytes(found: Fetched) -> int:
    """Bytes of memory fetched keys/values hold (the decoded tensors their views keep alive)."""
    storages: dict[int, int] = {}
    layers = found.layers if isinstance(found, Restore) else [pair for run in found.runs for pair in run.layers]
    for pair in layers:
        for part in pair:
            storage = part.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class CacheSources:
    """A model service's snapshot policy and prefix store, used off the model thread (see the module
    docstring). `prefix`: the local prefix cache the fetched blocks extend (read here without its
    owner's lock: single dict lookups, and a stale answer only makes a fetch larger or smaller)."""

    def __init__(self, snapshots: SnapshotPolicy | None = None, prefix_store: RedisPrefixStore | None = None,
                 prefix: PrefixCache | None = None, max_pending_saves: int = 2, layout: KVLayout | None = None,
                 max_staged_bytes: int = 1 << 30) -> None:
        """`layout`: the model's keys/values, which everything fetched must fit (`SessionCaches` passes it);
        `max_staged_bytes`: the most bytes of fetched keys/values waiting for their pass (outside the KV
        budget until then): beyond it the oldest are dropped, and their sessions prefill."""
        self.max_staged_bytes = max_staged_bytes
        if prefix_store is not None and prefix is None:
            raise ValueError("a prefix store shares the prefix cache's blocks: it needs a prefix cache")
        self.layout = layout
        self.rejected_snapshots = 0  # snapshots found malformed (and deleted)
        self.snapshots = snapshots
        self.prefix_store = prefix_store
        self.prefix = prefix
        self.max_pending_saves = max_pending_saves
        self._staged: OrderedDict[str, tuple[float, Fetched]] = OrderedDict()  # by session: (when, what)
        self.staged_bytes = 0
        self._lock = threading.Lock()
        self._writer: ThreadPoolExecutor | None = None
        self._saves: dict[str, Future] = {}  # by session: the snapshots being written
        self.skipped_saves = 0  # evicted sessions not saved because the writer was behind
        self._paused_until = 0.0  # time.monotonic() before which no fetch is tried (one failed)
        self._pause_s = 0.0

    @property
    def min_tokens(self) -> int:
        """The shortest history (before its last token) any source can pay for."""
        mins = [s.min_tokens for s in (self.snapshots, self.prefix_store) if s is not None]
        return min(mins) if mins else 0

    def wants(self, history: list[int]) -> bool:
        """Whether a new session with `history` is worth a `fetch` (cheap: no I/O): not while fetching is
        paused after a failure (`PAUSE_S`)."""
        return (bool(self.snapshots or self.prefix_store) and len(history) - 1 >= self.min_tokens
                and time.monotonic() >= self._paused_until)

    # -- fetching (an I/O thread) ---------------------------------------------------------------

    def fetch(self, session_id: str, history: list[int]) -> bool:
        """Look for the session's snapshot, else for shared prefix blocks of its history, and keep what
        is found for its pass; whether anything was. Never raises: a failure means a prefill."""
        needed = history[:-1]
        if time.monotonic() < self._paused_until:
            return False
        try:
            self._wait_for_save(session_id)  # evicted a moment ago: read the snapshot it is getting
            found: Fetched | None = self._restore(session_id, needed) or self._shared(needed)
        except Exception as exc:  # noqa: BLE001 - an optimisation: what is missing gets prefilled
            self._pause_s = min(max(2 * self._pause_s, PAUSE_S[0]), PAUSE_S[1])
            self._paused_until = time.monotonic() + self._pause_s
            log.warning("cache of session %s not fetched from Redis (%s); prefilling it, and no fetch for %.0f s",
                        session_id, exc, self._pause_s)
            return False
        self._pause_s = 0.0
        if found is None:
            return False
        now = time.monotonic()
        with self._lock:
            self._unstage(session_id)
            self._staged[session_id] = (now, found)
            self.staged_bytes += _nbytes(found)
            while self._staged and (len(self._staged) > MAX_STAGED or self.staged_bytes > self.max_staged_bytes
                                    or next(iter(self._staged.values()))[0] < now - STAGED_TTL_S):
                self._unstage(next(iter(self._staged)))
            return session_id in self._staged

    def _unstage(self, session_id: str) -> Fetched | None:
        """Forget what was fetched for a session (the caller holds the lock); what it was."""
        found = self._staged.pop(session_id, (0.0, None))[1]
        if found is not None:
            self.staged_bytes -= _nbytes(found)
        return found

    def _restore(self, session_id: str, needed: list[int]) -> Restore | None:
        """The session's snapshot if it covers enough of `needed` to beat a prefill."""
        policy = self.snapshots
        if policy is None or len(needed) < policy.min_tokens:
            return None
        try:
            if policy.store.tokens(session_id) < policy.min_tokens:
                return None
            blob = policy.store.get(session_id)
            if blob is None:
                return None
            tokens, layers = decode_layers(blob, policy.identity, self.layout)
        except MalformedKV as exc:  # corrupt: nobody can use it
            self.rejected_snapshots += 1
            log.warning("snapshot of %s is malformed (%s): deleted, re-prefilling", session_id, exc)
            policy.store.delete(session_id)
            return None
        except FailedPrecondition as exc:  # another model's or format's: left to its replicas
            log.info("snapshot of %s not restored (%s); re-prefilling", session_id, exc)
            return None
        restore = Restore(tokens, layers)
        return restore if restore.covers(needed) >= policy.min_tokens else None

    def _shared(self, needed: list[int]) -> SharedPrefix | None:
        """The blocks of `needed` other replicas published beyond those held here, if they cover at
        least `prefix_store.min_tokens` more tokens."""
        store, prefix = self.prefix_store, self.prefix
        if store is None or prefix is None:
            return None
        block = prefix.block_tokens
        local = prefix.match(needed, count=False)
        if len(needed) // block * block - local.length < store.min_tokens:
            return None
        names = [name for _, name in prefix.chain(needed, local)]
        runs = store.lookup(names)
        if sum(run.blocks for run in runs) * block < store.min_tokens:
            return None
        fetched: list[FetchedRun] = []
        start = local.length
        for run in runs:
            first = (start - local.length) // block
            one = store.fetch(run, block, start, needed[start : start + run.blocks * block],
                              names[first : first + run.blocks], self.layout)
            if one is None:
                break
            fetched.append(one)
            start = one.end
        return SharedPrefix(fetched) if fetched else None

    # -- handing over (the model thread) --------------------------------------------------------

    def take(self, session_id: str, needed: list[int]) -> Fetched | None:
        """What `fetch` found for the session, if it still serves `needed`, and forget it."""
        with self._lock:
            found = self._unstage(session_id)
        if isinstance(found, Restore) and (self.snapshots is None or found.covers(needed) < self.snapshots.min_tokens):
            return None
        return found

    def covers(self, session_id: str, history: list[int]) -> int:
        """Tokens of `history` what `fetch` found for the session would provide (0: nothing found)."""
        with self._lock:
            found = self._staged.get(session_id, (0.0, None))[1]
        return found.covers(history) if found is not None else 0

    def discard(self, session_id: str) -> None:
        with self._lock:
            self._unstage(session_id)

    # -- saving (a background writer) -----------------------------------------------------------

    def save(self, session_id: str, entry: Entry) -> None:
        """Snapshot an evicted session in the background, if it is long enough to be worth it."""
        policy = self.snapshots
        if policy is None or len(entry.tokens) < policy.min_tokens:
            return
        cache = entry.cache
        pieces = [cache.segments(layer, cache.length) for layer in range(cache.data.shape[1])]  # views
        with self._lock:
            if len(self._saves) >= self.max_pending_saves:
                self.skipped_saves += 1
                log.warning("snapshot of evicted session %s not saved: %d saves are still being written",
                            session_id, len(self._saves))
                return
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-snapshot-writer")
            future = self._writer.submit(self._write, session_id, list(entry.tokens), pieces)
            self._saves[session_id] = future
        future.add_done_callback(lambda done: self._saved(session_id, done))

    def _write(self, session_id: str, tokens: list[int], pieces: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        policy = self.snapshots
        assert policy is not None
        layers = [(host_join([k for k, _ in segments]), host_join([v for _, v in segments])) for segments in pieces]
        policy.store.put(session_id, encode_layers(layers, tokens, policy.identity), len(tokens))
        policy.saves += 1

    def _saved(self, session_id: str, future: Future) -> None:
        with self._lock:
            if self._saves.get(session_id) is future:
                del self._saves[session_id]
        if future.exception() is not None:  # the session re-prefills instead
            log.warning("snapshot of evicted session %s not saved (%s)", session_id, future.exception())

    def _wait_for_save(self, session_id: str, timeout_s: float = 30.0) -> None:
        with self._lock:
            pending = self._saves.get(session_id)
        if pending is not None:
            pending.exception(timeout=timeout_s)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the snapshots of evicted sessions queued so far, and the prefix uploads (tests, shutdown)."""
        with self._lock:
            pending = list(self._saves.values())
        for future in pending:
            future.exception(timeout=timeout)
        if self.prefix_store is not None:
            self.prefix_store.flush(timeout)
