"""The orchestrator's verify over long-lived VerifyStream calls, against real gRPC servers on free
ports: a call reused round after round, failures read as a Verify call's, a call that timed out
or failed never reused, a replica without VerifyStream sent Verify calls, a call opened before the
replica restarted replaced, and a stopping target ending the calls that wait for a request."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from orchestrator.backends import Busy, DraftReply, Released, TargetBackend
from specdec.core.sampling import SamplingParams
from specdec.errors import DeadlineExceeded, InvalidArgument, Unavailable
from specdec.server.constants import MissingConstants, SessionConstants
from specdec.server.serving import default_interceptors
from specdec.server.wire import sampling_to_pb
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.servicer import TargetServicer

C = grpc.StatusCode
PARAMS = SamplingParams(temperature=0.7, logit_bias=((5, -2.0),))


class Target(target_pb2_grpc.TargetServiceServicer):
    """A target that answers token 9, or fails with `code`; counts the calls each RPC was opened."""

    def __init__(self, code: grpc.StatusCode | None = None, stream: bool = True) -> None:
        self.code = code
        self.stream = stream
        self.opened = {"Verify": 0, "VerifyStream": 0}
        self.answered = 0
        self.hang = False  # never answer
        self.cancelled = 0  # calls that ended while a request waited for its answer
        self.held = SessionConstants()
        self.carried: list[str] = []

    async def _answer(self, request, context) -> target_pb2.VerifyResponse:
        msg = request.sampling
        self.carried.append("digest" if msg.constants_digest and not msg.logit_bias else "full")
        if self.hang:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if self.code is not None:
            if self.code == C.RESOURCE_EXHAUSTED:
                context.set_trailing_metadata((("retry-after-ms", "250"),))
            await context.abort(self.code, "boom")
        try:
            self.held.resolve(request.session_id, msg)
        except MissingConstants as exc:
            await context.abort(C.NOT_FOUND, str(exc))
        self.answered += 1
        return target_pb2.VerifyResponse(num_accepted=0, token_id=9, compute_ns=request.timeout_ms)

    async def GetInfo(self, request, context):
        return common_pb2.ModelInfo(caches_sampling_constants=True)

    async def Verify(self, request, context):
        self.opened["Verify"] += 1
        return await self._answer(request, context)

    async def VerifyStream(self, requests, context):
        if not self.stream:  # a replica of an earlier version
            await context.abort(C.UNIMPLEMENTED, "Method not found!")
        self.opened["VerifyStream"] += 1
        async for request in requests:
            yield await self._answer(request, context)


async def serve(servicer, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=default_interceptors())
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def verify(backend: TargetBackend, session: str = "s", timeout: float | None = None, params=PARAMS):
    return await backend.verify(session, [1, 2], DraftReply(), params, 0, timeout=timeout)


async def test_one_call_carries_every_round_and_each_request_its_time_limit():
    target = Target()
    server, port = await serve(target)
    backend = TargetBackend(f"127.0.0.1:{port}", timeout_s=10.0)
    try:
        replies = [await verify(backend) for _ in range(5)]
        assert [r.token_id for r in replies] == [9] * 5
        assert target.opened == {"Verify": 0, "VerifyStream": 1} and target.answered == 5
        assert replies[0].compute_ns == 10_000  # the servicer echoed timeout_ms: the backend's 10 s
        assert (await verify(backend, timeout=2.5)).compute_ns == 2500
        # concurrent rounds each take a call of their own, and give it back
        await asyncio.gather(*(verify(backend, f"c{i}") for i in range(3)))
        assert target.opened["VerifyStream"] == 3
        await asyncio.gather(*(verify(backend, f"c{i}") for i in range(3)))
        assert target.opened["VerifyStream"] == 3
    finally:
        await backend.close()
        await server.stop(None)


@pytest.mark.parametrize("code, timeout, error, message", [
    (C.INVALID_ARGUMENT, None, InvalidArgument, "^boom$"),
    (C.CANCELLED, None, Released, "^boom$"),
    (C.DEADLINE_EXCEEDED, 1.0, DeadlineExceeded, "deadline passed while the target verified"),
    (C.DEADLINE_EXCEEDED, None, Busy, r"did not answer within 10.0s$"),
    (C.RESOURCE_EXHAUSTED, None, Busy, r"is overloaded: boom$"),
    (C.FAILED_PRECONDITION, None, Unavailable, r"failed \(FAILED_PRECONDITION: boom\)"),
    (C.UNAVAILABLE, None, Unavailable, r"failed \(UNAVAILABLE: boom\)"),
])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
async def test_a_failure_on_the_stream_reads_as_a_verify_calls(stream, code, timeout, error, message):
    target = Target(code)
    server, port = await serve(target)
    backend = TargetBackend(f"127.0.0.1:{port}", timeout_s=10.0, stream=stream)
    try:
        with pytest.raises(error, match=message) as caught:
            await verify(backend, timeout=timeout)
        assert isinstance(caught.value, Busy) == (error is Busy)
        if code == C.RESOURCE_EXHAUSTED:
            assert caught.value.retry_after_s == 0.25
        target.code = None  # the failed call is not reused: the next round opens another
        assert (await verify(backend)).token_id == 9
        assert target.opened == ({"Verify": 0, "VerifyStream": 2} if stream else {"Verify": 2, "VerifyStream": 0})
    finally:
        await backend.close()
        await server.stop(None)


async def test_a_round_past_its_time_limit_is_busy_and_its_call_is_cancelled():
    target = Target()
    server, port = await serve(target)
    backend = TargetBackend(f"127.0.0.1:{port}", timeout_s=0.3)
    try:
        await verify(backend)
        target.hang = True
        started = time.monotonic()
        with pytest.raises(Busy, match="did not answer within 0.3s"):
            await verify(backend)
        assert time.monotonic() - started < 2.0
        for _ in range(50):  # the replica sees the call end
            if target.cancelled:
                break
            await asyncio.sleep(0.02)
        assert target.cancelled == 1
        target.hang = False
        assert (await verify(backend)).token_id == 9
        assert target.opened["VerifyStream"] == 2
    finally:
        await backend.close()
        await server.stop(None)


async def test_a_caller_cancelled_mid_round_leaves_no_call_behind():
    target = Target()
    target.hang = True
    server, port = await serve(target)
    backend = TargetBackend(f"127.0.0.1:{port}", timeout_s=10.0)
    try:
        task = asyncio.create_task(verify(backend))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(50):
            if target.cancelled:
                break
            await asyncio.sleep(0.02)
        assert target.cancelled == 1 and backend._idle == []
    finally:
        await backend.close()
        await server.stop(None)


async def test_a_replica_without_verify_stream_gets_verify_calls():
    target = Target(stream=False)
    server, port = await serve(target)
    backend = TargetBackend(f"127.0.0.1:{port}", timeout_s=10.0)
    try:
        assert [(await verify(backend)).token_id for _ in range(3)] == [9] * 3
        assert not backend.stream and target.opened["Verify"] == 3
    finally:
        await backend.close()
        await server.stop(None)


async def test_a_call_opened_before_the_replica_restarted_is_replaced_and_the_constants_sent_again():
    target = Target()
    server, port = await serve(target)
    backend = TargetBackend(f"127.0.0.1:{port}", timeout_s=10.0)
    try:
        await backend.info()  # it keeps the constants: later rounds carry their digest alone
        await verify(backend)
        await verify(backend)
        assert target.carried == ["full", "digest"]
        await server.stop(None)
        restarted = Target()  # nothing held: the digest is answered NOT_FOUND, then the full set goes
        server, _ = await serve(restarted, port)
        assert (await verify(backend)).token_id == 9
        assert restarted.carried == ["digest", "full"] and restarted.opened["VerifyStream"] == 2
    finally:
        await backend.close()
        await server.stop(None)


async def test_a_reused_call_whose_write_fails_as_its_connection_closes_is_replaced(monkeypatch):
    """gRPC core reports a write that races the connection's close as INTERNAL ("Internal error from
    Core") rather than UNAVAILABLE: on a call opened earlier the request never left, so it goes
    again on a new call; the same error on a new call, or a server's INTERNAL, is raised."""
    from orchestrator import backends

    target = Target()
    server, port = await serve(target)
    backend = TargetBackend(f"127.0.0.1:{port}", timeout_s=10.0)
    exchange, failures = backends._exchange, []

    async def racing(call, request, timeout):
        if failures:
            details = failures.pop()
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
        return await exchange(call, request, timeout)

    monkeypatch.setattr(backends, "_exchange", racing)
    try:
        await verify(backend)  # an idle call to reuse
        failures.append("Internal error from Core")
        assert (await verify(backend)).token_id == 9
        assert target.opened["VerifyStream"] == 2
        failures.append("the servicer failed")
        with pytest.raises(Unavailable):
            await verify(backend)
    finally:
        await backend.close()
        await server.stop(None)


