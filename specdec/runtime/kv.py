"""Per-session KV caches for one model, addressed by session id, scored one session or many at once.

A cache remembers which tokens it covers. Every call names the session's full accepted history,
so the cache is cut back to the longest common prefix and whatever is missing is re-prefilled in
the same forward pass: rollback after a rejection, rebuild after a restart or eviction, and a
client that moved to another replica all take the same path, and no caller depends on a cache
being alive.

`SessionCaches` is what callers use; it puts together three parts that change for different
reasons:

- the cache table (`cache_table.CacheTable`): which sessions are held, their buffers and shared
  prefix blocks, the byte budget and eviction;
- the cache sources (`cache_sources.CacheSources`): a session's snapshot and other replicas'
  prefix blocks, fetched from Redis before the session's job joins a pass (`prefetch`, which the
  batcher runs on an I/O thread), and evicted sessions' snapshots written after they left;
- the pass (`packed.build_forward`): every row's new tokens through the model in ONE forward pass,
  packed end to end with no padding, as the `EngineOptions` say (`engine_plan.plan_engine`
  decides what they mean for this model and machine, once).

`score_batch` (the model thread) validates the rows, cuts each cache back, installs what was
fetched for new sessions, makes room under the budget, runs the pass, extends the caches and
publishes new prefix blocks. It makes no network call. A row refused for room
(`ResourceExhausted`: the orchestrator retries a busy replica) loses nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from specdec.runtime.cache_sources import CacheSources, Restore, SharedPrefix
from specdec.runtime.cache_table import CacheTable, Entry, common_prefix_length
from specdec.runtime.engine_options import EngineOptions
from specdec.runtime.engine_plan import plan_engine
from specdec.runtime.kv_buffer import SessionKV
from specdec.runtime.memory import available_bytes
from specdec.runtime.packed import PackedRow, build_forward, kv_geometry
from specdec.runtime.prefix_cache import PrefixCache
from specdec.runtime.prefix_store import RedisPrefixStore
from specdec.runtime.snapshot_codec import KVLayout, encode_layers
from specdec.runtime.snapshot_store import SnapshotPolicy
from specdec.runtime.weights import output_layer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

__all__ = ["PREFILL_ALONE_ABOVE", "PUBLISH_ABOVE", "ScoreRequest", "Scored", "SessionCaches", "common_prefix_length",
           "default_budget_bytes"]

PREFILL_ALONE_ABOVE = 16
"""A row that (re-)prefills more than this many tokens makes a pass's cost say little about one
more decoding position (`batching._pass_positions` reports such steps as unknown). Packed passes
no longer prefill such rows on their own."""

PUBLISH_ABOVE = PREFILL_ALONE_ABOVE
"""A row that fed more than this many tokens in a pass (a prompt's prefill, a new chat turn)
publishes its history's new whole blocks to the prefix cache; decode rounds publish nothing, so a
session's prefix stays a handful of segments."""

CPU_BUDGET_FRACTION = 0.5
"""Default KV budget on a CPU: this fraction of the memory available when the service starts (the
machine's, or its container's limit less what it holds, whichever is smaller)."""
GPU_BUDGET_FRACTION = 0.9
"""Default KV budget on a GPU: this fraction of the device memory free after the weights loaded."""


def default_budget_bytes(device: torch.device | str) -> int:
    """The KV budget a service gets when none is configured, from the machine it runs on: on a CPU, a
    fraction of the memory it can still take, its container's limit included (`memory.available_bytes`)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_BUDGET_FRACTION)
    available, source = available_bytes()
    budget = int(available * CPU_BUDGET_FRACTION)
    log.info("KV budget: %d bytes, %.0f%% of %d available (%s); --kv-cache-bytes sets it", budget,
             100 * CPU_BUDGET_FRACTION, available, source)
    return budget


@dataclass(frozen=True)
class ScoreRequest:
    """Score `new_tokens` after `history` for one session (see `SessionCaches.score`)."""

    session_id: str
    history: list[int]
    new_tokens: list[int]


@dataclass(frozen=True)
class Scored:
    logits: torch.Tensor  # [len(new_tokens) + 1, V]
    prefilled: int  # history tokens (re-)prefilled beyond the last one


@dataclass
class _Row:
    """One request of a batch after its cache was cut back: what it still has to feed."""

    request: ScoreRequest
    entry: Entry
    feed: list[int]
    keep: int  # history tokens the cache already covered


class SessionCaches:
    """A bounded LRU of per-session KV caches for `model` (thread-safe; one pass at a time)."""

    def __init__(self, model: PreTrainedModel, max_context: int, max_sessions: int = 64,
                 idle_ttl_s: float = 900.0, snapshots: SnapshotPolicy | None = None,
                 budget_bytes: int | None = None, prefix_cache: PrefixCache | None = None,
                 prefix_store: RedisPrefixStore | None = None, engine: EngineOptions | None = None) -> None:
        """`budget_bytes`: the most keys/values held (None: `default_budget_bytes` of the model's
        device); `prefix_cache`: share prefix blocks between sessions (None: no sharing);
        `snapshots`, `prefix_store`: the Redis sources (`cache_sources`; the prefix store needs
        `prefix_cache`); `engine`: how the pass runs (default `EngineOptions()`; ValueError for
        what this model or machine cannot honour)."""
        self.model, self.max_context = model, max_context
        # inputs go to the output layer's device, in its activations' dtype (float32 for quantized weights)
        self.device, self.dtype, self.vocab_size = output_layer(model)
        budget = default_budget_bytes(self.device) if budget_bytes is None else budget_bytes
        layers, kv_heads, head_dim = kv_geometry(model)
        self.layout = KVLayout(layers, kv_heads, head_dim, self.dtype, self.vocab_size, max_context)
        self.table = CacheTable(self._new_cache, budget, max_sessions, idle_ttl_s, prefix_cache, self.device)
        self.sources = (CacheSources(snapshots, prefix_store, prefix_cache, layout=self.layout,
                                     max_staged_bytes=budget // 2)
                        if snapshots or prefix_store else None)
        if self.sources is not None:
            self.table.on_evict = self.sources.save
            if prefix_store is not None:
                self.table.on_publish = prefix_store.upload
                self.table.on_adopt = self._count_fetched
        self.forward = build_forward(model, plan_engine(model, engine or EngineOptions()))
        self._lock = threading.Lock()

    # -- figures (GetInfo, metrics; readable without the lock) ----------------------------------

    def __len__(self) -> int:
        return len(self.table)

    @property
    def cached_tokens(self) -> int:
        """Tokens whose keys/values are held, over all sessions."""
        return self.table.tokens

    @property
    def used_bytes(self) -> int:
        """Bytes of keys/values held: sessions' own buffers and shared prefix segments."""
        return self.table.used_bytes

    @property
    def budget_bytes(self) -> int:
        return self.table.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        self.table.budget_bytes = value

    @property
    def evictions(self) -> int:
        """Sessions evicted to make room under the budget."""
        return self.table.evictions

    @property
    def rejected(self) -> dict[str, int]:
        """Entries read from Redis that were malformed and dropped, by source ("snapshot", "prefix")."""
        out = {}
        if self.sources is not None and self.sources.snapshots is not None:
            out["snapshot"] = self.sources.rejected_snapshots
        if self.prefix_store is not None:
            out["prefix"] = self.prefix_store.rejected
        return out

    @property
    def prefix(self) -> PrefixCache | None:
        return self.table.prefix

    @property
    def snapshots(self) -> SnapshotPolicy | None:
        return self.sources.snapshots if self.sources is not None else None

    @property
    def prefix_store(self) -> RedisPrefixStore | None:
        return self.sources.prefix_store if self.sources is not None else None

    @property
    def compiled(self) -> bool:
        """Whether the forward pass runs compiled (`warm_up` compiles it)."""
        return self.forward.compiled is not None

    def warm_up(self) -> float:
        """Measure what the forward pass measures at start (`linear_rows="auto"`) and compile it, if it
        is compiled (at service start: no request pays a compile); the seconds compiling took."""
        with self._lock:
            return self.forward.warm_up()

    # -- fetching (any thread but the model's) --------------------------------------------------

    def wants_fetch(self, request: ScoreRequest) -> bool:
        """Whether `prefetch` may find something for this request (no I/O, no lock: a hint)."""
        return (self.sources is not None and request.session_id not in self.table.entries
                and self.sources.wants(request.history))

    def prefetch(self, request: ScoreRequest) -> bool:
        """Fetch what the Redis sources hold for a new session (its snapshot, or other replicas'
        prefix blocks), for its pass to install; whether anything was found. Blocking I/O: call it
        off the model thread, before the request joins a pass (the batcher does)."""
        return self.sources is not None and self.sources.fetch(request.session_id, request.history)

    def covered(self, session_id: str, history: list[int]) -> int:
        """Tokens of `history` whose keys/values are at hand for the session: its own cache's, or for
        a new session the shared prefix blocks it would view and what was fetched for it."""
        with self._lock:
            entry = self.table.entries.get(session_id)
            if entry is not None:
                return common_prefix_length(entry.tokens, history)
            local = self.prefix.match(history, count=False).length if self.prefix is not None else 0
            fetched = self.sources.covers(session_id, history) if self.sources is not None else 0
            return max(local, fetched)

    # -- scoring (the model thread) -------------------------------------------------------------

    def score(self, session_id: str, history: list[int], new_tokens: list[int]) -> tuple[torch.Tensor, int]:
        """Logits `[len(new_tokens) + 1, V]` for the positions after history[-1] and each new token.

        Row i is the model's next-token distribution after `history + new_tokens[:i]`. Returns
        the logits and how many history tokens had to be (re-)prefilled beyond the last one.
        Afterwards the cache covers `history + new_tokens`. One session, on the calling thread: it
        fetches first (`prefetch`), then scores; servers go through the batcher instead.
        """
        request = ScoreRequest(session_id, history, new_tokens)
        if self.wants_fetch(request):
            self.prefetch(request)
        result = self.score_batch([request])[0]
        if isinstance(result, Exception):
            raise result
        return result.logits, result.prefilled

    def score_batch(self, requests: Sequence[ScoreRequest]) -> list[Scored | Exception]:
        """`score` for several sessions (distinct ids) in one forward pass; one result per request.

        A request with bad input or no room gets its own error and takes no part in the pass; a
        failing forward fails every row of the pass (their caches are forgotten, to be rebuilt from
        the history next time). No network call: what was fetched for new sessions is installed.
        """
        ids = [r.session_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a batch holds each session at most once, got {ids}")
        results: list[Scored | Exception | None] = [None] * len(requests)
        with self._lock:
            self.table.evict_idle()
            rows = self._prepare_all(requests, results)
            try:
                with torch.inference_mode():
                    scored = self._forward([row for _, row in rows])
            except Exception:
                for _, row in rows:
                    self.table.remove(row.request.session_id)
                raise
            self._book(rows, scored, results, set(ids))
            self.table.trim()
        return results  # type: ignore[return-value]

    def _prepare_all(self, requests: Sequence[ScoreRequest], results: list) -> list[tuple[int, _Row]]:
        """Each request's row, in order; a request refused (bad input, no room) gets its error in
        `results`. The sessions prepared so far are never evicted to make room for the next."""
        rows: list[tuple[int, _Row]] = []
        pinned: set[str] = set()
        for i, request in enumerate(requests):
            pinned.add(request.session_id)
            try:
                rows.append((i, self._prepare(request, pinned)))
            except (InvalidArgument, ResourceExhausted) as exc:
                results[i] = exc
        return rows

    def _prepare(self, request: ScoreRequest, pinned: set[str]) -> _Row:
        """Validate, find or create the entry, cut it back to the common prefix, make room for what
        it will hold; what to feed. `pinned`: sessions not to evict for room."""
        history, new_tokens = request.history, request.new_tokens
        self._check(history, new_tokens)
        entry = self.table.entries.get(request.session_id)
        needed = history[:-1]  # the cache must cover these before we feed history[-1]
        keep = common_prefix_length(entry.tokens, needed) if entry is not None else 0
        feed = history[keep:] + new_tokens
        # Only tokens not already in the cache reach the model (the rest were checked when fed).
        top = max(feed)
        if top >= self.vocab_size:
            raise InvalidArgument(f"token id {top} is outside the vocabulary (size {self.vocab_size})")
        if entry is not None and keep < entry.cache.offset:  # diverged inside its shared prefix
            self.table.remove(request.session_id)
            entry = None
        created = entry is None
        if entry is None:
            entry = self._new_entry(request.session_id, needed)
            keep = common_prefix_length(entry.tokens, needed)
            feed = history[keep:] + new_tokens
        elif self.sources is not None:  # it has a cache: whatever a fetch found for it is not needed
            self.sources.discard(request.session_id)
        self.table.crop(entry, keep)
        try:
            self.table.reserve(entry, keep + len(feed), pinned)
        except ResourceExhausted:
            if created:  # nothing of a refused new session stays behind
                self.table.remove(request.session_id)
            raise
        return _Row(request, entry, feed, keep)

    def _check(self, history: list[int], new_tokens: list[int]) -> None:
        if not history:
            raise InvalidArgument("history is empty: send at least one token (the prompt)")
        total = len(history) + len(new_tokens)
        if total > self.max_context:
            raise InvalidArgument(
                f"context of {total} tokens exceeds the model's limit of {self.max_context}; "
                "shorten the prompt or lower max_new_tokens"
            )

    def _new_entry(self, session_id: str, needed: list[int]) -> Entry:
        """A new session's entry, added to the table: its restored snapshot, or the shared prefix
        blocks of `needed` held here or fetched from other replicas, or nothing."""
        fetched = self.sources.take(session_id, needed) if self.sources is not None else None
        if fetched is not None and not self._fits(fetched):
            fetched = None  # checked when decoded; this is the invariant the pass relies on, kept here too
        if isinstance(fetched, Restore):
            entry = self.table.restored(fetched.tokens, fetched.layers)
            assert self.snapshots is not None
            self.snapshots.restores += 1
        else:
            entry = self.table.start(needed, fetched.runs if isinstance(fetched, SharedPrefix) else ())
        self.table.add(session_id, entry)
        return entry

    def _fits(self, fetched: Restore | SharedPrefix) -> bool:
        """Whether fetched keys/values are exactly the model's: its layers, dtype, heads and head_dim, as
        many positions as tokens, head_dim contiguous (a restore's `[1, H, T, D]`, a run's `[H, n, D]`)."""
        layout = self.layout

        def fits(pairs: list[tuple[torch.Tensor, torch.Tensor]], *shape: int) -> bool:
            return len(pairs) == layout.layers and all(
                part.dtype == layout.dtype and tuple(part.shape) == shape and part.stride(-1) == 1
                for pair in pairs for part in pair)

        if isinstance(fetched, Restore):
            return fits(fetched.layers, 1, layout.kv_heads, len(fetched.tokens), layout.head_dim)
        return all(fits(run.layers, layout.kv_heads, len(run.tokens), layout.head_dim) for run in fetched.runs)

    def _count_fetched(self, tokens: int) -> None:
        """A segment fetched from other replicas joined the prefix cache (GetInfo counts them)."""
        store = self.prefix_store
        assert store is not None
        store.fetches += 1
        store.fetched_tokens += tokens

    def _forward(self, rows: list[_Row]) -> list[torch.Tensor]:
        """Feed every row's tokens into its cache; each row's last `len(new_tokens) + 1` logits."""
        if not rows:
            return []
        packed = [PackedRow(row.entry.cache, row.feed, len(row.request.new_tokens) + 1) for row in rows]
        return [logits.clone() for logits in self.forward(packed)]  # not views of one pass's tensor

    def _book(self, rows: list[tuple[int, _Row]], scored: list[torch.Tensor], results: list,
              pinned: set[str]) -> None:
        """After the pass: the caches cover what they were fed, the results are in, long feeds publish."""
        now = time.monotonic()
        for (i, row), logits in zip(rows, scored):
            self.table.extend(row.entry, row.feed)
            self.table.touch(row.request.session_id, now)
            results[i] = Scored(logits, len(row.request.history) - 1 - row.keep)
            if self.prefix is not None and len(row.feed) > PUBLISH_ABOVE:
                self.table.publish(row.entry, row.request.history, pinned)

    def _new_cache(self, capacity: int | None = None, prefix: tuple[torch.Tensor, ...] = ()) -> SessionKV:
        layers, kv_heads, head_dim = kv_geometry(self.model)
        return SessionKV(layers, kv_heads, head_dim, self.max_context, self.dtype, self.device,
                         prefix=prefix, **({} if capacity is None else {"capacity": capacity}))

    # -- snapshots and bookkeeping --------------------------------------------------------------

    def snapshot(self, session_id: str) -> tuple[int, bytes]:
        """The session's cache as a snapshot blob and the tokens it covers; (0, b"") if there is
        no cache or it is shorter than worth restoring. Writing it is `self.snapshots.store.put`."""
        policy = self.snapshots
        if policy is None:
            raise FailedPrecondition("this service runs without a snapshot store (--snapshot-redis-url)")
        with self._lock:
            entry = self.table.entries.get(session_id)
            if entry is None or len(entry.tokens) < policy.min_tokens:
                return 0, b""
            layers = [(layer.keys, layer.values) for layer in entry.cache.layers]
            return len(entry.tokens), encode_layers(layers, entry.tokens, policy.identity)

    def rollback(self, session_id: str, length: int) -> int:
        """Cut a session's cache back to its first `length` tokens; returns what it now covers."""
        with self._lock:
            entry = self.table.entries.get(session_id)
            if entry is None:
                return 0
            self.table.crop(entry, length)
            return len(entry.tokens)

    def release(self, session_id: str) -> bool:
        """Forget the session's cache and anything fetched for it; whether it had a cache."""
        if self.sources is not None:
            self.sources.discard(session_id)
        with self._lock:
            return self.table.remove(session_id) is not None

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the background writes queued so far: evicted sessions' snapshots, prefix uploads."""
        if self.sources is not None:
            self.sources.flush(timeout)
