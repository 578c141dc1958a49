"""Penalties, biases, stop tokens and log-probabilities through the real pipeline (tiny float64 target,
a poor model draft at k = 4, so most blocks have rejections): greedy output equals the target alone
under the same processors (transformers `generate`), and every returned log-probability equals a
plain forward pass of the target."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from specdec.client import Client
from tests.conftest import orchestrator_address
from tests.reference import Reference, full_logits

PROMPT = "The quick brown fox jumps over the lazy dog and then"
MAX_NEW = 24


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens: written here from the
    definition, independently of specdec.core.processors."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        for row in range(scores.shape[0]):
            counts: dict[int, int] = {}
            for token in input_ids[row, self.prompt_length:].tolist():
                counts[token] = counts.get(token, 0) + 1
            for token, count in counts.items():
                scores[row, token] -= self.frequency * count + self.presence
        return scores


@pytest.fixture(scope="module")
def client(http_pipeline):
    with Client(orchestrator_address(http_pipeline)) as c:
        yield c


def target_alone(reference: Reference, prompt_ids: list[int], **generate_kwargs) -> list[int]:
    ids = torch.tensor([prompt_ids])
    eos = reference.loaded.eos_token_ids
    with torch.inference_mode():
        out = reference.loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                              do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                                              **generate_kwargs)
    tokens = out[0, ids.shape[1]:].tolist()
    ends = [i for i, t in enumerate(tokens) if t in eos]
    return tokens[: ends[0] + 1] if ends else tokens


def f32(x: float) -> float:
    """The value as the services receive it (float32 on the wire)."""
    return float(torch.tensor(x, dtype=torch.float32))


def test_greedy_with_repetition_penalty_bias_and_min_tokens_equals_the_target_alone(client, reference):
    prompt_ids = reference.encode(PROMPT)
    plain = target_alone(reference, prompt_ids)
    biased = plain[1]  # push the target away from what it would say second
    expected = target_alone(reference, prompt_ids, repetition_penalty=f32(1.4), min_new_tokens=6,
                            sequence_bias={(biased,): f32(-7.5)})
    assert expected != plain  # the processors change the output, so the comparison means something
    out = client.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0, draft_length=4,
                          repetition_penalty=1.4, min_tokens=6, logit_bias={biased: -7.5})
    assert out.token_ids == expected
    assert out.stats["draft_tokens"] > 0 and out.stats["draft_fallbacks"] == 0  # its q saw the same processors


def test_greedy_with_openai_penalties_equals_the_target_alone(client, reference):
    prompt_ids = reference.encode(PROMPT)
    penalties = OpenAIPenalties(len(prompt_ids), f32(0.6), f32(0.9))
    expected = target_alone(reference, prompt_ids, logits_processor=LogitsProcessorList([penalties]))
    assert expected != target_alone(reference, prompt_ids)
    out = client.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0, draft_length=4,
                          presence_penalty=0.6, frequency_penalty=0.9)
    assert out.token_ids == expected and out.stats["draft_fallbacks"] == 0


def test_logprobs_equal_a_plain_forward_pass_of_the_target(client, reference):
    prompt_ids = reference.encode(PROMPT)
    out = client.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0, draft_length=4, logprobs=True,
                          top_logprobs=3)
    assert len(out.logprobs) == len(out.token_ids) > 0
    table = torch.log_softmax(full_logits(reference.loaded.model, prompt_ids + out.token_ids).double(), dim=1)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = table[len(prompt_ids) - 1 + i]
        assert entry.token_id == token and entry.rank == 1  # greedy: the most likely token
        assert math.isclose(entry.logprob, float(row[token]), abs_tol=1e-9)
        top = torch.topk(row, 3)
        assert [t for t, _, _ in entry.top] == top.indices.tolist()
        assert all(math.isclose(v, float(e), abs_tol=1e-9) for (_, _, v), e in zip(entry.top, top.values))
        assert entry.token == reference.tokenizer.decode([token])


def test_stop_token_ids_end_the_generation_and_ignore_eos_runs_past_it(client, reference):
    prompt_ids = reference.encode(PROMPT)
    plain = target_alone(reference, prompt_ids)
    out = client.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0, draft_length=4,
                          stop_token_ids=[plain[3]])
    assert out.token_ids == plain[:plain.index(plain[3]) + 1] and out.finish_reason == "stop"
    out = client.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0, draft_length=4, ignore_eos=True)
    assert len(out.token_ids) == MAX_NEW and out.finish_reason == "length"


def test_the_openai_client_streams_logprobs_with_every_token(api, model):
    stream = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to five"}],
                                         max_tokens=12, temperature=0, logprobs=True, top_logprobs=2, stream=True,
                                         stream_options={"include_usage": True}, presence_penalty=0.5)
    entries, usage = [], None
    for event in stream:
        if event.usage is not None:
            usage = event.usage
        for choice in event.choices:
            if choice.logprobs is not None:
                entries.extend(choice.logprobs.content)
    assert usage is not None and len(entries) == usage.completion_tokens > 0
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-12 for e in entries)


def test_completions_logprobs_in_the_legacy_shape(api, model):
    reply = api.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    lp = reply.choices[0].logprobs
    n = reply.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0 and all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)  # the 2 best, and the sampled token


def test_token_id_prompts_are_accepted(api, model, reference):
    ids = reference.encode(PROMPT)
    by_ids = api.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    by_text = api.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_prompt_logprobs_score_the_prompt_without_generating(client, reference):
    prompt_ids = reference.encode(PROMPT)
    out = client.generate(prompt_ids, max_new_tokens=0, prompt_logprobs=True, top_logprobs=2)
    assert out.token_ids == [] and out.finish_reason == "length"
    assert [e.token_id for e in out.prompt_logprobs] == prompt_ids
    assert out.prompt_logprobs[0].rank == 0  # nothing precedes the first token
    table = torch.log_softmax(full_logits(reference.loaded.model, prompt_ids).double(), dim=1)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert math.isclose(entry.logprob, float(table[i - 1, prompt_ids[i]]), abs_tol=1e-9)
        assert entry.rank == 1 + int((table[i - 1] > table[i - 1, prompt_ids[i]]).sum())
        assert len(entry.top) == 2


def test_echo_with_logprobs_scores_the_prompt_as_lm_evaluation_harness_asks(api, model, reference):
    """lm-evaluation-harness' local-completions log-likelihood request: token ids, echo, max_tokens 0 or 1."""
    ids = reference.encode(PROMPT)
    for max_tokens in (0, 1):
        reply = api.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0, echo=True,
                                       logprobs=1)
        lp = reply.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        table = torch.log_softmax(full_logits(reference.loaded.model, ids).double(), dim=1)
        assert all(math.isclose(lp.token_logprobs[i], float(table[i - 1, ids[i]]), abs_tol=1e-9)
                   for i in range(1, len(ids)))
        assert reply.choices[0].text.startswith("".join(lp.tokens[:len(ids)]))
    text = api.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert text.choices[0].text.startswith(PROMPT) and text.choices[0].logprobs is None


