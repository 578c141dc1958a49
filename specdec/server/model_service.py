"""What the services that host a model (draft, target) share, written once.

- `ModelServicer`: the RPCs both answer alike (Release, SaveSnapshot, GetInfo), and the requests of
  their long-lived calls (`requests_of`); each service's servicer adds its own (Propose, Verify).
- `model_thread`, `load_on` (`load_served`), `session_caches`, `admission_and_metrics`, `batcher_for` and
  `serve_model_service`: from a `ModelServiceConfig` to the thread that runs the model, the loaded
  model and its KV caches (with their snapshot policy), admission, metrics, the batcher, and a
  running server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from specdec.errors import InvalidArgument
from specdec.rpc_errors import grpc_errors
from specdec.runtime.batching import BatchConfig, Batcher
from specdec.runtime.grammars import SessionGrammars
from specdec.runtime.kv import SessionCaches
from specdec.runtime.latency import LatencyProfile
from specdec.runtime.models import LoadedModel, ModelLoadError, load_model
from specdec.runtime.native import parking
from specdec.runtime.packed import kv_geometry
from specdec.runtime.prefix_cache import PrefixCache
from specdec.runtime.prefix_store import RedisPrefixStore
from specdec.runtime.snapshot_codec import SnapshotIdentity
from specdec.runtime.snapshot_store import CHUNK_BYTES, RedisSnapshotStore, SnapshotPolicy, snapshot_max_bytes
from specdec.server.admission import Admission
from specdec.server.config import ModelServiceConfig
from specdec.server.constants import SessionConstants
from specdec.server.metrics import ServiceMetrics
from specdec.server.redis import connect
from specdec.server.serving import StartupError, serve_servicer, start_metrics
from specdec.server.tls import server_credentials_of
from specdec.v1 import common_pb2

T = TypeVar("T")


class ModelServicer:
    """Release, SaveSnapshot and GetInfo of a model service.

    `batcher` runs the model and holds its per-session caches; None for a draft without a model
    (prompt lookup), which holds nothing per session.
    """

    def __init__(self, info: common_pb2.ModelInfo, admission: Admission, batcher: Batcher | None) -> None:
        self.info = info
        self.admission = admission
        self.batcher = batcher
        self.grammars: SessionGrammars | None = None  # each session's grammar state, freed with its caches
        self.constants = SessionConstants()  # each session's logit_bias and grammar, sent once (resolve a call's)
        info.caches_sampling_constants = True
        self._idle_calls: set[asyncio.Task | None] = set()  # long-lived calls waiting for their next request
        self._stopping = False

    async def requests_of(self, requests: AsyncIterator[T]) -> AsyncIterator[T]:
        """The requests of a long-lived call (VerifyStream, ProposeStream), one at a time, until the
        caller ends the call, or until the service stops while the call waits for one
        (`end_idle_calls`: the caller then sees the call end and opens one elsewhere)."""
        task = asyncio.current_task()
        pending = aiter(requests)
        while True:
            self._idle_calls.add(task)
            try:
                request = await anext(pending)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if self._stopping:
                    return
                raise
            finally:
                self._idle_calls.discard(task)
            yield request

    def end_idle_calls(self) -> None:
        """The service is stopping: end the long-lived calls that wait for a request (a graceful stop
        lets calls in flight finish, and would wait out its grace for these)."""
        self._stopping = True
        for task in list(self._idle_calls):
            if task is not None:
                task.cancel()

    @grpc_errors
    async def Release(self, request: common_pb2.ReleaseRequest, context) -> common_pb2.ReleaseResponse:
        self.constants.release(request.session_id)
        if self.grammars is not None:
            self.grammars.release(request.session_id)
        if self.batcher is None:
            return common_pb2.ReleaseResponse(released=False)
        self.batcher.cancel_session(request.session_id, request.sent_unix_ns)  # its queued and running work stops
        caches = self.batcher.caches
        released = await self.batcher.call(caches.release, request.session_id)
        if caches.snapshots is not None:  # everything held for the session goes, its snapshot too
            await asyncio.to_thread(caches.snapshots.store.delete, request.session_id)
        return common_pb2.ReleaseResponse(released=released)

    @grpc_errors
    async def SaveSnapshot(self, request: common_pb2.SaveSnapshotRequest, context) -> common_pb2.SaveSnapshotResponse:
        if not request.session_id:
            raise InvalidArgument("session_id is empty")
        if self.batcher is None:  # prompt lookup keeps no KV cache: nothing to save
            return common_pb2.SaveSnapshotResponse(tokens=0, bytes=0)
        tokens, size = await save_snapshot(self.batcher, request.session_id)
        return common_pb2.SaveSnapshotResponse(tokens=tokens, bytes=size)

    @grpc_errors
    async def GetInfo(self, request: common_pb2.GetInfoRequest, context) -> common_pb2.ModelInfo:
        info = common_pb2.ModelInfo()
        info.CopyFrom(self.info)
        batcher = self.batcher
        if batcher is None:
            info.running_requests, info.waiting_requests = self.admission.running, self.admission.waiting
            return info
        caches = batcher.caches
        info.cached_sessions, info.cached_tokens = len(caches), caches.cached_tokens
        if caches.snapshots is not None:
            info.snapshot_saves, info.snapshot_restores = caches.snapshots.saves, caches.snapshots.restores
        info.kv_cache_bytes_used, info.kv_cache_bytes_budget = caches.used_bytes, caches.budget_bytes
        info.kv_cache_evictions = caches.evictions
        if caches.prefix is not None:
            info.prefix_cache_queries, info.prefix_cache_hits = caches.prefix.queries, caches.prefix.hits
            info.prefix_cache_blocks = caches.prefix.blocks
            info.prefix_cache_shared_blocks = caches.prefix.shared_blocks
        if caches.prefix_store is not None:
            info.prefix_fetched_tokens = caches.prefix_store.fetched_tokens
        info.running_requests = batcher.running
        info.waiting_requests = self.admission.waiting + batcher.waiting
        return info


async def save_snapshot(batcher: Batcher, session_id: str) -> tuple[int, int]:
    """Snapshot a session's cache: (tokens covered, bytes); (0, 0) when there is nothing worth saving.

    Only the encode runs on the model's thread (between steps); the store's write runs beside it.
    FailedPrecondition (from `SessionCaches.snapshot`) when the service keeps no snapshots.
    """
    caches = batcher.caches
    tokens, blob = await batcher.call(caches.snapshot, session_id)
    if tokens and caches.snapshots is not None:
        await asyncio.to_thread(caches.snapshots.store.put, session_id, blob, tokens)
        caches.snapshots.saves += 1
    return tokens, len(blob)


# -- wiring -------------------------------------------------------------------------------------


def snapshot_policy(config: ModelServiceConfig, loaded: LoadedModel, role: str,
                    client: Any = None) -> SnapshotPolicy | None:
    """The snapshot policy of a service's config (None when it has no --snapshot-redis-url); `client`:
    the Redis client to keep them with (default: one `connect`ed for --snapshot-redis-url)."""
    if not config.snapshot_redis_url:
        return None
    client = client or connect(config.redis_settings(config.snapshot_redis_url))
    store = RedisSnapshotStore(client, role, config.snapshot_ttl_s, CHUNK_BYTES, largest_snapshot(loaded))
    return SnapshotPolicy(store, model_identity(loaded), config.snapshot_min_tokens)


def largest_snapshot(loaded: LoadedModel) -> int:
    """Bytes of the largest KV blob the loaded model makes: what its stores read at most from Redis."""
    layers, kv_heads, head_dim = kv_geometry(loaded.model)
    return snapshot_max_bytes(layers, kv_heads, head_dim, loaded.dtype.itemsize, loaded.max_context)


def model_identity(loaded: LoadedModel) -> SnapshotIdentity:
    """What keys/values written by one replica must match to be read by another."""
    dtype = str(loaded.dtype).removeprefix("torch.")  # "float32", as --dtype names it
    weights = loaded.weights  # quantized weights compute other keys/values: only the same weights share them
    model = f"{loaded.name}@{weights.format}:{weights.fingerprint}" if weights.quantized else loaded.name
    return SnapshotIdentity(model, dtype, loaded.fingerprint, loaded.model.config.num_hidden_layers)


def model_thread(role: str) -> ThreadPoolExecutor:
    """The one thread that does a model service's model work: loading, warm-up and every pass.

    One, because of how torch's OpenMP runtime on Linux (libgomp) waits: each thread that starts a
    parallel region gets a pool of worker threads of its own, and once the pools of a process hold
    more threads than it has CPUs, workers stop spinning between regions and sleep, so each of the
    hundreds of regions in a forward pass wakes them through the kernel. A model loaded and warmed
    up on the main thread and then run on a batching thread makes two pools. Measured on 2 cores
    (SmolLM2-135M, one session at 64 tokens, a pass after another, medians): 69-74 ms a pass that way,
    35-42 ms with loading, warm-up and passes on one thread."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{role}-model")


