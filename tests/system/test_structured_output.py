"""Structured output through the real pipeline, under speculation: every output follows its grammar,
and greedy output equals the target alone under the same grammar (transformers `generate` with a
logits processor from the same grammar library), for a model draft and for prompt lookup."""

from __future__ import annotations

import json
import random

import jsonschema
import pydantic
import pytest
import torch
from openai import BadRequestError
from transformers import LogitsProcessor, LogitsProcessorList

from specdec.client import Client
from specdec.core.grammar import GrammarCompiler, GrammarSpec
from tests.conftest import orchestrator_address, start_tiny_pipeline
from tests.reference import Reference

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "size": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["cat", "dog", "fox"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
}, "required": ["name", "size", "kind", "tags"], "additionalProperties": False}
MAX_NEW = 120


class GrammarMask(LogitsProcessor):
    """The reference: llguidance (through specdec.core.grammar) masking the target alone, its state
    advanced along the tokens generated so far."""

    def __init__(self, compiler: GrammarCompiler, spec: GrammarSpec, prompt_length: int) -> None:
        self.state = compiler.compile(spec).state()
        self.prompt_length = prompt_length

    def __call__(self, input_ids, scores):
        generated = input_ids[0, self.prompt_length:].tolist()
        self.state.advance(generated[self.state.num_tokens:])
        mask = self.state.allowed()[:scores.shape[1]]
        return scores.masked_fill(~mask[None, :], float("-inf"))


@pytest.fixture(scope="module")
def compiler(reference) -> GrammarCompiler:
    return GrammarCompiler(reference.tokenizer, reference.loaded.vocab_size, reference.loaded.eos_token_ids)


@pytest.fixture(scope="module")
def ngram_pipeline(tiny_models, tmp_path_factory):
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-grammar-ngram"), tiny_models, "target",
                                   proposer="ngram")
    yield pipeline
    pipeline.stop()


def target_alone(reference: Reference, compiler: GrammarCompiler, prompt_ids: list[int],
                 spec: GrammarSpec) -> list[int]:
    ids = torch.tensor([prompt_ids])
    eos = reference.loaded.eos_token_ids
    processors = LogitsProcessorList([GrammarMask(compiler, spec, len(prompt_ids))])
    with torch.inference_mode():
        out = reference.loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                              do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                                              logits_processor=processors)
    tokens = out[0, ids.shape[1]:].tolist()
    ends = [i for i, t in enumerate(tokens) if t in eos]
    return tokens[: ends[0] + 1] if ends else tokens


SPECS = [
    GrammarSpec("json_schema", json.dumps(SCHEMA)),
    GrammarSpec("json_object"),
    GrammarSpec("regex", r"[a-z]{2,6}-[0-9]{3}"),
    GrammarSpec("choice", json.dumps(["north", "south", "east", "west"])),
    GrammarSpec("lark", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'),
]


@pytest.mark.parametrize("spec", SPECS, ids=[s.kind for s in SPECS])
def test_greedy_under_a_grammar_equals_the_target_alone(http_pipeline, ngram_pipeline, reference, compiler, spec):
    prompt_ids = reference.encode("Answer: ")
    expected = target_alone(reference, compiler, prompt_ids, spec)
    for source, pipeline in (("model draft", http_pipeline), ("prompt lookup", ngram_pipeline)):
        with Client(orchestrator_address(pipeline)) as client:
            out = client.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0, draft_length=4,
                                  grammar=(spec.kind, spec.text))
        assert out.token_ids == expected, source
        assert out.stats["draft_fallbacks"] == 0, source  # the draft took part in every round it was asked
    text = reference.tokenizer.decode(expected, skip_special_tokens=True)
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif spec.kind == "choice":
        assert text in json.loads(spec.text)


def random_schema(rng: random.Random) -> dict:
    fields = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(["string", "integer", "boolean", "enum", "array", "object"])
        if kind == "string":
            fields[f"s{i}"] = {"type": "string", "maxLength": rng.randint(1, 6)}
        elif kind == "integer":
            fields[f"n{i}"] = {"type": "integer", "minimum": -50, "maximum": rng.randint(0, 500)}
        elif kind == "boolean":
            fields[f"b{i}"] = {"type": "boolean"}
        elif kind == "enum":
            fields[f"e{i}"] = {"enum": rng.sample(["red", "green", "blue", "cyan", "gray"], 3)}
        elif kind == "array":
            fields[f"a{i}"] = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                               "maxItems": rng.randint(1, 3)}
        else:
            fields[f"o{i}"] = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
                               "additionalProperties": False}
    return {"type": "object", "properties": fields, "required": sorted(fields), "additionalProperties": False}


