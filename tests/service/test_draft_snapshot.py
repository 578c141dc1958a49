"""Draft KV snapshots through the draft service's own gRPC API, in-process, with a real Redis.

A draft replica that never saw a session restores the snapshot another one saved instead of
re-prefilling, and then proposes exactly what a cold prefill proposes; a replica running another
model or dtype refuses the snapshot and prefills; Release deletes the draft's keys and only
those; prompt lookup has no cache and saves nothing.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import grpc
import pytest
import redis
from pydantic import ValidationError

from draft_service.config import DraftConfig
from draft_service.server import SERVICE_NAME, build_servicer
from specdec.channel import channel
from specdec.keys import snapshot_meta_key
from specdec.runtime.snapshot_store import RedisSnapshotStore
from specdec.server.serving import create_server
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

HISTORY = [5 + (i * 7) % 90 for i in range(40)]  # 40 token ids of the tiny character vocabulary
K = 4
MIN_TOKENS = 16


@asynccontextmanager
async def draft_service(**fields):
    """A draft service on a free port in this process; yields its stub."""
    servicer, _ = build_servicer(DraftConfig(**fields))  # no --threads: it would set every later test's torch threads
    server, port, _ = create_server(
        "127.0.0.1:0", [lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s)], [SERVICE_NAME])
    await server.start()
    ch = channel(f"127.0.0.1:{port}")
    try:
        yield draft_pb2_grpc.DraftServiceStub(ch)
    finally:
        await ch.close()
        await server.stop(None)
        if servicer.batcher is not None:
            await servicer.batcher.close()


def model_draft(tiny_models, redis_url: str | None, model: str = "good_draft", dtype: str = "float64") -> dict:
    fields = dict(proposer="model", model=str(tiny_models[model]), dtype=dtype, snapshot_min_tokens=MIN_TOKENS)
    return {**fields, "snapshot_redis_url": redis_url} if redis_url else fields


async def propose(stub, session_id: str, history: list[int]) -> tuple[list[int], list[int]]:
    """The proposed tokens and each proposal's prefill_tokens (greedy)."""
    request = draft_pb2.ProposeRequest(session_id=session_id, history=history, num_tokens=K)
    replies = [p async for p in stub.Propose(request, timeout=60)]
    return [p.token_id for p in replies], [p.prefill_tokens for p in replies]


async def info(stub) -> common_pb2.ModelInfo:
    return await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)


async def save(stub, session_id: str) -> common_pb2.SaveSnapshotResponse:
    return await stub.SaveSnapshot(common_pb2.SaveSnapshotRequest(session_id=session_id), timeout=30)


async def saved_session(tiny_models, redis_url: str, session_id: str) -> list[int]:
    """Turn 1 on one replica, then its snapshot; returns the turn-2 history (two of the K accepted)."""
    async with draft_service(**model_draft(tiny_models, redis_url)) as first:
        tokens, prefilled = await propose(first, session_id, HISTORY)
        assert prefilled[0] == len(HISTORY) - 1  # a cold start prefills
        reply = await save(first, session_id)
        # The draft's cache holds the history and all but the last proposal (never fed back).
        assert reply.tokens == len(HISTORY) + K - 1 and reply.bytes > 0
        assert (await info(first)).snapshot_saves == 1
    return HISTORY + tokens[:2] + [7]


async def test_a_fresh_replica_restores_the_snapshot_instead_of_prefilling(tiny_models, redis_url):
    history = await saved_session(tiny_models, redis_url, "restore-1")
    async with draft_service(**model_draft(tiny_models, redis_url)) as fresh:
        restored, prefilled = await propose(fresh, "restore-1", history)
        assert prefilled[0] == 0  # the snapshot covered all of history[:-1]
        assert (await info(fresh)).snapshot_restores == 1
    async with draft_service(**model_draft(tiny_models, None)) as cold:
        expected, prefilled = await propose(cold, "restore-1", history)
        assert prefilled[0] == len(history) - 1
    assert restored == expected and len(expected) == K


@pytest.mark.parametrize("other", [dict(dtype="float32"), dict(model="poor_draft")], ids=["dtype", "model"])
async def test_another_model_or_dtype_refuses_the_snapshot_and_prefills(tiny_models, redis_url, other):
    session = "mismatch-" + "-".join(other.values())
    history = await saved_session(tiny_models, redis_url, session)
    async with draft_service(**model_draft(tiny_models, redis_url, **other)) as replica:
        tokens, prefilled = await propose(replica, session, history)
        assert prefilled[0] == len(history) - 1 and len(tokens) == K
        assert (await info(replica)).snapshot_restores == 0


async def test_short_sessions_are_not_saved(tiny_models, redis_url):
    async with draft_service(**model_draft(tiny_models, redis_url)) as replica:
        await propose(replica, "short", HISTORY[: MIN_TOKENS - K])
        assert (await save(replica, "short")).tokens == 0  # covers fewer than --snapshot-min-tokens
        assert (await save(replica, "never-seen")).tokens == 0
        assert (await info(replica)).snapshot_saves == 0
    assert not redis.Redis.from_url(redis_url).exists(snapshot_meta_key("short", "draft"))


async def test_release_deletes_the_draft_snapshot_and_leaves_the_targets(tiny_models, redis_url):
    r = redis.Redis.from_url(redis_url)
    target_store = RedisSnapshotStore(redis.Redis.from_url(redis_url), "target")
    target_store.put("release-1", b"the target's snapshot", 300)
    async with draft_service(**model_draft(tiny_models, redis_url)) as replica:
        await propose(replica, "release-1", HISTORY)
        assert (await save(replica, "release-1")).tokens > 0
        draft_keys = {k.decode() for k in r.keys("*{release-1}:kv:draft:*")}
        assert snapshot_meta_key("release-1", "draft") in draft_keys and len(draft_keys) >= 2  # meta and chunks
        assert (await replica.Release(common_pb2.ReleaseRequest(session_id="release-1"), timeout=10)).released
    assert not r.keys("*{release-1}:kv:draft:*")
    assert target_store.get("release-1") == b"the target's snapshot"  # another namespace: untouched
    target_store.delete("release-1")


async def test_a_model_draft_without_a_store_refuses_to_save(tiny_models):
    async with draft_service(**model_draft(tiny_models, None)) as replica:
        described = await info(replica)
        assert list(described.draft_sources) == ["model"] and not described.learns_outputs
        await propose(replica, "no-store", HISTORY)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await save(replica, "no-store")
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_prompt_lookup_saves_nothing_and_refuses_a_store(tiny_models):
    async with draft_service(proposer="ngram", model=str(tiny_models["good_draft"])) as replica:
        await propose(replica, "ngram-1", HISTORY)
        reply = await save(replica, "ngram-1")
        assert (reply.tokens, reply.bytes) == (0, 0)
        described = await info(replica)
        assert list(described.draft_sources) == ["ngram"] and not described.learns_outputs
    with pytest.raises(ValidationError, match="--snapshot-redis-url needs --proposer model"):
        DraftConfig(proposer="ngram", snapshot_redis_url="redis://127.0.0.1:6379/0")
