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
"""

from __future__ import annotations

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
                 dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int = MIN_CAPACITY) -> None:
        self.max_length = max_length
        self.length = 0  # positions whose keys/values are valid
        capacity = max(1, min(capacity, max_length))
        with torch.inference_mode(False):  # a normal tensor wherever it is made: writable in and out of inference mode
            self.data = torch.empty((2, layers, kv_heads, capacity, head_dim), dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def reserve(self, length: int) -> None:
        """Make room for `length` positions (doubling; the valid part is copied once per growth)."""
        if length <= self.capacity:
            return
        if length > self.max_length:
            raise ValueError(f"{length} positions exceed the session's limit of {self.max_length}")
        capacity = min(max(length, 2 * self.capacity), self.max_length)
        two, layers, heads, _, dim = self.data.shape
        with torch.inference_mode(False):  # see __init__
            grown = self.data.new_empty((two, layers, heads, capacity, dim))
            grown[:, :, :, : self.length] = self.data[:, :, :, : self.length]
        self.data = grown

    def crop(self, length: int) -> None:
        """Forget every position from `length` on (a rollback: nothing moves)."""
        self.length = max(0, min(length, self.length))

    def keys(self, layer: int, end: int) -> torch.Tensor:
        """`[kv_heads, end, head_dim]`: a view of the buffer, not a copy."""
        return self.data[0, layer, :, :end]

    def values(self, layer: int, end: int) -> torch.Tensor:
        """`[kv_heads, end, head_dim]`: a view of the buffer, not a copy."""
        return self.data[1, layer, :, :end]

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store `[kv_heads, n, head_dim]` keys/values at positions start .. start + n - 1 (in place)."""
        n = keys.shape[1]
        self.data[0, layer, :, start : start + n] = keys
        self.data[1, layer, :, start : start + n] = values

    @property
    def layers(self) -> list[KVLayer]:
        """Every layer's valid keys/values as `[1, H, length, D]` views (what a snapshot holds)."""
        return [KVLayer(self.keys(i, self.length)[None], self.values(i, self.length)[None])
                for i in range(self.data.shape[1])]

    def load(self, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Fill from per-layer keys/values `[1, H, length, D]` (a restored snapshot)."""
        if len(layers) != self.data.shape[1]:
            raise ValueError(f"{len(layers)} layers given, the model has {self.data.shape[1]}")
        self.reserve(length)
        for i, (keys, values) in enumerate(layers):
            if keys.shape[-2] != length or values.shape[-2] != length:
                raise ValueError(f"layer {i} covers {keys.shape[-2]} positions, not {length}")
            self.write(i, 0, keys[0], values[0])
        self.length = length
