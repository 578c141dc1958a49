"""A real target service verifying rounds ahead (`VerifyRequest.continues`): a session's k = 0
rounds, each saying the next follows, are answered from passes run before their requests came,
with exactly the tokens (greedy and sampled) and log-probabilities of rounds verified one by one;
a greedy block whose first draft token the guess refutes is answered from the guess; a request
other than the one guessed is verified as usual; a Release drops the guess and leaves no cache;
the draft's followers of a block (`VerifyRequest.followers`) have the round after it verified
ahead exactly when the block is accepted whole and the token after it is not among them; the
guesses are counted in /metrics."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.service.test_batching_services import scrape, service

PROMPT = "The quick brown fox"
ROUNDS = 10


@pytest.fixture(scope="module")
def target(tiny_models, tmp_path_factory):
    with service("target_service", tmp_path_factory.mktemp("target-logs"), "--model", str(tiny_models["target"]),
                 "--dtype", "float64") as running:
        yield running


def used_and_dropped(metrics_port: int) -> tuple[float, float]:
    samples = scrape(metrics_port)
    return (samples[("specdec_verified_ahead_total", (("outcome", "used"),))],
            samples[("specdec_verified_ahead_total", (("outcome", "dropped"),))])


async def rounds(address: str, session: str, history: list[int], continues: bool, sampling: common_pb2.SamplingParams,
                 count: int = ROUNDS, followers: list[int] | None = None) -> list[target_pb2.VerifyResponse]:
    """`count` rounds at k = 0 on one VerifyStream call, each request sent once the previous answer
    came, each saying the next follows (`continues`: the last one leaves a guess behind), or
    naming `followers`."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = target_pb2_grpc.TargetServiceStub(channel).VerifyStream()
        history, replies = list(history), []
        for _ in range(count):
            await call.write(target_pb2.VerifyRequest(
                session_id=session, history=history, sampling=sampling, seed=7, logprobs=True, top_logprobs=3,
                continues=continues, followers=None if followers is None else common_pb2.Followers(tokens=followers)))
            reply = await call.read()
            replies.append(reply)
            history.append(reply.token_id)
        await call.done_writing()
        return replies


def on_one_call(address: str, requests: list[target_pb2.VerifyRequest]) -> list[target_pb2.VerifyResponse]:
    """`requests` in turn on one VerifyStream call, each sent once the previous answer came."""
    async def go() -> list[target_pb2.VerifyResponse]:
        async with grpc.aio.insecure_channel(address) as channel:
            call = target_pb2_grpc.TargetServiceStub(channel).VerifyStream()
            replies = []
            for request in requests:
                await call.write(request)
                replies.append(await call.read())
            await call.done_writing()
            return replies
    return asyncio.run(go())


def summary(replies: list[target_pb2.VerifyResponse]) -> list[tuple]:
    return [(r.token_id, r.num_accepted, [(e.token_id, round(e.logprob, 9), list(e.top_token_ids)) for e in r.logprobs])
            for r in replies]


def release(address: str, session: str) -> None:
    async def go():
        async with grpc.aio.insecure_channel(address) as channel:
            await target_pb2_grpc.TargetServiceStub(channel).Release(common_pb2.ReleaseRequest(session_id=session))
    asyncio.run(go())


def cached_sessions(address: str) -> int:
    async def go():
        async with grpc.aio.insecure_channel(address) as channel:
            info = await target_pb2_grpc.TargetServiceStub(channel).GetInfo(common_pb2.GetInfoRequest())
            return info.cached_sessions
    return asyncio.run(go())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rounds_that_continue_are_answered_ahead_with_the_tokens_of_rounds_verified_one_by_one(
        target, reference, temperature):
    address, metrics_port = target
    prompt = reference.encode(PROMPT)
    sampling = common_pb2.SamplingParams(temperature=temperature)
    used, dropped = used_and_dropped(metrics_port)
    ahead = asyncio.run(rounds(address, f"ahead-{temperature}", prompt, True, sampling))
    plain = asyncio.run(rounds(address, f"plain-{temperature}", prompt, False, sampling))
    assert summary(ahead) == summary(plain)
    if temperature == 0:
        assert [r.token_id for r in plain] == reference.greedy(PROMPT, ROUNDS)
    # Every round after the first came from a pass run ahead (none after a token that ends the text).
    ends = set(reference.loaded.eos_token_ids)
    expected = [i > 0 and ahead[i - 1].token_id not in ends for i in range(ROUNDS)]
    assert [r.decoded_ahead for r in ahead] == expected and not any(r.decoded_ahead for r in plain)
    assert all(r.queue_ns == 0 and r.compute_ns > 0 for r, e in zip(ahead, expected) if e)
    assert used_and_dropped(metrics_port) == (used + sum(expected), dropped)
    for session in (f"ahead-{temperature}", f"plain-{temperature}"):
        release(address, session)
    assert cached_sessions(address) == 0
    held = ahead[-1].token_id not in ends  # the last round's guess, dropped by the Release
    assert used_and_dropped(metrics_port) == (used + sum(expected), dropped + held)


