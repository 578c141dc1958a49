"""The per-session KV caches of one model: which sessions are held, what they hold, and the memory
budget every byte of keys/values counts against.

A session's entry records the exact tokens its cache covers; its keys/values live in one
`kv_buffer.SessionKV`, possibly starting with views of shared prefix segments
(`prefix_cache.PrefixCache`). The table keeps the sessions in LRU order and bounds them three
ways: `max_sessions`, `idle_ttl_s`, and `budget_bytes` over the sessions' own buffers and the
prefix segments together. When a pass needs more room, prefix segments no session uses go
first, then idle sessions, least recently used first; a session being prepared for the pass is
never evicted for another (`pinned`). An evicted session is handed to `on_evict` (a background
snapshot writer) after it has left the table.

The table does no I/O: what other replicas or snapshots hold reaches it already fetched and
decoded (`cache_sources`), and it only installs it. Thread safety: none; its owner
(`kv.SessionCaches`) holds a lock around every call.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specdec.errors import ResourceExhausted
from specdec.runtime.kv_buffer import SessionKV
from specdec.runtime.prefix_cache import NO_MATCH, Match, PrefixCache
from specdec.runtime.prefix_store import FetchedRun

NewCache = Callable[..., SessionKV]
"""`(capacity=None, prefix=()) -> SessionKV`: an empty buffer of the model's geometry."""


@dataclass
class Entry:
    """One session's cache and the tokens whose keys/values it holds, in order."""

    tokens: list[int]
    cache: SessionKV
    last_used: float = field(default_factory=time.monotonic)
    prefix: Match = NO_MATCH  # the shared prefix blocks the cache views (cache.offset positions)


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


