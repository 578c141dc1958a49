"""The orchestrator's request path over fake pools and the in-memory store: rounds, stops, the
draft falling back, overlap, the controller. The fake target writes `REFERENCE` greedily, so
every lossless run must stream exactly its text."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.draft_length import continues_at_k0, observation
from orchestrator.loop import Speculator
from specdec.core.policy import PolicyState
from specdec.core.sampling import SamplingParams
from specdec.errors import Aborted, FailedPrecondition
from specdec.v1 import orchestrator_pb2 as pb
from tests.unit.fakes import EOS, FakeDraft, FakeTarget, InMemorySessionStore, orchestrator, tokens

PROMPT = "Once upon a time"
TEXT = " there was a small orchestrator that verified every token it was given."
REFERENCE = tokens(PROMPT + TEXT)  # then EOS: FakeTarget writes EOS past the end
START = len(tokens(PROMPT))


def request(**fields) -> pb.GenerateRequest:
    fields.setdefault("prompt", PROMPT)
    fields.setdefault("max_new_tokens", 24)
    return pb.GenerateRequest(**fields)


async def run(orch, **fields) -> list[pb.GenerateChunk]:
    return [chunk async for chunk in orch.generate(orch.parse(request(**fields)))]


def generated(chunks: list[pb.GenerateChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def success(orch, finish_reason: str) -> float | None:
    return orch.metrics.registry.get_sample_value(
        "specdec_request_success_total", {"finish_reason": finish_reason, "service": "orchestrator"})


async def test_a_right_draft_streams_the_targets_text_in_blocks_of_k():
    store, target, draft = InMemorySessionStore(), FakeTarget(REFERENCE), FakeDraft(REFERENCE)
    orch = orchestrator(store, target, draft, draft_length=4)
    chunks = await run(orch, max_new_tokens=12)
    assert chunks[0].session_id and not chunks[0].token_ids and chunks[0].offset == 0  # the header
    assert generated(chunks) == REFERENCE[START:START + 12]
    assert "".join(c.text for c in chunks) == TEXT[:12]
    assert [c.offset for c in chunks[1:]] == [0, 1, 6, 11]  # the first round is the target's alone
    assert target.calls[0] == (START, []) and draft.calls == [(START + 1, 4), (START + 6, 4)]
    last = chunks[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.stats.completion_tokens == 12
    assert last.stats.rounds == 4 and last.stats.draft_tokens == last.stats.accepted_tokens == 8
    state = await store.load(chunks[0].session_id)
    assert state.tokens == REFERENCE[:START + 12] and state.generated_tokens == 12 and state.rounds == 4
    assert state.generation.finish == pb.FINISH_REASON_LENGTH and state.generation.lease_until == 0
    assert success(orch, "length") == 1


async def test_wrong_draft_tokens_are_replaced_by_the_targets_own():
    wrong = {START + 2, START + 9, START + 10}
    target, draft = FakeTarget(REFERENCE), FakeDraft(REFERENCE, wrong_at=wrong)
    chunks = await run(orchestrator(InMemorySessionStore(), target, draft, draft_length=4), max_new_tokens=20)
    assert generated(chunks) == REFERENCE[START:START + 20]  # lossless
    rounds = [c.round for c in chunks[1:]]
    assert [r.accepted for r in rounds][:4] == [0, 1, 4, 1]  # rejected at START + 2, all four, at START + 9
    assert chunks[-1].stats.accepted_tokens < chunks[-1].stats.draft_tokens
    assert all(len(c.token_ids) == c.round.accepted + 1 for c in chunks[1:-1])


async def test_eos_ends_the_generation_and_counts_as_stop_in_the_metric():
    short = tokens(PROMPT + " the end")
    orch = orchestrator(InMemorySessionStore(), FakeTarget(short), FakeDraft(short), draft_length=3)
    chunks = await run(orch, max_new_tokens=50)
    assert generated(chunks) == tokens(" the end") + [EOS]
    assert "".join(c.text for c in chunks) == " the end"
    assert chunks[-1].finish_reason == pb.FINISH_REASON_EOS and chunks[-1].stats.completion_tokens == 9
    assert success(orch, "stop") == 1 and success(orch, "eos") is None  # the label speaks OpenAI


async def test_a_stop_string_ends_the_text_before_it():
    orch = orchestrator(InMemorySessionStore(), FakeTarget(REFERENCE), FakeDraft(REFERENCE), draft_length=4)
    chunks = await run(orch, max_new_tokens=40, stop=["small"])
    assert "".join(c.text for c in chunks) == " there was a "
    assert generated(chunks) == tokens(" there was a small")  # up to the token that completed it
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP


async def test_drafts_never_outrun_the_tokens_still_wanted():
    target, draft = FakeTarget(REFERENCE), FakeDraft(REFERENCE)
    orch = orchestrator(InMemorySessionStore(), target, draft, draft_length=8, overlap=True)
    chunks = await run(orch, max_new_tokens=13)
    assert generated(chunks) == REFERENCE[START:START + 13]
    for length, k in draft.calls:  # the last token of all is the target's
        assert length + k <= START + 12
    # The context fills before max_new_tokens is reached: the generation ends at its edge.
    target = FakeTarget(REFERENCE)
    chunks = await run(orchestrator(InMemorySessionStore(), target, FakeDraft(REFERENCE), max_context=START + 5,
                                    draft_length=4), max_new_tokens=24)
    assert generated(chunks) == REFERENCE[START:START + 5] and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize("failure", [True, "released", "unavailable"])
async def test_a_failing_draft_falls_back_to_plain_decoding(failure):
    draft = FakeDraft(REFERENCE, available=False) if failure == "unavailable" else FakeDraft(REFERENCE, fail=failure)
    orch = orchestrator(InMemorySessionStore(), FakeTarget(REFERENCE), draft, draft_length=4)
    chunks = await run(orch, max_new_tokens=6)
    assert generated(chunks) == REFERENCE[START:START + 6]  # one token per round, no error
    # Rounds 2-5 wanted k = 4, 3, 2, 1; the first and the last (one token left) draft nothing.
    assert [c.round.draft_fallback for c in chunks[1:]] == [False] + [True] * 4 + [False]
    assert chunks[-1].stats.draft_fallbacks == 4 and chunks[-1].stats.draft_tokens == 0
    assert len(draft.calls) == (0 if failure == "unavailable" else 4)


async def test_without_a_draft_every_round_is_plain_decoding():
    target = FakeTarget(REFERENCE)
    chunks = await run(orchestrator(InMemorySessionStore(), target, None, draft_length=4, decode_steps=1),
                       max_new_tokens=5)
    assert generated(chunks) == REFERENCE[START:START + 5]
    assert all(draft_tokens == [] for _, draft_tokens in target.calls) and len(target.calls) == 5


@pytest.mark.parametrize("draft", [True, False])
async def test_rounds_at_k0_ask_the_target_for_several_tokens_within_those_still_wanted(draft):
    """--decode-steps 4: after the first round (its prefill alone: the time to first token), each round
    at k = 0 asks for up to 4 tokens in its one call, never more than the generation still wants; the
    client gets each round's tokens as one chunk, the round's stats count its passes."""
    target = FakeTarget(REFERENCE)
    orch = orchestrator(InMemorySessionStore(), target, FakeDraft(REFERENCE) if draft else None, draft_length=0,
                        decode_steps=4)
    chunks = [c for c in await run(orch, max_new_tokens=11) if c.token_ids]
    assert generated(chunks) == REFERENCE[START:START + 11]
    assert target.steps == [1, 4, 4, 2] and all(drafts == [] for _, drafts in target.calls)
    assert [len(c.token_ids) for c in chunks] == [1, 4, 4, 2]
    assert [c.round.verify_passes for c in chunks] == [1, 4, 4, 2]
    assert chunks[-1].stats.rounds == 4 and chunks[-1].stats.completion_tokens == 11
    assert target.continues == [True, True, True, False]


async def test_a_round_of_several_tokens_ends_at_the_end_of_sequence_and_at_a_stop():
    """The target stops a round's passes at the end of sequence; a stop string inside a round's tokens
    ends the generation there, as it would one round a token."""
    short = tokens(PROMPT + " the end")
    target = FakeTarget(short)
    chunks = await run(orchestrator(InMemorySessionStore(), target, None, draft_length=0, decode_steps=16),
                       max_new_tokens=50)
    assert generated(chunks) == tokens(" the end") + [EOS] and target.steps == [1, 16]
    assert "".join(c.text for c in chunks) == " the end" and chunks[-1].finish_reason == pb.FINISH_REASON_EOS
    runs = [await run(orchestrator(InMemorySessionStore(), FakeTarget(REFERENCE), None, draft_length=0,
                                   decode_steps=steps), max_new_tokens=40, stop=["small"]) for steps in (1, 8)]
    for chunks in runs:  # "small" ends in the third round of 1, 8, 8 tokens
        assert "".join(c.text for c in chunks) == " there was a "
        assert generated(chunks) == tokens(" there was a small")  # up to the token that completed it
        assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.parametrize("wrong_at", [set(), {START + 8, START + 20}])
async def test_overlap_drafts_the_next_block_during_the_verify(wrong_at):
    target, draft = FakeTarget(REFERENCE), FakeDraft(REFERENCE, wrong_at=wrong_at)
    orch = orchestrator(InMemorySessionStore(), target, draft, draft_length=3, overlap=True)
    chunks = await run(orch, max_new_tokens=30)
    assert generated(chunks) == REFERENCE[START:START + 30]  # lossless either way
    assert draft.calls[0] == (START, 4)  # during the first verify: a guess of its token, then k = 3
    overlapped = [c.round.overlapped for c in chunks[1:]]
    assert chunks[-1].stats.overlapped_rounds == sum(overlapped)
    if wrong_at:  # a rejected block's guess fails: the next block is drafted afresh, not overlapped
        assert overlapped[:2] == [False, True] and not all(overlapped[1:-1])
    else:  # 30 tokens: 1, then 4 a round; the last round (one token left) drafts nothing
        assert overlapped == [False] + [True] * 7 + [False]


async def test_auto_runs_the_controller_and_folds_it_into_the_prior():
    store = InMemorySessionStore()
    orch = orchestrator(store, FakeTarget(REFERENCE), FakeDraft(REFERENCE), draft_length="auto")
    chunks = await run(orch, max_new_tokens=30)
    assert generated(chunks) == REFERENCE[START:START + 30]
    assert (await store.load(chunks[0].session_id)).policy  # the controller's state travels with the session
    assert await store.load_prior() is not None


@pytest.mark.parametrize("sources,by_source", [(("model",), False), (("model", "suffix"), True)])
async def test_the_controller_keeps_a_state_per_source_the_draft_names(sources, by_source):
    store = InMemorySessionStore()
    orch = orchestrator(store, FakeTarget(REFERENCE), FakeDraft(REFERENCE, sources=sources), draft_length="auto")
    chunks = await run(orch, max_new_tokens=12)
    assert generated(chunks) == REFERENCE[START:START + 12]
    policy = (await store.load(chunks[0].session_id)).policy
    assert ("by_source" in policy) == by_source and (not by_source or set(policy["by_source"]) == {"suffix"})


async def test_getstatus_and_the_metrics_count_the_same_rounds():
    orch = orchestrator(InMemorySessionStore(), FakeTarget(REFERENCE), FakeDraft(REFERENCE, wrong_at={START + 2}),
                        draft_length=4)
    chunks = await run(orch, max_new_tokens=12)
    reply = pb.GetStatusResponse()
    orch.counters.fill(reply)
    metric = orch.metrics.registry.get_sample_value
    labels = {"service": "orchestrator"}
    assert reply.generations_total == 1 and reply.active_generations == 0
    assert reply.generated_tokens == 12 == len(generated(chunks))
    assert reply.draft_tokens == metric("specdec_spec_decode_num_draft_tokens_total", labels) == \
        chunks[-1].stats.draft_tokens
    assert reply.accepted_tokens == metric("specdec_spec_decode_num_accepted_tokens_total", labels) == \
        chunks[-1].stats.accepted_tokens


async def test_a_session_takes_turns_and_refuses_a_second_request_while_leased():
    store, target = InMemorySessionStore(), FakeTarget(REFERENCE)
    orch = orchestrator(store, target, FakeDraft(REFERENCE), draft_length=2)
    first = await run(orch, prompt=PROMPT[:10], max_new_tokens=3)
    session = first[0].session_id
    assert generated(first) == REFERENCE[10:13]
    second = await run(orch, session_id=session, prompt=PROMPT[13:16], max_new_tokens=2)
    assert second[0].session_id == session
    state = await store.load(session)
    assert state.tokens == REFERENCE[:16 + 2] and state.generation.prompt_tokens == 16
    state.generation.lease_until, state.generation.finish = 1e12, 0  # as if a request held it now
    await store.save(state, [])
    with pytest.raises(Aborted, match="is busy with generation"):
        await run(orch, session_id=session, prompt="x")


async def test_a_finished_output_is_shared_for_the_suffix_indexes_unless_turned_off():
    store = InMemorySessionStore()
    reader = FakeDraft(REFERENCE, reads_shared_outputs=True)
    chunks = await run(orchestrator(store, FakeTarget(REFERENCE), reader, draft_length=2), max_new_tokens=6)
    for _ in range(50):  # published in the background, after the last chunk
        if store.published:
            break
        await asyncio.sleep(0.01)
    assert store.published == [generated(chunks)]
    quiet = InMemorySessionStore()
    await run(orchestrator(quiet, FakeTarget(REFERENCE), reader, share_outputs=False, draft_length=2),
              max_new_tokens=6)
    await asyncio.sleep(0.05)
    assert quiet.published == []


@pytest.mark.parametrize("draft", [None, FakeDraft(REFERENCE)], ids=["no draft", "a draft that does not read"])
async def test_no_output_is_written_where_no_draft_reads_the_stream(draft):
    """Sharing is on, but nothing would read the stream: no tenant's output is left in Redis."""
    store = InMemorySessionStore()
    chunks = await run(orchestrator(store, FakeTarget(REFERENCE), draft, draft_length=2), max_new_tokens=6)
    await asyncio.sleep(0.05)
    assert generated(chunks) == REFERENCE[START:START + 6] and store.published == []


