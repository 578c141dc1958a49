"""Structured output: grammar masks over the vocabulary, for both sides of speculative decoding.

Glossary (see sampling.py and acceptance.py): `V` is the logits width, `k` the number of draft
tokens. A *mask* is a `BoolTensor [V]`, true where the grammar allows the token next. Masking
`p` and `q` alike with the same grammar state keeps speculative decoding lossless with
respect to the masked target: the draft proposes from masked `q_i`, the target verifies
against masked `p_i`, and row `i` of both uses the mask after the first `i` draft tokens
(`GrammarState.block_masks`).

Engine: llguidance (guidance-ai, MIT), chosen by measurement against xgrammar and outlines-core
(`python bench/grammar_mask.py`; the figures are in docs/benchmarks.md, "Grammar masks"):
- every kind we need natively: JSON schema, regex, choice, Lark, and GBNF ("ebnf") through
  its converter; outlines-core is regex-only (no recursive grammars, no Lark/EBNF);
- a light install: one abi3 wheel with no dependencies, where xgrammar declares a GPU compiler
  (`triton`) as a hard dependency on Linux x86_64;
- its masks are slower than xgrammar's, but a round's masks cost well under 1 % of a forward pass;
- the operations speculative decoding needs are in the API: rollback, `validate_tokens`
  (how many of a proposal the grammar allows, without consuming), fast-forward tokens,
  `deep_copy`; and it never raises on a bad grammar or token, it reports an error state,
  which we turn into `ValueError` in one place.

EOS: the compiler takes `eos_token_ids` (default: the tokenizer's `eos_token_id`). When the
grammar may end, every EOS id is in the allowed set; once the grammar is complete (nothing
but EOS can follow, `is_terminated()`), the allowed set is exactly the EOS ids. Special
tokens other than EOS are never allowed, nor are ids `>= len(tokenizer)` when the logits are
wider than the tokenizer (`vocab_size > len(tokenizer)`).

Bounds. A grammar is a program its sender writes, and compiling one can take unbounded time,
memory or native stack (a JSON schema nesting a few thousand levels, or a few thousand `$ref`s or
Lark rules in a chain, overflows llguidance's stack and kills the process; a 20-byte regex such as
`(a{1000}){1000}` builds hundreds of megabytes of lexer). `GrammarLimits` bounds each spec before
any engine sees it (its size in bytes and its bracket nesting, checked by a scan that cannot
recurse), and llguidance's own `LLParserLimits` (`PARSER_LIMITS`: regex-building fuel, lexer
states, per-step fuel) bound the compile and every mask; a spec over a bound is a `ValueError`
naming it. A compile's time is bounded by running it off the caller's thread
(`specdec.runtime.grammars.GrammarWorker`, on a thread with a large stack).

JSON kinds are generated in `json.dumps`' default layout: `", "` between items, `": "` after
keys, no other whitespace. One layout means a weak or random model cannot loop on
whitespace, and keys become forced tokens (`GrammarState.forced`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

KINDS = ("json_object", "json_schema", "regex", "choice", "lark", "ebnf")
"""What `GrammarSpec.kind` may be."""

JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON compile options for both JSON kinds (`json.dumps` default layout)."""

_ANY_OBJECT = '{"type": "object"}'

PARSER_LIMITS: dict[str, int] = dict(initial_lexer_fuel=200_000, step_lexer_fuel=50_000, max_lexer_states=50_000)
"""llguidance's `LLParserLimits` for every compile and mask, tighter than its defaults (1,000,000,
200,000 and 250,000): building the lexer of `(a{1000}){1000}` took 2.4 s and 195 MB with the
defaults, 0.3 s and 29 MB (then refused) with these; every schema and regex of the tests (formats,
enums of thousands, strings of thousands of characters) compiles under them."""


@dataclass(frozen=True)
class GrammarLimits:
    """What a grammar spec may be, checked before any engine sees it (`GrammarSpec.check`).

    `max_bytes`: the text's UTF-8 length; `max_depth`: how deep its brackets nest (`(`, `[`, `{`;
    for the JSON kinds outside strings), well below where parsers recurse out of stack;
    `compile_timeout_s`: how long compiling it may take (enforced where it runs off-thread:
    `specdec.runtime.grammars.GrammarWorker`)."""

    max_bytes: int = 64 * 1024
    max_depth: int = 100
    compile_timeout_s: float = 10.0