class CacheTable:
    """Sessions' entries in LRU order, bounded by count, idle time and bytes (see the module docstring)."""

    def __init__(self, new_cache: NewCache, budget_bytes: int, max_sessions: int = 64, idle_ttl_s: float = 900.0,
                 prefix: PrefixCache | None = None, device: torch.device | str = "cpu") -> None:
        """`new_cache`: makes an empty buffer of the model's geometry; `device`: where the model's
        keys/values live (fetched ones are copied there)."""
        self.new_cache = new_cache
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self.prefix = prefix
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.tokens = 0  # sum of len(entry.tokens) over the entries; readable without the lock
        self.own_bytes = 0  # bytes of the sessions' own buffers
        self.evictions = 0  # sessions evicted to make room under the budget
        self.on_evict: Callable[[str, Entry], None] | None = None  # given each evicted session after it left
        self.on_publish: Callable[[list[bytes], list[int], torch.Tensor, int, bytes], None] | None = None
        """Given each segment `publish` adds: its block names, tokens and keys/values (never changed after),
        its first position and the name of the block before it (b"" at position 0)."""
        self.on_adopt: Callable[[int], None] | None = None  # given the tokens of each fetched run `start` adopts

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def used_bytes(self) -> int:
        """Bytes of keys/values held: sessions' own buffers and shared prefix segments."""
        return self.own_bytes + (self.prefix.nbytes if self.prefix is not None else 0)

    # -- entries ---------------------------------------------------------------------------------

    def add(self, session_id: str, entry: Entry) -> None:
        self.entries[session_id] = entry
        self.own_bytes += entry.cache.nbytes

    def touch(self, session_id: str, now: float) -> None:
        self.entries[session_id].last_used = now
        self.entries.move_to_end(session_id)

    def start(self, needed: list[int], fetched: Sequence[FetchedRun] = ()) -> Entry:
        """A new entry (not yet added) starting with the shared prefix blocks of `needed`: those held
        here, extended by the `fetched` runs (registered in the prefix cache as if computed here)."""
        prefix = self.prefix
        if prefix is None:
            return Entry(tokens=[], cache=self.new_cache())
        match = prefix.match(needed)
        if fetched:
            match = self._adopt(needed, match, list(fetched))
        else:
            prefix.acquire(match)
        if not match.length:
            return Entry(tokens=[], cache=self.new_cache())
        self.tokens += match.length
        return Entry(tokens=needed[: match.length], cache=self.new_cache(prefix=match.views(prefix.block_tokens)),
                     prefix=match)

    def _adopt(self, needed: list[int], match: Match, fetched: list[FetchedRun]) -> Match:
        """Register the fetched runs that continue `match` and fit the budget; the match of the
        whole, acquired (so that making room for one run never evicts the blocks it extends)."""
        prefix = self.prefix
        assert prefix is not None
        prefix.acquire(match)
        for run in fetched:
            if run.end <= match.length:
                continue  # computed here meanwhile
            if run.start > match.length or needed[run.start : run.end] != run.tokens:
                break  # a gap (evicted meanwhile), or another history
            data = run.data(skip=match.length - run.start).to(self.device)
            if not self.make_room(data.numel() * data.element_size(), set()):
                break
            grown = prefix.publish(needed, match, data)
            prefix.acquire(grown)
            prefix.release(match)
            match = grown
            if self.on_adopt is not None:
                self.on_adopt(data.shape[3])
        return match

    def restored(self, tokens: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Entry:
        """A new entry (not yet added) holding a restored snapshot: per layer `[1, H, len(tokens), D]`."""
        cache = self.new_cache(capacity=len(tokens))
        cache.load(layers, len(tokens))
        self.tokens += len(tokens)
        return Entry(tokens=list(tokens), cache=cache)

    def crop(self, entry: Entry, length: int) -> None:
        """Cut an entry back to its first `length` tokens (into its shared prefix: start it over without it)."""
        if length >= len(entry.tokens):
            return
        if length < entry.cache.offset:
            if self.prefix is not None:
                self.prefix.release(entry.prefix)
            entry.prefix = NO_MATCH
            self.own_bytes -= entry.cache.nbytes
            entry.cache = self.new_cache()
            self.own_bytes += entry.cache.nbytes
            length = 0
        entry.cache.crop(length)
        self.tokens -= len(entry.tokens) - length
        del entry.tokens[length:]

    def extend(self, entry: Entry, tokens: list[int]) -> None:
        entry.tokens.extend(tokens)
        self.tokens += len(tokens)

    def remove(self, session_id: str) -> Entry | None:
        """Forget a session's entry (its prefix blocks released); the entry, or None if there was none."""
        entry = self.entries.pop(session_id, None)
        if entry is None:
            return None
        self.tokens -= len(entry.tokens)
        self.own_bytes -= entry.cache.nbytes
        if self.prefix is not None:
            self.prefix.release(entry.prefix)
        return entry

    def evict_idle(self) -> None:
        """Forget sessions unused for `idle_ttl_s`."""
        cutoff = time.monotonic() - self.idle_ttl_s
        while self.entries:
            sid, entry = next(iter(self.entries.items()))
            if entry.last_used >= cutoff:
                break
            self.remove(sid)

    def trim(self) -> None:
        """Forget the least recently used sessions beyond `max_sessions`."""
        while len(self.entries) > self.max_sessions:
            self.remove(next(iter(self.entries)))

    # -- memory ----------------------------------------------------------------------------------

    def reserve(self, entry: Entry, length: int, pinned: set[str]) -> None:
        """Make the entry's own buffer hold `length` positions within the budget (a new entry's
        first buffer included): the usual doubling if it fits, else just what is needed, evicting
        for room; ResourceExhausted if even that does not fit."""
        cache = entry.cache
        want = cache.grown_capacity(length)
        need = max(length - cache.offset, cache.capacity)
        if self.used_bytes + cache.bytes_for(want) - cache.nbytes > self.budget_bytes:
            if not self.make_room(cache.bytes_for(need) - cache.nbytes, pinned):
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
            self.own_bytes += cache.nbytes - before

    def make_room(self, need: int, pinned: set[str]) -> bool:
        """Evict until `need` more bytes fit the budget, if possible: unused prefix segments first,
        then idle sessions (not `pinned`), least recently used first. Whether they fit now."""
        if self.prefix is not None:
            for seg in self.prefix.idle():
                if self.used_bytes + need <= self.budget_bytes:
                    return True
                self.prefix.evict(seg)
        for sid in list(self.entries):
            if self.used_bytes + need <= self.budget_bytes:
                return True
            if sid not in pinned:
                self.evict(sid)
        return self.used_bytes + need <= self.budget_bytes

    def evict(self, session_id: str) -> None:
        """Drop a session's cache for room; `on_evict` gets it once it has left."""
        entry = self.remove(session_id)
        self.evictions += 1
        if entry is not None and self.on_evict is not None:
            self.on_evict(session_id, entry)

    # -- sharing ---------------------------------------------------------------------------------

    def publish(self, entry: Entry, history: list[int], pinned: set[str]) -> None:
        """Share the whole blocks of `history` the entry holds beyond its prefix: take those another
        session published meanwhile, publish the rest (one copy into the prefix cache, handed to
        `on_publish`), and keep only the tail in the entry's own buffer. Not when that does not fit
        the budget (after evicting for it): the session then keeps its own copy."""
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
        if not self.make_room(extra, pinned):
            return
        match = found
        if found.length < aligned:
            with torch.inference_mode(False):  # storage of its own, usable by any later pass
                data = cache.own(found.length, aligned).clone()
            match = prefix.publish(tokens, found, data)
            if self.on_publish is not None:
                self.on_publish(match.runs[-1][0].names, tokens[found.length:], data, found.length, found.name)
        before = cache.nbytes
        prefix.acquire(match)
        prefix.release(entry.prefix)
        entry.prefix = match
        cache.rebase(match.views(block))
        self.own_bytes += cache.nbytes - before
