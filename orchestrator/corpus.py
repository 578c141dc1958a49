"""Corpus groups: whose finished outputs may draft whose requests.

A suffix-speculation draft keeps a corpus of earlier outputs, and what it proposes shows in the
round statistics every chunk carries (`proposed`, `accepted`): with greedy decoding and a
`logit_bias` on a candidate token, `accepted >= 1` tells a caller the corpus's next token, and so,
token by token, another caller's output. So outputs are kept per *corpus group*, and a request
drafts only from its own group's: by default each principal (`specdec.server.auth.principal_of`)
is a group of its own, and the anonymous principal "" (no authentication) is one group, so a
deployment without tokens shares one corpus, as a single tenant would. An operator may put
identities that trust each other in one group (`--corpus-groups`).

What travels (on `ProposeRequest.corpus_group` and in the outputs stream's `group` field) is an
opaque id: a hash of the group's name, or of the principal, never an identity or a token.
"""

from __future__ import annotations

import hashlib
import re

from specdec.server.auth import principal_of

EVERYONE = "*"  # as a member: every authenticated identity not named in another group
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _group_id(kind: str, name: str) -> str:
    return hashlib.sha256(f"specdec-corpus\0{kind}\0{name}".encode()).hexdigest()[:32]


class CorpusGroups:
    """Maps a session's principal to its corpus group id (see the module docstring)."""

    def __init__(self, members: dict[str, str] | None = None, everyone: str = "") -> None:
        """`members`: identity -> group name; `everyone`: the group of every other identity ("": each
        its own)."""
        self._by_principal = {principal_of(identity): _group_id("group", group)
                              for identity, group in (members or {}).items()}
        self._everyone = _group_id("group", everyone) if everyone else ""

    @classmethod
    def parse(cls, spec: str) -> CorpusGroups:
        """`GROUP=IDENTITY,IDENTITY;GROUP=...` (identities as the tokens file names them: a token's
        name, or `token-<12 hex>` for an unnamed one; `*` for every identity not named elsewhere).
        `ValueError` naming what is wrong."""
        members: dict[str, str] = {}
        everyone = ""
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            group, sep, names = part.partition("=")
            group = group.strip()
            if not sep or not _NAME.fullmatch(group):
                raise ValueError(f"{part!r}: expected GROUP=IDENTITY[,IDENTITY...] with a group name of letters, "
                                 "digits, '_', '.' or '-'")
            identities = [n.strip() for n in names.split(",") if n.strip()]
            if not identities:
                raise ValueError(f"group {group!r} names no identity")
            for identity in identities:
                if identity == EVERYONE:
                    if everyone:
                        raise ValueError(f"'*' is in two groups ({everyone!r} and {group!r})")
                    everyone = group
                elif identity in members:
                    raise ValueError(f"identity {identity!r} is in two groups ({members[identity]!r} and {group!r})")
                else:
                    members[identity] = group
        return cls(members, everyone)

    def of(self, principal: str) -> str:
        """The corpus group id of a session opened by `principal` ("" for the anonymous one)."""
        if not principal:
            return ""
        return self._by_principal.get(principal) or self._everyone or _group_id("principal", principal)