def test_a_resumed_generation_sends_the_same_logprobs(http_pipeline, reference):
    """A resume replays stored tokens the client lacks: their log-probabilities are scored again by
    the target and equal those the rounds sent."""
    import grpc

    from specdec.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc

    prompt_ids = reference.encode(PROMPT)
    with grpc.insecure_channel(orchestrator_address(http_pipeline)) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), max_new_tokens=MAX_NEW, temperature=0.8,
                                     seed=5, draft_length=4, logprobs=True, top_logprobs=2, presence_penalty=0.3)
        chunks = list(stub.Generate(request, timeout=120))
        session = chunks[0].session_id
        first = [e for c in chunks for e in c.logprobs]
        tokens = [t for c in chunks for t in c.token_ids]
        assert len(first) == len(tokens) > 4
        resumed = list(stub.Generate(pb.GenerateRequest(session_id=session, resume_from=2), timeout=120))
    again = [e for c in resumed for e in c.logprobs]
    assert [t for c in resumed for t in c.token_ids] == tokens[2:]
    assert [e.token_id for e in again] == tokens[2:]
    for a, b in zip(first[2:], again):
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-9) and list(a.top_token_ids) == list(b.top_token_ids)


def test_n_choices_run_together_each_with_its_own_seed(api, model):
    reply = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say something"}],
                                        n=3, max_tokens=10, temperature=1.0, seed=11)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1  # three seeds, three streams
    tokens = 0
    for i, text in enumerate(texts):  # choice i is the generation with seed 11 + i
        alone = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say something"}],
                                            max_tokens=10, temperature=1.0, seed=11 + i)
        assert alone.choices[0].message.content == text
        tokens += alone.usage.completion_tokens
    assert reply.usage.completion_tokens == tokens and reply.usage.prompt_tokens == alone.usage.prompt_tokens
    assert all(c.speculation["rounds"] > 0 for c in reply.choices)  # each choice's own statistics


def test_a_batch_of_prompts_streams_every_choice(api, model):
    stream = api.completions.create(model=model, prompt=["One", "Two"], n=2, max_tokens=6, temperature=1.0, seed=4,
                                    stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finished, usage = set(), None
    for event in stream:
        usage = event.usage or usage
        for choice in event.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2, 3} and usage is not None
    whole = api.completions.create(model=model, prompt=["One", "Two"], n=2, max_tokens=6, temperature=1.0, seed=4)
    assert [c.text for c in whole.choices] == [texts[i] for i in range(4)]
    assert whole.usage.completion_tokens == usage.completion_tokens
