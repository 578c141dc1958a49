"""Bearer tokens: parsing, constant-time lookup, the server interceptor and session principals."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.server.auth import AuthInterceptor, Tokens, bearer_token, current_identity, identity_of_token, principal_of
from specdec.server.interceptors import DecodeGuard
from specdec.server.serving import create_server, mark_serving
from specdec.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc

ALICE = "alice-0123456789abcdef"
BOB = "bob-fedcba9876543210xyz"
UNNAMED = "unnamed-token-0000000000000"


@pytest.fixture
def tokens_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# comment\n\nalice:{ALICE}\nbob:{BOB}\n{UNNAMED}\n")
    return path


def test_tokens_from_a_file_name_their_identity(tokens_file):
    tokens = Tokens.load(str(tokens_file))
    assert len(tokens) == 3
    assert tokens.identity(f"Bearer {ALICE}") == "alice"
    assert tokens.identity(f"bearer {BOB}") == "bob"  # the scheme is case-insensitive
    assert tokens.identity(f"Bearer {UNNAMED}") == identity_of_token(UNNAMED)
    assert UNNAMED not in identity_of_token(UNNAMED)  # an identity never shows the token


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", f"Basic {ALICE}", ALICE, f"Bearer {ALICE}x",
                                    f"Bearer {ALICE[:-1]}", "Bearer \udcff\udcfe", "Bearer " + "x" * 10_000])
def test_wrong_or_missing_tokens_have_no_identity(tokens_file, header):
    assert Tokens.load(str(tokens_file)).identity(header) is None


def test_tokens_from_the_environment(monkeypatch, tokens_file):
    monkeypatch.setenv("SOME_TOKENS", f"carol:{'c' * 20}, {'d' * 20}")
    tokens = Tokens.load(str(tokens_file), env="SOME_TOKENS")
    assert len(tokens) == 5
    assert tokens.identity("Bearer " + "c" * 20) == "carol"
    assert Tokens.load(env="UNSET_VARIABLE_NAME").enabled is False


@pytest.mark.parametrize("text, message", [("alice:\n", "empty token"), ("short\n", "shorter than 16"),
                                           ("# only a comment\n", "holds no token")])
def test_bad_token_files_are_refused(tmp_path, text, message):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        Tokens.load(str(path))


def test_a_missing_token_file_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--auth-tokens-file .*cannot read"):
        Tokens.load(str(tmp_path / "nope"))


def test_bearer_token_and_principals():
    assert bearer_token("Bearer  abc ") == "abc"
    assert bearer_token("Token abc") is None
    assert principal_of("") == ""
    assert principal_of("alice") != principal_of("bob")
    assert "alice" not in principal_of("alice") and len(principal_of("alice")) == 64


class _Echo(orchestrator_pb2_grpc.OrchestratorServicer):
    """Answers with the caller's identity as the session id."""

    async def Generate(self, request, context):
        yield pb.GenerateChunk(session_id=current_identity.get() or "anonymous")

    async def CloseSession(self, request, context):
        return pb.CloseSessionResponse(closed=current_identity.get() == "alice")


async def _serve(tokens: Tokens):
    server, port, health = create_server(
        "127.0.0.1:0", [lambda s: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(_Echo(), s)],
        ["specdec.v1.Orchestrator"], interceptors=[AuthInterceptor(tokens), DecodeGuard()])
    await server.start()
    await mark_serving(health, ["specdec.v1.Orchestrator"])
    return server, f"127.0.0.1:{port}"


async def test_the_interceptor_lets_in_only_valid_tokens(tokens_file):
    server, address = await _serve(Tokens.load(str(tokens_file)))
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            chunks = [c async for c in stub.Generate(pb.GenerateRequest(prompt="x"),
                                                     metadata=(("authorization", f"Bearer {ALICE}"),))]
            assert chunks[0].session_id == "alice"
            reply = await stub.CloseSession(pb.CloseSessionRequest(session_id="s"),
                                            metadata=(("authorization", f"Bearer {ALICE}"),))
            assert reply.closed
            for metadata in [(), (("authorization", "Bearer wrong-token-wrong-token"),),
                             (("authorization", ALICE),)]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.CloseSession(pb.CloseSessionRequest(session_id="s"), metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "bearer token" in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(pb.GenerateRequest(prompt="x"), metadata=metadata):
                        pass
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Health stays open for probes.
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)


async def test_without_tokens_everyone_is_anonymous():
    server, address = await _serve(Tokens())
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            chunks = [c async for c in stub.Generate(pb.GenerateRequest(prompt="x"),
                                                     metadata=(("authorization", "Bearer anything-at-all"),))]
            assert chunks[0].session_id == "anonymous"
    finally:
        await server.stop(0)


async def test_the_identity_does_not_leak_between_concurrent_calls(tokens_file):
    server, address = await _serve(Tokens.load(str(tokens_file)))
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)

            async def who(token: str) -> str:
                chunks = [c async for c in stub.Generate(pb.GenerateRequest(prompt="x"),
                                                         metadata=(("authorization", f"Bearer {token}"),))]
                return chunks[0].session_id

            got = await asyncio.gather(*(who(t) for t in [ALICE, BOB] * 20))
            assert got == ["alice", "bob"] * 20
    finally:
        await server.stop(0)


