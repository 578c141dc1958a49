"""Incremental detokenization and stop strings."""

from __future__ import annotations

import pytest

from orchestrator.detokenizer import Detokenizer
from specdec.testing.tiny import make_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer()


def feed(tok, stream: Detokenizer, text: str) -> str:
    out = ""
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        if stream.stopped:
            break
        stream.push(t)
        out += stream.release()
    return out + stream.release(final=True)


def test_text_round_trips_without_stop_strings(tok):
    assert feed(tok, Detokenizer(tok), "Hello, world!\n") == "Hello, world!\n"


@pytest.mark.parametrize("text,stop,expected", [
    ("Hello END world", ["END"], "Hello "),
    ("abcabc", ["ca"], "ab"),
    ("no stop here", ["zzz"], "no stop here"),
    ("STOP at start", ["STOP"], ""),
    ("two stops b then a", ["a", "b"], "two stops "),
])
def test_stop_strings_cut_the_text(tok, text, stop, expected):
    stream = Detokenizer(tok, stop)
    assert feed(tok, stream, text) == expected
    assert stream.stopped == (expected != text)


def test_a_possible_stop_prefix_is_held_back_until_resolved(tok):
    stream = Detokenizer(tok, ["END"])
    released = ""
    for ch in "xEN":
        stream.push(tok.convert_tokens_to_ids(ch))
        released += stream.release()
    assert released == "x"  # "EN" could still become "END"
    stream.push(tok.convert_tokens_to_ids("d"))
    assert stream.release() == "ENd"  # "ENd" cannot: the held-back characters come out


def test_replaying_tokens_skips_ends_of_sequence_and_what_follows_a_stop(tok):
    eos = tok.eos_token_id
    stream = Detokenizer(tok, ["END"])
    stream.replay(tok("ab", add_special_tokens=False)["input_ids"] + [eos], {eos})
    assert stream.release(final=True) == "ab"
    stream = Detokenizer(tok, ["END"])
    stream.replay(tok("xENDyz", add_special_tokens=False)["input_ids"], {eos})
    assert stream.stopped and stream.release(final=True) == "x"


# -- invalid UTF-8: a bounded window ----------------------------------------------------------------


def byte_tokenizer():
    """A byte-level tokenizer with one token per byte (as GPT-2-style BPE vocabularies hold), whose
    decode turns bytes that are not UTF-8 into U+FFFD, as real ones do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    backend = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-to-unicode table maps to `char`."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table[char]


class Counting:
    """Wraps a tokenizer and counts the token ids it decodes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def btok():
    return byte_tokenizer()


def stream_text(tokenizer, ids: list[int], stop=()) -> str:
    stream, out = Detokenizer(tokenizer, stop), ""
    for t in ids:
        stream.push(t)
        out += stream.release()
        if stream.stopped:
            break
    return out + stream.release(final=True)


def test_the_byte_tokenizer_decodes_bytes_as_utf8_with_replacement(btok):
    assert btok.decode([0xE2, 0x82, 0xAC]) == "€" and btok.decode([0x80, 0x41]) == "\ufffdA"


def test_lone_continuation_bytes_cost_a_bounded_window_per_token(btok):
    """4,096 bytes that never complete a character (forceable with logit_bias and ignore_eos): the
    work per token stays bounded, where a window that never advances decoded millions of tokens."""
    n = 4096
    counting = Counting(btok)
    text = stream_text(counting, [0x80] * n)
    assert text == "\ufffd" * n
    assert counting.decoded < 64 * n, counting.decoded  # O(n); a window that never advanced decoded n^2/2 = 8.4M


@pytest.mark.parametrize("seed", range(40))
def test_streamed_text_equals_the_whole_decode_for_any_bytes(btok, seed):
    """Valid characters of 1 to 4 bytes mixed with invalid bytes and truncated sequences: the text
    released token by token is exactly the decode of all the tokens."""
    import random

    rng = random.Random(seed)
    pieces = [b"a", "é".encode(), "€".encode(), "😀".encode(), b"\x80", b"\xe2\x82", b"\xf0\x9f", b"\xc3",
              b"\xff", b"\xe2\x41"]
    data = b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 300)))
    ids = list(data)
    assert stream_text(btok, ids) == btok.decode(ids)


def test_a_stop_string_after_invalid_bytes_still_stops(btok):
    ids = [0x80] * 50 + list(b"xxEND") + [0x80] * 5
    assert stream_text(btok, ids, stop=["END"]) == "\ufffd" * 50 + "xx"


def test_special_tokens_that_decode_to_nothing_cost_a_bounded_window_too(tok):
    """A run of tokens with no text (special tokens are skipped) never grows the window either."""
    n = 2048
    counting = Counting(tok)
    bos = tok.convert_tokens_to_ids("<s>")
    ids = [bos] * n + tok("ok", add_special_tokens=False)["input_ids"]
    assert stream_text(counting, ids) == "ok"
    assert counting.decoded < 64 * n, counting.decoded
