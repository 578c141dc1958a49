"""Chat turns as tokens: the first turn of a session, and a turn that continues one.

A continued session's history is tokens, not messages, so a new turn is rendered as what the
model's chat template adds after an earlier conversation: render a fixed scaffold conversation,
render it again followed by the new messages, and keep the difference. The template's default
system prompt is then not repeated, and the tokens equal those of the whole conversation
rendered at once (as the unit tests check against the template itself).
"""

from __future__ import annotations

import json

from specdec.errors import FailedPrecondition

# Control characters no real message holds, so the scaffold's parts can be found in the text.
_SCAFFOLD = ({"role": "system", "content": "\x1f"}, {"role": "user", "content": "\x1f"},
             {"role": "assistant", "content": "\x1e"})


TOOLS_PROMPT = ('Functions you may call: {tools}\nTo call one, answer <tool_call>{{"name": ..., "arguments": '
                '{{...}}}}</tool_call>.')


def takes_tools(tokenizer) -> bool:
    """Whether the model's chat template renders a `tools` argument."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in (template if isinstance(template, str) else json.dumps(template))


def first_turn(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The tokens of a new conversation, ending with the assistant's generation prompt. `tools` go
    to the chat template; a template that takes none gets them described in a system message."""
    if tools and not takes_tools(tokenizer):
        described = {"role": "system", "content": TOOLS_PROMPT.format(tools=json.dumps(tools, separators=(",", ":")))}
        messages, tools = [described, *messages], None
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def next_turn(tokenizer, messages: list[dict[str, str]], eos_ids: set[int]) -> tuple[list[int], list[int]]:
    """The tokens that continue a conversation with `messages`.

    Returns two forms: for a history whose last assistant message is still open (its generation
    stopped at a length limit or a stop string, so the end-of-turn marker is added first), and
    for a history that ends with an end-of-sequence token (the marker is partly there already).
    """
    render = tokenizer.apply_chat_template
    before = render(list(_SCAFFOLD), tokenize=False)
    after = render([*_SCAFFOLD, *messages], tokenize=False, add_generation_prompt=True)
    if not after.startswith(before) or "\x1e" not in before:
        raise FailedPrecondition("this model's chat template cannot continue a conversation turn by turn; "
                                 "send the whole conversation in a new session, or a raw prompt")
    turn = after[len(before):]
    closing = before[before.rindex("\x1e") + 1:]  # what ends an assistant message, e.g. "<|im_end|>\n"
    eos_texts = [tokenizer.decode([e]) for e in sorted(eos_ids)]
    after_eos = next((closing[len(e):] for e in eos_texts if e and closing.startswith(e)), closing)
    encode = tokenizer
    return (list(encode(closing + turn, add_special_tokens=False)["input_ids"]),
            list(encode(after_eos + turn, add_special_tokens=False)["input_ids"]))
