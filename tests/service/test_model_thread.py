"""A model service does all of its model work on one thread: loading, warm-up and every pass.

Why it matters (`specdec.server.model_service.model_thread`): torch's OpenMP runtime keeps a pool of
worker threads per thread that starts parallel work, and with more pooled threads than CPUs its
workers sleep between parallel regions; a model loaded on the main thread and run on a batching
thread paid that on every pass (a one-session pass of the packaged model 69-74 ms instead of
35-42 on 2 cores). These tests build the real services in this process, serve a request through
their gRPC API, and record the thread of each piece of model work.
"""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager

import pytest

from draft_service.config import DraftConfig
from draft_service.server import SERVICE_NAME as DRAFT_SERVICE, build_servicer as build_draft
from specdec.channel import channel
from specdec.runtime.kv import SessionCaches
from specdec.runtime.models import LoadedModel
from specdec.server.serving import create_server
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.config import TargetConfig
from target_service.server import SERVICE_NAME as TARGET_SERVICE, build_servicer as build_target

HISTORY = [5 + (i * 7) % 90 for i in range(40)]  # token ids of the tiny character vocabulary


@pytest.fixture
def model_work(monkeypatch) -> dict[str, set[int]]:
    """The threads (idents) that ran each kind of model work while the test ran."""
    seen: dict[str, set[int]] = {"load": set(), "caches": set(), "warm_up": set(), "pass": set()}

    def recorded(kind: str, fn):
        def wrapper(*args, **kwargs):
            seen[kind].add(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(LoadedModel, "__init__", recorded("load", LoadedModel.__init__))  # load_model's result
    monkeypatch.setattr(SessionCaches, "__init__", recorded("caches", SessionCaches.__init__))
    monkeypatch.setattr(SessionCaches, "warm_up", recorded("warm_up", SessionCaches.warm_up))
    monkeypatch.setattr(SessionCaches, "score_batch", recorded("pass", SessionCaches.score_batch))
    return seen


@asynccontextmanager
async def serving(servicer, add, name: str):
    server, port, _ = create_server("127.0.0.1:0", [lambda s: add(servicer, s)], [name])
    await server.start()
    ch = channel(f"127.0.0.1:{port}")
    try:
        yield ch
    finally:
        await ch.close()
        await server.stop(None)
        await servicer.batcher.close()


def one_thread(seen: dict[str, set[int]]) -> None:
    """Every kind of work ran, all of it on one thread, and not on this (the event loop's) thread."""
    assert all(seen.values()), f"model work not seen: {[k for k, v in seen.items() if not v]}"
    threads = set().union(*seen.values())
    assert len(threads) == 1, f"model work ran on {len(threads)} threads: {seen}"
    assert threads != {threading.get_ident()}


async def test_the_target_service_loads_warms_up_and_verifies_on_one_thread(tiny_models, model_work):
    servicer, _ = build_target(TargetConfig(model=str(tiny_models["target"]), dtype="float64"))
    async with serving(servicer, target_pb2_grpc.add_TargetServiceServicer_to_server, TARGET_SERVICE) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        for k in (0, 2):
            reply = await stub.Verify(target_pb2.VerifyRequest(session_id="s", history=HISTORY,
                                                               draft_tokens=HISTORY[:k]), timeout=60)
            assert reply.num_accepted <= k
    one_thread(model_work)


async def test_a_model_draft_service_loads_warms_up_and_drafts_on_one_thread(tiny_models, model_work):
    servicer, _ = build_draft(DraftConfig(proposer="model", model=str(tiny_models["good_draft"]), dtype="float64"))
    async with serving(servicer, draft_pb2_grpc.add_DraftServiceServicer_to_server, DRAFT_SERVICE) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        request = draft_pb2.ProposeRequest(session_id="s", history=HISTORY, num_tokens=3)
        assert len([p async for p in stub.Propose(request, timeout=60)]) == 3
    one_thread(model_work)
