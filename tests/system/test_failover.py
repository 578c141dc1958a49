"""Failover, tested by killing real processes mid-stream with SIGKILL.

Every test streams a greedy generation through real processes (tiny float64 models, a real
Redis), kills one process after a few tokens, and checks that the tokens the client ends up with
are exactly the target's own greedy output: nothing lost, nothing duplicated. Verify is padded
to 40 ms (a labelled simulation) so that a stream lasts long enough to be interrupted.
"""

from __future__ import annotations

import time

import grpc
import pytest
import redis

from specdec.keys import session_tokens_key
from specdec.runtime.models import load_tokenizer
from specdec.v1 import draft_pb2_grpc, orchestrator_pb2 as pb
from tests.cluster import Cluster, cached_sessions, model_info, orchestrator_stub, request
from tests.reference import Reference

PROMPT = "The quick brown fox"
MAX_NEW = 48
SLOW = ("--emulate-verify-ms", "40")


@pytest.fixture(scope="module")
def expected(tiny_models) -> list[int]:
    return Reference(str(tiny_models["target"])).greedy(PROMPT, MAX_NEW)


@pytest.fixture
def cluster(tiny_models, tmp_path):
    c = Cluster(tmp_path, tiny_models)
    yield c
    c.stop()


def test_target_replica_killed_the_session_moves_to_the_other(cluster, expected):
    redis_port = cluster.redis()
    targets = [cluster.target("target-1", *SLOW), cluster.target("target-2", *SLOW)]
    address = cluster.orchestrator("orchestrator", targets, [cluster.draft("draft")], redis_port)
    ch, stub = orchestrator_stub(address)
    tokens, victim = [], None
    with ch:
        for chunk in stub.Generate(request(PROMPT, max_new_tokens=MAX_NEW, draft_length=4), timeout=120):
            tokens.extend(chunk.token_ids)
            if victim is None and len(tokens) >= 4:
                holders = [n for n in ("target-1", "target-2") if cached_sessions(cluster.addresses[n]) > 0]
                assert len(holders) == 1  # the session lives on exactly one replica
                victim = holders[0]
                cluster.kill(victim)
        assert chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert tokens == expected
    survivor = "target-2" if victim == "target-1" else "target-1"
    assert cached_sessions(cluster.addresses[survivor]) == 1  # re-prefilled there


def test_orchestrator_killed_the_client_resumes_on_another_replica(cluster, expected):
    redis_port = cluster.redis()
    target, draft = cluster.target("target", *SLOW), cluster.draft("draft")
    first = cluster.orchestrator("orchestrator-1", [target], [draft], redis_port)
    second = cluster.orchestrator("orchestrator-2", [target], [draft], redis_port)
    ch1, stub1 = orchestrator_stub(first)
    ch2, stub2 = orchestrator_stub(second)
    with ch1, ch2:
        undisturbed = stub2.GenerateUnary(request(PROMPT, max_new_tokens=MAX_NEW), timeout=120)
        assert list(undisturbed.token_ids) == expected
        session, tokens, text = "", [], ""
        with pytest.raises(grpc.RpcError) as info:
            for chunk in stub1.Generate(request(PROMPT, max_new_tokens=MAX_NEW), timeout=120):
                session = session or chunk.session_id
                assert chunk.offset == len(tokens)
                tokens.extend(chunk.token_ids)
                text += chunk.text
                if len(tokens) >= 4 and cluster.procs["orchestrator-1"].poll() is None:
                    cluster.kill("orchestrator-1")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        held = len(tokens)
        assert session and 4 <= held < len(expected)
        rest = list(stub2.Generate(pb.GenerateRequest(session_id=session, resume_from=held), timeout=120))
    assert rest[0].session_id == session and not rest[0].token_ids  # the header
    assert [c.offset for c in rest if c.token_ids][0] == held
    tokens += [t for c in rest for t in c.token_ids]
    text += "".join(c.text for c in rest)
    assert tokens == expected  # nothing duplicated, nothing lost
    assert text == undisturbed.text
    assert rest[-1].stats.completion_tokens == len(expected)