async def test_a_request_keeps_its_output_out_of_the_corpus_with_share_output_false():
    store = InMemorySessionStore()
    orch = orchestrator(store, FakeTarget(REFERENCE), FakeDraft(REFERENCE, reads_shared_outputs=True), draft_length=2)
    kept = await run(orch, max_new_tokens=6, share_output=False)
    shared = await run(orch, max_new_tokens=4, share_output=True)
    for _ in range(50):  # published in the background, after the last chunk
        if store.published:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert generated(kept) == REFERENCE[START:START + 6]  # the output itself is the same
    assert store.published == [generated(shared)]  # only the second
    with pytest.raises(FailedPrecondition, match="share_output.*--share-outputs is off"):
        orchestrator(InMemorySessionStore(), FakeTarget(REFERENCE), None, share_outputs=False).parse(
            request(share_output=True))


@pytest.mark.parametrize("draft", [None, FakeDraft(REFERENCE)], ids=["no draft", "a draft without a corpus"])
def test_share_output_true_is_refused_where_no_draft_learns_outputs(draft):
    orch = orchestrator(InMemorySessionStore(), FakeTarget(REFERENCE), draft)
    with pytest.raises(FailedPrecondition, match="share_output: this orchestrator's draft keeps no corpus"):
        orch.parse(request(share_output=True))
    assert orch.parse(request(share_output=False)).share_output is False  # keeping it out is always possible
    learning = FakeDraft(REFERENCE, learns_outputs=True)  # a suffix draft without the stream learns on release
    assert orchestrator(InMemorySessionStore(), FakeTarget(REFERENCE), learning).parse(
        request(share_output=True)).share_output is True


