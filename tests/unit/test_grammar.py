"""Grammar masks (specdec.core.grammar) with the real SmolLM2 tokenizer of the packaged model."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance", reason="llguidance (the grammar engine) is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is needed to check outputs")

from specdec.core.grammar import (  # noqa: E402
    KINDS,
    GrammarCompiler,
    GrammarSpec,
    GrammarState,
    apply_mask,
    cut_proposal,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAD = 64  # logits wider than the tokenizer, as with padded embedding tables

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada", "age": 36, "role": "admin", "tags": ["math", "poem"],
            "address": {"city": "London"}}
SPECS = {
    "json_object": GrammarSpec("json_object"),
    "json_schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
    "regex": GrammarSpec("regex", r"[0-9]{3}-[a-z]+"),
    "choice": GrammarSpec("choice", json.dumps(["yes", "no", "maybe"])),
    "lark": GrammarSpec("lark", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]+/'),
    "ebnf": GrammarSpec("ebnf", 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+'),
}
SAMPLES = {"json_object": '{"a": [1, 2]}', "json_schema": json.dumps(DOCUMENT),
           "regex": "123-abc", "choice": "maybe", "lark": "(1+23)", "ebnf": "(1+23)"}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from specdec.runtime.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("default"), local_files_only=True)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab_size=len(tokenizer) + PAD)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_compiles_and_accepts_a_sample(compiler, tokenizer, kind):
    state = compiler.compile(SPECS[kind]).state()
    tokens = encode(tokenizer, SAMPLES[kind])
    for t in tokens:
        assert state.allowed()[t], f"{kind}: {tokenizer.decode([t])!r} refused"
        state.advance([t])
    assert state.accepts_eos() and state.allowed()[tokenizer.eos_token_id]
    state.advance([tokenizer.eos_token_id])
    assert state.num_tokens == len(tokens) + 1


@pytest.mark.parametrize(("spec", "message"), [
    (GrammarSpec("json_schema", '{"type": "objekt"}'), "text is not a valid json_schema"),
    (GrammarSpec("json_schema", "{not json"), "not JSON"),
    (GrammarSpec("json_schema", "[1, 2]"), "must be a JSON object or boolean"),
    (GrammarSpec("regex", "a(b"), "text is not a valid regex"),
    (GrammarSpec("lark", "start: missing_rule"), "text is not a valid lark"),
    (GrammarSpec("ebnf", "root ::= undefined"), "text is not a valid ebnf"),
    (GrammarSpec("choice", "[1, 2]"), "is not a non-empty string"),
    (GrammarSpec("choice", "[]"), "non-empty JSON list"),
    (GrammarSpec("yaml", "a: b"), "kind='yaml' is invalid"),
    (GrammarSpec("regex", ""), "text is empty"),
    (GrammarSpec("json_object", '{"type": "object"}'), "text must be empty"),
])
def test_invalid_specs_raise_clear_value_errors(compiler, spec, message):
    with pytest.raises(ValueError, match=message):
        spec.validate()
    with pytest.raises(ValueError, match=message):
        compiler.compile(spec)


def test_compiler_caches_by_spec_and_is_bounded(tokenizer, compiler):
    spec = GrammarSpec("regex", "ab+")
    assert compiler.compile(spec) is compiler.compile(GrammarSpec("regex", "ab+"))
    small = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), cache_size=2)
    a, b = small.compile(GrammarSpec("regex", "a")), small.compile(GrammarSpec("regex", "b"))
    assert small.compile(GrammarSpec("regex", "a")) is a  # a is now the most recent
    small.compile(GrammarSpec("regex", "c"))  # evicts b, the least recently used
    assert small.compile(GrammarSpec("regex", "a")) is a
    assert small.compile(GrammarSpec("regex", "b")) is not b


def test_walk_document_allows_each_token_and_refuses_others(compiler, tokenizer):
    state = compiler.compile(SPECS["json_schema"]).state()
    for t in encode(tokenizer, json.dumps(DOCUMENT)):
        mask = state.allowed()
        assert mask.shape == (compiler.vocab_size,) and mask[t]
        refused = int((~mask[: len(tokenizer)]).nonzero()[0])
        with pytest.raises(ValueError, match=f"={refused} is not allowed"):
            state.advance([refused])
        state.advance([t])
    assert state.is_terminated()
    assert state.allowed().nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_advance_is_all_or_nothing(compiler, tokenizer):
    state = compiler.compile(SPECS["regex"]).state()
    good, bad = encode(tokenizer, "12"), encode(tokenizer, "x")
    with pytest.raises(ValueError, match=r"tokens\[\d+\]=\d+ is not allowed by the regex"):
        state.advance(good + bad)
    assert state.num_tokens == 0
    assert torch.equal(state.allowed(), compiler.compile(SPECS["regex"]).state().allowed())


def test_block_masks_match_step_by_step_and_leave_state_unchanged(compiler, tokenizer):
    tokens = encode(tokenizer, json.dumps(DOCUMENT))
    state = compiler.compile(SPECS["json_schema"]).state(tokens[:3])
    before = state.allowed()
    draft = tokens[3:9]  # k = 6
    masks = state.block_masks(draft)
    assert masks.shape == (len(draft) + 1, compiler.vocab_size) and masks.dtype == torch.bool
    stepper = state.fork()
    for i, t in enumerate(draft):
        assert torch.equal(masks[i], stepper.allowed()), f"row {i}"
        stepper.advance([t])
    assert torch.equal(masks[-1], stepper.allowed())
    assert state.num_tokens == 3 and torch.equal(state.allowed(), before)


def test_block_masks_copy_the_row_of_the_first_refused_token(compiler, tokenizer):
    tokens = encode(tokenizer, json.dumps(DOCUMENT))
    state = compiler.compile(SPECS["json_schema"]).state()
    refused = encode(tokenizer, "x")[0]
    masks = state.block_masks([tokens[0], refused, tokens[1], tokens[2]])
    assert not masks[1, refused]
    assert all(torch.equal(masks[i], masks[1]) for i in (2, 3, 4))
    assert state.num_tokens == 0


def test_forced_returns_a_fixed_key_and_leaves_state_unchanged(compiler, tokenizer):
    schema = {"type": "object", "properties": {"temperature": {"type": "number"}},
              "required": ["temperature"], "additionalProperties": False}
    state = compiler.compile(GrammarSpec("json_schema", json.dumps(schema))).state()
    forced = state.forced(16)
    assert tokenizer.decode(forced).startswith('{"temperature')
    assert state.num_tokens == 0
    state.advance(forced)  # every forced token is allowed in turn
    assert state.forced(2) == state.forced(16)[:2]
    assert compiler.compile(SPECS["choice"]).state().forced(8) == []  # a real choice


def test_greedy_decode_of_masked_random_logits_validates(compiler, tokenizer):
    compiled = compiler.compile(SPECS["json_schema"])
    eos = tokenizer.eos_token_id
    generator = torch.Generator().manual_seed(0)
    for draw in range(20):
        state, out = compiled.state(), []
        while not out or out[-1] != eos:
            logits = torch.randn(1, compiler.vocab_size, generator=generator)  # [1, V]
            masked = apply_mask(logits, state.allowed().unsqueeze(0))
            token = int(masked.argmax())
            state.advance([token])
            out.append(token)
            assert len(out) < 400, f"draw {draw} did not end"
        document = json.loads(tokenizer.decode(out[:-1]))
        jsonschema.validate(document, SCHEMA)


def test_extra_logit_ids_and_special_tokens_are_never_allowed(compiler, tokenizer):
    state = compiler.compile(SPECS["json_object"]).state()
    n = len(tokenizer)
    assert compiler.vocab_size == n + PAD and not state.allowed()[n:].any()
    with pytest.raises(ValueError, match=f"tokens\\[0\\]={n + 1} is not allowed"):
        state.advance([n + 1])
    assert not state.allowed()[tokenizer.convert_tokens_to_ids("<|im_start|>")]
    with pytest.raises(ValueError, match="vocab_size"):
        GrammarCompiler(tokenizer, vocab_size=n - 1)


def test_eos_only_once_complete(compiler, tokenizer):
    eos = tokenizer.eos_token_id
    state = compiler.compile(GrammarSpec("regex", "[0-9]+")).state()
    assert not state.accepts_eos() and not state.allowed()[eos]
    state.advance(encode(tokenizer, "7"))
    assert state.accepts_eos() and not state.is_terminated()
    assert state.allowed()[eos] and state.allowed().sum() > 1  # may end or go on
    done = compiler.compile(SPECS["choice"]).state(encode(tokenizer, "maybe"))
    assert done.is_terminated() and done.allowed().nonzero().flatten().tolist() == [eos]
    before = done.num_tokens
    done.advance([eos])  # the end: nothing follows, the mask stays EOS-only
    assert done.is_terminated() and not done.accepts_eos()
    assert done.allowed().nonzero().flatten().tolist() == [eos]
    with pytest.raises(ValueError, match="not allowed"):
        done.advance([eos])
    done.rollback(1)  # undoing the EOS undoes only the EOS
    assert done.num_tokens == before and done.accepts_eos()
    masks = state.block_masks([eos, 5])  # rows after an accepted EOS copy its row
    assert torch.equal(masks[1], masks[0]) and torch.equal(masks[2], masks[0])


def test_cut_proposal_fork_rebuild(compiler, tokenizer):
    tokens = encode(tokenizer, json.dumps(DOCUMENT))
    state = compiler.compile(SPECS["json_schema"]).state(tokens[:4])
    proposal = tokens[4:8] + encode(tokenizer, "}}}")
    assert cut_proposal(state, proposal) == tokens[4:8]
    assert cut_proposal(compiler.compile(SPECS["json_schema"]).state(), encode(tokenizer, "zzz")) == []
    assert state.num_tokens == 4
    twin = state.fork()
    twin.advance(tokens[4:6])
    assert state.num_tokens == 4 and twin.num_tokens == 6
    rebuilt = state.rebuild(twin.tokens)
    assert isinstance(rebuilt, GrammarState) and torch.equal(rebuilt.allowed(), twin.allowed())
    twin.rollback(2)
    assert torch.equal(twin.allowed(), state.allowed())


def test_apply_mask_is_not_in_place():
    logits = torch.zeros(2, 4)
    mask = torch.tensor([[True, False, True, False], [False, False, False, True]])
    out = apply_mask(logits, mask)
    assert torch.equal(logits, torch.zeros(2, 4))
    assert torch.isinf(out[~mask]).all() and (out[mask] == 0).all()
