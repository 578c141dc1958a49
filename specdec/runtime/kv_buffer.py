"""One session's keys and values for every layer, appended in place.

Storage: one buffer per session, `[2, layers, kv_heads, capacity, head_dim]` (keys, then values),
of which the first `length` positions are valid. Appending writes into the buffer; rolling back
after a rejection only moves `length`; nothing copies a session's past on a round. When an
append would overflow, the capacity doubles (capped at the model's context limit) and the valid
part is copied once, so each token is copied about once over a session's life (amortised O(1)).

Why per-session buffers and not blocks from a shared pool (paged attention): attention on the
CPU reads a session's keys as ONE strided view `[kv_heads, length, head_dim]` of its buffer (the
capacity only changes the stride), which a matmul consumes in place. Blocks would have to be
gathered into such a view each pass (a copy of the past, the cost this module removes) or
attended block by block with an online softmax (a Python loop per block, per layer, per session).
What blocks buy (no over-allocation, sharing of common prefixes) matters for a GPU's fixed memory;
here the worst case of doubling is 2x one session's need, paid only by growing sessions.

Shared prefixes: a session may begin with positions held by the prefix cache
(`specdec.runtime.prefix_cache`), shared by reference with other sessions. Those come first, as
read-only views `[2, layers, kv_heads, n, head_dim]` (`prefix`), and the session's own buffer holds
the positions from `offset` (their total) on. Every position argument here is absolute (0 is the
first token of the session); attention reads a session as its list of `segments`, never a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_CAPACITY = 64
"""Positions a new session's buffer holds at first (fewer if the context limit is lower)."""


@dataclass(frozen=True)
class KVLayer:
    """A layer's valid keys and values `[1, kv_heads, length, head_dim]` (views: for snapshots)."""

    keys: torch.Tensor
    values: torch.Tensor