def test_a_request_other_than_the_one_guessed_is_verified_as_usual(target, reference):
    """Rounds that all continue, but only the third asks what was guessed: the others (a block of
    drafts, a history gone back) are verified as a session with no guess is, and the guesses they
    did not ask for are counted dropped."""
    address, metrics_port = target
    prompt, g = reference.encode(PROMPT), reference.greedy(PROMPT, 8)
    wrong = (g[3] + 1) % reference.loaded.vocab_size
    requests = [(prompt, []), (prompt + g[:1], [g[1], g[2], wrong]), (prompt + g[:4], []), (prompt, [g[0], g[1]])]
    sampling = common_pb2.SamplingParams()

    def send(session: str, continues: bool) -> list[target_pb2.VerifyResponse]:
        return on_one_call(address, [target_pb2.VerifyRequest(session_id=session, history=history, draft_tokens=drafts,
                                                              sampling=sampling, seed=1, continues=continues)
                                     for history, drafts in requests])

    used, dropped = used_and_dropped(metrics_port)
    guessed = send("other-ahead", True)
    plain = send("other-plain", False)
    verdicts = [(0, g[0]), (2, g[3]), (0, g[4]), (2, g[2])]
    assert [(r.num_accepted, r.token_id) for r in guessed] == [(r.num_accepted, r.token_id) for r in plain] == verdicts
    assert [r.decoded_ahead for r in guessed] == [False, False, True, False]
    assert used_and_dropped(metrics_port) == (used + 1, dropped + 2)  # the last round's guess is still held
    for session in ("other-ahead", "other-plain"):
        release(address, session)
    assert cached_sessions(address) == 0
    assert used_and_dropped(metrics_port) == (used + 1, dropped + 3)


def refuted(metrics_port: int) -> float:
    return scrape(metrics_port)[("specdec_verified_ahead_total", (("outcome", "refuted"),))]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_greedy_block_whose_first_token_the_guess_refutes_is_answered_from_the_guess(
        target, reference, temperature):
    """A block of drafts after the guessed history: greedy, when the guess's token is not the
    block's first, the guess is the block's verdict (nothing accepted, that token, the same
    log-probabilities) and the round after it is guessed in turn; a block the guess does not refute,
    and any sampled block, is verified by its own pass. Each verdict equals a session's without
    guesses."""
    address, metrics_port = target
    prompt, g = reference.encode(PROMPT), reference.greedy(PROMPT, 6)
    vocab = reference.loaded.vocab_size
    wrong = [(t + 1) % vocab for t in g]
    requests = [(prompt, []), (prompt + g[:1], [wrong[1], g[2]]), (prompt + g[:2], []),
                (prompt + g[:3], [g[3], wrong[4]]), (prompt + g[:5], [])]
    sampling = common_pb2.SamplingParams(temperature=temperature)

    def send(session: str, continues: bool) -> list[target_pb2.VerifyResponse]:
        return on_one_call(address, [target_pb2.VerifyRequest(
            session_id=session, history=history, draft_tokens=drafts, sampling=sampling, seed=3, logprobs=True,
            top_logprobs=3, continues=continues) for history, drafts in requests])

    used, dropped = used_and_dropped(metrics_port)
    before = refuted(metrics_port)
    guessed = send(f"refuted-{temperature}", True)
    plain = send(f"refuted-plain-{temperature}", False)
    assert summary(guessed) == summary(plain)
    if temperature == 0:
        assert [(r.num_accepted, r.token_id) for r in guessed] == [(0, g[0]), (0, g[1]), (0, g[2]), (1, g[4]),
                                                                   (0, g[5])]
        assert [r.decoded_ahead for r in guessed] == [False, True, True, False, True]
        assert refuted(metrics_port) == before + 1
        assert used_and_dropped(metrics_port) == (used + 2, dropped + 1)
    else:  # a sampled block takes no guess: its draws are its own
        assert not guessed[1].decoded_ahead and not guessed[3].decoded_ahead
        assert refuted(metrics_port) == before
    assert not any(r.decoded_ahead for r in plain)
    for session in (f"refuted-{temperature}", f"refuted-plain-{temperature}"):
        release(address, session)
    assert cached_sessions(address) == 0


