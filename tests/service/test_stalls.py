"""What a model service does when something it waits on stalls:

- its own model thread (a pass that never ends, a hung kernel): health turns NOT_SERVING once work has
  waited `--health-stall-s` with no pass completing, so Kubernetes' probes fail instead of being told
  SERVING, and SERVING again once passes complete;
- its Redis (`CLIENT PAUSE`: the server answers nobody for seconds): the sessions that need nothing from
  Redis go on getting passes at their usual pace, a session whose cache is being fetched waits alone
  and then scores as a plain forward does, and health stays SERVING.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.channel import channel
from specdec.runtime.batching import BatchConfig, Batcher
from specdec.runtime.kv import SessionCaches
from specdec.runtime.prefix_cache import PrefixCache
from specdec.runtime.prefix_store import RedisPrefixStore
from specdec.runtime.snapshot_codec import SnapshotIdentity
from specdec.runtime.snapshot_store import RedisSnapshotStore, SnapshotPolicy
from specdec.server.model_service import model_stall, save_snapshot
from specdec.server.redis import RedisSettings, connect
from specdec.server.serving import create_server, mark_serving, watch_health
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.config import TargetConfig
from target_service.server import SERVICE_NAME, build_servicer
from tests.reference import OnePassJob as ScoreJob, full_logits

HISTORY = [5 + (i * 7) % 90 for i in range(40)]


async def _status(stub) -> int:
    return (await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)).status


async def _until(stub, status: int, timeout_s: float) -> float:
    start = time.monotonic()
    while await _status(stub) != status:
        assert time.monotonic() - start < timeout_s, f"health did not turn {status} in {timeout_s} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_health_is_not_serving_while_the_model_thread_completes_no_pass(tiny_models):
    servicer, _ = build_servicer(TargetConfig(model=str(tiny_models["target"]), dtype="float64"))
    server, port, health = create_server(
        "127.0.0.1:0", [lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s)], [SERVICE_NAME])
    await server.start()
    await mark_serving(health, [SERVICE_NAME])  # as serve_servicer does
    watch = asyncio.get_running_loop().create_task(
        watch_health(health, [SERVICE_NAME], model_stall(servicer.batcher, 0.5), interval_s=0.05))
    ch = channel(f"127.0.0.1:{port}")
    stub, target = health_pb2_grpc.HealthStub(ch), target_pb2_grpc.TargetServiceStub(ch)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        await _until(stub, serving, 5)
        await target.Verify(target_pb2.VerifyRequest(session_id="s", history=HISTORY), timeout=60)
        await asyncio.sleep(1.0)  # idle for longer than the deadline: nothing waits, nothing is stalled
        assert await _status(stub) == serving

        release = threading.Event()
        stuck = asyncio.ensure_future(servicer.batcher.call(release.wait, 30))  # the model thread hangs
        verify = asyncio.ensure_future(target.Verify(target_pb2.VerifyRequest(session_id="s", history=HISTORY + [7]),
                                                     timeout=60))
        waited = await _until(stub, not_serving, 10)
        assert waited >= 0.3 and not verify.done()
        release.set()
        await stuck
        assert (await verify).token_id >= 0  # the waiting call is served once the thread is back
        await _until(stub, serving, 5)
    finally:
        watch.cancel()
        await ch.close()
        await server.stop(None)
        await servicer.batcher.close()




def _replica(model, redis_url: str) -> SessionCaches:
    identity = SnapshotIdentity(model="tiny", dtype="float64", fingerprint="fp", layers=model.config.num_hidden_layers)
    client = connect(RedisSettings(url=redis_url, timeout_s=30))
    return SessionCaches(model, 512, snapshots=SnapshotPolicy(RedisSnapshotStore(client, "target", 60), identity, 32),
                         prefix_cache=PrefixCache(8),
                         prefix_store=RedisPrefixStore(client, "target", identity, 60, min_tokens=32))


async def test_a_redis_that_stalls_does_not_freeze_the_passes(tiny_model, redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    rng = random.Random(4)
    long_history = [rng.randrange(3, 100) for _ in range(120)]
    writer, reader = _replica(tiny_model, redis_url), _replica(tiny_model, redis_url)
    thread_writer = Batcher(writer, BatchConfig(4, 0.0))
    await thread_writer.run(ScoreJob("long", long_history, []))
    await save_snapshot(thread_writer, "long")
    writer.flush(timeout=30)
    await thread_writer.close()

    batcher = Batcher(reader, BatchConfig(4, 0.0))
    history = [rng.randrange(3, 100) for _ in range(20)]
    await batcher.run(ScoreJob("decoding", history, []))  # its cache is here: it needs nothing from Redis
    stall_s = 3.0
    r.client_pause(int(stall_s * 1000), all=True)  # Redis answers no command for stall_s
    started = time.monotonic()
    fetching = asyncio.ensure_future(batcher.run(ScoreJob("long", long_history + [9], [])))  # its fetch waits on Redis
    health = model_stall(batcher, 1.0)
    steps = []
    while time.monotonic() - started < stall_s - 0.5:
        one = time.monotonic()
        result, _ = await batcher.run(ScoreJob("decoding", history, [7]))
        steps.append(time.monotonic() - one)
        assert health() is None  # the job waiting on Redis is not the model thread's
    assert len(steps) >= 5 and max(steps) < 1.0, steps  # passes went on while Redis slept
    assert not fetching.done()
    result, _ = await fetching
    assert time.monotonic() - started >= stall_s - 0.5  # it waited for Redis, alone
    torch.testing.assert_close(result.logits, full_logits(tiny_model, long_history + [9])[-1:], rtol=0, atol=1e-9)
    assert reader.snapshots is not None and reader.snapshots.restores == 1
    await batcher.close()


async def test_the_stall_clock_counts_only_work_the_model_thread_owes(tiny_model):
    batcher = Batcher(SessionCaches(tiny_model, 512), BatchConfig(4, 0.0))
    assert batcher.stalled_for() == 0.0
    release = threading.Event()
    stuck = asyncio.ensure_future(batcher.call(release.wait, 30))
    job = asyncio.ensure_future(batcher.run(ScoreJob("s", HISTORY, [])))
    await asyncio.sleep(0.3)
    assert batcher.stalled_for() >= 0.25
    release.set()
    await stuck
    await job
    assert batcher.stalled_for() == 0.0
    await batcher.close()


async def test_new_sessions_do_not_queue_behind_fetches_from_a_redis_that_does_not_answer(tiny_model, redis_url):
    """Fetches run one at a time on the I/O thread, each Redis call bounded by the timeout: against a
    Redis that answers nothing, every new session's fetch would wait out its calls' timeouts behind the
    others'. After a fetch fails, the sources stop asking for a while (doubling), and new sessions
    prefill at once."""
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    rng = random.Random(5)
    identity = SnapshotIdentity(model="tiny", dtype="float64", fingerprint="fp",
                                layers=tiny_model.config.num_hidden_layers)
    client = connect(RedisSettings(url=redis_url, timeout_s=1.0, connect_timeout_s=1.0))
    reader = SessionCaches(tiny_model, 512,
                           snapshots=SnapshotPolicy(RedisSnapshotStore(client, "target", 60), identity, 32),
                           prefix_cache=PrefixCache(8),
                           prefix_store=RedisPrefixStore(client, "target", identity, 60, min_tokens=32))
    batcher = Batcher(reader, BatchConfig(8, 0.0))
    histories = {f"new{i}": [rng.randrange(3, 100) for _ in range(60)] for i in range(6)}
    pause_s = 6.0
    r.client_pause(int(pause_s * 1000), all=True)
    started = time.monotonic()
    results = await asyncio.gather(*(batcher.run(ScoreJob(sid, h, [])) for sid, h in histories.items()))
    took = time.monotonic() - started
    await asyncio.sleep(max(0.0, pause_s + 0.2 - took))  # Redis answers again before the next test
    await batcher.close()
    for history, (result, _) in zip(histories.values(), results):
        torch.testing.assert_close(result.logits, full_logits(tiny_model, history)[-1:], rtol=0, atol=1e-9)
    assert took < 4.0, f"{len(histories)} new sessions took {took:.1f} s behind fetches that time out after 1 s"