DEFAULT_LIMITS = GrammarLimits()
SERVICE_LIMITS = GrammarLimits(max_bytes=256 * 1024)
"""What draft and target accept: the most an orchestrator may be configured to let through."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. Hashable: the compiler caches by it.

    kind:
    - `json_object`: any JSON object; `text` must be empty.
    - `json_schema`: `text` is the JSON schema (a JSON object or boolean, as a string).
    - `regex`: `text` is a regular expression (Rust `regex` syntax), matched in full.
    - `choice`: `text` is a JSON list of non-empty strings; the output is one of them.
    - `lark`: `text` is a Lark grammar (llguidance dialect; the start rule is `start`).
    - `ebnf`: `text` is a GBNF grammar (llama.cpp dialect; the start rule is `root`),
      converted to Lark by llguidance.
    """

    kind: str
    text: str = ""

    def check(self, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
        """Raise `ValueError` naming the field if the kind is unknown, or the text empty or over
        `limits` (its size, its nesting): cheap, no engine involved."""
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is invalid: must be one of {', '.join(KINDS)}")
        if not isinstance(self.text, str):
            raise ValueError(f"text={self.text!r} is invalid: must be a string")
        if self.kind != "json_object" and not self.text.strip():
            raise ValueError(f"text is empty: kind={self.kind!r} needs a grammar")
        size = len(self.text.encode("utf-8", "surrogatepass"))
        if size > limits.max_bytes:
            raise ValueError(f"text is {size} bytes, over the limit of {limits.max_bytes}")
        depth = nesting_depth(self.text, json=self.kind in ("json_object", "json_schema", "choice"))
        if depth > limits.max_depth:
            raise ValueError(f"text nests {depth} levels deep, over the limit of {limits.max_depth}")

    def validate(self, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
        """Raise `ValueError` naming the field and what is wrong with it.

        Checks the spec against `limits` (`check`), then compiles the grammar without a
        tokenizer, so an invalid schema, regex or grammar is reported here with the engine's
        message (e.g. `text is not a valid regex: ... unclosed group`). Its time is bounded only
        where it runs off-thread (`specdec.runtime.grammars.GrammarWorker`).
        """
        _to_llguidance(self, limits)


def nesting_depth(text: str, json: bool = False) -> int:
    """How deep `(`, `[` and `{` nest in `text` (closers that do not match are ignored); with
    `json`, brackets inside JSON strings do not count. A loop: any depth is measured safely."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif json and ch == '"':
            in_string = True
        elif ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}" and depth:
            depth -= 1
    return deepest


def _parser_limits() -> llguidance.LLParserLimits:
    limits = PARSER_LIMITS
    return llguidance.LLParserLimits(initial_lexer_fuel=limits["initial_lexer_fuel"],
                                     step_lexer_fuel=limits["step_lexer_fuel"],
                                     max_lexer_states=limits["max_lexer_states"])


def _to_llguidance(spec: GrammarSpec, limits: GrammarLimits = DEFAULT_LIMITS) -> str:
    """The llguidance grammar for `spec`; `ValueError` (naming the field) if it is invalid."""
    spec.check(limits)
    if spec.kind in ("json_object", "json_schema"):
        grammar = _json_grammar(spec)
    elif spec.kind == "choice":
        grammar = llguidance.grammar_from("choice", json.dumps(_choices(spec.text)))
    elif spec.kind == "ebnf":
        try:
            grammar = llguidance.grammar_from("ebnf", spec.text)
        except ValueError as e:
            raise ValueError(f"text is not a valid ebnf grammar: {e}") from None
    elif spec.kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(spec.text)
    else:
        grammar = llguidance.LLMatcher.grammar_from_lark(spec.text)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=_parser_limits())
    if is_error:
        raise ValueError(f"text is not a valid {spec.kind}: {messages[0].strip()}")
    return grammar


def _json_grammar(spec: GrammarSpec) -> str:
    if spec.kind == "json_object":
        if spec.text:
            raise ValueError("text must be empty for kind='json_object' (use 'json_schema')")
        schema_text = _ANY_OBJECT
    else:
        try:
            schema = json.loads(spec.text)
        except json.JSONDecodeError as e:
            raise ValueError(f"text is not a valid json_schema: not JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("text is not a valid json_schema: must be a JSON object or boolean, "
                             f"got {type(schema).__name__}")
        schema_text = spec.text
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema_text, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise ValueError(f"text is not a valid json_schema: {e}") from None


def _choices(text: str) -> list[str]:
    try:
        choices = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"text is not a valid choice list: not JSON ({e})") from None
    if not isinstance(choices, list) or not choices:
        raise ValueError("text is not a valid choice list: must be a non-empty JSON list")
    bad = [c for c in choices if not isinstance(c, str) or not c]
    if bad:
        raise ValueError(f"text is not a valid choice list: {bad[0]!r} is not a non-empty string")
    return choices


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled against one tokenizer; shared by every state made from it."""

    spec: GrammarSpec
    vocab_size: int
    """`V`: the logits width masks are made for."""
    eos_token_ids: tuple[int, ...]
    _initial: llguidance.LLMatcher = field(repr=False)
    """A matcher at the start of the grammar; states start as deep copies of it."""

    def state(self, tokens: Sequence[int] = ()) -> GrammarState:
        """A fresh state at the start of the grammar, advanced along `tokens`."""
        state = GrammarState(self)
        state.advance(tokens)
        return state


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer, with a bounded LRU cache keyed by spec.

    tokenizer: a fast Hugging Face tokenizer; vocab_size: the model's logits width `V`
    (`>= len(tokenizer)`; ids past the tokenizer are never allowed); eos_token_ids: the stop
    tokens (default: `[tokenizer.eos_token_id]`). Building the compiler walks the whole
    vocabulary (about 2 s for a 49k vocabulary): make one per model and keep it.
    Thread-safe.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] | None = None,
                 cache_size: int = 64, limits: GrammarLimits = SERVICE_LIMITS) -> None:
        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size={vocab_size} is invalid: must be >= len(tokenizer) "
                             f"= {len(tokenizer)}")
        if eos_token_ids is None:
            eos_token_ids = [tokenizer.eos_token_id]
        eos = tuple(int(t) for t in eos_token_ids if t is not None)
        if not eos or not all(0 <= t < len(tokenizer) for t in eos):
            raise ValueError(f"eos_token_ids={list(eos_token_ids)!r} is invalid: need at least "
                             f"one id in [0, {len(tokenizer)})")
        if cache_size < 1:
            raise ValueError(f"cache_size={cache_size} is invalid: must be >= 1")
        self.vocab_size = vocab_size
        self.eos_token_ids = eos
        import llguidance.hf  # imports transformers; the caller holds an HF tokenizer anyway

        try:
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos))
        except ValueError:  # a decoder llguidance does not know (e.g. a character-level one): token by token
            self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tokenizer)),
                                                     n_vocab=vocab_size, eos_token=list(eos))
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self.limits = limits
        self._lock = threading.Lock()

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        """The compiled grammar for `spec` if it is in the cache (then marked as used)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
            return hit

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar for `spec` (cached); `ValueError` if the spec is invalid or over
        the limits. Compiling includes the first mask (where llguidance builds most of its lexer),
        so that its cost is paid here, not by the first step that needs a mask."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        grammar = _to_llguidance(spec, self.limits)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=_parser_limits())
        if not matcher.is_error():
            _fill(matcher, torch.empty((1, (self.vocab_size + 31) // 32), dtype=torch.int32), 0)
        if matcher.is_error():
            raise ValueError(f"text is not a valid {spec.kind}: {_first_line(matcher.get_error())}")
        compiled = CompiledGrammar(spec, self.vocab_size, self.eos_token_ids, matcher)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled


def _first_line(message: str) -> str:
    """An engine error without the parser state and grammar llguidance appends to it."""
    return message.strip().splitlines()[0] if message.strip() else "the grammar engine refused it"


class _TokenTable:
    """A tokenizer as llguidance's generic wrapper reads it: each token's bytes, decoded alone. Right
    for tokenizers whose tokens are whole characters; byte-level ones go through llguidance.hf."""

    def __init__(self, tokenizer: Any) -> None:
        special = set(tokenizer.all_special_ids)
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(special)
        self.tokens = [(tokenizer.convert_ids_to_tokens(i) if i in special else tokenizer.decode([i])).encode()
                       for i in range(len(tokenizer))]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


class GrammarFailed(ValueError):
    """The engine gave up on a grammar that compiled, at some position: one of its limits
    (`PARSER_LIMITS`: a lexer or parser step grew too large) was hit there. The request's grammar is
    what caused it: a `ValueError`, so services answer INVALID_ARGUMENT."""

    def __init__(self, reason: str, position: int) -> None:
        super().__init__(f"the grammar engine gave up after {position} tokens of output: {reason}")


class GrammarState:
    """Where one sequence is in its grammar: one per session and side (draft, target).

    Only `advance` and `rollback` change the state; `allowed`, `block_masks`, `forced` and
    `cut_proposal` leave it as they found it. Not thread-safe: one owner at a time.
    """

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self._matcher = compiled._initial.deep_copy()
        self._eos = frozenset(compiled.eos_token_ids)
        self._words = (compiled.vocab_size + 31) // 32
        self._tokens: list[int] = []  # consumed since the start of the grammar, EOS included

    @property
    def tokens(self) -> list[int]:
        """The tokens consumed since the start of the grammar (EOS included); a copy."""
        return list(self._tokens)

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    # --- changing the state -------------------------------------------------------------

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume `tokens`; all or nothing.

        Raises `ValueError` naming the first token the grammar does not allow (the state is
        then unchanged). EOS is allowed when the grammar may end (`accepts_eos()`).
        """
        for i, token in enumerate(int(t) for t in tokens):
            if not self._allows(token):
                self._rollback(i)
                raise ValueError(f"tokens[{i}]={token} is not allowed by the "
                                 f"{self.compiled.spec.kind} grammar after {self.num_tokens} tokens")
            self._consume(token)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` consumed tokens."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"num_tokens={num_tokens} is invalid: must be in [0, {self.num_tokens}]")
        self._rollback(num_tokens)

    def rebuild(self, tokens: Sequence[int]) -> GrammarState:
        """A fresh state of the same grammar advanced along `tokens` (this one is untouched).

        After a failover the history decides: the new replica replays the emitted tokens.
        """
        return self.compiled.state(tokens)

    def fork(self) -> GrammarState:
        """An independent copy of this state (a few µs)."""
        twin = GrammarState.__new__(GrammarState)
        twin.compiled, twin._eos, twin._words = self.compiled, self._eos, self._words
        twin._matcher = self._matcher.deep_copy()
        twin._tokens = list(self._tokens)
        return twin

    __copy__ = fork

    # --- reading the state --------------------------------------------------------------

    def is_terminated(self) -> bool:
        """True when the grammar is complete: only EOS is allowed, or EOS was consumed.

        After an EOS the sequence is over: `advance` refuses every token, and `allowed()`
        stays the EOS-only mask (a mask never has an empty row).
        """
        return self._ended() or bool(self._matcher.is_stopped())

    def accepts_eos(self) -> bool:
        """True when the grammar may end here: the EOS ids are in the allowed set."""
        return not self._ended() and bool(self._matcher.is_accepting() or self._matcher.is_stopped())

    def allowed(self) -> torch.Tensor:
        """The mask `[V]` (bool) of tokens the grammar allows next."""
        bitmask = torch.empty((1, self._words), dtype=torch.int32)  # [1, ceil(V/32)]
        self._fill(bitmask, 0)
        return _unpack(bitmask, self.compiled.vocab_size)[0]

    def block_masks(self, draft_tokens: Sequence[int]) -> torch.Tensor:
        """Masks `[k+1, V]` (bool) for a block of `k` draft tokens; the state is unchanged after.

        Row `i` is the allowed set after accepting `draft_tokens[:i]` (row 0 is `allowed()`,
        row `k` the one for the bonus token). If `draft_tokens[j]` is the first token the
        grammar refuses (it is false in row `j`), rows `j+1..k` are copies of row `j`:
        acceptance stops at `j` at the latest, since the masked target gives `draft_tokens[j]`
        probability 0, so those rows are never used. Likewise rows after an accepted EOS
        copy the row that allowed it.
        """
        tokens = [int(t) for t in draft_tokens]  # [k]
        k = len(tokens)
        bitmask = torch.empty((k + 1, self._words), dtype=torch.int32)  # [k+1, ceil(V/32)]
        done = 0
        for i in range(k + 1):
            self._fill(bitmask, i)
            if i == k or tokens[i] in self._eos or not _bit(bitmask[i], tokens[i], self.compiled.vocab_size):
                bitmask[i + 1:] = bitmask[i]
                break
            self._consume(tokens[i])
            done += 1
        self._rollback(done)
        return _unpack(bitmask, self.compiled.vocab_size)

    def forced(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens the grammar forces from here; the state is unchanged.

        Two sources, in turn: a position where the allowed set has exactly one token (that
        token), and llguidance's fast-forward tokens (a tokenization of the bytes the grammar
        forces, e.g. a fixed JSON key, omitting a last token that could still be extended).
        Stops at the first position with a real choice, and before EOS.

        Use them as a deterministic draft (one-hot `q`): the target verifies them, so the
        output stays lossless even where the model would tokenize forced bytes differently;
        a token that was the only allowed one is always accepted.
        """
        matcher = self._matcher.deep_copy()
        out: list[int] = []
        bitmask = torch.empty((1, self._words), dtype=torch.int32)  # [1, ceil(V/32)]
        while len(out) < max_tokens and not self._ended() and not matcher.is_stopped():
            step = list(matcher.compute_ff_tokens())[: max_tokens - len(out)]
            if not step:
                _fill(matcher, bitmask, 0)
                ids = _unpack(bitmask, self.compiled.vocab_size)[0].nonzero().flatten().tolist()
                if len(ids) != 1 or ids[0] in self._eos:
                    break
                step = ids
            if not matcher.consume_tokens(step):
                break
            out += step
        return out

    # --- llguidance, in one place -------------------------------------------------------

    def _allows(self, token: int) -> bool:
        if not 0 <= token < self.compiled.vocab_size or self._ended():
            return False
        if token in self._eos:
            return self._matcher.is_accepting() or self._matcher.is_stopped()
        return self._matcher.validate_tokens([token]) == 1

    def _ended(self) -> bool:
        return bool(self._tokens) and self._tokens[-1] in self._eos

    # EOS never reaches the matcher (llguidance does not count an EOS consumed after the
    # grammar stopped as a token, which would skew rollback): it is only recorded here.

    def _consume(self, token: int) -> None:
        if token not in self._eos and not self._matcher.consume_token(token):
            raise GrammarFailed(_first_line(self._matcher.get_error()), self.num_tokens)
        self._tokens.append(token)

    def _rollback(self, n: int) -> None:
        in_matcher = n - 1 if n and self._ended() else n
        if in_matcher and not self._matcher.rollback(in_matcher):
            raise GrammarFailed(_first_line(self._matcher.get_error()), self.num_tokens)
        del self._tokens[len(self._tokens) - n:]

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self._ended():
            bitmask[row] = 0
            for t in self._eos:
                bitmask[row, t // 32] |= _word_bit(t % 32)
            return
        _fill(self._matcher, bitmask, row)
        if self._matcher.is_error():
            raise GrammarFailed(_first_line(self._matcher.get_error()), self.num_tokens)


def _fill(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """Write the matcher's next-token mask into row `row` of a CPU int32 bitmask `[N, W]`.

    What `llguidance.torch.fill_next_token_bitmask` does, without importing torch._dynamo.
    """
    assert bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.is_contiguous()
    words = bitmask[row]  # [W]
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


_BITS = torch.arange(32, dtype=torch.int32)  # [32]


def _word_bit(bit: int) -> int:
    """Bit `bit` (0..31) of an int32 word, as a Python int in int32 range."""
    return (1 << bit) - (1 << 32) if bit == 31 else 1 << bit


def _bit(words: torch.Tensor, token: int, vocab_size: int) -> bool:
    """Whether `token` is set in one bitmask row `[ceil(V/32)]` (false when out of range)."""
    if not 0 <= token < vocab_size:
        return False
    return bool((int(words[token // 32]) >> (token % 32)) & 1)


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask `[N, ceil(V/32)]` int32 (bit `j` of word `w` is token `32w + j`) -> `[N, V]`."""
    n = bitmask.shape[0]
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1  # [N, W, 32]
    return bits.view(n, -1)[:, :vocab_size].bool()


def apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits `[N, V]` with disallowed tokens (mask `[N, V]` false) set to -inf; a new tensor."""
    assert logits.ndim == 2, f"logits must be [N, V], got {tuple(logits.shape)}"
    assert mask.shape == logits.shape, f"mask {tuple(mask.shape)} != logits {tuple(logits.shape)}"
    assert mask.dtype == torch.bool, f"mask must be bool, got {mask.dtype}"
    return logits.masked_fill(~mask.to(logits.device), float("-inf"))


def cut_proposal(state: GrammarState, tokens: Sequence[int]) -> list[int]:
    """The longest prefix of a model-free proposal (e.g. prompt lookup) the grammar allows.

    The state is unchanged. A proposal is cut at its first disallowed token, and after an
    EOS (nothing follows the end).
    """
    keep: list[int] = []
    for token in (int(t) for t in tokens):
        if not state._allows(token):
            break
        state._consume(token)
        keep.append(token)
        if token in state._eos:
            break
    state._rollback(len(keep))
    return keep
