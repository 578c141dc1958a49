"""One session of a workload (`WorkItem`) and how its text is cut into words.

Shared by the bundled workloads (`loadtest.workloads`) and the ones built from public data
(`loadtest.realdata`), which both build `WorkItem`s.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

# A word and the whitespace after it: joining pieces gives the text back, line breaks and all.
WORD = re.compile(r"\S+\s*")


def cut_words(text: str, words: int) -> str:
    """The first `words` words of `text`, whitespace (line breaks, indentation) kept."""
    return "".join(WORD.findall(text)[:words]).rstrip()


@dataclass(frozen=True)
class WorkItem:
    id: str
    kind: str
    instruction: str
    document: str = ""
    system: str = ""  # a system prompt sent first (shared-system)
    followups: tuple[str, ...] = ()  # the later user turns of a multi-turn session (sharegpt-chat)
    history: tuple[tuple[str, str], ...] = ()  # (user, assistant) turns before this one (see at_turn)

    @property
    def turns(self) -> int:
        """Requests this session sends: its first user turn and the followups."""
        return 1 + len(self.followups)

    def content(self) -> str:
        """The (first) user message: the instruction, then the document after a blank line."""
        return "\n\n".join(x for x in (self.instruction, self.document) if x)

    def messages(self) -> list[dict[str, str]]:
        """The chat of the (first) request: system prompt, earlier turns, then this user message."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for user, assistant in self.history:
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return out + [{"role": "user", "content": self.content()}]

    def at_turn(self, answers: Sequence[str]) -> WorkItem:
        """The request for turn `len(answers)` (0-based) of this session, given the answers the server
        gave to the turns before it: a one-turn item whose history holds those turns."""
        users = [self.content(), *self.followups]
        if len(answers) >= len(users):
            raise ValueError(f"{self.id} has {len(users)} turns; no turn after {len(answers)} answers")
        if not answers:
            return self
        return replace(self, instruction=users[len(answers)], document="", followups=(),
                       history=self.history + tuple(zip(users, answers)))
