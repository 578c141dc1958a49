"""The wire format of a KV-cache snapshot: one safetensors blob per session cache.

A blob holds, per layer, the keys and values `[1, H, T, D]` (`k.<i>`, `v.<i>`), plus the T
tokens they cover (`tokens`); its metadata names the layout (`format`, `FORMAT_VERSION`) and the
model (tokenizer fingerprint, model name, dtype, layer count) so that a replica running anything
else, or reading another layout, refuses it. Blobs written before the layout was versioned carry
no `format` and have the layout of version 1, so they are read as version 1. Where blobs are
kept: `specdec.runtime.snapshot_store`.

A blob comes from Redis, so it is not trusted: `decode_layers` with the reader's `KVLayout` checks
every tensor's name, dtype, shape and contiguity and every token id against the model before any
of it is used, and raises `MalformedKV` (a corrupt entry, to be dropped) for what does not fit; a
blob of another model or format is `FailedPrecondition` (another replica's, to be left alone).
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


@dataclass(frozen=True)
class KVLayout:
    """What the keys/values of a reading replica's model look like: a blob's tensors must have exactly
    this shape and dtype (and its tokens these bounds) to be used."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    vocab_size: int
    max_tokens: int  # the model's context: a blob covers at most this many positions


class MalformedKV(ValueError):
    """A blob that claims this replica's model but whose contents do not fit it (truncated, another
    dtype or shape, token ids outside the vocabulary, ...): a corrupt entry."""


def encode_layers(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], tokens: list[int],
                  identity: SnapshotIdentity, extra: dict[str, str] | None = None) -> bytes:
    """The safetensors blob of per-layer keys/values `[1, H, T, D]` covering `tokens`; `extra`: more
    metadata (a prefix segment's position and chain, `prefix_store`)."""
    tensors: dict[str, torch.Tensor] = {"tokens": torch.tensor(tokens, dtype=torch.int64)}
    for i, (keys, values) in enumerate(layers):
        if keys.shape[-2] != len(tokens) or values.shape[-2] != len(tokens):
            raise ValueError(f"layer {i} covers {keys.shape[-2]} tokens, not {len(tokens)}")
        tensors[f"k.{i}"] = keys.contiguous().cpu()
        tensors[f"v.{i}"] = values.contiguous().cpu()
    return st_save(tensors, metadata={**(extra or {}), **identity.as_metadata(), "format": FORMAT_VERSION})


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


def metadata_of(blob: bytes) -> dict[str, str]:
    """The metadata of a blob's header; MalformedKV when the header does not parse."""
    try:
        header_len = int.from_bytes(blob[:8], "little")
        if len(blob) < 8 or header_len > len(blob) - 8:
            raise ValueError(f"a header of {header_len} bytes in a blob of {len(blob)}")
        metadata = json.loads(blob[8:8 + header_len]).get("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError("its metadata is not a map of strings")
        return metadata
    except (ValueError, AttributeError) as exc:  # JSON, UTF-8 and the checks above: all ValueErrors
        raise MalformedKV(f"the KV blob's header does not parse: {exc}") from exc


def decode_layers(blob: bytes, identity: SnapshotIdentity,
                  layout: KVLayout | None = None) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The tokens and per-layer keys/values `[1, H, T, D]` (on the CPU) of a blob; FailedPrecondition
    if it was written for another model or in another layout; with `layout`, MalformedKV unless every
    tensor fits it exactly (`check_layout`)."""
    metadata = metadata_of(blob)
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
    try:
        tensors = st_load(blob)
    except Exception as exc:
        raise MalformedKV(f"the KV blob does not load: {exc}") from exc
    if layout is not None:
        check_layout(tensors, identity.layers, layout)
    try:
        layers = [(tensors[f"k.{i}"], tensors[f"v.{i}"]) for i in range(identity.layers)]
    except KeyError as exc:
        raise MalformedKV(f"the KV blob lacks {exc}") from exc
    return tensors["tokens"].tolist(), layers


def check_layout(tensors: dict[str, torch.Tensor], layers: int, layout: KVLayout) -> None:
    """MalformedKV unless `tensors` are exactly a blob of `layout`: `tokens` int64 `[T]` with 1 <= T <=
    max_tokens, every id in the vocabulary, and `k.<i>`, `v.<i>` for each layer, contiguous, of the
    model's dtype and shape `[1, kv_heads, T, head_dim]`, and nothing else."""
    if layers != layout.layers:
        raise MalformedKV(f"a blob of {layers} layers for a model of {layout.layers}")
    names = {"tokens", *(f"{kind}.{i}" for i in range(layers) for kind in "kv")}
    if set(tensors) != names:
        missing, extra = sorted(names - set(tensors))[:4], sorted(set(tensors) - names)[:4]
        raise MalformedKV(f"the KV blob's tensors are not its layout's (missing {missing}, unexpected {extra})")
    tokens = tensors["tokens"]
    count = tokens.shape[0] if tokens.ndim == 1 else -1
    if tokens.dtype != torch.int64 or not 1 <= count <= layout.max_tokens:
        raise MalformedKV(f"the KV blob's tokens are {tokens.dtype} {tuple(tokens.shape)}, not int64 "
                          f"[1..{layout.max_tokens}]")
    if int(tokens.min()) < 0 or int(tokens.max()) >= layout.vocab_size:
        raise MalformedKV(f"the KV blob's tokens leave the vocabulary of {layout.vocab_size}")
    shape = (1, layout.kv_heads, count, layout.head_dim)
    for name, tensor in tensors.items():
        if name != "tokens" and (tensor.dtype != layout.dtype or tensor.shape != shape or not tensor.is_contiguous()):
            raise MalformedKV(f"the KV blob's {name} is {tensor.dtype} {tuple(tensor.shape)}, not {layout.dtype} "
                              f"{shape}")


def decode(blob: bytes, identity: SnapshotIdentity, config: PreTrainedConfig,
           device: torch.device | str = "cpu") -> tuple[list[int], DynamicCache]:
    """The tokens and the cache of a blob, on `device`; FailedPrecondition if it was written for another model."""
    tokens, layers = decode_layers(blob, identity)
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i, (keys, values) in enumerate(layers):
        cache.update(keys.to(device), values.to(device), i)
    return tokens, cache