def test_a_release_drops_the_guess_and_leaves_no_cache(target, reference):
    """Released while its guess may still be running: nothing of the session stays, and the same
    request afterwards is verified from scratch."""
    address, metrics_port = target
    prompt = reference.encode(PROMPT)
    sampling = common_pb2.SamplingParams()
    first = asyncio.run(rounds(address, "released", prompt, True, sampling, count=2))
    assert first[1].decoded_ahead
    again = asyncio.run(rounds(address, "released", prompt + [first[0].token_id], True, sampling, count=1))
    # (a lone request that continues leaves a guess behind, running or done)
    release(address, "released")
    assert cached_sessions(address) == 0
    after = asyncio.run(rounds(address, "released", prompt + [first[0].token_id], False, sampling, count=1))
    assert not after[0].decoded_ahead and after[0].token_id == again[0].token_id == first[1].token_id
    release(address, "released")
    assert cached_sessions(address) == 0


def test_followers_have_the_next_round_verified_ahead_only_when_it_drafts_nothing(target, reference):
    """Greedy requests naming the draft's followers of their block, never `continues`: the round
    after one is verified ahead when the block is accepted whole and the token after it is not a
    follower (an empty list: nothing can be drafted next), and not when that token is one, nor
    after a block cut short; the verdicts are a session's without followers."""
    address, metrics_port = target
    prompt, g = reference.encode(PROMPT), reference.greedy(PROMPT, 9)
    wrong = (g[7] + 1) % reference.loaded.vocab_size
    requests = [(prompt, [], []), (prompt + g[:1], [], [g[1]]), (prompt + g[:2], [g[2], g[3]], []),
                (prompt + g[:5], [], None), (prompt + g[:6], [g[6], wrong], []), (prompt + g[:8], [], None)]
    sampling = common_pb2.SamplingParams()

    def send(session: str, with_followers: bool) -> list[target_pb2.VerifyResponse]:
        return on_one_call(address, [target_pb2.VerifyRequest(
            session_id=session, history=history, draft_tokens=drafts, sampling=sampling, seed=1, logprobs=True,
            followers=common_pb2.Followers(tokens=followers) if with_followers and followers is not None else None)
            for history, drafts, followers in requests])

    used, dropped = used_and_dropped(metrics_port)
    followed = send("followers", True)
    plain = send("followers-plain", False)
    assert summary(followed) == summary(plain)
    assert [(r.num_accepted, r.token_id) for r in plain] == [(0, g[0]), (0, g[1]), (2, g[4]), (0, g[5]), (1, g[7]),
                                                             (0, g[8])]
    assert [r.decoded_ahead for r in followed] == [False, True, False, True, False, False]
    assert not any(r.decoded_ahead for r in plain)
    assert used_and_dropped(metrics_port) == (used + 2, dropped)
    for session in ("followers", "followers-plain"):
        release(address, session)
    assert cached_sessions(address) == 0


def test_sampled_rounds_naming_no_followers_are_verified_ahead_with_their_own_draws(target, reference):
    """A sampled session's k = 0 rounds whose draft can draft nothing after any token (an empty
    followers list): each round after the first is answered from a pass run ahead, with the tokens
    and log-probabilities of rounds verified one by one."""
    address, _ = target
    prompt = reference.encode(PROMPT)
    sampling = common_pb2.SamplingParams(temperature=1.0)
    followed = asyncio.run(rounds(address, "followed-sampled", prompt, False, sampling, followers=[]))
    plain = asyncio.run(rounds(address, "followed-sampled-plain", prompt, False, sampling))
    assert summary(followed) == summary(plain)
    ends = set(reference.loaded.eos_token_ids)
    assert [r.decoded_ahead for r in followed] == [i > 0 and followed[i - 1].token_id not in ends
                                                   for i in range(ROUNDS)]
    for session in ("followed-sampled", "followed-sampled-plain"):
        release(address, session)
    assert cached_sessions(address) == 0


def test_too_many_followers_are_refused_naming_the_field(target, reference):
    address, _ = target
    prompt = reference.encode(PROMPT)

    async def send():
        async with grpc.aio.insecure_channel(address) as channel:
            await target_pb2_grpc.TargetServiceStub(channel).Verify(target_pb2.VerifyRequest(
                session_id="too-many-followers", history=prompt, sampling=common_pb2.SamplingParams(),
                followers=common_pb2.Followers(tokens=list(range(257)))))

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(send())
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "followers lists 257 tokens; at most 256" in refused.value.details()
    assert cached_sessions(address) == 0


