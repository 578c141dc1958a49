"""The wire format of a KV-cache snapshot: one safetensors blob per session cache.

A blob holds, per layer, the keys and values `[1, H, T, D]` (`k.<i>`, `v.<i>`), plus the T
tokens they cover (`tokens`); its metadata names the layout (`format`, `FORMAT_VERSION`) and the
model (tokenizer fingerprint, model name, dtype, layer count) so that a replica running anything
else, or reading another layout, refuses it. Blobs written before the layout was versioned carry
no `format` and have the layout of version 1, so they are read as version 1. Where blobs are
kept: `specdec.runtime.snapshot_store`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load as st_load, save as st_save

from specdec.errors import FailedPrecondition

if TYPE_CHECKING:  # transformers' cache classes load at first use (a model-free service never needs them)
    from transformers import DynamicCache, PreTrainedConfig

FORMAT_VERSION = "1"
"""The layout this code writes and reads; bump it when the tensors' names, shapes or order change."""


@dataclass(frozen=True)
class SnapshotIdentity:
    """What must match between the replica that wrote a snapshot and the one restoring it."""

    model: str
    dtype: str
    fingerprint: str
    layers: int

    def as_metadata(self) -> dict[str, str]:
        return {"model": self.model, "dtype": self.dtype, "fingerprint": self.fingerprint, "layers": str(self.layers)}


def encode_layers(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], tokens: list[int],
                  identity: SnapshotIdentity) -> bytes:
    """The safetensors blob of per-layer keys/values `[1, H, T, D]` covering `tokens`."""
    tensors: dict[str, torch.Tensor] = {"tokens": torch.tensor(tokens, dtype=torch.int64)}
    for i, (keys, values) in enumerate(layers):
        if keys.shape[-2] != len(tokens) or values.shape[-2] != len(tokens):
            raise ValueError(f"layer {i} covers {keys.shape[-2]} tokens, not {len(tokens)}")
        tensors[f"k.{i}"] = keys.contiguous().cpu()
        tensors[f"v.{i}"] = values.contiguous().cpu()
    return st_save(tensors, metadata={**identity.as_metadata(), "format": FORMAT_VERSION})


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host_join(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """`parts` `[H, n_i, D]` (any strides) joined along positions into one contiguous CPU tensor
    `[1, H, sum n_i, D]`, copied by numpy. numpy copies on the calling thread alone, so a thread other
    than the model's (a background snapshot writer) makes the copy without starting a pool of OpenMP
    threads of its own, which would slow every pass (`specdec.server.model_service.model_thread`)."""
    ints = _SAME_SIZE_INT[parts[0].element_size()]  # numpy has no bfloat16: copy the bits
    arrays = [(part if part.device.type == "cpu" else part.cpu()).view(ints).numpy() for part in parts]
    return torch.from_numpy(np.concatenate(arrays, axis=1)[None]).view(parts[0].dtype)


def encode(cache: DynamicCache, tokens: list[int], identity: SnapshotIdentity) -> bytes:
    """The safetensors blob of a single-session cache covering `tokens` (anything with `.layers`
    of `.keys`/`.values`: a `DynamicCache`, a `kv_buffer.SessionKV`)."""
    layers = []
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)  # full-attention layers only
        if keys is None or values is None:
            raise ValueError(f"layer {i} covers 0 tokens, not {len(tokens)}")
        layers.append((keys, values))
    return encode_layers(layers, tokens, identity)


def decode_layers(blob: bytes, identity: SnapshotIdentity) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The tokens and per-layer keys/values `[1, H, T, D]` (on the CPU) of a blob; FailedPrecondition
    if it was written for another model or in another layout."""
    header_len = int.from_bytes(blob[:8], "little")
    metadata = json.loads(blob[8:8 + header_len]).get("__metadata__", {})
    version = metadata.get("format", "1")  # unversioned blobs have version 1's layout
    if version != FORMAT_VERSION:
        raise FailedPrecondition(f"the KV snapshot has format {version!r}; this replica reads {FORMAT_VERSION!r}")
    expected = identity.as_metadata()
    wrong = {k: (metadata.get(k), v) for k, v in expected.items() if metadata.get(k) != v}
    if wrong:
        raise FailedPrecondition(
            "the KV snapshot was written by another model: "
            + ", ".join(f"{k} is {got!r}, this replica has {want!r}" for k, (got, want) in wrong.items())
        )
    tensors = st_load(blob)
    layers = [(tensors[f"k.{i}"], tensors[f"v.{i}"]) for i in range(identity.layers)]
    return tensors["tokens"].tolist(), layers


def decode(blob: bytes, identity: SnapshotIdentity, config: PreTrainedConfig,
           device: torch.device | str = "cpu") -> tuple[list[int], DynamicCache]:
    """The tokens and the cache of a blob, on `device`; FailedPrecondition if it was written for another model."""
    tokens, layers = decode_layers(blob, identity)
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i, (keys, values) in enumerate(layers):
        cache.update(keys.to(device), values.to(device), i)
    return tokens, cache
