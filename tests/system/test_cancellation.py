"""100 concurrent streams, 10 cancelled mid-stream: the other 90 get exactly the tokens they would
have had alone, and afterwards nothing is left over (checked through the services' admin views,
Redis itself and the orchestrator's metrics, not by trusting the code)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import grpc
import redis

from specdec.keys import PRIOR_KEY, session_meta_key
from specdec.launcher import free_port
from specdec.v1 import common_pb2, draft_pb2_grpc, orchestrator_pb2 as pb, orchestrator_pb2_grpc, target_pb2_grpc
from tests.conftest import orchestrator_address, start_tiny_pipeline
from tests.reference import Reference

STREAMS, CANCELLED, MAX_NEW, LONG = 100, set(range(3, 100, 10)), 24, 400


def _cached(pipeline) -> tuple[int, int]:
    addrs = pipeline.plan.grpc_addresses()
    with grpc.insecure_channel(addrs["target"]) as t, grpc.insecure_channel(addrs["draft"]) as d:
        return (target_pb2_grpc.TargetServiceStub(t).GetInfo(common_pb2.GetInfoRequest(), timeout=10).cached_sessions,
                draft_pb2_grpc.DraftServiceStub(d).GetInfo(common_pb2.GetInfoRequest(), timeout=10).cached_sessions)


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _eventually(check, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


async def _run(address: str, prompts: list[str]) -> list[tuple[str, list[int] | None]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)

        async def one(i: int) -> tuple[str, list[int] | None]:
            # A stream to cancel asks for many tokens, so it is still running when the client leaves.
            wanted = LONG if i in CANCELLED else MAX_NEW
            call = stub.Generate(pb.GenerateRequest(prompt=prompts[i], max_new_tokens=wanted, draft_length=4))
            session, tokens = "", []
            async for chunk in call:
                session = session or chunk.session_id
                tokens.extend(chunk.token_ids)
                if i in CANCELLED and tokens:
                    call.cancel()  # the client goes away mid-stream
                    return session, None
            return session, tokens

        return await asyncio.gather(*(one(i) for i in range(STREAMS)))


def test_cancelled_streams_free_everything_and_the_rest_are_unchanged(tiny_models, tmp_path):
    metrics_port = free_port()
    pipeline = start_tiny_pipeline(tmp_path, tiny_models, "good_draft",
                                   # the clean-up closes every session at once, past the close rate limit
                                   extra_orchestrator_args=["--metrics-port", str(metrics_port),
                                                            "--max-closes-per-s", "0"])
    try:
        prompts = [f"Tale {i}: once upon a time" for i in range(STREAMS)]
        reference = Reference(str(tiny_models["target"]))
        results = asyncio.run(_run(orchestrator_address(pipeline), prompts))
        for i, (session, tokens) in enumerate(results):
            assert session
            if i not in CANCELLED:
                assert tokens == reference.greedy(prompts[i], MAX_NEW), f"stream {i} differs from its solo run"
        # What the server saw: a cancelled stream's generation is left interrupted (finish 0, still
        # resumable) unless it ended before the cancel reached the server (a race the test allows).
        r = redis.Redis(port=pipeline.plan.redis_port)
        interrupted = sum(json.loads(r.hget(session_meta_key(results[i][0]), "state"))["generation"]["finish"] == 0
                          for i in CANCELLED)
        assert interrupted >= len(CANCELLED) - 2
        # The cancelled streams' caches go at once; the finished sessions keep theirs until closed.
        finished = STREAMS - interrupted
        assert _eventually(lambda: _cached(pipeline) == (finished, finished)), _cached(pipeline)
        assert _eventually(lambda: _metric(metrics_port, "specdec_num_requests_running") == 0)
        assert _metric(metrics_port, 'specdec_request_success_total{finish_reason="cancelled"') == interrupted

        with grpc.insecure_channel(orchestrator_address(pipeline)) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            for session, _ in results:
                assert stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=30).closed
        assert _eventually(lambda: _cached(pipeline) == (0, 0)), _cached(pipeline)
        leftover = [k.decode() for k in redis.Redis(port=pipeline.plan.redis_port).keys("*")]
        # no session, lease or temporary key is left (the global prior is not per session), and with a
        # model draft, which reads no outputs stream, no finished output was written to one
        assert set(leftover) <= {PRIOR_KEY}, leftover
    finally:
        pipeline.stop()