@pytest.mark.parametrize(("share_outputs", "share_output", "finish", "forget"), [
    (True, None, True, False),  # a finished, shareable generation: a draft may learn it on release
    (True, False, True, True),  # the request kept it out
    (False, None, True, True),  # the orchestrator does not share
    (True, None, False, True),  # not finished (interrupted): never learned
])
async def test_closing_a_session_tells_the_draft_whether_it_may_learn_the_output(share_outputs, share_output,
                                                                                 finish, forget):
    store, draft = InMemorySessionStore(), FakeDraft(REFERENCE)
    orch = orchestrator(store, FakeTarget(REFERENCE), draft, share_outputs=share_outputs, draft_length=2)
    fields = {} if share_output is None else {"share_output": share_output}
    session = (await run(orch, max_new_tokens=4, **fields))[0].session_id
    if not finish:
        state = await store.load(session)
        state.generation.finish = 0
        await store.save(state, [])
    assert await orch.close_session(session) is True
    assert draft.released[-1] == session and draft.forget_output[-1] is forget


async def _shared_groups(orch, principal: str) -> tuple[str, str]:
    """The corpus group a request of `principal` drafted with, and the one its output was published to."""
    published = len(orch.store.published_groups)
    chunks = [c async for c in orch.generate(orch.parse(request(max_new_tokens=6), principal=principal))]
    assert generated(chunks) == REFERENCE[START:START + 6]
    for _ in range(50):  # published in the background, after the last chunk
        if len(orch.store.published_groups) > published:
            break
        await asyncio.sleep(0.01)
    return orch.draft.corpus_groups[-1], orch.store.published_groups[-1]