def flat(replies: list[target_pb2.VerifyResponse]) -> tuple[list[int], list[tuple]]:
    """The tokens of `replies` in order (each token_id, then its decoded ones) and their log-probabilities."""
    tokens = [t for r in replies for t in [r.token_id, *r.decoded]]
    return tokens, [(e.token_id, round(e.logprob, 9), list(e.top_token_ids)) for r in replies for e in r.logprobs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_of_several_decode_steps_emits_the_tokens_of_rounds_verified_one_by_one(
        target, reference, temperature):
    """decode_steps 4, then 5 from where it ended: 9 tokens in two answers, with the tokens and
    log-probabilities of 9 rounds verified one by one (greedy and sampled: each pass draws as its own
    request would); the second answer came from passes run back to back, its first ahead of it
    (the first said `continues`)."""
    address, metrics_port = target
    prompt = reference.encode(PROMPT)
    sampling = common_pb2.SamplingParams(temperature=temperature)
    plain = asyncio.run(rounds(address, f"one-by-one-{temperature}", prompt, False, sampling, count=9))
    tokens, entries = flat(plain)

    def ask(history: list[int], steps: int, continues: bool) -> target_pb2.VerifyRequest:
        return target_pb2.VerifyRequest(session_id=f"steps-{temperature}", history=history, sampling=sampling, seed=7,
                                        logprobs=True, top_logprobs=3, decode_steps=steps, continues=continues)

    used, _ = used_and_dropped(metrics_port)
    replies = on_one_call(address, [ask(prompt, 4, True), ask(prompt + tokens[:4], 5, False)])
    assert flat(replies) == (tokens, entries)
    assert [len(r.decoded) for r in replies] == [3, 4] and all(r.compute_ns > 0 for r in replies)
    assert replies[1].decoded_ahead and used_and_dropped(metrics_port)[0] > used
    for session in (f"one-by-one-{temperature}", f"steps-{temperature}"):
        release(address, session)
    assert cached_sessions(address) == 0


def test_decode_steps_end_at_an_end_token_and_are_refused_with_draft_tokens_or_beyond_64(target, reference):
    address, _ = target
    prompt, g = reference.encode(PROMPT), reference.greedy(PROMPT, 6)
    ended = on_one_call(address, [target_pb2.VerifyRequest(
        session_id="steps-end", history=prompt, decode_steps=6,
        sampling=common_pb2.SamplingParams(end_token_ids=[g[2]]))])[0]
    assert [ended.token_id, *ended.decoded] == g[:3]

    async def send(**fields):
        async with grpc.aio.insecure_channel(address) as channel:
            await target_pb2_grpc.TargetServiceStub(channel).Verify(target_pb2.VerifyRequest(
                session_id="steps-refused", history=prompt, sampling=common_pb2.SamplingParams(), **fields))

    for fields in ({"decode_steps": 2, "draft_tokens": g[:2]}, {"decode_steps": 65}):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(send(**fields))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "decode_steps must be 0..64 and at most 1 with draft tokens" in refused.value.details()
    release(address, "steps-end")
    assert cached_sessions(address) == 0


def test_a_release_during_a_request_of_many_decode_steps_leaves_no_cache(target, reference):
    """Released while the further passes of a request of 64 decode steps run: the request ends (with
    the tokens so far, or CANCELLED), no pass after the Release keeps the session's cache, and the
    service serves the next request."""
    address, _ = target
    prompt = reference.encode(PROMPT)
    no_end = common_pb2.SamplingParams(logit_bias={t: -100.0 for t in reference.loaded.eos_token_ids})

    async def go(sent: int):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            call = stub.Verify(target_pb2.VerifyRequest(session_id="steps-released", history=prompt, decode_steps=64,
                                                        sampling=no_end, sent_unix_ns=sent))
            for _ in range(5000):  # until its first pass ran
                if (await stub.GetInfo(common_pb2.GetInfoRequest())).cached_sessions:
                    break
                await asyncio.sleep(0.001)
            await stub.Release(common_pb2.ReleaseRequest(session_id="steps-released"))  # (no send time: stops anyway)
            try:
                return len((await call).decoded)
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.CANCELLED, error
                return None

    decoded = asyncio.run(go(time.time_ns()))
    assert decoded is None or decoded < 63  # cut short by the Release
    for _ in range(50):
        if cached_sessions(address) == 0:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert cached_sessions(address) == 0
    replies = on_one_call(address, [target_pb2.VerifyRequest(session_id="after-steps", history=prompt, decode_steps=3,
                                                             sampling=common_pb2.SamplingParams())])
    assert len(replies[0].decoded) == 2
    release(address, "after-steps")