def load_on(thread: ThreadPoolExecutor, config: ModelServiceConfig, role: str) -> tuple[LoadedModel, SessionCaches]:
    """Load the configured model and build its session caches (warmed up) on `thread` (`model_thread`);
    blocks until done, raising what loading raised."""
    return thread.submit(load_served, config, role).result()


def load_served(config: ModelServiceConfig, role: str) -> tuple[LoadedModel, SessionCaches]:
    """The configured model and its session caches (warmed up), loaded in the caller's thread: what a
    service serves (`load_on`), and what an offline tool times when it measures the served model."""
    options = config.engine_options
    try:
        loaded = load_model(config.model, dtype=config.dtype, threads=config.threads, device=config.device,
                            weights=options.weights, quantize=options.quantize, quantize_group=options.quantize_group)
    except ModelLoadError:
        raise
    except ValueError as exc:  # weights this model or machine cannot serve (--weights gguf of a checkpoint, ...)
        raise StartupError(str(exc)) from exc
    return loaded, session_caches(config, loaded, role)


def session_caches(config: ModelServiceConfig, loaded: LoadedModel, role: str) -> SessionCaches:
    """The per-session KV caches of a loaded model, bounded, shared and snapshotted as the config says."""
    try:  # a Redis option or an engine option this model or machine cannot honour (--kernels native, ...)
        clients = {url: connect(config.redis_settings(url))  # one client (a pool) per Redis
                   for url in {config.snapshot_redis_url, config.prefix_redis_url} if url}
        store = None
        if config.prefix_redis_url:
            store = RedisPrefixStore(clients[config.prefix_redis_url], role, model_identity(loaded),
                                     config.prefix_ttl_s, config.prefix_min_fetch_tokens, largest_snapshot(loaded))
        caches = SessionCaches(loaded.model, loaded.max_context, config.max_sessions, config.idle_ttl_s,
                               snapshot_policy(config, loaded, role, clients.get(config.snapshot_redis_url)),
                               budget_bytes=config.kv_cache_bytes or None,
                               prefix_cache=PrefixCache(config.prefix_block_tokens) if config.prefix_cache else None,
                               prefix_store=store, engine=config.engine_options)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    caches.warm_up()  # before the service listens: no request pays a compile
    return caches


