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
