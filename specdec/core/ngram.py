"""Prompt-lookup (n-gram) proposer logic: model-free draft tokens, pure.

The draft is deterministic (its q is one-hot at each proposed token), so the target
verifies it with `verify_sampling(p, None, ...)` or greedily.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(
    history: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1
) -> list[int]:
    """Propose up to `k` tokens by finding the history's suffix earlier in the history.

    For n from `max_ngram` down to `min_ngram`, the key is the last n tokens; the most
    recent earlier occurrence of the key (not the suffix itself) wins, and the up to `k`
    tokens that followed it are returned (fewer near the end of the history). Returns []
    when nothing matches or `k == 0`.

    One backward scan: at each candidate end `i` it measures how many of the last
    `max_ngram` tokens match ending at `i`, stopping early on a full-length match.
    """
    if k < 0:
        raise ValueError(f"k={k} is invalid: must be >= 0")
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    n_hist = len(history)
    if k == 0 or n_hist < min_ngram + 1:
        return []

    key = [history[n_hist - 1 - j] for j in range(min(max_ngram, n_hist - 1))]  # reversed suffix
    best_end: dict[int, int] = {}  # n -> most recent end index of a length-n match
    for i in range(n_hist - 2, -1, -1):  # i: last index of a candidate occurrence
        if history[i] != key[0]:
            continue
        m = 1
        while m < len(key) and m <= i and history[i - m] == key[m]:
            m += 1
        for n in range(min_ngram, m + 1):
            best_end.setdefault(n, i)
        if m == max_ngram:
            break

    for n in range(max_ngram, min_ngram - 1, -1):
        if n in best_end:
            start = best_end[n] + 1
            return [int(t) for t in history[start : start + k]]
    return []
