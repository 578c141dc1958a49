# A FROZEN COPY of specdec/runtime/kv.py as it was before the in-place KV engine: per-session
# DynamicCache, padded batched passes.
# bench/engine.py times it side by side with the new engine. Not used by any service; do not edit.
"""Per-session KV caches for one model, addressed by session id, scored one session or many at once.

A cache remembers which tokens it covers. Every call names the session's full accepted history,
so the cache is cut back to the longest common prefix and whatever is missing is re-prefilled in
the same forward pass: rollback after a rejection, rebuild after a restart or eviction, and a
client that moved to another replica all take the same path, and no caller depends on a cache
being alive.

Batched scoring (`score_batch`) runs the blocks of several sessions through ONE forward pass.
Each session keeps its own `DynamicCache`; for the pass they are laid side by side:

    row i:  [ pad .. pad | past_i (L_i) ][ feed_i (F_i) | pad .. pad ]
            <------------ P ------------><------------- N ------------>

The past is left-padded to the longest past P and the fed tokens are right-padded to the longest
feed N; the 2-D attention mask hides both kinds of padding and each row gets its own position
ids (L_i, L_i + 1, ...), so row i computes exactly what it would alone (up to float rounding).
Right-padding the feed keeps every query row attending to at least one real token, so no softmax
row is empty and no NaN can leak into the cache. Afterwards each session's cache is extended
with its own F_i new keys/values (a copy, never a view into the batch tensor). Rows that must
re-prefill a long prefix (new sessions, lost caches) prefill it first in a pass of their own, so
that one cache miss does not pad the whole batch to its length.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from specdec.errors import FailedPrecondition, InvalidArgument
from specdec.runtime.snapshot_codec import decode, encode
from specdec.runtime.snapshot_store import SnapshotPolicy

log = logging.getLogger(__name__)

PREFILL_ALONE_ABOVE = 16
"""In a batch, rows that must re-prefill more than this many tokens do so first, in a pass of their own."""


@dataclass
class _Entry:
    tokens: list[int]  # tokens whose keys/values the cache holds, in order
    cache: DynamicCache
    last_used: float = field(default_factory=time.monotonic)


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


def _keys_values(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values `[B, H, T, D]`, which a layer that has seen tokens holds."""
    if layer.keys is None or layer.values is None:
        raise RuntimeError("the cache layer holds no keys and values")
    return layer.keys, layer.values


def _plain(layer: object) -> DynamicLayer:
    """A cache layer that `SessionCaches._batchable` found to be a plain full-attention one."""
    if not isinstance(layer, DynamicLayer):
        raise TypeError(f"cannot batch a {type(layer).__name__}")
    return layer


