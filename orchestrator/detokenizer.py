"""The incremental detokenizer of a generation's stream, with stop strings.

Text is released as tokens arrive, holding back an incomplete UTF-8 character (decoded as
U+FFFD) and any tail that could still grow into a stop string. Decoding works on a short window
of recent tokens (the offsets trick of text-generation-inference), so a round costs the same at
token 10 and at token 10,000.
"""

from __future__ import annotations

from collections.abc import Sequence


class Detokenizer:
    """Turns a generation's tokens into text as they arrive (`push`, then `release` the text ready)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = 0  # tokens already turned into text
        self.text = ""  # all text decoded so far (including held-back characters)
        self._emitted = 0  # characters of self.text already released
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token: int) -> None:
        """Add one token; sets `stopped` (and trims `text`) when a stop string completes."""
        assert not self.stopped, "push after a stop string"
        self._ids.append(token)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        new = window[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

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
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
            self.text += self._decode(self._ids[self._prefix_offset:])[len(prefix):]
            self._read_offset = len(self._ids)
        end = len(self.text) if final or self.stopped else max(self._emitted, len(self.text) - self._open_prefix())
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
