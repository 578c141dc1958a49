"""Conversions between protobuf messages and domain types (the `from_pb` / `to_pb` layer)."""

from __future__ import annotations

import numpy as np

from specdec.core.sampling import SamplingParams
from specdec.errors import InvalidArgument
from specdec.v1 import common_pb2


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Validated SamplingParams; top_p 0 (unset) means 1."""
    params = SamplingParams(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p or 1.0)
    try:
        params.validate()
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    return params


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)


def probs_to_bytes(rows: np.ndarray) -> bytes:
    """`[..., V]` float probabilities as little-endian float32 bytes."""
    return np.ascontiguousarray(rows, dtype="<f4").tobytes()


def probs_from_bytes(data: bytes, rows: int, vocab_size: int) -> np.ndarray | None:
    """`[rows, V]` float32 from bytes; None for empty bytes (greedy or deterministic draft)."""
    if not data:
        return None
    expected = rows * vocab_size * 4
    if len(data) != expected:
        raise InvalidArgument(
            f"draft_probs holds {len(data)} bytes, expected {expected} ({rows} rows x {vocab_size} float32)"
        )
    return np.frombuffer(data, dtype="<f4").reshape(rows, vocab_size)
