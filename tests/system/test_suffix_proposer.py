"""Suffix speculation through the whole pipeline: lossless, and fed by the shared outputs stream."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
import redis

from specdec import Client
from specdec.core.sampling import SamplingParams
from specdec.core.suffix import OUTPUT_FIELD, encode_output
from specdec.keys import suffix_outputs_key
from specdec.runtime.proposers import SuffixProposer
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from tests.conftest import orchestrator_address, start_tiny_pipeline

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, world!", "abcabcabc", "The answer is",
           "Roses are red,"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def suffix_pipeline(tiny_models, tmp_path_factory):
    """The launcher points a suffix draft at the pipeline's Redis (--suffix-redis-url)."""
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-suffix"), tiny_models, "target", proposer="suffix")
    yield pipeline
    pipeline.stop()


def test_suffix_draft_greedy_equals_target_generate(suffix_pipeline, reference):
    proposed = 0
    with Client(orchestrator_address(suffix_pipeline)) as client:
        for prompt in PROMPTS:
            out = client.generate(prompt, max_new_tokens=MAX_NEW, draft_length=4)
            assert out.token_ids == reference.greedy(prompt, MAX_NEW), prompt
            proposed += out.stats["draft_tokens"]
    assert proposed > 0, "suffix speculation never proposed anything: the test would not exercise verification"


def test_a_repeating_output_is_mostly_accepted(suffix_pipeline, reference):
    prompt = "x y z x y z x y z x y z x y z"  # the tiny target settles into a short loop
    with Client(orchestrator_address(suffix_pipeline)) as client:
        out = client.generate(prompt, max_new_tokens=32, draft_length=4)
    assert out.token_ids == reference.greedy(prompt, 32)
    assert out.stats["draft_tokens"] >= 8
    assert out.stats["accepted_tokens"] >= 0.7 * out.stats["draft_tokens"]


def test_a_block_lists_every_token_after_which_its_history_could_be_drafted(suffix_pipeline, reference):
    """ProposeStream answers list the block's followers: for every token of the vocabulary that a
    later request (the history, the block and that token, a session indexed afresh alike, of a
    corpus group no output joins) is drafted anything after, the token is listed; a request with a
    grammar lists none (the grammar may force tokens whatever the indexes hold)."""
    history = reference.encode("abcabcab xyz abcab")
    vocab = reference.loaded.vocab_size

    def answers(requests: list[draft_pb2.ProposeRequest]) -> list[draft_pb2.ProposeBlock]:
        with grpc.insecure_channel(suffix_pipeline.plan.grpc_addresses()["draft"]) as channel:
            return list(draft_pb2_grpc.DraftServiceStub(channel).ProposeStream(iter(requests), timeout=60))

    def ask(session: str, tokens: list[int], sampling=None) -> draft_pb2.ProposeRequest:
        return draft_pb2.ProposeRequest(session_id=session, history=tokens, num_tokens=4, seed=1,
                                        sampling=sampling or common_pb2.SamplingParams(),
                                        corpus_group="followers")  # (no output joins it meanwhile)

    constrained = common_pb2.SamplingParams(grammar_kind="regex", grammar_text="[a-z ]+")
    first, grammar = answers([ask("followers", history), ask("followers-grammar", history, constrained)])
    block = [p.token_id for p in first.proposals]
    assert block and first.HasField("followers") and not grammar.HasField("followers")
    listed = set(first.followers.tokens)
    after = answers([ask(f"after-{t}", history + block + [t]) for t in range(vocab)])
    drafted = {t for t, answer in zip(range(vocab), after) if answer.proposals}
    assert drafted and drafted <= listed, (drafted - listed)


def own_history_proposes_nothing(prompt_ids: list[int], output: list[int], k: int) -> bool:
    """Along the greedy trajectory, a suffix proposer without a corpus never proposes (checked in-process)."""
    proposer = SuffixProposer()
    return not any(list(proposer.propose("s", prompt_ids + output[:i], k, SamplingParams(), 0))
                   for i in range(len(output)))


def generate_fresh_until_drafted(client: Client, prompt: str, n: int, expected: list[int]):
    """A fresh session each time (only the corpus can propose), until it drafts or 15 s pass."""
    deadline = time.monotonic() + 15
    while True:
        out = client.generate(prompt, max_new_tokens=n, draft_length=4)
        assert out.token_ids == expected
        if out.stats["draft_tokens"] > 0 or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def test_an_entry_added_to_the_shared_stream_serves_a_later_request(suffix_pipeline, reference):
    prompt, n = "In the beginning", 8  # a short output that does not repeat itself: nothing to look up
    expected = reference.greedy(prompt, n)
    assert own_history_proposes_nothing(reference.encode(prompt), expected, 4)
    # Another replica's finished output, as the orchestrator appends it.
    plan = suffix_pipeline.plan
    redis.Redis(host=plan.host, port=plan.redis_port).xadd(
        suffix_outputs_key(), {OUTPUT_FIELD: encode_output(expected)}, maxlen=10_000, approximate=True)
    time.sleep(0.5)  # the draft's reader is blocked on XREAD: the entry reaches it at once
    with Client(orchestrator_address(suffix_pipeline)) as client:
        after = generate_fresh_until_drafted(client, prompt, n, expected)
    # From the third token on, the history's end matches the entry and its tokens are proposed and accepted.
    assert after.stats["accepted_tokens"] >= n // 2, after.stats