@pytest.mark.parametrize("corpus_groups", ["", "team=alice,bob", "everyone=*"])
async def test_outputs_draft_and_join_only_their_own_corpus_group(corpus_groups):
    """Each principal is its own corpus group unless the operator groups identities; the anonymous
    principal (no authentication) is one group, "". What travels is an opaque id, never the identity."""
    from specdec.server.auth import principal_of

    draft = FakeDraft(REFERENCE, reads_shared_outputs=True)
    orch = orchestrator(InMemorySessionStore(), FakeTarget(REFERENCE), draft, draft_length=2,
                        corpus_groups=corpus_groups)
    groups = {identity: await _shared_groups(orch, principal_of(identity))
              for identity in ("alice", "bob", "carol", "")}
    for identity, (drafted, published) in groups.items():
        assert drafted == published and (identity == "" or identity not in drafted), identity
    alice, bob, carol, anonymous = (groups[i][0] for i in ("alice", "bob", "carol", ""))
    assert anonymous == ""
    assert len({alice, bob, carol, anonymous}) == {"": 4, "team=alice,bob": 3, "everyone=*": 2}[corpus_groups]
    assert (alice == bob) == bool(corpus_groups)


@pytest.mark.parametrize("spec, message", [
    ("team", "expected GROUP=IDENTITY"), ("team=", "names no identity"), ("a=x;b=x", "'x' is in two groups"),
    ("a=*;b=*", "'\\*' is in two groups"), ("bad name=x", "expected GROUP=IDENTITY"),
])
def test_corpus_groups_that_do_not_parse_are_refused_at_start(spec, message):
    from pydantic import ValidationError

    from orchestrator.config import OrchestratorConfig

    with pytest.raises(ValidationError, match=message):
        OrchestratorConfig(target="fake:1", corpus_groups=spec)


