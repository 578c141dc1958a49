"""A chat turn that continues a session renders exactly as the whole conversation would."""

from __future__ import annotations

import pytest

from orchestrator.chat import first_turn, next_turn
from specdec.errors import FailedPrecondition
from specdec.runtime.models import load_tokenizer
from specdec.testing.tiny import make_char_tokenizer

TURN1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
REPLY = "Blue, like the sky."
TURN2 = [{"role": "user", "content": "And a fruit?"}]


def _eos_ids(tokenizer) -> set[int]:
    return {tokenizer.eos_token_id}


def _check(tokenizer, reply_ends_with_eos: bool):
    eos = _eos_ids(tokenizer)
    history = first_turn(tokenizer, TURN1) + tokenizer(REPLY, add_special_tokens=False)["input_ids"]
    if reply_ends_with_eos:
        history.append(tokenizer.eos_token_id)
    open_ids, after_eos = next_turn(tokenizer, TURN2, eos)
    continued = history + (after_eos if reply_ends_with_eos else open_ids)
    whole = first_turn(tokenizer, [*TURN1, {"role": "assistant", "content": REPLY}, *TURN2])
    # The generated end-of-sequence token stays in the history; apart from it, the text is the same.
    assert tokenizer.decode(continued, skip_special_tokens=True) == tokenizer.decode(whole, skip_special_tokens=True)
    return continued, whole


@pytest.mark.parametrize("eos", [True, False])
def test_tiny_template_turns(eos):
    tokenizer = make_char_tokenizer()
    continued, whole = _check(tokenizer, eos)
    if not eos:  # the tiny template closes a message with "\n" and has no end-of-turn token
        assert continued == whole


@pytest.mark.slow
@pytest.mark.parametrize("eos", [True, False])
def test_default_model_template_turns(eos):
    """SmolLM2's template adds a default system prompt; a continued turn must not repeat it."""
    tokenizer = load_tokenizer("default")
    continued, whole = _check(tokenizer, eos)
    assert continued == whole
    text = tokenizer.decode(continued)
    assert text.count("<|im_start|>system") == 1


def test_template_that_cannot_continue_is_refused():
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = "{{ messages[-1]['content'] }}"  # drops all but the last message
    with pytest.raises(FailedPrecondition, match="cannot continue a conversation"):
        next_turn(tokenizer, TURN2, _eos_ids(tokenizer))
