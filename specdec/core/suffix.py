"""Suffix speculation (the idea of SuffixDecoding): model-free draft tokens from earlier text, pure.

A `SuffixIndex` holds token sequences: one session's history, or a corpus of earlier outputs.
Given the end of the current context it finds the longest *match* (a suffix of the context, at
least `min_match` and at most `max_depth` tokens long, seen before in the index) and every
*occurrence* of it. The continuations that followed those occurrences make the proposal: it
extends greedily along the most frequent next token, each step's empirical probability being
(occurrences going on with that token) / (occurrences still consistent), and stops once the
running product falls below `min_prob`. So a pattern seen once (or always continued alike)
proposes many tokens, a pattern continued many ways proposes few or none. `spec_factor` bounds
a proposal by the match's length as SuffixDecoding does (its reference implementation's default
is 1: a 2-token match proposes at most 2): a short match seen once is weak evidence. The draft is
deterministic: the verifier reads its q as one-hot.

Data structure, and why. A bounded-depth suffix trie stores up to `max_depth` nodes per indexed
token (a Python dict each: ~1 GB for 10^5 tokens at depth 32); a hash of all n-gram contexts
costs the same. Instead the index keeps:

- the tokens themselves in one flat int32 array (a sentinel -1 between sequences), and
- a hash from each `min_match`-gram to the increasing list of positions where it ends.

One entry per token, however deep the matches. A query looks up the candidates of its last
`min_match` tokens (the most recent `max_candidates` of them), lengthens the match one token at
a time with vectorised compares over all candidates at once (at most `max_depth` numpy steps,
stopping as soon as none is left), and reads the continuations as one [candidates, k] gather.
That is the same set of occurrences a suffix-tree node would hold, found in well under a
millisecond for 10^5 indexed tokens; appending costs one dict append per token.

Memory is bounded by `max_tokens`: the oldest sequences go first (a single sequence longer
than the bound keeps its newest `max_tokens`). `Corpora` keeps one index per corpus group (a
tenant, or tenants an operator groups), under one budget.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SENTINEL = -1  # between sequences and past the end: matches no token


@dataclass(frozen=True)
class Speculation:
    """A proposal: `tokens`, `score` = the expected number accepted under the empirical model (the
    sum of the running products), and the length of the match it came from."""

    tokens: list[int]
    score: float = 0.0
    match_length: int = 0


NOTHING = Speculation([])


class SuffixIndex:
    """Token sequences, searchable by the end of a context; see the module docstring."""

    def __init__(self, max_depth: int = 32, min_match: int = 2, max_tokens: int = 1_000_000,
                 max_candidates: int = 256) -> None:
        if not 1 <= min_match <= max_depth:
            raise ValueError(f"need 1 <= min_match <= max_depth, got {min_match}, {max_depth}")
        if max_tokens < 1 or max_candidates < 1:
            raise ValueError("max_tokens and max_candidates must be >= 1")
        self.max_depth = max_depth
        self.min_match = min_match
        self.max_tokens = max_tokens
        self.max_candidates = max_candidates
        self._buf = np.full(1024, SENTINEL, dtype=np.int32)  # logical positions [base, base + len); [0] a sentinel
        self._base = 0  # logical position of _buf[0]
        self._cut = 0  # positions before this are evicted
        self._end = 0  # logical end (exclusive)
        self._index: dict[tuple[int, ...], list[int]] = {}  # min_match-gram -> increasing end positions
        self._next: dict[tuple[int, ...], set[int]] = {}  # a key's first min_match - 1 tokens -> its last tokens
        self._starts: deque[int] = deque()  # first position of each sequence (after its sentinel)
        self._tail: list[int] = []  # last min_match - 1 tokens of the open sequence

    # -- updates ---------------------------------------------------------------------------------

    def add(self, tokens: Sequence[int]) -> None:
        """Start a new sequence with `tokens` (a finished output for the corpus, or a session's first)."""
        self._write([SENTINEL])
        self._starts.append(self._end)
        self._tail = []
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append `tokens` to the last sequence (a session's newly verified tokens)."""
        if not self._starts:
            self.add(tokens)
            return
        tokens = [int(t) for t in tokens]
        if any(t < 0 for t in tokens):
            raise ValueError("token ids must be >= 0")
        start = self._end
        self._write(tokens)
        m = self.min_match
        window = self._tail + tokens
        offset = len(self._tail) - m + 1  # window index of the first token of the key ending at `start`
        index = self._index
        for i in range(max(0, -offset), len(tokens)):
            key = tuple(window[offset + i: offset + i + m])
            positions = index.get(key)
            if positions is None:
                index[key] = [start + i]
                following = self._next.get(key[:-1])
                if following is None:
                    self._next[key[:-1]] = {key[-1]}
                else:
                    following.add(key[-1])
            else:
                positions.append(start + i)
        self._tail = window[len(window) - (m - 1):] if m > 1 else []
        self._evict()

    @property
    def tokens_held(self) -> int:
        """Tokens (and sentinels) indexed now: at most `max_tokens` plus one sentinel per sequence."""
        return self._end - self._cut

    @property
    def sequences(self) -> int:
        return len(self._starts)

    def _write(self, tokens: list[int]) -> None:
        used = self._end - self._base
        need = used + len(tokens) + 1  # one sentinel slot always follows the end
        if need > len(self._buf):
            grown = np.full(max(need, 2 * len(self._buf)), SENTINEL, dtype=np.int32)
            grown[:used] = self._buf[:used]
            self._buf = grown
        self._buf[used: used + len(tokens)] = tokens
        self._end += len(tokens)

    def _evict(self) -> None:
        while self._end - self._starts[0] > self.max_tokens:
            if len(self._starts) > 1:
                self._starts.popleft()
                cutoff = self._starts[0] - 1  # from the next sequence's sentinel
            else:
                cutoff = self._end - self.max_tokens
                self._starts[0] = cutoff
            self._drop_before(cutoff)

    def _drop_before(self, cutoff: int) -> None:
        m, base = self.min_match, self._base
        keys = set()
        for p in range(max(self._cut, base + m - 1), cutoff):
            key = tuple(int(t) for t in self._buf[p - m + 1 - base: p + 1 - base])
            if SENTINEL not in key:
                keys.add(key)
        for key in keys:
            positions = self._index.get(key)
            if positions is None:
                continue
            del positions[:bisect.bisect_left(positions, cutoff)]
            if not positions:
                del self._index[key]
                following = self._next[key[:-1]]
                following.discard(key[-1])
                if not following:
                    del self._next[key[:-1]]
        self._cut = cutoff
        keep_from = cutoff - (m - 1)  # the key ending at `cutoff` still reads its first tokens
        if keep_from - self._base > len(self._buf) // 2:
            used = self._end - keep_from
            self._buf[1:used + 2] = self._buf[keep_from - self._base: self._end - self._base + 1]
            self._buf[0] = SENTINEL  # backward reads clamped to slot 0 stop there
            self._buf[used + 2:] = SENTINEL
            self._base = keep_from - 1

    # -- queries ---------------------------------------------------------------------------------

    def successors(self, prefix: tuple[int, ...]) -> frozenset[int] | set[int]:
        """The tokens t such that `prefix + (t,)` is indexed (`prefix`: `min_match - 1` tokens), i.e.
        every token after which a context ending in `prefix` has a match here. Read-only."""
        return self._next.get(prefix, frozenset())

    def match(self, context: Sequence[int], own: bool = False) -> tuple[int, np.ndarray]:
        """The longest match of the end of `context` and the end positions of its occurrences.

        `own`: `context` is this index's last sequence itself (a session's history), so its own
        end is no occurrence. (0, []) when not even `min_match` tokens match.
        """
        m = self.min_match
        if len(context) < m:
            return 0, np.empty(0, dtype=np.int64)
        positions = self._index.get(tuple(int(t) for t in context[-m:]))
        if not positions:
            return 0, np.empty(0, dtype=np.int64)
        ends = np.asarray(positions[-self.max_candidates:], dtype=np.int64)
        if own:
            ends = ends[ends != self._end - 1]
        if ends.size == 0:
            return 0, ends
        depth = min(self.max_depth, len(context))
        wanted = np.asarray(context[len(context) - depth:][::-1], dtype=np.int32)  # [D] the context, backwards
        back = ends[:, None] - (np.arange(depth) + self._base)  # [n, D] buffer slots before each end
        same = self._buf[np.maximum(back, 0)] == wanted  # slot 0 is a sentinel: matches nothing
        lengths = np.logical_and.accumulate(same, axis=1).sum(axis=1)  # [n]
        length = int(lengths.max())
        if length < m:  # only where the buffer lost the key's first tokens (a trimmed sequence)
            return 0, ends[:0]
        ends = ends[lengths == length]
        return length, ends

    def speculate(self, context: Sequence[int], k: int, min_prob: float, own: bool = False,
                  spec_factor: float = 0.0) -> Speculation:
        """Up to `k` tokens along the most frequent continuation of the longest match (see the module);
        with `spec_factor`, at most that many times the match's length (SuffixDecoding's bound: a
        short match is weak evidence however few its occurrences)."""
        if k <= 0:
            return NOTHING
        length, ends = self.match(context, own)
        if length == 0:
            return NOTHING
        if spec_factor > 0:
            k = min(k, int(spec_factor * length))
            if k <= 0:
                return NOTHING
        last = self._end - self._base  # the sentinel slot past the end
        tokens, score, prob = [], 0.0, 1.0
        for i in range(1, k + 1):
            if len(ends) == 1:  # one occurrence left: each next token has probability 1, up to its end
                rest = self._buf[ends[0] + i - self._base: min(ends[0] + k + 1 - self._base, last + 1)]
                more = rest.tolist()
                more = more[:more.index(SENTINEL)] if SENTINEL in more else more
                tokens += more
                score += prob * len(more)
                break
            column = self._buf[np.minimum(ends + (i - self._base), last)]  # [n] the i-th tokens after
            token, count = _most_frequent(column)
            if count == 0:
                break
            prob *= count / len(column)
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            ends = ends[column == token]
        return Speculation(tokens, score, length)


class Corpora:
    """Corpora of finished outputs, one `SuffixIndex` per corpus group, so that one group's outputs
    never draft another's requests (a draft's proposals, and so the round statistics a client sees,
    would reveal them).

    Bounded in all: at most `max_tokens` tokens held over every group, and at most `max_groups`
    groups; past either, whole corpora go, the least recently used group (added to or drafted
    from) first. One group may hold the whole budget (its own index keeps its newest outputs).
    Not thread-safe: the owner locks.
    """

    def __init__(self, max_depth: int = 32, min_match: int = 2, max_tokens: int = 1_000_000,
                 max_groups: int = 1024) -> None:
        if max_groups < 1:
            raise ValueError("max_groups must be >= 1")
        self._new = lambda: SuffixIndex(max_depth, min_match, max_tokens)
        self.max_tokens = max_tokens
        self.max_groups = max_groups
        self._groups: OrderedDict[str, SuffixIndex] = OrderedDict()
        self._held = 0  # tokens held over every group

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def tokens_held(self) -> int:
        return self._held

    def add(self, group: str, tokens: Sequence[int]) -> None:
        """`tokens` (a finished output) join `group`'s corpus."""
        index = self._groups.pop(group, None) or self._new()
        self._groups[group] = index  # the most recently used
        before = index.tokens_held
        index.add(tokens)
        self._held += index.tokens_held - before
        while len(self._groups) > 1 and (self._held > self.max_tokens or len(self._groups) > self.max_groups):
            _, dropped = self._groups.popitem(last=False)
            self._held -= dropped.tokens_held

    def get(self, group: str) -> SuffixIndex | None:
        """`group`'s corpus (None when it has none), marked as used."""
        index = self._groups.get(group)
        if index is not None:
            self._groups.move_to_end(group)
        return index


def _most_frequent(column: np.ndarray) -> tuple[int, int]:
    """The most frequent token of `column` (ties: the most recent occurrence wins) and its count."""
    first = column[0]
    if first != SENTINEL and (column == first).all():  # the usual confident case
        return int(first), len(column)
    live = column[column != SENTINEL]
    if live.size == 0:
        return SENTINEL, 0
    values, counts = np.unique(live, return_counts=True)
    top = counts.max()
    best = values[counts == top]
    if len(best) == 1:
        return int(best[0]), int(top)
    for token in live[::-1]:  # rows are in increasing position: the last is the most recent
        if token in best:
            return int(token), int(top)
    raise AssertionError("unreachable")


def followers(context: Sequence[int], indexed: int, own: SuffixIndex, corpus: SuffixIndex | None,
              most: int) -> tuple[int, ...] | None:
    """The tokens t after which `context + [t]` could be speculated anything from `own` (the session's
    index, holding `context[:indexed]`) and `corpus`: those t that end an indexed `min_match`-gram
    with the context's last `min_match - 1` tokens, or such a gram of the part of the context not yet
    indexed (a block being verified). A superset: a match may still fall short of `min_prob`, or
    end with its sequence. None when there are more than `most`, or at `min_match` 1 (every indexed
    token continues a one-token match).
    """
    m = own.min_match
    if m < 2:
        return None
    if len(context) < m - 1:
        return ()
    prefix = tuple(int(t) for t in context[len(context) - (m - 1):])
    found = set(own.successors(prefix))
    if corpus is not None:
        found |= corpus.successors(prefix)
    for end in range(max(indexed, m - 1), len(context)):  # grams the session's index will hold after the round
        if tuple(context[end - m + 1:end]) == prefix:
            found.add(int(context[end]))
    return tuple(sorted(found)) if len(found) <= most else None


def best_speculation(*candidates: Speculation) -> Speculation:
    """The candidate with the most tokens expected accepted (ties: the longer match, then the first)."""
    best = NOTHING
    for c in candidates:
        if (c.score, c.match_length) > (best.score, best.match_length):
            best = c
    return best


# -- the wire format of a finished output in the shared stream -------------------------------------

OUTPUT_FIELD = b"tokens"  # the stream entry's field holding encode_output(tokens)
FINGERPRINT_FIELD = b"tokenizer"  # optional: the tokenizer fingerprint the ids belong to
GROUP_FIELD = b"group"  # optional: the corpus group the output belongs to (absent: "", the anonymous group)
MAX_TOKEN_ID = 2**31 - 1  # the index holds int32 ids


def encode_output(tokens: Sequence[int]) -> bytes:
    """Token ids as uint32 little-endian bytes."""
    return np.asarray(tokens, dtype="<u4").tobytes()


def decode_output(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"an encoded output is a multiple of 4 bytes, got {len(data)}")
    return np.frombuffer(data, dtype="<u4").astype(np.int64).tolist()


def encode_entry(tokens: Sequence[int], group: str = "") -> dict[bytes, bytes]:
    """The fields of a stream entry holding one finished output of corpus group `group`."""
    fields = {OUTPUT_FIELD: encode_output(tokens)}
    if group:
        fields[GROUP_FIELD] = group.encode()
    return fields


@dataclass(frozen=True)
class OutputEntry:
    """A finished output read from the shared stream, and the corpus group it belongs to."""

    tokens: list[int]
    group: str = ""


class SkippedEntry(ValueError):
    """A stream entry that cannot join a corpus; `reason` is one of `SKIP_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


SKIP_REASONS = ("malformed", "other_tokenizer", "out_of_vocabulary", "empty")
"""Why an entry is skipped: its fields do not decode (text that is not UTF-8, a length that is no
multiple of 4); it names another tokenizer; it holds an id the model does not have; it is empty."""


def decode_entry(fields: dict[bytes, bytes], fingerprint: str = "", vocab_size: int | None = None) -> OutputEntry:
    """The output a stream entry holds, checked: `SkippedEntry` (with its reason) when the entry is
    malformed, names a tokenizer other than `fingerprint`, is empty, or holds an id outside
    [0, `vocab_size`) (which the target would refuse if it were proposed)."""
    try:
        named = fields.get(FINGERPRINT_FIELD, b"").decode()
        group = fields.get(GROUP_FIELD, b"").decode()
        tokens = decode_output(fields.get(OUTPUT_FIELD, b""))
    except (UnicodeDecodeError, ValueError, AttributeError) as exc:
        raise SkippedEntry("malformed", f"malformed entry: {exc}") from None
    if named and fingerprint and named != fingerprint:
        raise SkippedEntry("other_tokenizer", f"entry of another tokenizer ({named[:16]})")
    if not tokens:
        raise SkippedEntry("empty", "entry with no tokens")
    top = max(tokens)
    limit = min(vocab_size, MAX_TOKEN_ID + 1) if vocab_size is not None else MAX_TOKEN_ID + 1
    if top >= limit:
        raise SkippedEntry("out_of_vocabulary", f"entry holds token {top}, outside the vocabulary (ids below {limit})")
    return OutputEntry(tokens, group)