def test_redis_killed_fails_in_flight_requests_cleanly_and_persisted_sessions_survive(cluster, expected, tmp_path):
    data = tmp_path / "redis-data"
    data.mkdir()
    redis_port = cluster.redis(data_dir=data)
    address = cluster.orchestrator("orchestrator", [cluster.target("target", *SLOW)], [cluster.draft("draft")],
                                   redis_port)
    ch, stub = orchestrator_stub(address)
    session, tokens = "", []
    with ch:
        with pytest.raises(grpc.RpcError) as info:
            for chunk in stub.Generate(request(PROMPT, max_new_tokens=MAX_NEW), timeout=120):
                session = session or chunk.session_id
                tokens.extend(chunk.token_ids)
                if len(tokens) >= 4 and cluster.procs["redis"].poll() is None:
                    cluster.kill("redis")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "session store unavailable" in info.value.details()
        cluster.restart("redis")
        # The persisted record is exactly what the client received: the prompt and its tokens.
        stored = [int(t) for t in redis.Redis(port=redis_port).lrange(session_tokens_key(session), 0, -1)]
        prompt_ids = list(load_tokenizer(str(cluster.models["target"]))(PROMPT)["input_ids"])
        assert stored == prompt_ids + tokens
        rest = list(stub.Generate(pb.GenerateRequest(session_id=session, resume_from=len(tokens)), timeout=120))
    assert tokens + [t for c in rest for t in c.token_ids] == expected


def test_kv_snapshot_moves_a_session_to_another_replica_without_a_prefill(cluster, tiny_models):
    redis_port = cluster.redis()
    snap = ("--snapshot-redis-url", f"redis://127.0.0.1:{redis_port}/0", "--snapshot-min-tokens", "8")
    targets = [cluster.target("target-1", *snap), cluster.target("target-2", *snap)]
    address = cluster.orchestrator("orchestrator", targets, [cluster.draft("draft")], redis_port, "--kv-snapshots")
    ch, stub = orchestrator_stub(address)
    with ch:
        first = stub.GenerateUnary(request(PROMPT, max_new_tokens=24), timeout=120)
        holder = next(n for n in ("target-1", "target-2") if cached_sessions(cluster.addresses[n]) > 0)
        deadline = time.monotonic() + 30
        while model_info(cluster.addresses[holder]).snapshot_saves < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert model_info(cluster.addresses[holder]).snapshot_saves == 1
        history = [int(t) for t in redis.Redis(port=redis_port).lrange(session_tokens_key(first.session_id), 0, -1)]
        cluster.kill(holder)
        second = stub.GenerateUnary(request(" and so", session_id=first.session_id, max_new_tokens=16), timeout=120)
    survivor = "target-2" if holder == "target-1" else "target-1"
    assert model_info(cluster.addresses[survivor]).snapshot_restores == 1
    tokenizer = load_tokenizer(str(tiny_models["target"]))
    turn = list(tokenizer(" and so", add_special_tokens=False)["input_ids"])
    expected = Reference(str(tiny_models["target"])).greedy_ids(history + turn, 16)
    assert list(second.token_ids) == expected  # the restored cache continues exactly like a prefill


def test_draft_kv_snapshot_moves_a_session_to_another_draft_replica_without_a_prefill(cluster, tiny_models):
    redis_port = cluster.redis()
    snap = ("--snapshot-redis-url", f"redis://127.0.0.1:{redis_port}/0", "--snapshot-min-tokens", "8")
    drafts = [cluster.draft("draft-1", "good_draft", *snap), cluster.draft("draft-2", "good_draft", *snap)]
    # The target keeps no snapshots: --kv-snapshots asks it anyway, and its refusal changes nothing.
    address = cluster.orchestrator("orchestrator", [cluster.target("target")], drafts, redis_port, "--kv-snapshots")

    def info(name: str):
        return model_info(cluster.addresses[name], draft_pb2_grpc.DraftServiceStub)

    ch, stub = orchestrator_stub(address)
    with ch:
        first = stub.GenerateUnary(request(PROMPT, max_new_tokens=24), timeout=120)
        holders = [n for n in ("draft-1", "draft-2") if info(n).cached_sessions > 0]
        assert len(holders) == 1  # the session lives on exactly one draft replica
        holder = holders[0]
        deadline = time.monotonic() + 30
        while info(holder).snapshot_saves < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert info(holder).snapshot_saves == 1
        history = [int(t) for t in redis.Redis(port=redis_port).lrange(session_tokens_key(first.session_id), 0, -1)]
        cluster.kill(holder)
        second = stub.GenerateUnary(request(" and so", session_id=first.session_id, max_new_tokens=16), timeout=120)
    survivor = "draft-2" if holder == "draft-1" else "draft-1"
    assert info(survivor).snapshot_restores == 1  # restored from the dead replica's snapshot, not prefilled
    tokenizer = load_tokenizer(str(tiny_models["target"]))
    turn = list(tokenizer(" and so", add_special_tokens=False)["input_ids"])
    assert list(second.token_ids) == Reference(str(tiny_models["target"])).greedy_ids(history + turn, 16)