class Idle(TargetServicer):
    """The real servicer's VerifyStream, with `_verify` answering at once (no model)."""

    def __init__(self) -> None:  # only what VerifyStream and end_idle_calls use
        self._idle_calls = set()
        self._stopping = False

    async def _verify(self, request, context):
        return target_pb2.VerifyResponse(token_id=9)


async def test_a_stopping_target_ends_the_calls_that_wait_for_a_request():
    servicer = Idle()
    server, port = await serve(servicer)
    backend = TargetBackend(f"127.0.0.1:{port}", timeout_s=10.0)
    try:
        await asyncio.gather(*(verify(backend, f"s{i}", params=SamplingParams()) for i in range(3)))
        # Each call's handler waits for its next request only once its answer is out: under load the
        # client can have the answers before the handlers are back at their wait.
        for _ in range(1000):  # 10 s at most
            if len(servicer._idle_calls) == 3:
                break
            await asyncio.sleep(0.01)
        assert len(backend._idle) == 3 and len(servicer._idle_calls) == 3
        servicer.end_idle_calls()
        started = time.monotonic()
        await server.stop(5.0)  # would wait out the grace with the three calls open
        assert time.monotonic() - started < 1.0
        assert servicer._idle_calls == set()
    finally:
        await backend.close()
        await server.stop(None)


