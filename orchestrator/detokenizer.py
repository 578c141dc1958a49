"""The incremental detokenizer of a generation's stream, with stop strings.

Text is released as tokens arrive, holding back an incomplete UTF-8 character (decoded as
U+FFFD) and any tail that could still grow into a stop string. Decoding works on a short window
of recent tokens (the offsets trick of text-generation-inference), so a round costs the same at
token 10 and at token 10,000.

The window stays short for bytes that never make a character, and for tokens with no text, too.
An incomplete character has at most 3 bytes, so it lies in the last 3 tokens; when more tokens
than `PENDING` wait and the window still ends in U+FFFD (or has not grown), the text up to a token
at least 3 from the end is final (those bytes are invalid UTF-8 and decode as U+FFFD for good;
skipped special tokens decode as nothing) and is released, at a cut where no character spans the
boundary (the shorter decode is a prefix of the longer one). Without it, a run of lone
continuation bytes or of special tokens (which logit_bias and ignore_eos can force) made every
token decode the whole run again: n^2/2 tokens decoded for n tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

PENDING = 4  # tokens that may wait for a character to complete before a cut is looked for
CUT_TRIES = 4  # cuts tried per token: in any 4 consecutive byte boundaries one is outside every character


class Detokenizer:
    """Turns a generation's tokens into text as they arrive (`push`, then `release` the text ready)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = 0  # tokens already turned into text
        self._prefix: str | None = ""  # the text of ids[prefix_offset:read_offset] (None: not decoded yet)
        self.text = ""  # all text decoded so far (including held-back characters)
        self._emitted = 0  # characters of self.text already released
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token: int) -> None:
        """Add one token; sets `stopped` (and trims `text`) when a stop string completes."""
        assert not self.stopped, "push after a stop string"
        self._ids.append(token)
        prefix = self._prefix_text()
        end, window = len(self._ids), self._decode(self._ids[self._prefix_offset:])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            # An incomplete character, bytes that never make one, or tokens with no text.
            end, window = self._final_cut(prefix, window)
            if end is None:
                return
        new = window[len(prefix):]
        self._prefix_offset, self._read_offset, self._prefix = self._read_offset, end, None
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _prefix_text(self) -> str:
        if self._prefix is None:
            self._prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return self._prefix

    def _final_cut(self, prefix: str, window: str) -> tuple[int | None, str]:
        """Where the window's text is final although it ends in U+FFFD, and the text up to there:
        (None, window) while fewer than `PENDING` tokens wait, or no cut is clean yet."""
        ids, start = self._ids, self._prefix_offset
        if len(ids) - self._read_offset <= PENDING:
            return None, window
        for cut in range(len(ids) - 3, max(self._read_offset, len(ids) - 3 - CUT_TRIES), -1):
            head = self._decode(ids[start:cut])
            if len(head) >= len(prefix) and window.startswith(head):  # no character spans the cut
                return cut, head
        return None, window

    def replay(self, tokens: list[int], eos_ids: set[int]) -> None:
        """Push tokens already generated (a resume catching up), as the rounds pushed them: an
        end-of-sequence token has no text, and nothing follows a stop string."""
        for token in tokens:
            if token not in eos_ids and not self.stopped:
                self.push(token)

    def _open_prefix(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def release(self, final: bool = False) -> str:
        """The text not yet released; keeps back a possible stop-string prefix unless final."""
        if final and not self.stopped and self._read_offset < len(self._ids):
            prefix = self._prefix_text()
            self.text += self._decode(self._ids[self._prefix_offset:])[len(prefix):]
            self._read_offset, self._prefix = len(self._ids), None
        end = len(self.text) if final or self.stopped else max(self._emitted, len(self.text) - self._open_prefix())
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
