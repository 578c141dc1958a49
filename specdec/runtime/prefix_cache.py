"""Keys and values of token prefixes, computed once and shared by reference between sessions.

Content addressing: a session's tokens are cut into blocks of `block_tokens`; block i is named
by a hash of its tokens and of block i - 1's name, so a name stands for the block's tokens AND
everything before them, i.e. for the exact keys/values the block's positions have (keys are
stored after the rotary embedding: they depend on the position, which the chain fixes). Only
full blocks are shared; a session's partial last block stays in its own buffer.

Storage: a `Segment` holds consecutive blocks published together (one session's prompt, or the
part of it no other session had published), contiguously, `[2, layers, kv_heads, n, head_dim]`.
A session that finds its first m blocks here takes views of the segments holding them as the
prefix of its `SessionKV` (no copy) and computes only the rest. Each registered block is
published once: a session that publishes first re-matches (another session may have published
the same blocks in the same pass) and takes what is there, so a block's predecessors are always
registered and every session viewing a segment views its whole chain. Hence a segment no session
references has no referenced descendants either, and evicting it (least recently used first,
under the owner's memory budget) unregisters its descendants' blocks, which could no longer be
reached by a match.

Why segments, not one tensor per block (paged attention): attention on the CPU runs one matmul
per segment and layer (`attention.attend`), so the number of segments a session reads must stay
small: one per prompt that added to the chain, not one per 32 tokens.

Thread safety: none for changes; the owner (`cache_table.CacheTable`, under `kv.SessionCaches`'
lock) makes every one. `match(..., count=False)` may also run on another thread without that lock
(`cache_sources` does, to decide what to fetch): it reads the block index with single dict
lookups, and a stale answer only makes a fetch larger or smaller.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

DEFAULT_BLOCK_TOKENS = 32
"""Tokens per block: the granularity of sharing (a shorter common prefix is not shared)."""


def block_name(previous: bytes, block: list[int]) -> bytes:
    """The name of a block of tokens after the block named `previous` (b"" for the first block)."""
    return hashlib.blake2b(previous + array("q", block).tobytes(), digest_size=16).digest()


def block_names(previous: bytes, tokens: list[int], block_tokens: int) -> list[bytes]:
    """The names of `tokens`' whole blocks, the first one after the block named `previous`."""
    names = []
    for i in range(len(tokens) // block_tokens):
        previous = block_name(previous, tokens[i * block_tokens : (i + 1) * block_tokens])
        names.append(previous)
    return names


@dataclass(eq=False)
class Segment:
    """Consecutive blocks published together: their keys/values, their names, who uses them."""

    data: torch.Tensor  # [2, layers, kv_heads, blocks * block_tokens, head_dim]
    start: int  # absolute position of the first token
    names: list[bytes]  # block names, in order
    parent: Segment | None  # the segment holding the block before `start` (None at position 0)
    refs: int = 0  # sessions viewing some of it
    last_used: float = field(default_factory=time.monotonic)
    children: list[Segment] = field(default_factory=list)
    live: bool = True  # False once evicted: its blocks are no longer registered

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(frozen=True)
class Match:
    """Where a token sequence's leading blocks lie: `(segment, first block, blocks)` runs in order."""

    runs: tuple[tuple[Segment, int, int], ...]
    length: int  # positions covered (a multiple of block_tokens)
    name: bytes  # name of the last matched block (b"" when nothing matched)

    def views(self, block_tokens: int) -> tuple[torch.Tensor, ...]:
        """The runs as views of their segments' storage, `[2, layers, kv_heads, n, head_dim]` each."""
        return tuple(seg.data[:, :, :, first * block_tokens : (first + n) * block_tokens]
                     for seg, first, n in self.runs)

    @property
    def segments(self) -> list[Segment]:
        out: list[Segment] = []
        for seg, _, _ in self.runs:
            if not out or out[-1] is not seg:
                out.append(seg)
        return out


NO_MATCH = Match((), 0, b"")


class PrefixCache:
    """Shared prefix blocks of one model (see the module docstring)."""

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._blocks: dict[bytes, tuple[Segment, int]] = {}  # name -> (segment, block index in it)
        self._segments: list[Segment] = []
        self.nbytes = 0
        self.queries = 0  # tokens looked up (as vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens found (prefix_cache_hits)

    # -- naming ---------------------------------------------------------------------------------

    def name(self, previous: bytes, block: list[int]) -> bytes:
        return block_name(previous, block)

    def _names(self, tokens: list[int], start_block: int = 0, previous: bytes = b"") -> Iterator[tuple[int, bytes]]:
        b = self.block_tokens
        for i in range(start_block, len(tokens) // b):
            previous = self.name(previous, tokens[i * b : (i + 1) * b])
            yield i, previous

    def chain(self, tokens: list[int], after: Match) -> Iterator[tuple[int, bytes]]:
        """(block index, name) of `tokens`' whole blocks after those `after` matched."""
        return self._names(tokens, after.length // self.block_tokens, after.name)

    # -- lookup -----------------------------------------------------------------------------------

    def match(self, tokens: list[int], count: bool = True) -> Match:
        """The longest run of `tokens`' leading full blocks held here (`count`: into queries/hits)."""
        runs: list[tuple[Segment, int, int]] = []
        name = b""
        for _, block_name in self._names(tokens):
            found = self._blocks.get(block_name)
            if found is None:
                break
            seg, index = found
            if runs and runs[-1][0] is seg and runs[-1][1] + runs[-1][2] == index:
                runs[-1] = (seg, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((seg, index, 1))
            name = block_name
        length = sum(n for _, _, n in runs) * self.block_tokens
        if count:
            self.queries += len(tokens)
            self.hits += length
        return Match(tuple(runs), length, name)

    # -- references -------------------------------------------------------------------------------

    def acquire(self, match: Match) -> None:
        now = time.monotonic()
        for seg in match.segments:
            seg.refs += 1
            seg.last_used = now

    def release(self, match: Match) -> None:
        now = time.monotonic()
        for seg in match.segments:
            seg.refs -= 1
            seg.last_used = now
            if seg.refs == 0 and not seg.live:
                self._free(seg)

    # -- publishing -------------------------------------------------------------------------------

    def publish(self, tokens: list[int], after: Match, data: torch.Tensor) -> Match:
        """Register `data` (keys/values of `tokens[after.length : after.length + n]`, n a multiple
        of the block size; a tensor this cache now owns) after the blocks `after` matched; the
        match of the whole. Blocks named already (published meanwhile) are not registered again."""
        b = self.block_tokens
        n = data.shape[3]
        if n % b or n == 0 or after.length + n > len(tokens):
            raise ValueError(f"{n} positions after {after.length} are not whole blocks of {len(tokens)} tokens")
        parent = after.runs[-1][0] if after.runs else None
        seg = Segment(data, after.length, [], parent)
        for i, name in self._names(tokens[: after.length + n], after.length // b, after.name):
            seg.names.append(name)
            self._blocks.setdefault(name, (seg, i - after.length // b))
        if parent is not None:
            parent.children.append(seg)
        self._segments.append(seg)
        self.nbytes += seg.nbytes
        return Match(after.runs + ((seg, 0, n // b),), after.length + n, seg.names[-1])

    # -- eviction ---------------------------------------------------------------------------------

    def idle(self) -> list[Segment]:
        """Registered segments no session references, least recently used first."""
        return sorted((s for s in self._segments if s.refs == 0 and s.live), key=lambda s: s.last_used)

    def evict(self, seg: Segment) -> int:
        """Unregister `seg` and its descendants, freeing those no session references; bytes freed."""
        before = self.nbytes
        stack = [seg]
        while stack:
            one = stack.pop()
            if not one.live:
                continue
            one.live = False
            for name in one.names:
                if self._blocks.get(name, (None, 0))[0] is one:
                    del self._blocks[name]
            stack.extend(one.children)
            if one.refs == 0:
                self._free(one)
        return before - self.nbytes

    def _free(self, seg: Segment) -> None:
        if seg in self._segments:
            self._segments.remove(seg)
            self.nbytes -= seg.nbytes
            if seg.parent is not None and seg in seg.parent.children:
                seg.parent.children.remove(seg)

    # -- figures ----------------------------------------------------------------------------------

    @property
    def blocks(self) -> int:
        """Blocks registered (reachable by a match)."""
        return len(self._blocks)

    @property
    def shared_blocks(self) -> int:
        """Registered blocks of segments that two or more sessions view at once."""
        return sum(len(s.names) for s in self._segments if s.live and s.refs >= 2)