def test_a_published_output_serves_a_later_session(suffix_pipeline, reference):
    """End to end with the orchestrator's --share-outputs: one session's output, the next one's draft."""
    prompt, n = "SELECT * FROM", 8
    expected = reference.greedy(prompt, n)
    with Client(orchestrator_address(suffix_pipeline)) as client:
        before = client.generate(prompt, max_new_tokens=n, draft_length=4, share_output=True)
        assert before.token_ids == expected
        after = generate_fresh_until_drafted(client, prompt, n, expected)
    assert after.stats["accepted_tokens"] >= max(n // 2, before.stats["accepted_tokens"] + 1), after.stats
    # the orchestrator wrote the output because its draft says it reads the stream
    with grpc.insecure_channel(suffix_pipeline.plan.grpc_addresses()["draft"]) as channel:
        info = draft_pb2_grpc.DraftServiceStub(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert info.kind == "suffix" and info.reads_shared_outputs
    assert redis.Redis(port=suffix_pipeline.plan.redis_port).xlen(suffix_outputs_key()) >= 1
    status = subprocess.run([sys.executable, "-m", "specdec.cli", "status", "--address",
                             orchestrator_address(suffix_pipeline)], capture_output=True, text=True, timeout=60)
    draft = [line for line in status.stdout.splitlines() if line.split()[:1] == ["draft"]]
    assert status.returncode == 0 and len(draft) == 1 and draft[0].endswith("reads the shared outputs stream"), status


def test_a_request_with_share_output_false_does_not_serve_a_later_session(suffix_pipeline, reference):
    """share_output=False keeps the output out of the corpus; the same request left to the server's
    setting then serves the next session (so the first half could have failed)."""
    n = 8
    candidates = ["Dear diary,", "Breaking news:", "A journey of a thousand", "Lorem ipsum"]  # not sent above
    prompt = next(p for p in candidates if own_history_proposes_nothing(reference.encode(p), reference.greedy(p, n), 4))
    expected = reference.greedy(prompt, n)
    with Client(orchestrator_address(suffix_pipeline)) as client:
        for _ in range(2):
            kept = client.generate(prompt, max_new_tokens=n, draft_length=4, share_output=False)
            assert kept.token_ids == expected and kept.stats["draft_tokens"] == 0, kept.stats
            time.sleep(0.5)  # a published output would reach the draft's reader within this
        client.generate(prompt, max_new_tokens=n, draft_length=4)
        after = generate_fresh_until_drafted(client, prompt, n, expected)
    assert after.stats["accepted_tokens"] >= n // 2, after.stats


ALICE, MALLORY = "alice-token-0123456789abcdef", "mallory-token-fedcba98765432"


@pytest.fixture(scope="module")
def tenants_pipeline(tiny_models, tmp_path_factory):
    """A suffix draft fed by the outputs stream, behind an orchestrator with two tokens (two tenants)."""
    root = tmp_path_factory.mktemp("logs-tenants")
    tokens = root / "tokens"
    tokens.write_text(f"alice:{ALICE}\nmallory:{MALLORY}\n")
    pipeline = start_tiny_pipeline(root, tiny_models, "target", proposer="suffix", auth_tokens_file=str(tokens))
    yield pipeline
    pipeline.stop()


def test_a_tenants_output_never_drafts_another_tenants_request(tenants_pipeline, reference):
    """Every chunk reports how many tokens the draft proposed and how many were accepted: if one
    tenant's output drafted another's requests, a greedy probe (with a logit_bias on a candidate,
    `accepted >= 1` says the candidate is the corpus's next token) would read it token by token. The
    corpus is per tenant: mallory's probe is drafted from nothing, alice's own next session is."""
    n = 8
    candidates = ["Top secret:", "Confidential memo", "My password is", "Private notes"]
    prompt = next(p for p in candidates if own_history_proposes_nothing(reference.encode(p), reference.greedy(p, n), 4))
    expected = reference.greedy(prompt, n)
    address = orchestrator_address(tenants_pipeline)
    with Client(address, token=ALICE) as alice:
        first = alice.generate(prompt, max_new_tokens=n, draft_length=4)
        assert first.token_ids == expected and first.stats["draft_tokens"] == 0
        again = generate_fresh_until_drafted(alice, prompt, n, expected)  # alice's output reached her corpus
    assert again.stats["accepted_tokens"] >= n // 2, again.stats
    with Client(address, token=MALLORY) as mallory:
        for _ in range(3):  # her own probes stay out of her corpus: only alice's output could draft them
            probe = mallory.generate(prompt, max_new_tokens=n, draft_length=4, share_output=False)
            assert probe.token_ids == expected  # lossless, whatever the draft
            assert probe.stats["draft_tokens"] == 0 and probe.stats["accepted_tokens"] == 0, probe.stats
            time.sleep(0.3)