def _biased_greedy(reference: Reference, ids: list[int], bias: dict[int, float], n: int) -> list[int]:
    """Greedy decoding of the target alone with `bias` added to its logits (the pipeline's logit_bias)."""
    from tests.reference import full_logits

    out = []
    for _ in range(n):
        logits = full_logits(reference.loaded.model, ids + out)[-1].clone()
        for token, value in bias.items():
            logits[token] += value
        out.append(int(logits.argmax()))
        if out[-1] in reference.loaded.eos_token_ids:
            break
    return out


def test_a_sessions_logit_bias_survives_a_target_restart_and_a_move_to_another_orchestrator(cluster, tiny_models):
    """The logit_bias goes to each replica once per session; a restarted target has lost it, says so
    (NOT_FOUND) and is sent it again; another orchestrator replica reads it from Redis."""
    reference = Reference(str(tiny_models["target"]))
    prompt_ids = reference.encode(PROMPT)
    plain = reference.greedy_ids(prompt_ids, 6)
    bias = {plain[0]: -100.0, plain[1]: -100.0, plain[2]: 5.0}  # a path the unbiased model does not take
    expected = _biased_greedy(reference, prompt_ids, bias, 24)
    assert expected[:6] != plain
    redis_port = cluster.redis()
    target, draft = cluster.target("target", *SLOW), cluster.draft("draft")
    first = cluster.orchestrator("orchestrator-1", [target], [draft], redis_port, "--target-retry-s", "0.5")
    second = cluster.orchestrator("orchestrator-2", [target], [draft], redis_port)
    ch1, stub1 = orchestrator_stub(first)
    ch2, stub2 = orchestrator_stub(second)
    with ch1, ch2:
        session, tokens = "", []
        with pytest.raises(grpc.RpcError) as info:
            for chunk in stub1.Generate(request(PROMPT, max_new_tokens=24, logit_bias=bias, draft_length=2),
                                        timeout=120):
                session = session or chunk.session_id
                tokens.extend(chunk.token_ids)
                if len(tokens) >= 4 and cluster.procs["target"].poll() is None:
                    cluster.kill("target")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        cluster.restart("target")
        for attempt in range(40):  # as the SDK does: until the orchestrator's probe sees the target back
            try:
                rest = list(stub2.Generate(pb.GenerateRequest(session_id=session, resume_from=len(tokens)),
                                           timeout=120))
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and attempt < 39, exc
                time.sleep(0.5)
        tokens += [t for c in rest for t in c.token_ids]
        assert tokens == expected  # the other orchestrator had the bias from Redis
        # The first orchestrator sent the bias to this address before: it names it by digest, a target
        # restarted since answers NOT_FOUND, and gets it again (the output shows it was applied).
        cluster.kill("target")
        cluster.restart("target")
        more = None
        for attempt in range(40):
            try:
                more = stub1.GenerateUnary(pb.GenerateRequest(session_id=session, prompt=" and", max_new_tokens=8,
                                                              logit_bias=bias, draft_length=2), timeout=120)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and attempt < 39, exc
                time.sleep(0.5)
    # (A try the orchestrator refused while it still saw the target down added " and" already: the
    # reference is the history as stored.)
    stored = [int(t) for t in redis.Redis(port=redis_port).lrange(session_tokens_key(session), 0, -1)]
    history = stored[:len(stored) - len(more.token_ids)]
    and_ids = reference.tokenizer(" and", add_special_tokens=False)["input_ids"]
    assert history[:len(prompt_ids) + len(expected)] == prompt_ids + expected and history[-len(and_ids):] == and_ids
    assert list(more.token_ids) == _biased_greedy(reference, history, bias, 8)
    log = (cluster.log_dir / "orchestrator-1.log").read_text()
    assert f"{target} holds no logit_bias and grammar for session {session}" in log
