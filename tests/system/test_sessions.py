"""Sessions across requests: multi-turn chat, one request at a time, resume, TTL and close.

One real pipeline (tiny float64 models, real Redis); verify padded to 30 ms (a labelled
simulation) so a stream is still running when a second request arrives.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import redis

from orchestrator.chat import first_turn
from orchestrator.config import OrchestratorConfig
from orchestrator.server import build_orchestrator
from specdec.keys import session_meta_key, session_tokens_key
from specdec.runtime.models import load_tokenizer
from specdec.v1 import orchestrator_pb2 as pb
from tests.cluster import cached_sessions, orchestrator_stub, request
from tests.conftest import orchestrator_address, start_tiny_pipeline
from tests.reference import Reference

PROMPT = "Once upon a time"
MAX_NEW = 40


@pytest.fixture(scope="module")
def pipeline(tiny_models, tmp_path_factory):
    p = start_tiny_pipeline(tmp_path_factory.mktemp("logs-sessions"), tiny_models, "good_draft",
                            extra_target_args=["--emulate-verify-ms", "30"])
    yield p
    p.stop()


@pytest.fixture(scope="module")
def stub(pipeline):
    ch, stub = orchestrator_stub(orchestrator_address(pipeline))
    yield stub
    ch.close()


@pytest.fixture(scope="module")
def expected(tiny_models) -> list[int]:
    return Reference(str(tiny_models["target"])).greedy(PROMPT, MAX_NEW)


def _history(pipeline, session: str) -> list[int]:
    r = redis.Redis(port=pipeline.plan.redis_port)
    return [int(t) for t in r.lrange(session_tokens_key(session), 0, -1)]


def test_second_request_on_a_busy_session_is_aborted_and_state_is_not_interleaved(pipeline, stub, expected):
    stream = stub.Generate(request(PROMPT, max_new_tokens=MAX_NEW), timeout=120)
    header = next(stream)
    session = header.session_id
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateUnary(request(" and then", session_id=session, max_new_tokens=4), timeout=60)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "is busy with generation" in info.value.details()
    tokens = [t for chunk in stream for t in chunk.token_ids]
    assert tokens == expected
    # Once it is done, the session takes the next turn.
    more = stub.GenerateUnary(request(" and then", session_id=session, max_new_tokens=4), timeout=60)
    assert len(more.token_ids) == 4
    history = _history(pipeline, session)
    assert history[-4:] == list(more.token_ids)
    assert history[len(history) - 4 - len(" and then") - len(expected):][:len(expected)] == expected


def test_resume_after_a_cancelled_stream_sends_exactly_the_rest(pipeline, stub, expected):
    stream = stub.Generate(request(PROMPT, max_new_tokens=MAX_NEW), timeout=120)
    session, held, text = "", [], ""
    for chunk in stream:
        session = session or chunk.session_id
        held.extend(chunk.token_ids)
        text += chunk.text
        if len(held) >= 5:
            stream.cancel()
            break
    rest = list(stub.Generate(pb.GenerateRequest(session_id=session, resume_from=len(held)), timeout=120))
    assert rest[0].offset == len(held)
    assert held + [t for c in rest for t in c.token_ids] == expected
    final = rest[-1]
    assert final.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert final.stats.completion_tokens == len(expected)
    unary = stub.GenerateUnary(request(PROMPT, max_new_tokens=MAX_NEW), timeout=120)
    assert text + "".join(c.text for c in rest) == unary.text
    # Resuming a finished generation again answers with its end, and nothing else.
    again = list(stub.Generate(pb.GenerateRequest(session_id=session, resume_from=len(expected)), timeout=60))
    assert [t for c in again for t in c.token_ids] == []
    assert again[-1].finish_reason == final.finish_reason
    assert again[-1].stats.completion_tokens == len(expected)


def test_a_stream_closed_at_a_yield_frees_the_lease_and_both_caches(pipeline, tiny_models):
    """A client that leaves while its stream waits at a `yield` (the gRPC write) does not cancel
    the handler's task: its response generators are closed instead (GeneratorExit). That path
    must free the session like a cancelled task does: caches on both services, the lease, and
    the generation left resumable. An orchestrator in this process, against the real services."""
    addresses = pipeline.plan.grpc_addresses()

    async def scenario() -> tuple[str, dict, dict, float, dict]:
        config = OrchestratorConfig(target=addresses["target"], draft=addresses["draft"],
                                    model=str(tiny_models["target"]),
                                    redis_url=f"redis://127.0.0.1:{pipeline.plan.redis_port}/0", draft_length=4)
        orchestrator = await build_orchestrator(config)

        async def cached() -> dict[str, int]:  # sessions each service holds a cache for
            return {role: (await backend.info()).cached_sessions for role, backend in orchestrator.backends()}

        before = await cached()
        stream = orchestrator.generate(orchestrator.parse(request(PROMPT, max_new_tokens=MAX_NEW)))
        session = (await anext(stream)).session_id
        for _ in range(2):  # the first round is the target's alone; the second drafts too
            assert (await anext(stream)).token_ids
        assert await cached() == {role: n + 1 for role, n in before.items()}
        await stream.aclose()  # as gRPC does when the client goes away at a write
        for _ in range(100):
            if not orchestrator._background:
                break
            await asyncio.sleep(0.05)
        after = await cached()
        cancelled = orchestrator.metrics.registry.get_sample_value(
            "specdec_request_success_total", {"finish_reason": "cancelled", "service": "orchestrator"})
        return session, before, after, cancelled, json.loads(redis.Redis(port=pipeline.plan.redis_port).hget(
            session_meta_key(session), "state"))["generation"]

    session, before, after, cancelled, generation = asyncio.run(scenario())
    assert after == before, "the closed stream's caches were left on the services"
    assert generation["lease_until"] == 0 and generation["finish"] == 0  # free, and resumable
    assert cancelled == 1


def test_resume_takes_a_running_generation_over(pipeline, stub, expected):
    first = stub.Generate(request(PROMPT, max_new_tokens=MAX_NEW), timeout=120)
    session, held = "", []
    for chunk in first:
        session = session or chunk.session_id
        held.extend(chunk.token_ids)
        if len(held) >= 3:
            break
    rest = list(stub.Generate(pb.GenerateRequest(session_id=session, resume_from=len(held)), timeout=120))
    assert held + [t for c in rest for t in c.token_ids] == expected
    with pytest.raises(grpc.RpcError) as info:  # the displaced stream stops at its next write
        for _ in first:
            pass
    assert info.value.code() == grpc.StatusCode.ABORTED
    prompt_len = len(_history(pipeline, session)) - len(expected)
    assert _history(pipeline, session)[prompt_len:] == expected  # one history, not two interleaved


@pytest.mark.parametrize("fields,code,message", [
    (dict(session_id="", resume_from=0), grpc.StatusCode.INVALID_ARGUMENT, "needs the session_id"),
    (dict(session_id="nope", resume_from=0), grpc.StatusCode.NOT_FOUND, "nothing to resume"),
    (dict(session_id="x", resume_from=0, prompt="hi"), grpc.StatusCode.INVALID_ARGUMENT, "leave prompt"),
])
def test_bad_resume_requests(stub, fields, code, message):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(**fields), timeout=30))
    assert info.value.code() == code and message in info.value.details()


def test_resume_from_beyond_what_was_generated_is_refused(stub):
    out = stub.GenerateUnary(request(PROMPT, max_new_tokens=4), timeout=60)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(session_id=out.session_id, resume_from=99), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "has produced 4 tokens" in info.value.details()


def test_multi_turn_chat_keeps_one_history_equal_to_the_whole_conversation(pipeline, stub, tiny_models):
    tokenizer = load_tokenizer(str(tiny_models["target"]))
    turn1 = [{"role": "user", "content": "Hi there"}]
    turn2 = [{"role": "user", "content": "Tell me more"}]
    chat = lambda msgs, **kw: pb.GenerateRequest(  # noqa: E731
        messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in msgs]), max_new_tokens=12, **kw)
    one = stub.GenerateUnary(chat(turn1), timeout=60)
    two = stub.GenerateUnary(chat(turn2, session_id=one.session_id), timeout=60)
    assert two.session_id == one.session_id
    history = _history(pipeline, one.session_id)
    reply1 = tokenizer.decode(list(one.token_ids), skip_special_tokens=True)
    whole = first_turn(tokenizer, [*turn1, {"role": "assistant", "content": reply1}, *turn2])
    assert tokenizer.decode(history, skip_special_tokens=True) == \
        tokenizer.decode(whole + list(two.token_ids), skip_special_tokens=True)
    assert two.stats.prompt_tokens == len(history) - len(two.token_ids)


def test_sessions_expire_by_ttl_and_close_frees_everything(pipeline, stub):
    r = redis.Redis(port=pipeline.plan.redis_port)
    out = stub.GenerateUnary(request(PROMPT, max_new_tokens=6), timeout=60)
    for key in (session_meta_key(out.session_id), session_tokens_key(out.session_id)):
        assert 0 < r.ttl(key) <= 3600  # --session-ttl-s default, refreshed on every write
    target = pipeline.plan.grpc_addresses()["target"]
    before = cached_sessions(target)
    assert stub.CloseSession(pb.CloseSessionRequest(session_id=out.session_id), timeout=30).closed
    assert not r.exists(session_meta_key(out.session_id), session_tokens_key(out.session_id))
    assert cached_sessions(target) == before - 1