def test_fifty_schemas_sampled_and_greedy_all_parse_and_validate(http_pipeline, reference):
    rng = random.Random(7)
    prompts = ["Describe it as JSON: ", "Data: ", "{", "Here is the record -> ", "Output:\n"]
    drafted = 0
    with Client(orchestrator_address(http_pipeline)) as client:
        for i in range(50):
            schema, prompt = random_schema(rng), prompts[i % len(prompts)]
            for temperature in (0.0, 1.0):
                out = client.generate(prompt, max_new_tokens=MAX_NEW, temperature=temperature, seed=i,
                                      draft_length=4, grammar=("json_schema", json.dumps(schema)))
                assert out.finish_reason == "eos", (schema, out.text)
                jsonschema.validate(json.loads(out.text), schema)
                assert out.stats["draft_fallbacks"] == 0
                drafted += out.stats["draft_tokens"]
    assert drafted > 0


def test_chat_completions_parse_with_a_pydantic_model(api, model):
    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        legs: int = pydantic.Field(ge=0, le=8)
        kind: str = pydantic.Field(pattern="^(cat|dog)$")

    for temperature in (0.0, 1.0):
        reply = api.chat.completions.parse(model=model, messages=[{"role": "user", "content": "A pet, as JSON"}],
                                           response_format=Pet, temperature=temperature, max_tokens=MAX_NEW, seed=3)
        pet = reply.choices[0].message.parsed
        assert isinstance(pet, Pet) and 0 <= pet.legs <= 8 and pet.kind in ("cat", "dog")


def test_json_object_and_guided_fields_through_the_gateway(api, model):
    reply = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "JSON please"}],
                                        response_format={"type": "json_object"}, temperature=1.0, seed=1,
                                        max_tokens=MAX_NEW)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    reply = api.completions.create(model=model, prompt="Pick: ", max_tokens=10, temperature=1.0, seed=2,
                                   extra_body={"guided_choice": ["alpha", "beta"]})
    assert reply.choices[0].text in ("alpha", "beta")
    reply = api.completions.create(model=model, prompt="Code: ", max_tokens=12, temperature=1.0, seed=3,
                                   extra_body={"guided_regex": "[A-Z]{3}[0-9]{2}"})
    assert len(reply.choices[0].text) == 5 and reply.choices[0].text[:3].isupper()


def test_an_invalid_grammar_is_refused_before_anything_runs(api, model):
    with pytest.raises(BadRequestError) as info:
        api.completions.create(model=model, prompt="x", max_tokens=5, extra_body={"guided_regex": "(unclosed"})
    assert "regex" in info.value.body["message"]
    with pytest.raises(BadRequestError) as info:
        api.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": {"type": "objekt"}}})
    assert info.value.body["param"] == "response_format" and "json_schema" in info.value.body["message"]


def test_sampling_under_a_grammar_and_penalties_follows_the_processed_target(http_pipeline, reference):
    """200 sampled generations of "[abcd]{3}" under presence and frequency penalties, drafted by the
    poor model at k = 4: the empirical distribution of the 64 strings matches the target's own
    (each position's logits penalised by the letters before it, masked by the grammar, softmaxed),
    chi-square at the 0.1 % level."""
    from scipy.stats import chi2

    from specdec.core.processors import process_block
    from specdec.core.sampling import SamplingParams

    letters = [reference.tokenizer.convert_tokens_to_ids(c) for c in "abcd"]
    prompt_ids = reference.encode("Letters: ")
    params = SamplingParams(temperature=1.0, presence_penalty=float(torch.tensor(1.0, dtype=torch.float32)),
                            frequency_penalty=float(torch.tensor(0.5, dtype=torch.float32)),
                            output_start=len(prompt_ids))
    model = reference.loaded.model

    def masked(context: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([context])).logits[0, -1:].double()
        row = process_block(logits, context, [], params)[0]
        return torch.softmax(row[letters], dim=0)  # the grammar allows exactly the four letters here

    expected: dict[str, float] = {}
    for a in range(4):
        pa = masked(prompt_ids)[a]
        for b in range(4):
            pb = masked(prompt_ids + [letters[a]])[b]
            third = masked(prompt_ids + [letters[a], letters[b]])
            for c in range(4):
                expected["abcd"[a] + "abcd"[b] + "abcd"[c]] = float(pa * pb * third[c])
    counts = dict.fromkeys(expected, 0)
    trials = 200
    with Client(orchestrator_address(http_pipeline)) as client:
        for seed in range(trials):
            out = client.generate(prompt_ids, max_new_tokens=8, temperature=1.0, seed=1000 + seed, draft_length=4,
                                  presence_penalty=1.0, frequency_penalty=0.5, grammar=("regex", "[abcd]{3}"))
            counts[out.text] += 1
    cells = sorted(expected, key=expected.get, reverse=True)
    big = [s for s in cells if expected[s] * trials >= 5]
    observed = [counts[s] for s in big] + [sum(counts[s] for s in cells if s not in big)]
    wanted = [expected[s] * trials for s in big] + [trials * sum(expected[s] for s in cells if s not in big)]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, wanted) if e > 0)
    assert statistic < chi2.ppf(0.999, len(observed) - 1), (observed, wanted)