async def test_a_rounds_time_outside_the_model_is_in_its_stats_and_in_the_metrics():
    orch = orchestrator(InMemorySessionStore(), FakeTarget(REFERENCE), None, draft_length=0, decode_steps=1)
    rounds = [c.round for c in await run(orch, max_new_tokens=4) if c.token_ids]
    assert len(rounds) == 4 and all(r.save_ns > 0 and r.detokenize_ns > 0 for r in rounds)
    assert rounds[0].between_ns == 0 and all(r.between_ns > 0 for r in rounds[1:])
    for part in ("target_rpc", "target_queue", "between", "save", "detokenize"):
        labels = {"service": "orchestrator", "part": part}
        assert orch.metrics.registry.get_sample_value("specdec_round_part_seconds_count", labels) == 4


@pytest.mark.parametrize("draft", [True, False])
async def test_rounds_at_k0_tell_the_target_that_the_next_one_follows_except_the_last(draft):
    """`continues` (the target may verify the next round ahead): every round at k = 0 whose next round
    is still wanted, with or without a draft pool; not the last round, which nothing follows."""
    target = FakeTarget(REFERENCE)
    orch = orchestrator(InMemorySessionStore(), target, FakeDraft(REFERENCE) if draft else None, draft_length=0,
                        decode_steps=1)
    assert generated(await run(orch, max_new_tokens=6)) == REFERENCE[START:START + 6]
    assert target.continues == [True] * 5 + [False]


async def test_a_round_followed_by_a_block_does_not_continue_and_the_switch_turns_it_off():
    """Rounds of 1, 5, 5 tokens, then the 12th alone: only the round before that one is followed at
    k = 0 (the first, at k = 0 itself, is followed by a block)."""
    target = FakeTarget(REFERENCE)
    orch = orchestrator(InMemorySessionStore(), target, FakeDraft(REFERENCE), draft_length=4)
    assert generated(await run(orch, max_new_tokens=12)) == REFERENCE[START:START + 12]
    assert [len(drafts) for _, drafts in target.calls] == [0, 4, 4, 0]
    assert target.continues == [False, False, True, False]
    target = FakeTarget(REFERENCE)
    orch = orchestrator(InMemorySessionStore(), target, None, draft_length=0, verify_ahead=False, decode_steps=1)
    assert generated(await run(orch, max_new_tokens=6)) == REFERENCE[START:START + 6]
    assert target.continues == [False] * 6


