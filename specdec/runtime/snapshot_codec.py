"""The wire format of a KV-cache snapshot: one safetensors blob per session cache.

A blob holds, per layer, the keys and values `[1, H, T, D]` (`k.<i>`, `v.<i>`), plus the T
tokens they cover (`tokens`); its metadata names the model (tokenizer fingerprint, model name,
dtype, layer count) so that a replica running anything else refuses it. Where blobs are kept:
`specdec.runtime.snapshot_store`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load, save as st_save
from transformers import DynamicCache, PreTrainedConfig

from specdec.errors import FailedPrecondition


@dataclass(frozen=True)
class SnapshotIdentity:
    """What must match between the replica that wrote a snapshot and the one restoring it."""

    model: str
    dtype: str
    fingerprint: str
    layers: int

    def as_metadata(self) -> dict[str, str]:
        return {"model": self.model, "dtype": self.dtype, "fingerprint": self.fingerprint, "layers": str(self.layers)}


def encode(cache: DynamicCache, tokens: list[int], identity: SnapshotIdentity) -> bytes:
    """The safetensors blob of a single-session cache covering `tokens`."""
    tensors: dict[str, torch.Tensor] = {"tokens": torch.tensor(tokens, dtype=torch.int64)}
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)  # full-attention layers only
        if keys is None or values is None or keys.shape[-2] != len(tokens):
            raise ValueError(f"layer {i} covers {0 if keys is None else keys.shape[-2]} tokens, not {len(tokens)}")
        tensors[f"k.{i}"] = keys.contiguous().cpu()
        tensors[f"v.{i}"] = values.contiguous().cpu()
    return st_save(tensors, metadata=identity.as_metadata())


def decode(blob: bytes, identity: SnapshotIdentity, config: PreTrainedConfig,
           device: torch.device | str = "cpu") -> tuple[list[int], DynamicCache]:
    """The tokens and the cache of a blob, on `device`; FailedPrecondition if it was written for another model."""
    header_len = int.from_bytes(blob[:8], "little")
    metadata = json.loads(blob[8:8 + header_len]).get("__metadata__", {})
    expected = identity.as_metadata()
    wrong = {k: (metadata.get(k), v) for k, v in expected.items() if metadata.get(k) != v}
    if wrong:
        raise FailedPrecondition(
            "the KV snapshot was written by another model: "
            + ", ".join(f"{k} is {got!r}, this replica has {want!r}" for k, (got, want) in wrong.items())
        )
    tensors = st_load(blob)
    tokens = tensors["tokens"].tolist()
    cache = DynamicCache(config=config)
    for i in range(identity.layers):
        cache.update(tensors[f"k.{i}"].to(device), tensors[f"v.{i}"].to(device), i)
    return tokens, cache
