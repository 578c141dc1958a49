"""Per-session KV caches for one model, addressed by session id.

A cache remembers which tokens it covers. Every call names the session's full accepted history,
so the cache is cut back to the longest common prefix and whatever is missing is re-prefilled in
the same forward pass: rollback after a rejection, rebuild after a restart or eviction, and a
client that moved to another replica all take the same path, and no caller depends on a cache
being alive.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specdec.errors import InvalidArgument


@dataclass
class _Entry:
    tokens: list[int]  # tokens whose keys/values the cache holds, in order
    cache: DynamicCache
    last_used: float = field(default_factory=time.monotonic)


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


class SessionCaches:
    """A bounded LRU of per-session KV caches for `model` (thread-safe; one forward at a time)."""

    def __init__(self, model: torch.nn.Module, max_context: int, max_sessions: int = 64,
                 idle_ttl_s: float = 900.0) -> None:
        self.model = model
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = max_context
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def score(self, session_id: str, history: list[int], new_tokens: list[int]) -> tuple[torch.Tensor, int]:
        """Logits `[len(new_tokens) + 1, V]` for the positions after history[-1] and each new token.

        Row i is the model's next-token distribution after `history + new_tokens[:i]`. Returns
        the logits and how many history tokens had to be (re-)prefilled beyond the last one.
        Afterwards the cache covers `history + new_tokens`.
        """
        if not history:
            raise InvalidArgument("history is empty: send at least one token (the prompt)")
        total = len(history) + len(new_tokens)
        if total > self.max_context:
            raise InvalidArgument(
                f"context of {total} tokens exceeds the model's limit of {self.max_context}; "
                "shorten the prompt or lower max_new_tokens"
            )
        with self._lock:
            self._evict_idle()
            entry = self._entries.pop(session_id, None)
            needed = history[:-1]  # the cache must cover these before we feed history[-1]
            if entry is None:
                entry = _Entry(tokens=[], cache=DynamicCache(config=self.model.config))
            keep = common_prefix_length(entry.tokens, needed)
            if keep < len(entry.tokens):
                entry.cache.crop(keep - len(entry.tokens))
                del entry.tokens[keep:]
            feed = history[keep:] + new_tokens
            # Only tokens not already in the cache reach the model (the rest were checked when fed).
            top = max(feed)
            if top >= self.vocab_size:
                if entry.tokens:
                    self._entries[session_id] = entry  # still consistent: keep it
                raise InvalidArgument(f"token id {top} is outside the vocabulary (size {self.vocab_size})")
            # The entry is out of the LRU while the forward runs: if it raises, the cache is in
            # an unknown state and is simply forgotten (rebuilt from the history next time).
            with torch.inference_mode():
                ids = torch.tensor([feed], dtype=torch.long)  # [1, S]
                out = self.model(input_ids=ids, cache=entry.cache, use_cache=True,
                                 logits_to_keep=len(new_tokens) + 1)
            logits = out.logits[0, -(len(new_tokens) + 1):]  # [k+1, V]
            entry.tokens.extend(feed)
            entry.last_used = time.monotonic()
            self._entries[session_id] = entry
            while len(self._entries) > self.max_sessions:
                self._entries.popitem(last=False)
            return logits, len(history) - 1 - keep

    def rollback(self, session_id: str, length: int) -> int:
        """Cut a session's cache back to its first `length` tokens; returns what it now covers."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                return 0
            if length < len(entry.tokens):
                entry.cache.crop(length - len(entry.tokens))
                del entry.tokens[length:]
            return len(entry.tokens)

    def release(self, session_id: str) -> bool:
        with self._lock:
            return self._entries.pop(session_id, None) is not None

    def _evict_idle(self) -> None:
        cutoff = time.monotonic() - self.idle_ttl_s
        while self._entries:
            sid, entry = next(iter(self._entries.items()))
            if entry.last_used >= cutoff:
                break
            del self._entries[sid]
