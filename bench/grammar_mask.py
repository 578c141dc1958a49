"""Grammar engines on CPU: compile time and per-token mask / advance / rollback cost.

Compares xgrammar, llguidance and outlines-core with the packaged model's tokenizer
(SmolLM2, V = 49152) on one JSON schema (nested object, array, enum, integer, string).
For each library it measures:

- *tokenizer setup*: building the library's vocabulary structure (once per model);
- *compile*: schema -> compiled grammar, caches off (median over `--compiles` runs);
- *first_mask*: the first mask of a fresh matcher (lazy work after compile shows up here);
- *mask*: filling the allowed-token bitmask `[ceil(V / 32)]` int32 at every position while
  walking a valid document token by token (median and p90 over all positions and repeats);
- *advance*: consuming one token; *rollback*: undoing one token, and undoing a block of 4
  (what a rejected speculative block needs).

Writes bench/results/grammar_mask.json. Short by design (about a minute on 2 shared cores):

    .venv/bin/python bench/grammar_mask.py
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "grammar_mask.json"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "tags": ["math", "engines", "poetry"],
    "address": {"city": "London", "zip": 10115},
}
BLOCK = 4  # tokens undone by the "rollback block" measurement


def _us(seconds: list[float]) -> dict[str, float]:
    """Median and p90 of durations in seconds, as microseconds."""
    xs = sorted(seconds)
    p90 = xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]
    return {"median_us": round(statistics.median(xs) * 1e6, 2), "p90_us": round(p90 * 1e6, 2),
            "n": len(xs)}


def _timed(fn: Callable[..., object], *args: object) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


class Engine:
    """One library behind the four operations the walk needs."""

    name = ""

    def setup(self, tokenizer, vocab_size: int, eos: int) -> None: ...
    def compile(self, schema: str) -> object: ...
    def matcher(self, compiled: object) -> object: ...
    def fill(self, m: object, bitmask: torch.Tensor) -> None: ...
    def advance(self, m: object, token: int) -> bool: ...
    def rollback(self, m: object, n: int) -> None: ...


class XGrammar(Engine):
    name = "xgrammar"

    def setup(self, tokenizer, vocab_size, eos):
        import xgrammar as xg

        self.xg = xg
        self.info = xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=[eos])

    def compile(self, schema):
        compiler = self.xg.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(schema, any_whitespace=True)

    def matcher(self, compiled):
        return self.xg.GrammarMatcher(compiled)

    def fill(self, m, bitmask):
        m.fill_next_token_bitmask(bitmask)

    def advance(self, m, token):
        return m.accept_token(token)

    def rollback(self, m, n):
        m.rollback(n)


class LLGuidance(Engine):
    name = "llguidance"

    def setup(self, tokenizer, vocab_size, eos):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.fill_fn = llguidance.torch.fill_next_token_bitmask
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        m = self.ll.LLMatcher(self.tok, grammar)  # llguidance compiles when the matcher is built
        assert not m.is_error(), m.get_error()
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled)

    def fill(self, m, bitmask):
        self.fill_fn(m, bitmask, 0)

    def advance(self, m, token):
        return m.consume_token(token)

    def rollback(self, m, n):
        m.rollback(n)


class OutlinesCore(Engine):
    name = "outlines-core"

    def setup(self, tokenizer, vocab_size, eos):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = outlines_core
        self.to_regex = build_regex_from_schema
        # GPT-2 byte-level BPE: map each token's unicode form back to its raw bytes.
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
            + list(range(ord("®"), ord("ÿ") + 1))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        byte_of = {chr(c): b for b, c in zip(bs, cs)}
        special = set(tokenizer.all_special_ids)
        vocab: dict[bytes, list[int]] = {}
        for text, i in tokenizer.get_vocab().items():
            if i in special:
                continue
            vocab.setdefault(bytes(byte_of[ch] for ch in text), []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, vocab)

    def compile(self, schema):
        return self.oc.Index(self.to_regex(schema), self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled, max_rollback=64)

    def fill(self, m, bitmask):
        m.write_mask_into(bitmask.data_ptr(), bitmask.numel(), bitmask.element_size())

    def advance(self, m, token):
        m.advance(token, return_tokens=False)
        return True

    def rollback(self, m, n):
        m.rollback_state(n)


def measure(engine: Engine, tokenizer, vocab_size: int, eos: int, tokens: list[int],
            compiles: int, repeats: int) -> dict:
    """Setup, compile and walk `tokens` `repeats` times with one engine."""
    setup_s, _ = _timed(engine.setup, tokenizer, vocab_size, eos)
    schema = json.dumps(SCHEMA)
    compile_s = [_timed(engine.compile, schema)[0] for _ in range(compiles)]
    compiled = engine.compile(schema)
    bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)  # [1, ceil(V/32)]
    first_s = []  # a fresh matcher's first mask (llguidance builds lexer states lazily)
    for _ in range(compiles):
        m = engine.matcher(engine.compile(schema))
        first_s.append(_timed(engine.fill, m, bitmask)[0])
    mask_s, adv_s, rb1_s, rbk_s, allowed = [], [], [], [], []
    for _ in range(repeats):
        m = engine.matcher(compiled)
        for i, t in enumerate(tokens):
            mask_s.append(_timed(engine.fill, m, bitmask)[0])
            allowed.append(_popcount(bitmask))
            assert (int(bitmask[0, t // 32]) >> (t % 32)) & 1, f"{engine.name}: token {i} refused"
            dt, ok = _timed(engine.advance, m, t)
            assert ok, f"{engine.name}: advance refused token {i}"
            adv_s.append(dt)
            rb1_s.append(_timed(engine.rollback, m, 1)[0])
            engine.advance(m, t)
            if i + 1 >= BLOCK:
                rbk_s.append(_timed(engine.rollback, m, BLOCK)[0])
                for u in tokens[i + 1 - BLOCK: i + 1]:
                    engine.advance(m, u)
        engine.fill(m, bitmask)
        assert (int(bitmask[0, eos // 32]) >> (eos % 32)) & 1, f"{engine.name}: EOS refused at end"
    return {
        "tokenizer_setup_ms": round(setup_s * 1e3, 1),
        "compile_ms": round(statistics.median(compile_s) * 1e3, 2),
        "compile_ms_all": [round(s * 1e3, 2) for s in compile_s],
        "first_mask": _us(first_s), "mask": _us(mask_s), "advance": _us(adv_s), "rollback_1": _us(rb1_s),
        f"rollback_{BLOCK}": _us(rbk_s),
        "allowed_tokens_median": statistics.median(allowed[: len(tokens)]),
    }


def _popcount(bitmask: torch.Tensor) -> int:
    b = bitmask.view(torch.uint8)
    return int(sum(bin(x).count("1") for x in b.flatten().tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compiles", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoTokenizer

    from specdec.runtime.models import resolve_model_path

    path = resolve_model_path("default")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    vocab_size, eos = len(tokenizer), int(tokenizer.eos_token_id)
    document = json.dumps(DOCUMENT, separators=(",", ":"))
    tokens = tokenizer.encode(document, add_special_tokens=False)

    results: dict[str, dict] = {}
    for engine in (XGrammar(), LLGuidance(), OutlinesCore()):
        try:
            results[engine.name] = measure(engine, tokenizer, vocab_size, eos, tokens,
                                           args.compiles, args.repeats)
        except Exception as e:  # noqa: BLE001 - a library that fails is recorded, not fatal
            results[engine.name] = {"error": f"{type(e).__name__}: {e}"}
        print(engine.name, json.dumps(results[engine.name]))

    from importlib.metadata import version

    out = {
        "what": "CPU cost of JSON-schema grammar masks with the SmolLM2 tokenizer",
        "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": 1},
        "tokenizer": path, "vocab_size": vocab_size, "eos_token_id": eos,
        "schema": SCHEMA, "document": document, "document_tokens": len(tokens),
        "versions": {n: version(n) for n in ("xgrammar", "llguidance", "outlines_core")},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