@pytest.mark.parametrize("verify_ahead", [True, False])
async def test_the_drafts_followers_of_a_block_go_to_the_target_when_a_round_may_follow_it(verify_ahead):
    """Rounds of 1, 5, 5 tokens, then the 12th alone, the draft listing followers with each block:
    the target is told them for the first block (the round after it asks for a block again), not
    for the second (the round after it is certainly at k = 0: `continues`), and with
    --verify-ahead off never."""
    target, listed = FakeTarget(REFERENCE), frozenset({7, 9})
    orch = orchestrator(InMemorySessionStore(), target, FakeDraft(REFERENCE, followers=listed), draft_length=4,
                        verify_ahead=verify_ahead)
    assert generated(await run(orch, max_new_tokens=12)) == REFERENCE[START:START + 12]
    assert [len(drafts) for _, drafts in target.calls] == [0, 4, 4, 0]
    assert target.followers == ([None, listed, None, None] if verify_ahead else [None] * 4)
    assert target.continues == ([False, False, True, False] if verify_ahead else [False] * 4)


@pytest.mark.parametrize("listed", [frozenset({5}), frozenset(), None])
async def test_followers_take_the_place_of_a_guess(listed):
    """A round that would guess its next round ahead sends the draft's followers instead when the
    draft lists them (they tell for certain what the guess bets on), and guesses when it does not;
    a round that is certainly followed at k = 0 continues whatever the draft lists."""
    target = FakeTarget(REFERENCE)
    speculator = Speculator("s", SamplingParams(), 0, FakeDraft(REFERENCE, followers=listed), target, "fp")
    history = REFERENCE[:START]
    await speculator.round(history, 3, 3, continues=False, guess=True, follow=True)
    await speculator.round(history, 3, 0, continues=True, guess=False, follow=True)
    await speculator.round(history, 3, 3, continues=False, guess=False, follow=False)
    assert target.followers == [listed, None, None]
    assert target.continues == [listed is None, True, False]


def test_a_round_followed_by_a_block_continues_when_the_guess_pays():
    """A greedy session whose draft mostly proposes nothing lets the target verify the next round
    ahead even though that round asks for a block (the guess answers it when the draft proposes
    nothing, or when the guess refutes the block's first token)."""
    assert not continues_at_k0(0, 4, 10, True)
    assert continues_at_k0(0, 4, 10, True, guess=True)
    assert continues_at_k0(4, 4, 10, True, guess=True)
    assert not continues_at_k0(4, 4, 5, True, guess=True)  # the round's at most 5 tokens end the generation


class ScriptedLengths:
    """A draft-length controller whose choices after each round are scripted: `(wanted, upcoming)`, the
    last repeated; the policy state it shows makes a guess pay (the draft mostly proposes nothing)."""

    policy = PolicyState(empty_ewma=0.9, rtt_draft_s=0.002, rtt_target_s=0.001, verify_s=(0.002,))
    sources = ()
    room = 1  # a round at k = 0 runs one pass

    def __init__(self, script: list[tuple[int, int]]) -> None:
        self.script = list(script)
        self.wanted, self.upcoming = self.script.pop(0)

    def observe(self, state, stats, loop_s, source="", asked=()) -> None:
        if self.script:
            self.wanted, self.upcoming = self.script.pop(0)

    async def finish(self, store) -> None:
        pass


async def test_a_round_the_target_verifies_ahead_stays_at_k0_when_the_controller_changes_its_mind(monkeypatch):
    """The first round tells the target that the next follows at k = 0; the controller then wants a
    block: that round still asks the draft for nothing (a block would wait for the pass run ahead,
    then run its own) and makes no guess (it asked nothing to guess from); the block comes a round
    later, and that round, asking the draft, guesses its next round ahead."""
    import orchestrator.generation as generation

    async def scripted(*args, **kwargs):
        return ScriptedLengths([(0, 0), (4, 4)])

    monkeypatch.setattr(generation, "controller_for", scripted)
    target = FakeTarget(REFERENCE)
    orch = orchestrator(InMemorySessionStore(), target, FakeDraft(REFERENCE), draft_length=4)
    assert generated(await run(orch, max_new_tokens=12)) == REFERENCE[START:START + 12]
    assert [len(drafts) for _, drafts in target.calls][:3] == [0, 0, 4]
    assert target.continues[:3] == [True, False, True]