class SessionKV:
    """Keys and values of one session, all layers, in one buffer written in place."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_length: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int = MIN_CAPACITY,
                 prefix: Sequence[torch.Tensor] = ()) -> None:
        self.max_length = max_length
        self.prefix = tuple(prefix)  # shared read-only views [2, layers, kv_heads, n, head_dim], in order
        self.offset = sum(view.shape[3] for view in self.prefix)  # positions the prefix holds
        if self.offset > max_length:
            raise ValueError(f"a prefix of {self.offset} positions exceeds the session's limit of {max_length}")
        self.length = self.offset  # positions whose keys/values are valid (prefix included)
        capacity = max(1, min(capacity, max_length - self.offset))
        with torch.inference_mode(False):  # a normal tensor wherever it is made: writable in and out of inference mode
            self.data = torch.empty((2, layers, kv_heads, capacity, head_dim), dtype=dtype, device=device)
        self._check_views(self.prefix)

    def _check_views(self, views: Sequence[torch.Tensor]) -> None:
        """Shared prefix views must be keys/values of this session's kind: `[2, layers, kv_heads, n,
        head_dim]` of its dtype, on its device, with a contiguous head_dim. Attention reads them with
        the session's geometry (the native kernel through raw pointers), so one of another shape or
        dtype (a prefix segment that came from Redis) is refused before it joins."""
        two, layers, heads, _, dim = self.data.shape
        for view in views:
            if view.ndim != 5 or view.shape[:3] != (two, layers, heads) or view.shape[4] != dim \
                    or view.dtype != self.data.dtype or view.device != self.data.device or view.stride(4) != 1:
                raise ValueError(f"a shared prefix view {view.dtype} {tuple(view.shape)} on {view.device} does not "
                                 f"hold keys/values [2, {layers}, {heads}, n, {dim}] {self.data.dtype} on "
                                 f"{self.data.device}")

    @property
    def capacity(self) -> int:
        """Positions the session's own buffer holds (after the prefix)."""
        return self.data.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes of the session's own buffer (the shared prefix is the prefix cache's)."""
        return self.data.numel() * self.data.element_size()

    def bytes_for(self, capacity: int) -> int:
        """Bytes of an own buffer of `capacity` positions."""
        return self.nbytes // max(1, self.capacity) * capacity

    def grown_capacity(self, length: int) -> int:
        """The own capacity `reserve(length)` grows to by default (doubling, capped at the limit)."""
        need = length - self.offset
        if need <= self.capacity:
            return self.capacity
        return min(max(need, 2 * self.capacity), self.max_length - self.offset)

    def reserve(self, length: int, capacity: int | None = None) -> None:
        """Make room for `length` positions: the own buffer grows to `capacity` positions (default
        `grown_capacity`, doubling), and its valid part is copied once per growth."""
        if length - self.offset <= self.capacity:
            return
        if length > self.max_length:
            raise ValueError(f"{length} positions exceed the session's limit of {self.max_length}")
        capacity = self.grown_capacity(length) if capacity is None else max(capacity, length - self.offset)
        two, layers, heads, _, dim = self.data.shape
        own = self.length - self.offset
        with torch.inference_mode(False):  # see __init__
            grown = self.data.new_empty((two, layers, heads, capacity, dim))
            grown[:, :, :, :own] = self.data[:, :, :, :own]
        self.data = grown

    def crop(self, length: int) -> None:
        """Forget every position from `length` on (a rollback: nothing moves). The shared prefix
        cannot be cut into: a caller that needs fewer positions starts a new `SessionKV`."""
        length = max(0, length)
        if length < self.offset:
            raise ValueError(f"cannot cut a session back to {length} positions inside its shared prefix "
                             f"of {self.offset}")
        self.length = min(length, self.length)

    def keys(self, layer: int, end: int) -> torch.Tensor:
        """`[kv_heads, end - offset, head_dim]`: the own buffer's keys up to position `end` (a view)."""
        return self.data[0, layer, :, : end - self.offset]

    def values(self, layer: int, end: int) -> torch.Tensor:
        """`[kv_heads, end - offset, head_dim]`: the own buffer's values up to position `end` (a view)."""
        return self.data[1, layer, :, : end - self.offset]

    def segments(self, layer: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values `[kv_heads, n, head_dim]` of positions 0 .. end - 1 of `layer`, as the
        views they lie in: each shared prefix segment, then the own buffer (no copies)."""
        out = [(view[0, layer], view[1, layer]) for view in self.prefix]
        out.append((self.keys(layer, end), self.values(layer, end)))
        return out

    def joined(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0 .. end - 1 as single tensors: a view without a prefix,
        else a copy (for snapshots and the generic fallback path, not for a pass)."""
        parts = self.segments(layer, end)
        if len(parts) == 1:
            return parts[0]
        return torch.cat([k for k, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store `[kv_heads, n, head_dim]` keys/values at positions start .. start + n - 1 (in place)."""
        n, start = keys.shape[1], start - self.offset
        if start < 0:
            raise ValueError(f"position {start + self.offset} lies in the shared prefix (read-only)")
        self.data[0, layer, :, start : start + n] = keys
        self.data[1, layer, :, start : start + n] = values

    def own(self, start: int, end: int) -> torch.Tensor:
        """`[2, layers, kv_heads, end - start, head_dim]`: positions start .. end - 1 of the own buffer (a view)."""
        if not self.offset <= start <= end <= self.length:
            raise ValueError(f"positions {start}..{end} are not in the own buffer ({self.offset}..{self.length})")
        return self.data[:, :, :, start - self.offset : end - self.offset]

    def rebased_capacity(self, offset: int) -> int:
        """The own capacity `rebase` to a prefix of `offset` positions gives."""
        return max(1, min(max(MIN_CAPACITY, 2 * (self.length - offset)), self.max_length - offset))

    def rebase(self, prefix: Sequence[torch.Tensor]) -> None:
        """Take `prefix` (shared views covering positions 0 .. their total, equal to what this
        session holds there) as the session's prefix; the own buffer keeps only what follows it,
        in a buffer sized to it (one copy of that tail)."""
        prefix = tuple(prefix)
        self._check_views(prefix)
        offset = sum(view.shape[3] for view in prefix)
        if not self.offset <= offset <= self.length:
            raise ValueError(f"a prefix of {offset} positions does not fit a session holding "
                             f"{self.offset}..{self.length}")
        tail = self.length - offset
        capacity = self.rebased_capacity(offset)
        two, layers, heads, _, dim = self.data.shape
        with torch.inference_mode(False):  # see __init__
            own = self.data.new_empty((two, layers, heads, capacity, dim))
            own[:, :, :, :tail] = self.data[:, :, :, offset - self.offset : self.length - self.offset]
        self.data, self.prefix, self.offset = own, prefix, offset

    @property
    def layers(self) -> list[KVLayer]:
        """Every layer's valid keys/values as `[1, H, length, D]` (what a snapshot holds; views when
        there is no shared prefix, else copies)."""
        out = []
        for i in range(self.data.shape[1]):
            keys, values = self.joined(i, self.length)
            out.append(KVLayer(keys[None], values[None]))
        return out

    def load(self, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Fill from per-layer keys/values `[1, H, length, D]` (a restored snapshot; no prefix)."""
        if self.prefix:
            raise ValueError("a snapshot loads into a session without a shared prefix")
        if len(layers) != self.data.shape[1]:
            raise ValueError(f"{len(layers)} layers given, the model has {self.data.shape[1]}")
        _, _, heads, _, dim = self.data.shape
        for i, (keys, values) in enumerate(layers):  # exactly these: never broadcast or cast
            for part in (keys, values):
                if part.shape != (1, heads, length, dim) or part.dtype != self.data.dtype:
                    raise ValueError(f"layer {i} holds {part.dtype} {tuple(part.shape)}, not keys/values "
                                     f"{self.data.dtype} (1, {heads}, {length}, {dim})")
        self.reserve(length)
        for i, (keys, values) in enumerate(layers):
            self.write(i, 0, keys[0], values[0])
        self.length = length