async def test_a_request_that_does_not_parse_is_invalid_argument(tokens_file):
    server, address = await _serve(Tokens.load(str(tokens_file)))
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            raw = ch.unary_stream("/specdec.v1.Orchestrator/Generate", request_serializer=lambda b: b,
                                  response_deserializer=pb.GenerateChunk.FromString)
            metadata = (("authorization", f"Bearer {ALICE}"),)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in raw(b"\x0a\x02\xff\xfe", metadata=metadata):  # prompt: invalid UTF-8
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid message" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:  # unauthenticated garbage: the token is checked first
                async for _ in raw(b"\x0a\x02\xff\xfe"):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(0)


def test_per_identity_limit_counts_each_token_apart():
    from specdec.errors import ResourceExhausted
    from specdec.server.limits import PerIdentityLimit

    limit = PerIdentityLimit(2)
    with limit.hold("alice"), limit.hold("alice"):
        with pytest.raises(ResourceExhausted, match="--max-concurrent-per-token=2"):
            limit.acquire("alice")
        with limit.hold("bob"):
            pass
        for _ in range(5):  # the anonymous identity (auth off) is not limited
            limit.acquire("")
    assert limit.running == {"": 5}
    limit.acquire("alice")  # the slots came back
    assert limit.running["alice"] == 1


@pytest.mark.parametrize("sid, ok", [("0123456789abcdef0123456789abcdef", True), ("a-b_C9", True), ("", False),
                                     ("x" * 65, False), ("a b", False), ("{x}", False), ("é", False), ("a\n", False)])
def test_session_ids_must_look_like_ours(sid, ok):
    from specdec.errors import InvalidArgument
    from specdec.server.limits import check_session_id

    if ok:
        assert check_session_id(sid) == sid
    else:
        with pytest.raises(InvalidArgument, match="not a session id"):
            check_session_id(sid)


def test_specdec_up_passes_tokens_and_log_format_to_the_services():
    from specdec.launcher import PipelineSpec

    cmds = PipelineSpec(auth_tokens_file="/run/tokens", log_format="json", http_port=8000).commands()
    for name in ("orchestrator", "http"):
        assert cmds[name][cmds[name].index("--auth-tokens-file") + 1] == "/run/tokens"
    for name in ("orchestrator", "http", "target", "draft"):
        assert cmds[name][cmds[name].index("--log-format") + 1] == "json"
    plain = PipelineSpec().commands()
    assert all("--auth-tokens-file" not in cmd and "--log-format" not in cmd for cmd in plain.values())


def test_a_rate_per_identity_refuses_past_its_burst_and_refills():
    from specdec.server.limits import PerIdentityRate

    now = [100.0]
    rate = PerIdentityRate(per_s=2.0, flag="--max-closes-per-s", clock=lambda: now[0])
    assert all(rate.take("alice") is None for _ in range(4))  # a burst of twice the rate
    wait = rate.take("alice")
    assert wait is not None and 0 < wait <= 0.5  # refused, with how long until the next one
    assert rate.take("bob") is None  # another identity has its own bucket
    now[0] += 0.5
    assert rate.take("alice") is None and rate.take("alice") is not None
    assert PerIdentityRate(per_s=0.0).take("alice") is None  # 0: no limit
    many = PerIdentityRate(per_s=1.0, clock=lambda: now[0], max_keys=100)
    for i in range(1000):
        many.take(f"id-{i}")
    assert len(many) <= 100  # full buckets are forgotten: memory stays bounded


async def test_closes_are_rate_limited_per_identity_with_a_retry_hint(tokens_file):
    from specdec.server.limits import PerIdentityRate, RateLimit

    tokens = Tokens.load(str(tokens_file))
    server, port, _ = create_server(
        "127.0.0.1:0", [lambda s: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(_Echo(), s)],
        ["specdec.v1.Orchestrator"],
        interceptors=[AuthInterceptor(tokens), RateLimit(PerIdentityRate(1.0, "--max-closes-per-s")), DecodeGuard()])
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)

            async def close(token: str):
                return await stub.CloseSession(pb.CloseSessionRequest(session_id="s"),
                                               metadata=(("authorization", f"Bearer {token}"),))

            assert (await close(ALICE)).closed and (await close(ALICE)).closed  # the burst: twice the rate
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await close(ALICE)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-closes-per-s=1" in err.value.details()
            hint = dict(err.value.trailing_metadata())["retry-after-ms"]
            assert 0 < int(hint) <= 1000
            assert not (await close(BOB)).closed  # bob's own bucket: served (his Echo answer is False)
            # Generations are not rate-limited by it.
            chunks = [c async for c in stub.Generate(pb.GenerateRequest(prompt="x"),
                                                     metadata=(("authorization", f"Bearer {ALICE}"),))]
            assert chunks[0].session_id == "alice"
    finally:
        await server.stop(0)