class _BatchLayer(DynamicLayer):
    """One layer of a batched pass: the rows' cached keys/values, left-padded to `p`, plus the pass's own.

    The `[B, H, P + N, D]` buffer is filled once, when the pass delivers its new keys/values (so
    shapes and dtype come from the model itself); no other copy of the pasts is made.
    """

    def __init__(self, rows: list[DynamicLayer], past: list[int], p: int) -> None:
        super().__init__()
        self.rows, self.past, self.p = rows, past, p
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        b, heads, n, _ = key_states.shape  # [B, H, N, D]
        self.device = key_states.device
        self.keys = key_states.new_zeros((b, heads, self.p + n, key_states.shape[-1]))
        self.values = value_states.new_zeros((b, heads, self.p + n, value_states.shape[-1]))
        for i, (layer, length) in enumerate(zip(self.rows, self.past)):
            if length:
                keys, values = _keys_values(layer)  # [1, H, length, D] each
                self.keys[i, :, self.p - length : self.p] = keys[0]
                self.values[i, :, self.p - length : self.p] = values[0]
        self.keys[:, :, self.p :] = key_states
        self.values[:, :, self.p :] = value_states
        self.rows = []  # the sessions' tensors are no longer needed by this pass
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.p


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
                 idle_ttl_s: float = 900.0, snapshots: SnapshotPolicy | None = None) -> None:
        self.model = model
        head = _head_weight(model)  # [V, hidden]
        self.device = head.device  # inputs go where the weights are
        self.vocab_size = head.shape[0]
        self.max_context = max_context
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._tokens = 0  # sum of len(entry.tokens) over _entries; readable without the lock
        self.snapshots = snapshots
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> int:
        """Tokens whose keys/values are held, over all sessions (for GetInfo and metrics)."""
        return self._tokens

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
            for i, request in enumerate(requests):
                try:
                    rows.append((i, self._prepare(request)))
                except InvalidArgument as exc:
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
            while len(self._entries) > self.max_sessions:
                self._remove(next(iter(self._entries)))
        return results  # type: ignore[return-value]

    def _prepare(self, request: ScoreRequest) -> _Row:
        """Validate, find or create the entry, cut it back to the common prefix; what to feed."""
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
        if entry is None:
            entry = self._restore(request.session_id, needed) or _Entry(tokens=[], cache=self._new_cache())
            self._entries[request.session_id] = entry
            keep = common_prefix_length(entry.tokens, needed)
            feed = history[keep:] + new_tokens
        self._crop(entry, keep)
        return _Row(request, entry, feed, keep)

    def _forward(self, rows: list[_Row]) -> list[torch.Tensor]:
        """Feed every row's tokens into its cache; each row's last `len(new_tokens) + 1` logits."""
        if not rows:
            return []
        tails = [len(row.request.new_tokens) + 1 for row in rows]
        if len(rows) == 1:
            return [self._forward_one(rows[0].entry, rows[0].feed, tails[0])]
        if not all(self._batchable(row.entry.cache) for row in rows):
            return [self._forward_one(row.entry, row.feed, tail) for row, tail in zip(rows, tails)]
        # Rows that must re-prefill a long prefix (a new session, a lost cache) prefill it first, in
        # a pass of their own, so that one cache miss does not pad the whole batch to its length.
        long = [(row, tail) for row, tail in zip(rows, tails) if len(row.feed) - tail > PREFILL_ALONE_ABOVE]
        if long:
            prefixes = [row.feed[:-tail] for row, tail in long]
            if len(long) == 1:
                self._forward_one(long[0][0].entry, prefixes[0], 1)
            else:
                self._forward_padded([row.entry for row, _ in long], prefixes, [1] * len(long))
            for (row, tail), prefix in zip(long, prefixes):
                self._extend(row.entry, prefix)
                row.feed = row.feed[-tail:]
        return self._forward_padded([row.entry for row in rows], [row.feed for row in rows], tails)

    def _new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def _forward_one(self, entry: _Entry, feed: list[int], keep_logits: int) -> torch.Tensor:
        ids = torch.tensor([feed], dtype=torch.long, device=self.device)  # [1, S]
        out = self.model(input_ids=ids, cache=entry.cache, use_cache=True, logits_to_keep=keep_logits)
        return out.logits[0, -keep_logits:]  # [keep_logits, V]

    def _forward_padded(self, entries: list[_Entry], feeds: list[list[int]], tails: list[int]) -> list[torch.Tensor]:
        """One pass over several sessions (layout in the module docstring); each row's last `tail` logits.

        Each entry's cache is extended by its feed; the caller extends `entry.tokens`.
        """
        b = len(entries)
        past = [len(entry.tokens) for entry in entries]  # L_i
        width = [len(feed) for feed in feeds]  # F_i
        p, n = max(past), max(width)
        ids = torch.zeros((b, n), dtype=torch.long)  # [B, N]; pads are token 0, masked out
        mask = torch.zeros((b, p + n), dtype=torch.long)  # [B, P + N]
        positions = torch.zeros((b, n), dtype=torch.long)  # [B, N]
        for i, feed in enumerate(feeds):
            ids[i, : width[i]] = torch.tensor(feed, dtype=torch.long)
            mask[i, p - past[i] : p + width[i]] = 1
            positions[i] = torch.arange(past[i], past[i] + n)
        if self.device.type != "cpu":  # built on the host, moved in one transfer each
            ids, mask, positions = (t.to(self.device, non_blocking=True) for t in (ids, mask, positions))
        n_layers = len(entries[0].cache.layers)
        batch_cache = self._new_cache()
        layers = [_BatchLayer([_plain(entry.cache.layers[layer_idx]) for entry in entries], past, p)
                  for layer_idx in range(n_layers)]
        batch_cache.layers = list(layers)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=batch_cache,
                         use_cache=True, logits_to_keep=max(0, n - min(w - t for w, t in zip(width, tails))))
        kept = out.logits.shape[1]  # the last `kept` positions of every row
        logits = [out.logits[i, kept - n + width[i] - tails[i] : kept - n + width[i]].clone() for i in range(b)]
        for layer_idx, layer in enumerate(layers):  # each session takes its own new keys
            keys, values = _keys_values(layer)  # [B, H, P + N, D]
            for i, entry in enumerate(entries):
                entry.cache.update(keys[i : i + 1, :, p : p + width[i]], values[i : i + 1, :, p : p + width[i]],
                                   layer_idx)
        return logits

    @staticmethod
    def _batchable(cache: DynamicCache) -> bool:
        """Plain full-attention layers only: sliding-window or other layer kinds are scored one by one."""
        return all(type(layer) is DynamicLayer for layer in cache.layers)

    # -- bookkeeping ------------------------------------------------------------------------

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
            return len(entry.tokens), encode(entry.cache, entry.tokens, self.snapshots.identity)

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
            tokens, cache = decode(blob, policy.identity, self.model.config, self.device)
        except Exception as exc:  # noqa: BLE001 - a snapshot is an optimisation: fall back to prefill
            log.warning("snapshot of %s not restored (%s); re-prefilling", session_id, exc)
            return None
        if common_prefix_length(tokens, needed) < policy.min_tokens:
            return None
        policy.restores += 1
        entry = _Entry(tokens=tokens, cache=cache)
        self._tokens += len(tokens)
        return entry

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
            entry.cache.crop(length - len(entry.tokens))
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
        return True

    def _evict_idle(self) -> None:
        cutoff = time.monotonic() - self.idle_ttl_s
        while self._entries:
            sid, entry = next(iter(self._entries.items()))
            if entry.last_used >= cutoff:
                break
            self._remove(sid)