def test_processors_with_prompt_lookup_equal_the_target_alone(ngram_pipeline, reference):
    """The processors hold for a model-free draft too: its deterministic proposals are verified
    against the processed target (the model draft's case: test_processors_pipeline.py)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    prompt_ids = reference.encode("abc abc abc abc abc abc")  # prompt lookup has plenty to propose
    ids = torch.tensor([prompt_ids])
    biased = reference.tokenizer.convert_tokens_to_ids("a")
    bias = float(torch.tensor(-3.5, dtype=torch.float32))
    penalty = float(torch.tensor(1.3, dtype=torch.float32))
    eos = reference.loaded.eos_token_ids
    processors = LogitsProcessorList([SequenceBiasLogitsProcessor({(biased,): bias}),
                                      RepetitionPenaltyLogitsProcessor(penalty)])
    with torch.inference_mode():
        out = reference.loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                              do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                                              logits_processor=processors)
    expected = out[0, ids.shape[1]:].tolist()
    ends = [i for i, t in enumerate(expected) if t in eos]
    expected = expected[: ends[0] + 1] if ends else expected
    with Client(orchestrator_address(ngram_pipeline)) as client:
        got = client.generate(prompt_ids, max_new_tokens=24, temperature=0, draft_length=3, repetition_penalty=1.3,
                              logit_bias={biased: -3.5})
    assert got.token_ids == expected and got.stats["draft_tokens"] > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_grammar_that_ends_before_min_tokens_wins(http_pipeline, reference, temperature):
    """min_tokens holds back the end of sequence while the output is shorter, but where the grammar
    allows nothing else (it is complete) the grammar wins: the output ends there, with EOS, shorter
    than min_tokens, instead of drawing from a row where nothing is allowed."""
    with Client(orchestrator_address(http_pipeline)) as client:
        for seed in range(3):
            out = client.generate("Answer: ", max_new_tokens=20, min_tokens=10, temperature=temperature, seed=seed,
                                  draft_length=4, grammar=("choice", json.dumps(["yes", "no"])))
            assert out.text in ("yes", "no") and out.finish_reason == "eos", (out.text, out.finish_reason)
            assert out.token_ids[-1] in reference.loaded.eos_token_ids


def test_grammar_bombs_are_refused_naming_the_grammar_and_the_pipeline_keeps_serving(http_pipeline, api, model):
    """A 64 KiB chain of $refs overflowed the orchestrator's stack in the grammar engine and killed it;
    a deeply nested schema raised RecursionError (an internal error); an oversized one was compiled.
    Now: the chain compiles on the grammar worker's large stack, the others are 400 naming the bound."""
    from specdec.errors import InvalidArgument
    from tests.unit.test_grammar_limits import ref_chain

    with Client(orchestrator_address(http_pipeline), timeout=120) as client:
        out = client.generate("Answer: ", max_new_tokens=4, grammar=("json_schema", ref_chain(64 * 1024)))
        assert set(out.text) <= {"[", "]", " ", ",", *"0123456789-"}, out.text  # arrays of arrays ... of integers
        for grammar, refusal in [(("json_schema", "[" * 300 + "]" * 300), "grammar: .*nests 300 levels deep"),
                                 (("regex", "a" * 70_000),
                                  "grammar text has 70000 bytes; the limit is --max-grammar-bytes=65536")]:
            with pytest.raises(InvalidArgument, match=refusal):
                client.generate("Answer: ", max_new_tokens=4, grammar=grammar)
    deep = json.loads('{"type": "array", "items": ' * 300 + '{"type": "integer"}' + "}" * 300)
    with pytest.raises(BadRequestError) as info:
        api.completions.create(model=model, prompt="x", max_tokens=4, extra_body={"guided_json": deep})
    assert "nests 301 levels deep" in info.value.body["message"]
    reply = api.completions.create(model=model, prompt="x", max_tokens=3)  # still serving
    assert reply.choices[0].text is not None
