"""The documentation keeps its promises:

- the README stays a README (at most `README_LINES` lines) and holds runnable blocks
  (tests/system/test_readme.py runs them against a pipeline);
- every command the README and docs/ show (`specdec ...`, `python -m MODULE ...`, `python
  SCRIPT.py ...`, `make TARGET`), in a code block or inline, names only subcommands, flags and
  choices the real argparse parser of that command has;
- every relative link points at a file that exists, and at a heading that exists in it;
- docs/configuration.md is what `python scripts/configdoc.py` generates from the config objects;
- the pages for users cite no commit ids and tell no history ("this round", "the issue").
"""

from __future__ import annotations

import argparse
import functools
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_LINES = 300
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
# The pages written for users, which must read as a product's (the design pages may cite history).
USER_PAGES = [README, *(ROOT / "docs" / name for name in ("README.md", "usage.md", "configuration.md",
                                                           "deploy.md", "security.md", "benchmarks.md"))]
RUNNABLE = re.compile(r"<!-- runnable -->\n```(\w+)\n(.*?)\n```", re.S)
FENCE = re.compile(r"^[ \t]*```(\w*)[^\n]*\n(.*?)\n[ \t]*```", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
SHELLS = ("bash", "sh", "shell", "console", "")
COMMANDS = ("specdec", "python", "make")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# -- the commands ---------------------------------------------------------------------------------


def _shell_lines(block: str) -> list[str]:
    """A shell block as logical lines (continuations joined)."""
    return block.replace("\\\n", " ").splitlines()


def _commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at |, &&, ;), comments and env assignments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: not a command line
        return []
    commands, current = [], []
    for token in [*tokens, ";"]:
        if token and set(token) <= set("|&;"):
            while current and re.fullmatch(r"[A-Z_]+=.*", current[0]):
                current.pop(0)
            if current and current[0] in COMMANDS:
                commands.append(current)
            current = []
        else:
            current.append(token)
    return commands


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every command in the README and docs: shell blocks and inline code."""
    found = []
    for path in DOCS:
        text = _text(path)
        where = path.relative_to(ROOT)
        for lang, block in FENCE.findall(text):
            if lang in SHELLS:
                found += [(f"{where}: {line.strip()}", argv) for line in _shell_lines(block)
                          for argv in _commands(line)]
        prose = FENCE.sub("", text)
        for span in INLINE.findall(prose):
            span = " ".join(span.split())
            if span.split(" ", 1)[0] in COMMANDS and " " in span:
                found += [(f"{where}: `{span}`", argv) for argv in _commands(span)]
    return found


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def _captured(run, name: str) -> argparse.ArgumentParser:
    """The first parser a program asks to parse its arguments (the program stops there)."""
    def grab(self, *_args, **_kwargs):
        raise _Parsed(self)

    saved_path, saved_argv = list(sys.path), list(sys.argv)
    sys.argv[:] = [name]  # a program that reads sys.argv itself sees no arguments
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_known_args", grab), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: a module already imported as a library
            run()
    except _Parsed as parsed:
        return parsed.parser
    finally:
        sys.path[:], sys.argv[:] = saved_path, saved_argv
    raise AssertionError(f"{name} parsed no arguments")


@functools.cache
def parser_of(program: tuple[str, ...]) -> argparse.ArgumentParser:
    """The real parser of `specdec`, `python -m MODULE` or `python SCRIPT.py`."""
    if program == ("specdec",):
        from specdec.cli import build_parser

        return build_parser()
    if program[:2] == ("python", "-m"):
        return _captured(lambda: runpy.run_module(program[2], run_name="__main__", alter_sys=True), program[2])
    script = ROOT / program[1]
    assert script.is_file(), f"{program[1]} does not exist"
    return _captured(lambda: runpy.run_path(str(script), run_name="__main__"), program[1])


def _placeholder(value: str) -> bool:
    return bool(re.search(r"[|$<>…]|\.\.\.|^[A-Z_]+$", value))


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def check_argv(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """What in `args` the parser does not know: subcommands, options, choices."""
    problems, i = [], 0
    while i < len(args):
        token = args[i]
        if token.startswith("-") and not re.fullmatch(r"-[0-9.]+", token):
            name, eq, value = token.partition("=")
            action = parser._option_string_actions.get(name)
            if action is None:
                problems.append(f"{parser.prog}: no option {name}")
            elif action.nargs != 0:
                if not eq and i + 1 < len(args):
                    value, i = args[i + 1], i + 1
                if action.choices is not None and value and not _placeholder(value) \
                        and value not in {str(c) for c in action.choices}:
                    problems.append(f"{parser.prog} {name}: {value!r} is not one of {sorted(action.choices)}")
        elif (sub := _subparsers(parser)) is not None:
            if token not in sub.choices:
                problems.append(f"{parser.prog}: no command {token!r} (choices: {sorted(sub.choices)})")
                return problems
            parser = sub.choices[token]
        i += 1
    return problems


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-zA-Z][\w-]*):", _text(ROOT / "Makefile"), re.M))


def test_the_docs_show_commands():
    programs = {argv[0] for _, argv in documented_commands()}
    assert {"specdec", "python", "make"} <= programs


@pytest.mark.parametrize("program", ["specdec", "python -m", "python script", "make"])
def test_every_documented_command_uses_only_what_its_parser_has(program):
    problems = []
    for where, argv in documented_commands():
        if argv[0] == "make":
            if program == "make":
                problems += [f"{where}: no make target {t}" for t in argv[1:2]
                             if "=" not in t and t not in _make_targets()]
            continue
        if argv[0] == "specdec" and program == "specdec":
            problems += [f"{where}: {p}" for p in check_argv(parser_of(("specdec",)), argv[1:])]
        elif argv[:2] == ["python", "-m"] and program == "python -m":
            problems += [f"{where}: {p}" for p in check_argv(parser_of(tuple(argv[:3])), argv[3:])]
        elif argv[0] == "python" and len(argv) > 1 and argv[1].endswith(".py") and program == "python script":
            problems += [f"{where}: {p}" for p in check_argv(parser_of(tuple(argv[:2])), argv[2:])]
    assert not problems


def test_the_flag_check_catches_a_wrong_flag_a_wrong_choice_and_a_wrong_command():
    parser = parser_of(("specdec",))
    assert check_argv(parser, ["up", "--detach", "--proposer", "ngram"]) == []
    assert check_argv(parser, ["up", "--proposer", "suffix|ngram"]) == []  # a placeholder
    assert check_argv(parser, ["generate", "x", "--max-tokens", "3"]) == ["specdec generate: no option --max-tokens"]
    assert check_argv(parser, ["up", "--proposer", "magic"])[0].startswith("specdec up --proposer: 'magic'")
    assert check_argv(parser, ["launch"])[0].startswith("specdec: no command 'launch'")
    assert _commands("printf 'Hi\\n' | specdec chat --json  # a comment") == [["specdec", "chat", "--json"]]


# -- the README ----------------------------------------------------------------------------------


def test_the_readme_is_a_readme():
    lines = _text(README).splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_the_readme_has_runnable_blocks_of_each_interface():
    blocks = RUNNABLE.findall(_text(README))
    assert {lang for lang, _ in blocks} == {"bash", "python"}
    text = "\n".join(block for _, block in blocks)
    assert "specdec generate" in text and "from specdec import Client" in text and "from openai import" in text


# -- links and pages -----------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", _text(path))
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_relative_link_resolves():
    problems = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", _text(path))):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                problems.append(f"{path.relative_to(ROOT)}: {target} does not exist")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                problems.append(f"{path.relative_to(ROOT)}: {target}: no such heading")
    assert not problems


def test_the_configuration_page_is_the_generated_one():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "configdoc.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_user_pages_cite_no_commits_and_tell_no_history(page):
    text = _text(page)
    commits = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", w) and re.search(r"\d", w)]
    history = re.findall(r"this round|earlier rounds?|the issue|issue #?\d+|#\d+\b|since [0-9a-f]{7}", text, re.I)
    assert not commits and not history