def admission_and_metrics(config: ModelServiceConfig, role: str) -> tuple[Admission, ServiceMetrics]:
    """A service's admission and metrics (`role`: "draft" or "target"); the gauges read the admission
    until `batcher_for` gives them a batcher to read."""
    metrics = ServiceMetrics(role)
    admission = Admission(config.max_concurrent, config.max_queued, name=f"{role} service", observer=metrics)
    metrics.track(running=lambda: admission.running, waiting=lambda: admission.waiting,
                  kv_sessions=lambda: 0, kv_tokens=lambda: 0)
    return admission, metrics


def batcher_for(config: ModelServiceConfig, caches: SessionCaches, profile: LatencyProfile, admission: Admission,
                metrics: ServiceMetrics, thread: ThreadPoolExecutor) -> Batcher:
    """The batcher that runs the model on `caches` on `thread`, the one that loaded it (`load_on`);
    call inside the event loop. The gauges read it."""
    batch = BatchConfig(config.max_batch, config.batch_window_ms / 1e3, config.prefill_chunk_tokens)
    batcher = Batcher(caches, batch, profile, metrics, executor=thread, parking=parking())
    metrics.track(running=lambda: batcher.running, waiting=lambda: admission.waiting + batcher.waiting,
                  kv_sessions=lambda: len(caches), kv_tokens=lambda: caches.cached_tokens)
    metrics.track_kv(caches)
    return batcher


def model_stall(batcher: Batcher, deadline_s: float) -> Callable[[], str | None]:
    """A health check: why the service cannot serve (its model thread has completed no pass for
    `deadline_s` while work waits), or None."""

    def why() -> str | None:
        stalled = batcher.stalled_for()
        if stalled <= deadline_s:
            return None
        return (f"the model thread has completed no pass for {stalled:.0f} s while work waits "
                f"(--health-stall-s {deadline_s:g})")

    return why


async def serve_model_service(config: ModelServiceConfig, servicer: ModelServicer, metrics: ServiceMetrics,
                              register: Callable[[grpc.aio.Server], None], service_name: str,
                              description: str) -> None:
    """Start the metrics endpoint (its port goes into GetInfo) and serve `servicer` until signalled; its
    health says NOT_SERVING while its model thread is stalled (`model_stall`)."""
    servicer.info.metrics_port = start_metrics(metrics.registry, config.host, config.metrics_port)
    check = model_stall(servicer.batcher, config.health_stall_s) if servicer.batcher is not None else None
    try:
        await serve_servicer(config.address, register, service_name, description,
                             credentials=server_credentials_of(config), health_check=check,
                             on_stop=servicer.end_idle_calls)
    finally:
        if servicer.batcher is not None:
            await servicer.batcher.close()  # (wakes a parked model thread: the process exits without waiting for it)
