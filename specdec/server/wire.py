"""Conversions between protobuf messages and domain types (the `from_pb` / `to_pb` layer)."""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterable

import numpy as np

from specdec.core.logprobs import TokenLogprob
from specdec.core.sampling import SamplingParams
from specdec.errors import InvalidArgument
from specdec.v1 import common_pb2

MAX_FOLLOWERS = 256
"""Tokens a `Followers` message may list (a draft's block, then the verify request that carries it)."""


def followers_from_pb(msg) -> frozenset[int] | None:
    """`msg.followers` (a draft's ProposeBlock or a VerifyRequest), None when unset; refused past
    MAX_FOLLOWERS."""
    if not msg.HasField("followers"):
        return None
    tokens = msg.followers.tokens
    if len(tokens) > MAX_FOLLOWERS:
        raise InvalidArgument(f"followers lists {len(tokens)} tokens; at most {MAX_FOLLOWERS} (leave it unset when "
                              "they are not known)")
    return frozenset(tokens)


def followers_to_pb(msg, tokens: Iterable[int]) -> None:
    """Set `msg.followers` to `tokens`, in order (set even when empty: nothing can be drafted next)."""
    msg.followers.SetInParent()
    msg.followers.tokens.extend(sorted(tokens))


def sampling_from_pb(msg: common_pb2.SamplingParams, vocab_size: int | None = None) -> SamplingParams:
    """Validated SamplingParams; top_p and repetition_penalty 0 (unset) mean 1. With `vocab_size`,
    token ids in logit_bias and end_token_ids must lie below it."""
    params = SamplingParams(
        temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p or 1.0, min_p=msg.min_p,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0, logit_bias=tuple(msg.logit_bias.items()),
        min_tokens=msg.min_tokens, end_token_ids=tuple(msg.end_token_ids), output_start=msg.output_start,
        grammar_kind=msg.grammar_kind, grammar_text=msg.grammar_text,
    )
    try:
        params.validate()
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    if vocab_size is not None:
        ids = [t for t, _ in params.logit_bias] + list(params.end_token_ids)
        if ids and max(ids) >= vocab_size:
            raise InvalidArgument(f"token id {max(ids)} in logit_bias or end_token_ids is outside the "
                                  f"vocabulary (ids below {vocab_size})")
    return params


def sampling_to_pb(params: SamplingParams, constants: bool = True) -> common_pb2.SamplingParams:
    """The message, with `constants_digest` when logit_bias or a grammar is set; `constants` False
    leaves those out (for a service that holds them for the session already)."""
    msg = common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, min_tokens=params.min_tokens,
        end_token_ids=list(params.end_token_ids), output_start=params.output_start,
        constants_digest=constants_digest(params),
    )
    if constants:
        msg.logit_bias.update(dict(params.logit_bias))
        msg.grammar_kind, msg.grammar_text = params.grammar_kind, params.grammar_text
    return msg


@functools.lru_cache(maxsize=256)
def constants_digest(params: SamplingParams) -> bytes:
    """SHA-256 of the generation's request-constant sampling state (logit_bias, grammar_kind,
    grammar_text), b"" when there is none. Each part is length-prefixed; biases are packed as the
    float32 the wire carries, so both ends of a call compute the same digest."""
    if not (params.logit_bias or params.grammar_kind or params.grammar_text):
        return b""
    kind, text = params.grammar_kind.encode(), params.grammar_text.encode()
    h = hashlib.sha256(b"specdec-sampling-constants-v1")
    h.update(struct.pack("<I", len(kind)) + kind + struct.pack("<Q", len(text)) + text)
    h.update(struct.pack("<I", len(params.logit_bias)))
    h.update(b"".join(struct.pack("<If", t, b) for t, b in params.logit_bias))  # sorted by SamplingParams
    return h.digest()


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


def logprobs_to_pb(entry: TokenLogprob) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_id=entry.token, logprob=entry.logprob, rank=entry.rank,
                                    top_token_ids=[t for t, _ in entry.top], top_logprobs=[v for _, v in entry.top])
