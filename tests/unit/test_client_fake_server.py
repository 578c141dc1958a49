"""Both SDK clients against scripted in-process orchestrators: headers, resume, failover, retries, TLS.

The fakes make each failure happen at an exact point; the real thing (an orchestrator killed
mid-stream) is in tests/system/test_sdk.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from concurrent import futures

import grpc
import pytest

from specdec import AsyncClient, Client, errors
from specdec.launcher import free_port
from specdec.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc

TOKENS = list(range(10, 20))


def chunks(session: str, tokens: list[int], start: int = 0, per: int = 2, header: bool = True):
    """A generation streamed `per` tokens a chunk (text: one letter per token), from token `start`."""
    if header:
        yield pb.GenerateChunk(session_id=session, offset=start)
    for i in range(start, len(tokens), per):
        part = tokens[i:i + per]
        msg = pb.GenerateChunk(session_id=session, token_ids=part, offset=i,
                               text="".join(chr(ord("a") + t - 10) for t in part),
                               round=pb.RoundStats(draft_length=per, proposed=per, accepted=per - 1))
        if i + per >= len(tokens):
            msg.finish_reason = pb.FINISH_REASON_LENGTH
            msg.stats.completion_tokens = len(tokens)
        yield msg


class Fake(orchestrator_pb2_grpc.OrchestratorServicer):
    """Answers Generate with the next scripted behaviour: a callable (request, context) -> iterator."""

    def __init__(self) -> None:
        self.script: list = []
        self.requests: list[pb.GenerateRequest] = []
        self.status_failures = 0
        self.status_calls = 0

    def Generate(self, request, context):
        self.requests.append(request)
        behaviour = self.script.pop(0)
        yield from behaviour(request, context)

    def GetStatus(self, request, context):
        self.status_calls += 1
        if self.status_calls <= self.status_failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        return pb.GetStatusResponse(version="fake", active_generations=self.status_calls)

    def CloseSession(self, request, context):
        return pb.CloseSessionResponse(closed=request.session_id == "known")


def whole(session="s1", header=True):
    return lambda request, context: chunks(session, TOKENS, header=header)


def breaks_after(n_chunks: int, session="s1", header=True, code=grpc.StatusCode.UNAVAILABLE):
    def behaviour(request, context):
        for i, msg in enumerate(chunks(session, TOKENS, header=header)):
            if i == n_chunks:
                context.abort(code, "Socket closed")
            yield msg
    return behaviour


def resumes(session="s1"):
    def behaviour(request, context):
        assert request.session_id == session and request.WhichOneof("input") is None
        yield from chunks(session, TOKENS, start=request.resume_from)
    return behaviour


def fails(code, details="no"):
    def behaviour(request, context):
        context.abort(code, details)
        yield  # pragma: no cover
    return behaviour


def start_fake(credentials=None):
    fake = Fake()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(fake, server)
    host = "localhost" if credentials is not None else "127.0.0.1"
    port = (server.add_secure_port(f"{host}:0", credentials) if credentials is not None
            else server.add_insecure_port(f"{host}:0"))
    server.start()
    return fake, server, f"{host}:{port}"


@pytest.fixture
def two():
    """Two fake orchestrators."""
    a, sa, addr_a = start_fake()
    b, sb, addr_b = start_fake()
    yield (a, addr_a), (b, addr_b)
    sa.stop(0)
    sb.stop(0)


def test_header_is_not_a_chunk_and_chunks_add_up(two):
    (a, addr), _ = two
    a.script = [whole()]
    with Client(addr) as client:
        got = list(client.stream("Hi"))
    assert [c.token_ids for c in got] == [TOKENS[i:i + 2] for i in range(0, 10, 2)]
    assert "".join(c.text for c in got) == "abcdefghij" and got[0].session_id == "s1"
    assert got[-1].finish_reason == "length" and got[-1].stats["completion_tokens"] == 10
    assert got[0].round == {**got[0].round, "proposed": 2, "accepted": 1}
    assert [c.offset for c in got] == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("header", [True, False], ids=["header", "old-server-without-header"])
def test_stream_broken_mid_way_resumes_on_the_next_address(two, header):
    (a, addr_a), (b, addr_b) = two
    a.script = [breaks_after(3, header=header)]  # header + 2 chunks (4 tokens), or 3 chunks (6 tokens)
    b.script = [resumes()]
    with Client([addr_a, addr_b]) as client:
        stream = client.stream("Hi", max_new_tokens=10)
        got = list(stream)
    held = 4 if header else 6
    assert [t for c in got for t in c.token_ids] == TOKENS  # every token exactly once
    assert "".join(c.text for c in got) == "abcdefghij"
    assert stream.resumes == 1 and stream.session_id == "s1" and stream.received == 10
    (resume,) = b.requests
    assert resume.session_id == "s1" and resume.resume_from == held and not resume.HasField("max_new_tokens")


def test_generate_resumes_too_and_reports_it(two):
    (a, addr_a), (b, addr_b) = two
    a.script = [breaks_after(2)]
    b.script = [resumes()]
    with Client(f"{addr_a},{addr_b}") as client:
        out = client.generate("Hi")
    assert out.token_ids == TOKENS and out.text == "abcdefghij" and out.resumes == 1
    assert out.finish_reason == "length" and out.session_id == "s1"


def test_resume_false_raises_unavailable_naming_the_address(two):
    (a, addr_a), (b, addr_b) = two
    a.script = [breaks_after(2)]
    with Client([addr_a, addr_b], resume=False) as client:
        seen = []
        with pytest.raises(errors.Unavailable, match=f"orchestrator {addr_a}: Socket closed"):
            for chunk in client.stream("Hi"):
                seen.append(chunk)
    assert len(seen) == 1 and b.requests == []


def test_failure_before_anything_arrived_sends_the_request_again(two):
    (a, addr_a), (b, addr_b) = two
    a.script = [fails(grpc.StatusCode.UNAVAILABLE, "target down")]
    b.script = [whole()]
    with Client([addr_a, addr_b]) as client:
        out = client.generate("Hi", max_new_tokens=10)
    assert out.token_ids == TOKENS and out.resumes == 0
    assert b.requests[0].prompt == "Hi" and b.requests[0].max_new_tokens == 10


def test_dead_first_address_is_skipped():
    fake, server, addr = start_fake()
    fake.script = [whole()]
    try:
        with Client([f"127.0.0.1:{free_port()}", addr]) as client:
            assert client.generate("Hi").token_ids == TOKENS
    finally:
        server.stop(0)


def test_aborted_is_not_retried(two):
    (a, addr_a), (b, addr_b) = two
    a.script = [fails(grpc.StatusCode.ABORTED, "session is busy")]
    with Client([addr_a, addr_b]) as client:
        with pytest.raises(errors.Aborted, match="session is busy"):
            client.generate("Hi", session_id="s1")
    assert len(a.requests) == 1 and b.requests == []


def test_attempts_are_bounded(two):
    (a, addr_a), _ = two
    a.script = [fails(grpc.StatusCode.UNAVAILABLE, "down")] * 3
    with Client(addr_a, max_attempts=3, initial_backoff_s=0.01) as client:
        with pytest.raises(errors.Unavailable, match="down"):
            client.generate("Hi")
    assert len(a.requests) == 3


def test_deadline_covers_the_whole_call(two):
    (a, addr), _ = two

    def slow(request, context):
        yield pb.GenerateChunk(session_id="s1")
        time.sleep(1.0)
        yield from chunks("s1", TOKENS, header=False)

    a.script = [slow]
    with Client(addr) as client:
        started = time.monotonic()
        with pytest.raises(errors.DeadlineExceeded):
            client.generate("Hi", timeout=0.3)
    assert time.monotonic() - started < 0.9 and len(a.requests) == 1


def test_round_robin_over_addresses(two):
    (a, addr_a), (b, addr_b) = two
    a.script = [whole("sa")] * 2
    b.script = [whole("sb")] * 2
    with Client([addr_a, addr_b]) as client:
        sessions = [client.generate("Hi").session_id for _ in range(4)]
    assert sessions == ["sa", "sb", "sa", "sb"]


def test_get_status_is_retried_by_grpc_retry_policy(two):
    (a, addr), _ = two
    a.status_failures = 2
    with Client(addr) as client:
        status = client.status()
    assert a.status_calls == 3 and status["version"] == "fake" and status["address"] == addr


def test_get_status_fails_over_and_close_session(two):
    (_, addr), _ = two
    dead = f"127.0.0.1:{free_port()}"
    with Client([dead, addr]) as client:
        assert client.status()["address"] == addr
        assert client.close_session("known") is True
        assert client.close_session("other") is False
    with Client(dead) as client:
        with pytest.raises(errors.Unavailable, match=dead):
            client.status(timeout=5)


def test_async_client_resumes_and_reads_status(two):
    (a, addr_a), (b, addr_b) = two
    a.script = [breaks_after(2)]
    b.script = [resumes()]
    a.status_failures = 1

    async def main():
        async with AsyncClient([addr_a, addr_b]) as client:
            stream = client.stream("Hi")
            tokens = [t async for c in stream for t in c.token_ids]
        async with AsyncClient(addr_a) as only_a:
            status = await only_a.status()
        return tokens, stream.resumes, status

    tokens, resumed, status = asyncio.run(main())
    assert tokens == TOKENS and resumed == 1
    assert status["version"] == "fake" and a.status_calls == 2  # one failure, retried by gRPC


def test_async_client_raises_typed_errors(two):
    (a, addr), _ = two
    a.script = [fails(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")]

    async def main():
        async with AsyncClient(addr) as client:
            await client.generate("")

    with pytest.raises(errors.InvalidArgument, match="prompt is empty"):
        asyncio.run(main())


def test_stopping_early_cancels_the_call(two):
    (a, addr), _ = two
    cancelled = threading.Event()

    def endless(request, context):
        context.add_callback(cancelled.set)
        yield pb.GenerateChunk(session_id="s1")
        for i in range(1000):
            yield pb.GenerateChunk(session_id="s1", token_ids=[i], text="x", offset=i)
            time.sleep(0.01)

    a.script = [endless]
    with Client(addr) as client:
        for _chunk in client.stream("Hi"):
            break
    assert cancelled.wait(5)


def test_tls(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    server_creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    fake, server, addr = start_fake(server_creds)
    fake.script = [whole()]
    try:
        with Client(addr, credentials=grpc.ssl_channel_credentials(cert.read_bytes())) as client:
            assert client.generate("Hi").token_ids == TOKENS
        with Client(addr, timeout=5, max_attempts=1) as plaintext:  # a plaintext client cannot talk to it
            with pytest.raises(errors.Unavailable):
                plaintext.status()
    finally:
        server.stop(0)
