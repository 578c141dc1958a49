"""Per-session KV caches for one model, addressed by session id, scored one session or many at once.

A cache remembers which tokens it covers. Every call names the session's full accepted history,
so the cache is cut back to the longest common prefix and whatever is missing is re-prefilled in
the same forward pass: rollback after a rejection, rebuild after a restart or eviction, and a
client that moved to another replica all take the same path, and no caller depends on a cache
being alive.

Each session's keys/values live in one buffer (`specdec.runtime.kv_buffer.SessionKV`) that new
positions are written into in place; cutting back moves a length. Batched scoring
(`score_batch`) runs the new tokens of several sessions through ONE forward pass, packed end to
end with no padding, each session attending to its own keys/values where they lie
(`specdec.runtime.packed`): every linear layer runs once for all rows, a session's first prefill
shares the pass with the others' decode steps at the cost of its own tokens only, and nothing
copies a session's past on a round. Models that are not Llama-structured are scored one session
at a time through transformers' own forward (`packed.forward_generic`).

Shared prefixes (`specdec.runtime.prefix_cache`): a new session whose history begins with blocks
another session computed views them instead of prefilling them, and a row that prefilled a long
block publishes its whole blocks for the next. Memory: every byte of keys/values (sessions' own
buffers and shared prefix segments) counts against `budget_bytes`; when a pass needs more, prefix
segments no session uses go first, then idle sessions, least recently used first (snapshotted
first when a snapshot store is configured); a row that still does not fit is refused with
`ResourceExhausted` (the orchestrator retries a busy replica), its session losing nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil
import torch

from specdec.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from specdec.runtime.kv_buffer import SessionKV
from specdec.runtime.packed import PackedForward, PackedRow, forward_generic, kv_geometry, supports
from specdec.runtime.prefix_cache import NO_MATCH, Match, PrefixCache
from specdec.runtime.prefix_store import RedisPrefixStore
from specdec.runtime.snapshot_codec import decode_layers, encode_layers
from specdec.runtime.snapshot_store import SnapshotPolicy

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

PREFILL_ALONE_ABOVE = 16
"""A row that (re-)prefills more than this many tokens makes a pass's cost say little about one
more decoding position (`batching._pass_positions` reports such steps as unknown). Packed passes
no longer prefill such rows on their own."""

PUBLISH_ABOVE = PREFILL_ALONE_ABOVE
"""A row that fed more than this many tokens in a pass (a prompt's prefill, a new chat turn)
publishes its history's new whole blocks to the prefix cache; decode rounds publish nothing, so a
session's prefix stays a handful of segments."""

CPU_BUDGET_FRACTION = 0.5
"""Default KV budget on a CPU: this fraction of the memory available when the service starts."""
GPU_BUDGET_FRACTION = 0.9
"""Default KV budget on a GPU: this fraction of the device memory free after the weights loaded."""


def default_budget_bytes(device: torch.device | str) -> int:
    """The KV budget a service gets when none is configured, from the machine it runs on."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_BUDGET_FRACTION)
    available = psutil.virtual_memory().available
    return int(available * CPU_BUDGET_FRACTION)


@dataclass
class _Entry:
    tokens: list[int]  # tokens whose keys/values the cache holds, in order
    cache: SessionKV
    last_used: float = field(default_factory=time.monotonic)
    prefix: Match = NO_MATCH  # the shared prefix blocks the cache views (cache.offset positions)


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
    entry: _Entry
    feed: list[int]
    keep: int  # history tokens the cache already covered


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, at C speed
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _head_weight(model: PreTrainedModel) -> torch.Tensor:
    """The weight of the model's LM head, whose rows are the logits."""
    weight = getattr(model.get_output_embeddings(), "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{type(model).__name__} has no output embeddings to score tokens with")
    return weight


class SessionCaches:
    """A bounded LRU of per-session KV caches for `model` (thread-safe; one forward at a time)."""

    def __init__(self, model: PreTrainedModel, max_context: int, max_sessions: int = 64,
                 idle_ttl_s: float = 900.0, snapshots: SnapshotPolicy | None = None,
                 budget_bytes: int | None = None, prefix_cache: PrefixCache | None = None,
                 prefix_store: RedisPrefixStore | None = None, prepack: str = "auto",
                 compile: str = "off", kernels: str = "auto",
                 linear_rows: int | str | None = None) -> None:
        """`budget_bytes`: the most keys/values held (None: `default_budget_bytes` of the model's
        device); `prefix_cache`: share prefix blocks between sessions (None: no sharing);
        `prefix_store`: also share them with other replicas through Redis (needs `prefix_cache`);
        `prepack`: the engine's weights pre-packed for oneDNN, on/off/auto (`packed.Projection`);
        `compile`: the packed pass's dense part through torch.compile, on/off/auto
        (`compiled.CompiledLayers`; `warm_up` compiles it); `kernels`: the packed pass's attention of
        decode and verify rows and projections of a few rows, native/torch/auto (`native`);
        `linear_rows`: the most rows of a pass whose projections take the native linear kernel, or
        "auto", measured by `warm_up`, or None: all it takes (`packed.PackedForward`)."""
        self.model = model
        head = _head_weight(model)  # [V, hidden]
        self.device = head.device  # inputs go where the weights are
        self.dtype = head.dtype
        self.vocab_size = head.shape[0]
        self.max_context = max_context
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._tokens = 0  # sum of len(entry.tokens) over _entries; readable without the lock
        self.snapshots = snapshots
        self.budget_bytes = default_budget_bytes(self.device) if budget_bytes is None else budget_bytes
        self.prefix = prefix_cache
        if prefix_store is not None and prefix_cache is None:
            raise ValueError("a prefix store shares the prefix cache's blocks: it needs a prefix cache")
        self.prefix_store = prefix_store
        self.evictions = 0  # sessions evicted to make room under the budget
        self._own_bytes = 0  # bytes of the sessions' own buffers
        for what, asked in (("pre-packed weights", prepack), ("the compiled pass", compile),
                            ("the native kernels", "on" if kernels == "native" else ""),
                            (f"--native-linear-rows {linear_rows}",
                             "on" if isinstance(linear_rows, int) and linear_rows > 0 else "")):
            if asked == "on" and not supports(model):
                raise ValueError(f"{what}: a feature of the packed pass, which does not run {type(model).__name__}")
        self._packed = PackedForward(model, prepack, compile, kernels, linear_rows) if supports(model) else None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        """Tokens whose keys/values are held, over all sessions (for GetInfo and metrics)."""
        return self._tokens

    @property
    def used_bytes(self) -> int:
        """Bytes of keys/values held: sessions' own buffers and shared prefix segments."""
        return self._own_bytes + (self.prefix.nbytes if self.prefix is not None else 0)

    @property
    def compiled(self) -> bool:
        """Whether the forward pass runs compiled (`warm_up` compiles it)."""
        return self._packed is not None and self._packed.compiled is not None

    def warm_up(self) -> float:
        """Measure what the forward pass measures at start (`linear_rows="auto"`) and compile it, if it
        is compiled (at service start: no request pays a compile); the seconds compiling took."""
        with self._lock:
            return self._packed.warm_up() if self._packed is not None else 0.0

    def covered(self, session_id: str, history: list[int]) -> int:
        """Tokens of `history` whose keys/values are at hand for the session: its own cache's, or
        for a new session the shared prefix blocks it would view (a session with a snapshot store
        and no cache counts as covered: its restore, if any, needs the whole history at once)."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is not None:
                return common_prefix_length(entry.tokens, history)
            if self.snapshots is not None:
                return len(history)
            return self.prefix.match(history, count=False).length if self.prefix is not None else 0

    # -- scoring ----------------------------------------------------------------------------

    def score(self, session_id: str, history: list[int], new_tokens: list[int]) -> tuple[torch.Tensor, int]:
        """Logits `[len(new_tokens) + 1, V]` for the positions after history[-1] and each new token.

        Row i is the model's next-token distribution after `history + new_tokens[:i]`. Returns
        the logits and how many history tokens had to be (re-)prefilled beyond the last one.
        Afterwards the cache covers `history + new_tokens`.
        """
        result = self.score_batch([ScoreRequest(session_id, history, new_tokens)])[0]
        if isinstance(result, Exception):
            raise result
        return result.logits, result.prefilled

    def score_batch(self, requests: Sequence[ScoreRequest]) -> list[Scored | Exception]:
        """`score` for several sessions (distinct ids) in one forward pass; one result per request.

        A request with bad input gets its own `InvalidArgument` and takes no part in the pass;
        a failing forward fails every row of the pass (their caches are forgotten, to be rebuilt
        from the history next time).
        """
        ids = [r.session_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a batch holds each session at most once, got {ids}")
        results: list[Scored | Exception | None] = [None] * len(requests)
        with self._lock:
            self._evict_idle()
            rows: list[tuple[int, _Row]] = []
            pinned: set[str] = set()  # sessions of this pass: never evicted to make room for another
            for i, request in enumerate(requests):
                pinned.add(request.session_id)
                try:
                    rows.append((i, self._prepare(request, pinned)))
                except (InvalidArgument, ResourceExhausted) as exc:
                    results[i] = exc
            try:
                with torch.inference_mode():
                    scored = self._forward([row for _, row in rows])
            except Exception:
                for _, row in rows:
                    self._remove(row.request.session_id)
                raise
            now = time.monotonic()
            for (i, row), logits in zip(rows, scored):
                self._extend(row.entry, row.feed)
                row.entry.last_used = now
                self._entries.move_to_end(row.request.session_id)
                results[i] = Scored(logits, len(row.request.history) - 1 - row.keep)
                if self.prefix is not None and len(row.feed) > PUBLISH_ABOVE:
                    self._publish(row.entry, row.request.history, pinned)
            while len(self._entries) > self.max_sessions:
                self._remove(next(iter(self._entries)))
        return results  # type: ignore[return-value]

    def _prepare(self, request: ScoreRequest, pinned: set[str]) -> _Row:
        """Validate, find or create the entry, cut it back to the common prefix, make room for
        what it will hold; what to feed. `pinned`: sessions not to evict for room."""
        history, new_tokens = request.history, request.new_tokens
        if not history:
            raise InvalidArgument("history is empty: send at least one token (the prompt)")
        total = len(history) + len(new_tokens)
        if total > self.max_context:
            raise InvalidArgument(
                f"context of {total} tokens exceeds the model's limit of {self.max_context}; "
                "shorten the prompt or lower max_new_tokens"
            )
        entry = self._entries.get(request.session_id)
        needed = history[:-1]  # the cache must cover these before we feed history[-1]
        keep = common_prefix_length(entry.tokens, needed) if entry is not None else 0
        feed = history[keep:] + new_tokens
        # Only tokens not already in the cache reach the model (the rest were checked when fed).
        top = max(feed)
        if top >= self.vocab_size:
            raise InvalidArgument(f"token id {top} is outside the vocabulary (size {self.vocab_size})")
        if entry is not None and keep < entry.cache.offset:  # diverged inside its shared prefix
            self._remove(request.session_id)
            entry = None
        created = entry is None
        if entry is None:
            entry = self._restore(request.session_id, needed) or self._shared(needed)
            self._entries[request.session_id] = entry
            self._own_bytes += entry.cache.nbytes
            keep = common_prefix_length(entry.tokens, needed)
            feed = history[keep:] + new_tokens
        self._crop(entry, keep)
        try:
            self._reserve(entry, keep + len(feed), pinned)
        except ResourceExhausted:
            if created:  # nothing of a refused new session stays behind
                self._remove(request.session_id)
            raise
        return _Row(request, entry, feed, keep)

    def _shared(self, needed: list[int]) -> _Entry:
        """A new entry starting with the shared prefix blocks of `needed`, if any."""
        prefix = self.prefix
        match = prefix.match(needed) if prefix is not None else NO_MATCH
        store = self.prefix_store
        whole = len(needed) // prefix.block_tokens * prefix.block_tokens if prefix is not None else 0
        if store is not None and whole - match.length >= store.min_tokens:
            match = self._fetch(needed, match, store)
        if prefix is None or not match.length:
            return _Entry(tokens=[], cache=self._new_cache())
        prefix.acquire(match)
        entry = _Entry(tokens=needed[: match.length], cache=self._new_cache(prefix=match.views(prefix.block_tokens)),
                       prefix=match)
        self._tokens += match.length
        return entry

    def _fetch(self, needed: list[int], match: Match, store: RedisPrefixStore) -> Match:
        """Extend a local prefix match with the blocks other replicas published to Redis, if that
        covers at least `store.min_tokens` more tokens; registered locally as if computed here."""
        prefix = self.prefix
        assert prefix is not None
        block = prefix.block_tokens
        names = [name for _, name in prefix.chain(needed, match)]
        try:
            runs = store.lookup(names)
            if sum(run.blocks for run in runs) * block < store.min_tokens:
                return match
            for run in runs:
                start = match.length
                data = store.fetch(run, block, needed[start : start + run.blocks * block])
                if data is None:
                    break
                if not self._make_room(data.numel() * data.element_size(), set()):
                    break
                match = prefix.publish(needed, match, data.to(self.device))
                store.fetches += 1
                store.fetched_tokens += run.blocks * block
        except Exception as exc:  # noqa: BLE001 - a fetch is an optimisation: what is missing gets prefilled
            log.warning("shared prefix not fetched from Redis (%s); prefilling it", exc)
        return match

    # -- memory ---------------------------------------------------------------------------------

    def _reserve(self, entry: _Entry, length: int, pinned: set[str]) -> None:
        """Make the entry's own buffer hold `length` positions within the budget (a new entry's
        first buffer included): the usual doubling if it fits, else just what is needed, evicting
        for room; ResourceExhausted if even that does not fit."""
        cache = entry.cache
        want = cache.grown_capacity(length)
        need = max(length - cache.offset, cache.capacity)
        if self.used_bytes + cache.bytes_for(want) - cache.nbytes > self.budget_bytes:
            if not self._make_room(cache.bytes_for(need) - cache.nbytes, pinned):
                raise ResourceExhausted(
                    f"KV cache full: this session's {length} positions need {cache.bytes_for(need)} bytes, "
                    f"{self.used_bytes - cache.nbytes} of the {self.budget_bytes}-byte budget are held by the "
                    "sessions of this pass and the shared prefixes they use; retry later, or raise the budget "
                    "(--kv-cache-bytes)")
            free = self.budget_bytes - self.used_bytes + cache.nbytes  # for this entry's buffer
            want = max(need, min(want, free // max(1, cache.bytes_for(1))))
        if want > cache.capacity:
            before = cache.nbytes
            cache.reserve(length, want)
            self._own_bytes += cache.nbytes - before

    def _make_room(self, need: int, pinned: set[str]) -> bool:
        """Evict until `need` more bytes fit the budget, if possible: unused prefix segments first,
        then idle sessions (not `pinned`), least recently used first. Whether they fit now."""
        if self.prefix is not None:
            for seg in self.prefix.idle():
                if self.used_bytes + need <= self.budget_bytes:
                    return True
                self.prefix.evict(seg)
        for sid in list(self._entries):
            if self.used_bytes + need <= self.budget_bytes:
                return True
            if sid in pinned:
                continue
            self._evict(sid)
        return self.used_bytes + need <= self.budget_bytes

    def _evict(self, session_id: str) -> None:
        """Drop a session's cache for room, snapshotting it first when snapshots are configured."""
        entry = self._entries.get(session_id)
        policy = self.snapshots
        if entry is not None and policy is not None and len(entry.tokens) >= policy.min_tokens:
            try:
                layers = [(layer.keys, layer.values) for layer in entry.cache.layers]
                policy.store.put(session_id, encode_layers(layers, entry.tokens, policy.identity), len(entry.tokens))
                policy.saves += 1
            except Exception as exc:  # noqa: BLE001 - the session re-prefills instead
                log.warning("snapshot of evicted session %s not saved (%s)", session_id, exc)
        self._remove(session_id)
        self.evictions += 1

    def _publish(self, entry: _Entry, history: list[int], pinned: set[str]) -> None:
        """Share the whole blocks of `history` the entry holds beyond its prefix: take those another
        session published meanwhile, publish the rest (one copy into the prefix cache), and keep
        only the tail in the entry's own buffer. Not when that does not fit the budget (after
        evicting for it): the session then keeps its own copy."""
        prefix = self.prefix
        assert prefix is not None
        block = prefix.block_tokens
        aligned = min(len(history), len(entry.tokens)) // block * block
        if aligned < entry.cache.offset + block:
            return
        tokens = history[:aligned]
        found = prefix.match(tokens, count=False)
        assert found.length >= entry.prefix.length  # the entry's own chain is registered
        cache = entry.cache
        extra = cache.bytes_for(aligned - found.length + cache.rebased_capacity(aligned)) - cache.nbytes
        if not self._make_room(extra, pinned):
            return
        match = found
        if found.length < aligned:
            with torch.inference_mode(False):  # storage of its own, usable by any later pass
                data = entry.cache.own(found.length, aligned).clone()
            match = prefix.publish(tokens, found, data)
            if self.prefix_store is not None:
                self.prefix_store.upload(match.runs[-1][0].names, tokens[found.length:], data)
        before = entry.cache.nbytes
        prefix.acquire(match)
        prefix.release(entry.prefix)
        entry.prefix = match
        entry.cache.rebase(match.views(block))
        self._own_bytes += entry.cache.nbytes - before

    def _forward(self, rows: list[_Row]) -> list[torch.Tensor]:
        """Feed every row's tokens into its cache; each row's last `len(new_tokens) + 1` logits."""
        if not rows:
            return []
        packed = [PackedRow(row.entry.cache, row.feed, len(row.request.new_tokens) + 1) for row in rows]
        if self._packed is not None:
            return [logits.clone() for logits in self._packed(packed)]  # not views of one pass's tensor
        return [forward_generic(self.model, row) for row in packed]

    def _new_cache(self, capacity: int | None = None, prefix: tuple[torch.Tensor, ...] = ()) -> SessionKV:
        layers, kv_heads, head_dim = kv_geometry(self.model)
        return SessionKV(layers, kv_heads, head_dim, self.max_context, self.dtype, self.device,
                         prefix=prefix, **({} if capacity is None else {"capacity": capacity}))

    # -- snapshots ----------------------------------------------------------------------------

    def snapshot(self, session_id: str) -> tuple[int, bytes]:
        """The session's cache as a snapshot blob and the tokens it covers; (0, b"") if there is
        no cache or it is shorter than worth restoring. Writing it is `self.snapshots.store.put`."""
        if self.snapshots is None:
            raise FailedPrecondition("this service runs without a snapshot store (--snapshot-redis-url)")
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None or len(entry.tokens) < self.snapshots.min_tokens:
                return 0, b""
            layers = [(layer.keys, layer.values) for layer in entry.cache.layers]
            return len(entry.tokens), encode_layers(layers, entry.tokens, self.snapshots.identity)

    def _restore(self, session_id: str, needed: list[int]) -> _Entry | None:
        """On a cache miss, the session's snapshot if it covers enough of `needed` to beat a prefill."""
        policy = self.snapshots
        if policy is None or len(needed) < policy.min_tokens:
            return None
        try:
            if policy.store.tokens(session_id) < policy.min_tokens:
                return None
            blob = policy.store.get(session_id)
            if blob is None:
                return None
            tokens, layers = decode_layers(blob, policy.identity)
            if common_prefix_length(tokens, needed) < policy.min_tokens:
                return None
            cache = self._new_cache(capacity=len(tokens))
            cache.load(layers, len(tokens))
        except Exception as exc:  # noqa: BLE001 - a snapshot is an optimisation: fall back to prefill
            log.warning("snapshot of %s not restored (%s); re-prefilling", session_id, exc)
            return None
        policy.restores += 1
        entry = _Entry(tokens=tokens, cache=cache)
        self._tokens += len(tokens)
        return entry

    # -- bookkeeping ------------------------------------------------------------------------

    def rollback(self, session_id: str, length: int) -> int:
        """Cut a session's cache back to its first `length` tokens; returns what it now covers."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                return 0
            self._crop(entry, length)
            return len(entry.tokens)

    def release(self, session_id: str) -> bool:
        with self._lock:
            return self._remove(session_id)

    def _crop(self, entry: _Entry, length: int) -> None:
        if length < len(entry.tokens):
            if length < entry.cache.offset:  # into the shared prefix: start over without it
                if self.prefix is not None:
                    self.prefix.release(entry.prefix)
                entry.prefix = NO_MATCH
                self._own_bytes -= entry.cache.nbytes
                entry.cache = self._new_cache()
                self._own_bytes += entry.cache.nbytes
                length = 0
            entry.cache.crop(length)
            self._tokens -= len(entry.tokens) - length
            del entry.tokens[length:]

    def _extend(self, entry: _Entry, tokens: list[int]) -> None:
        entry.tokens.extend(tokens)
        self._tokens += len(tokens)

    def _remove(self, session_id: str) -> bool:
        entry = self._entries.pop(session_id, None)
        if entry is None:
            return False
        self._tokens -= len(entry.tokens)
        self._own_bytes -= entry.cache.nbytes
        if self.prefix is not None:
            self.prefix.release(entry.prefix)
        return True

    def _evict_idle(self) -> None:
        cutoff = time.monotonic() - self.idle_ttl_s
        while self._entries:
            sid, entry = next(iter(self._entries.items()))
            if entry.last_used >= cutoff:
                break
            self._remove(sid)
