"""Grammar bombs: a grammar is a program its sender writes, and compiling one must stay bounded in
size, nesting, native stack, engine work and time, off the event loop and the model thread, and
be refused with INVALID_ARGUMENT naming the grammar and the bound."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest

from specdec.core.grammar import DEFAULT_LIMITS, GrammarFailed, GrammarLimits, GrammarSpec, nesting_depth
from specdec.core.sampling import SamplingParams
from specdec.errors import InvalidArgument
from specdec.runtime.grammars import GrammarWorker, SessionGrammars, check_grammar
from specdec.testing.tiny import make_char_tokenizer


def ref_chain(size: int) -> str:
    """A JSON schema of `$ref`s, each to the next, as many as `size` bytes hold (flat text, deep grammar)."""
    def make(n: int) -> str:
        defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)}
        defs[f"d{n}"] = {"type": "integer"}
        return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}, separators=(",", ":"))
    n = 1
    while len(make(2 * n)) <= size:
        n *= 2
    step = n // 2
    while step:
        if len(make(n + step)) <= size:
            n += step
        step //= 2
    return make(n)


def lark_chain(size: int) -> str:
    """A Lark grammar of rules, each the next one, as many as `size` bytes hold."""
    n = size // 12
    return "start:a0\n" + "".join(f"a{i}:a{i + 1}\n" for i in range(n)) + f'a{n}:"z"\n'


@pytest.mark.parametrize(("spec", "message"), [
    (GrammarSpec("regex", "a" * (DEFAULT_LIMITS.max_bytes + 1)), "text is 65537 bytes, over the limit of 65536"),
    (GrammarSpec("json_schema", "[" * 100_000 + "]" * 100_000), "over the limit of 65536"),
    (GrammarSpec("json_schema", "[" * 1000 + "]" * 1000), "text nests 1000 levels deep, over the limit of 100"),
    (GrammarSpec("lark", "start: " + "(" * 500 + '"a"' + ")" * 500), "nests 500 levels deep"),
    (GrammarSpec("ebnf", "root ::= " + "(" * 500 + '"a"' + ")" * 500), "nests 500 levels deep"),
])
def test_a_grammar_over_a_size_or_nesting_bound_is_refused_before_any_engine_sees_it(spec, message):
    """Deep JSON once escaped as RecursionError (a server error); now every bound is a ValueError."""
    started = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        spec.validate()
    assert time.perf_counter() - started < 1.0


def test_nesting_is_measured_without_recursion_and_json_strings_do_not_count():
    assert nesting_depth('{"pattern": "((((((", "items": [{"a": 1}]}', json=True) == 3
    assert nesting_depth("(a(b)[c]{2})") == 2
    assert nesting_depth("(" * 1_000_000) == 1_000_000


CHAINS = {"json_schema $ref chain": ("json_schema", ref_chain), "lark rule chain": ("lark", lark_chain)}


@pytest.mark.parametrize("name", list(CHAINS))
def test_a_deep_chain_within_the_size_bound_does_not_crash_the_process(name):
    """A 64 KiB chain of $refs or rules overflowed the 8 MiB stack of a main thread in llguidance
    and killed the process (SIGSEGV): compiled on the grammar worker's thread it completes. In a
    child process, so that a crash is a failure here, not the end of the test run."""
    kind, make = CHAINS[name]
    script = (f"import asyncio\nfrom specdec.core.sampling import SamplingParams\n"
              f"from specdec.core.grammar import DEFAULT_LIMITS\nfrom specdec.runtime.grammars import check_grammar\n"
              f"from tests.unit.test_grammar_limits import {make.__name__}\n"
              f"text = {make.__name__}(DEFAULT_LIMITS.max_bytes)\n"
              f"asyncio.run(check_grammar(SamplingParams(grammar_kind={kind!r}, grammar_text=text), DEFAULT_LIMITS))\n"
              "print('compiled', len(text))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "compiled" in done.stdout, (done.returncode, done.stderr[-2000:])


async def test_compiling_runs_on_the_worker_thread_and_a_slow_one_is_cut_at_the_time_bound():
    worker = GrammarWorker(timeout_s=0.2)
    assert await worker.run("quick", lambda: threading.current_thread().name) == "grammar-compile"
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    started = time.monotonic()
    with pytest.raises(InvalidArgument, match=r"grammar: compiling it took over 0.2 s \(the limit\)"):
        await worker.run("slow", lambda: time.sleep(1.0))
    assert time.monotonic() - started < 0.8
    assert ticks >= 5  # the event loop ran meanwhile
    ticker.cancel()
    with pytest.raises(InvalidArgument, match="took over 0.2 s before"):  # sent again: refused at once
        await worker.run("slow", lambda: None)
    assert await worker.run("after", lambda: 42) == 42  # once the slow one is over, the worker goes on


async def test_the_time_bound_counts_from_when_the_work_starts_not_while_it_queues():
    worker = GrammarWorker(timeout_s=0.5)
    first = asyncio.ensure_future(worker.run("a", lambda: time.sleep(0.3)))
    await asyncio.sleep(0.05)
    assert await worker.run("b", lambda: time.sleep(0.3) or "b") == "b"  # waited 0.25 s, ran 0.3 s: within
    await first


@pytest.fixture(scope="module")
def grammars() -> SessionGrammars:
    tokenizer = make_char_tokenizer()
    return SessionGrammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


async def test_a_service_refuses_a_grammar_over_its_bounds_naming_the_grammar(grammars):
    with pytest.raises(InvalidArgument, match="grammar: text is .* bytes, over the limit of 262144"):
        await grammars.prepare(GrammarSpec("regex", "a" * (256 * 1024 + 1)))
    with pytest.raises(InvalidArgument, match="grammar: text is not a valid regex"):
        await grammars.prepare(GrammarSpec("regex", "(unclosed"))


async def test_a_regex_that_builds_a_huge_lexer_is_refused_by_the_engines_limits(grammars):
    """`(a{1000}){1000}` is 20 bytes; with llguidance's default limits its lexer took 2.4 s and
    195 MB. Under `PARSER_LIMITS` it stops within its fuel, and the request gets INVALID_ARGUMENT
    naming the grammar (not an internal error) at the first token that needs more."""
    spec = GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "^(a{1000}){1000}$"}))
    started = time.perf_counter()
    with pytest.raises(InvalidArgument, match="grammar: the grammar engine gave up"):
        await grammars.prepare(spec)
        grammars.block_masks("bomb", spec, [], [])
        grammars.block_masks("bomb", spec, [grammars._tokenizer.convert_tokens_to_ids('"')], [])
    assert time.perf_counter() - started < 5.0


def test_an_engine_failure_mid_output_is_a_value_error_naming_the_position():
    assert issubclass(GrammarFailed, ValueError)  # services answer INVALID_ARGUMENT, not INTERNAL
    assert "after 3 tokens of output: lexer error" in str(GrammarFailed("lexer error", 3))


async def test_the_orchestrators_check_refuses_with_the_grammar_named():
    params = SamplingParams(grammar_kind="json_schema", grammar_text="[" * 200 + "]" * 200)
    with pytest.raises(InvalidArgument, match="grammar: text nests 200 levels deep"):
        await check_grammar(params, GrammarLimits())
    await check_grammar(SamplingParams(grammar_kind="regex", grammar_text="[0-9]+"), GrammarLimits())
    await check_grammar(SamplingParams(), GrammarLimits())  # no grammar: nothing to check


async def test_work_whose_caller_left_before_it_started_is_dropped():
    worker = GrammarWorker(timeout_s=5)
    ran = []
    first = asyncio.ensure_future(worker.run("a", lambda: time.sleep(0.3)))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(worker.run("b", lambda: ran.append("b")))
    await asyncio.sleep(0.05)
    second.cancel()  # its client went away while it queued
    await first
    assert await worker.run("c", lambda: "c") == "c" and ran == []