async def test_a_request_that_does_not_parse_ends_the_call_with_invalid_argument():
    server, port = await serve(Target())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/specdec.v1.TargetService/VerifyStream", request_serializer=lambda b: b,
                                         response_deserializer=target_pb2.VerifyResponse.FromString)()
            good = target_pb2.VerifyRequest(session_id="s", history=[1],
                                            sampling=sampling_to_pb(SamplingParams())).SerializeToString()
            await call.write(good)
            assert (await call.read()).token_id == 9
            await call.write(b"\x0a\xff")  # a string field whose length runs past the end
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call.read()
            assert caught.value.code() == C.INVALID_ARGUMENT and "not a valid message" in caught.value.details()
    finally:
        await server.stop(None)


@pytest.mark.parametrize("args, env, exporting", [
    ("", {}, False),
    ("file=sys.argv[1]", {}, True),  # --otel-file
    ("", {"OTEL_TRACES_EXPORTER": "console"}, True),
    ("", {"OTEL_TRACES_EXPORTER": "none"}, False),
])
def test_an_orchestrator_that_exports_traces_verifies_with_a_call_a_round(tmp_path, args, env, exporting):
    """`--verify-stream auto` is off where spans are exported: each Verify then has its span in the target."""
    script = ("import sys; from specdec.server import tracing; "
              f"tracing.setup('orchestrator', {args}); print(tracing.exporting())")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "spans.jsonl")], capture_output=True,
                         text=True, check=True, env={**os.environ, **env}, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == str(exporting)