async def test_a_round_at_k0_runs_one_pass_when_the_controller_wants_a_block_next(monkeypatch):
    """Rounds at k = 0 of up to 4 passes while the controller's next choice is k = 0 too; the round before
    the block it wants next runs one pass, so the block is not held back."""
    import orchestrator.generation as generation

    class Unbounded(ScriptedLengths):
        room = 64

    async def scripted(*args, **kwargs):
        return Unbounded([(0, 0), (0, 0), (0, 4), (4, 4)])

    monkeypatch.setattr(generation, "controller_for", scripted)
    target = FakeTarget(REFERENCE)
    orch = orchestrator(InMemorySessionStore(), target, FakeDraft(REFERENCE), draft_length=4, decode_steps=4)
    assert generated(await run(orch, max_new_tokens=16)) == REFERENCE[START:START + 16]
    assert target.steps[:4] == [1, 4, 1, 1] and [len(drafts) for _, drafts in target.calls][:4] == [0, 0, 0, 4]


async def test_a_round_that_asks_the_draft_nothing_guesses_nothing(monkeypatch):
    """A guess bets on the share of asked rounds the draft answers empty: the first round (k = 0) makes
    none although the controller's estimates make it pay and the next round asks for a block; that
    round, asking the draft, does."""
    import orchestrator.generation as generation

    async def scripted(*args, **kwargs):
        return ScriptedLengths([(4, 4)])

    monkeypatch.setattr(generation, "controller_for", scripted)
    target = FakeTarget(REFERENCE)
    orch = orchestrator(InMemorySessionStore(), target, FakeDraft(REFERENCE), draft_length=4)
    assert generated(await run(orch, max_new_tokens=12)) == REFERENCE[START:START + 12]
    assert [len(drafts) for _, drafts in target.calls][:2] == [0, 4]
    assert target.continues[:2] == [False, True]


async def test_a_round_the_budget_alone_would_follow_at_k0_does_not_hold_back_the_block_after_it():
    """At a fixed k = 4 with 6 tokens still wanted, the round's block leaves room for one plain round
    if it is accepted whole, so it continues; cut short after its first token, it leaves 4 wanted, and
    the next round drafts 3 of them: only the controller's own k = 0 keeps the next round at k = 0."""
    target = FakeTarget(REFERENCE)
    draft = FakeDraft(REFERENCE, wrong_at={START + 2})
    orch = orchestrator(InMemorySessionStore(), target, draft, draft_length=4)
    assert generated(await run(orch, max_new_tokens=7)) == REFERENCE[START:START + 7]
    assert [len(drafts) for _, drafts in target.calls] == [0, 4, 3]
    assert target.continues == [False, True, False]


def test_a_round_of_several_passes_is_observed_as_one_pass_with_its_calls_round_trip():
    """The controller files one pass's compute under t_v(0) and keeps the call's round trip (wall less
    compute less queue) whole; a round asking for 4 passes continues only if more than 4 tokens are
    still wanted."""
    one = observation(pb.RoundStats(verify_ns=9_000_000, verify_compute_ns=6_000_000, verify_queue_ns=400_000))
    four = observation(pb.RoundStats(verify_ns=27_000_000, verify_compute_ns=24_000_000, verify_queue_ns=1_600_000,
                                     verify_passes=4))
    for seen in (one, four):
        assert seen.verify_compute_s == pytest.approx(0.006) and seen.verify_queue_s == pytest.approx(0.0004)
    assert one.verify_wall_s == pytest.approx(0.009)
    assert four.verify_wall_s - four.verify_compute_s - four.verify_queue_s == pytest.approx(0.0014)
    ahead = observation(pb.RoundStats(verify_ns=5_000_000, verify_compute_ns=24_000_000, verify_passes=4))
    assert ahead.verify_wall_s == ahead.verify_compute_s == pytest.approx(0.006)  # passes run before the call
    assert continues_at_k0(0, 0, 5, False, steps=4) and not continues_at_k0(0, 0, 4, False, steps=4)
