"""Workloads: the bundled prompt sets, their input lengths, and the order requests are sent in.

Bundled in `loadtest/workloads/` (one JSON object a line: `id`, `kind`, `instruction`, and an
optional `document`, the input the instruction works on; all text written for this project):
- `chat`: open questions and requests, nothing to copy from;
- `grounded`: summarise, correct, extract from or reformat a given text: the answer repeats
  much of its input, which is where prompt lookup shines;
- `code`: write code, or rework code given in the prompt.

`input_words` sets the length of every request's input: a document longer than that is cut
after that many words (whitespace kept, so code stays code); a shorter one, or none, is padded
with prose from the bundled documents, after a blank line.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

BUNDLED = ("chat", "grounded", "code")


@dataclass(frozen=True)
class WorkItem:
    id: str
    kind: str
    instruction: str
    document: str = ""

    def content(self) -> str:
        return f"{self.instruction}\n\n{self.document}" if self.document else self.instruction

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.content()}]


def _parse(text: str, source: str) -> list[WorkItem]:
    items = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            items.append(WorkItem(id=str(obj["id"]), kind=str(obj.get("kind", "chat")),
                                  instruction=str(obj["instruction"]), document=str(obj.get("document", ""))))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{source}:{number}: a workload line needs JSON with 'id' and 'instruction' "
                             f"({type(exc).__name__}: {exc})") from None
    return items


def bundled(kind: str) -> list[WorkItem]:
    if kind not in BUNDLED:
        raise ValueError(f"unknown bundled workload {kind!r}; choose from {', '.join(BUNDLED)}, or give a .jsonl path")
    text = resources.files(__package__).joinpath("workloads", f"{kind}.jsonl").read_text(encoding="utf-8")
    return _parse(text, f"{kind}.jsonl")


def load_workload(spec: str) -> list[WorkItem]:
    """`chat,grounded,code` (any of the bundled sets, or `all`), or the path of a .jsonl file."""
    items: list[WorkItem] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part == "all":
            items += [x for kind in BUNDLED for x in bundled(kind)]
        elif part in BUNDLED:
            items += bundled(part)
        else:
            path = Path(part)
            if not path.is_file():
                raise ValueError(f"workload {part!r} is neither a bundled set ({', '.join(BUNDLED)}) nor a file")
            items += _parse(path.read_text(encoding="utf-8"), str(path))
    if not items:
        raise ValueError(f"the workload {spec!r} has no prompts")
    return items


_WORD = re.compile(r"\S+\s*")


def filler_words() -> list[str]:
    """Words of the bundled grounded documents: the prose that pads short inputs."""
    return [w.strip() for x in bundled("grounded") for w in _WORD.findall(x.document)]


def fit_document(document: str, words: int, filler: Sequence[str], offset: int = 0) -> str:
    """The document cut to `words` words, or padded to them with filler words (from `offset`)."""
    if words < 0:
        raise ValueError(f"input_words must not be negative, got {words}")
    pieces = _WORD.findall(document)
    if len(pieces) >= words:
        return "".join(pieces[:words]).rstrip()
    if not filler:
        raise ValueError("no filler words to pad with")
    missing = words - len(pieces)
    pad = " ".join(filler[(offset + i) % len(filler)] for i in range(missing))
    head = "".join(pieces).rstrip()
    return f"{head}\n\n{pad}" if head else pad


def shape_inputs(items: Sequence[WorkItem], input_words: int | None, seed: int = 0) -> list[WorkItem]:
    """Every item's document set to `input_words` words (None: unchanged)."""
    if input_words is None:
        return list(items)
    filler = filler_words()
    rng = random.Random(seed)
    return [replace(x, document=fit_document(x.document, input_words, filler, rng.randrange(len(filler))))
            for x in items]


def request_order(items: Sequence[WorkItem], seed: int = 0) -> Iterator[WorkItem]:
    """An endless, seeded sequence of items: kinds take turns (so any stretch is a balanced mix),
    each kind's items in a fresh shuffled order every pass."""
    if not items:
        raise ValueError("no workload items")
    rng = random.Random(seed)
    kinds: dict[str, list[WorkItem]] = {}
    for x in items:
        kinds.setdefault(x.kind, []).append(x)

    def cycle(group: list[WorkItem]) -> Iterator[WorkItem]:
        while True:
            order = list(group)
            rng.shuffle(order)
            yield from order

    streams = [cycle(kinds[k]) for k in kinds]
    for stream in itertools.cycle(streams):
        yield next(stream)
