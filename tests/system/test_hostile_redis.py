"""Hostile Redis: every key a service reads, corrupted (truncated, garbage, wrong dtype, wrong shape, huge
or negative counts, non-UTF-8, pointing elsewhere), costs no crash and no kernel fault, and the output
stays what the target alone computes; what is malformed is counted and deleted, what belongs to another
model or format is left alone.

The harness, for whoever adds a kind of key:

- a `Corruption` changes one key in place (`apply(redis, key)`) and says whether the reader must count
  and drop it (`malformed`) or only ignore it; `STRING`, `count_fields` and `BLOB` are the generic ones
  for a string, for a hash field holding a count and for a KV blob (rewritten whole, so the corruption
  reaches the decoder rather than the store's length checks);
- a `KeyKind` names a kind of key: the pattern of its keys in Redis once a `Scenario` primed it, and
  the corruptions that apply to it;
- a `Scenario` primes Redis with good values (the services computing as they do), then drives the path
  that reads them and asserts the output equals the reference; `rejected()` counts what it dropped.

Every (kind, corruption) pair is one test of `test_a_corrupted_key_changes_nothing_but_speed`. The model
services' keys (KV snapshots and prefix blocks, `specdec.keys`) run against the engine in process (a
real Redis, the batcher, the tiny float64 model with the native kernels), and all of them corrupted at
once against real processes in `test_a_target_replica_reading_a_corrupted_redis_answers_as_the_target_alone`.
The orchestrator's session records and the suffix stream are read by other services: add their kinds
with a scenario of their own.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import pytest
import redis
import torch
from safetensors.torch import load as st_load, save as st_save

from specdec.keys import session_tokens_key
from specdec.runtime.batching import BatchConfig, Batcher
from specdec.runtime.kv import SessionCaches
from specdec.runtime.models import load_tokenizer
from specdec.runtime.prefix_cache import PrefixCache, block_names
from specdec.runtime.prefix_store import RedisPrefixStore
from specdec.runtime.snapshot_codec import SnapshotIdentity
from specdec.runtime.snapshot_store import RedisSnapshotStore, SnapshotPolicy
from specdec.server.model_service import save_snapshot
from specdec.server.redis import RedisSettings, connect
from tests.cluster import Cluster, cached_sessions, model_info, orchestrator_stub, request
from tests.reference import OnePassJob as ScoreJob, Reference, full_logits

# -- corruptions ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corruption:
    name: str
    apply: Callable[[redis.Redis, str], None]
    malformed: bool = True  # the reader must count it and delete the key; False: ignore it, leave it


def _set(value: bytes) -> Callable[[redis.Redis, str], None]:
    def apply(r: redis.Redis, key: str) -> None:
        r.set(key, value, keepttl=True)
    return apply


def _edit(change: Callable[[bytes], bytes]) -> Callable[[redis.Redis, str], None]:
    def apply(r: redis.Redis, key: str) -> None:
        r.set(key, change(r.get(key) or b""), keepttl=True)
    return apply


def _field(name: str, value: bytes | None) -> Callable[[redis.Redis, str], None]:
    def apply(r: redis.Redis, key: str) -> None:
        if value is None:
            r.hdel(key, name)
        else:
            r.hset(key, name, value)
    return apply


STRING = [  # any string value (a chunk of a blob)
    Corruption("garbage of the same length", _edit(lambda v: bytes(random.Random(0).randrange(256) for _ in v))),
    Corruption("non-UTF-8", _edit(lambda v: b"\xff\xfe" * (len(v) // 2) + b"\xff" * (len(v) % 2))),
    Corruption("truncated", _edit(lambda v: v[: len(v) // 2]), malformed=False),  # a length mismatch reads as absent
    Corruption("empty", _set(b""), malformed=False),
    Corruption("one byte flipped in its header", _edit(lambda v: v[:10] + bytes([v[10] ^ 0x55]) + v[11:])),
]


def count_fields(*names: str) -> list[Corruption]:
    out = []
    for name in names:
        out += [
            Corruption(f"{name} not a number", _field(name, b"twelve")),
            Corruption(f"{name} non-UTF-8", _field(name, b"\xff\xfe\x00")),
            Corruption(f"{name} negative", _field(name, b"-3")),
            Corruption(f"{name} huge", _field(name, b"1" + b"0" * 30)),
            Corruption(f"{name} 2**40", _field(name, str(2**40).encode())),
        ]
    return out


def _blob_keys(r: redis.Redis, meta: str) -> tuple[list[str], bytes]:
    chunks = int(r.hget(meta, "chunks"))
    keys = [meta.removesuffix("meta") + str(i) for i in range(chunks)]
    return keys, b"".join(r.mget(keys))


def _rewrite_blob(change: Callable[[dict[str, torch.Tensor], dict[str, str]], None]):
    """A corruption of a KV blob: decoded, changed, encoded again and stored whole (one chunk, its meta
    describing it), so that it passes the store's own checks and reaches the decoder."""

    def apply(r: redis.Redis, meta: str) -> None:
        keys, blob = _blob_keys(r, meta)
        header = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
        tensors, metadata = dict(st_load(blob)), dict(header.get("__metadata__", {}))
        change(tensors, metadata)
        new = st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
        if keys[1:]:
            r.delete(*keys[1:])
        r.set(keys[0], new, keepttl=True)
        r.hset(meta, mapping={"chunks": 1, "bytes": len(new)})

    return apply


def _all_keys(change: Callable[[torch.Tensor], torch.Tensor], which: str = "k.0"):
    def edit(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        tensors[which] = change(tensors[which])
    return edit


def _meta(name: str, value: str | None):
    def edit(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        if value is None:
            metadata.pop(name, None)
        else:
            metadata[name] = value
    return edit


def _put(tokens: torch.Tensor, index: int, value: int) -> torch.Tensor:
    out = tokens.clone()
    out[index] = value
    return out


def _tokens(change: Callable[[torch.Tensor], torch.Tensor]):
    def edit(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        tensors["tokens"] = change(tensors["tokens"])
    return edit


BLOB = [  # a KV blob (snapshot or prefix segment), read through its meta key
    Corruption("keys float16", _rewrite_blob(_all_keys(lambda k: k.half()))),
    Corruption("keys float32", _rewrite_blob(_all_keys(lambda k: k.float()))),
    Corruption("keys one head of one dim", _rewrite_blob(_all_keys(lambda k: k[:, :1, :, :1]))),
    Corruption("keys of fewer positions", _rewrite_blob(_all_keys(lambda k: k[:, :, :-1]))),
    Corruption("keys of more positions", _rewrite_blob(_all_keys(lambda k: torch.cat([k, k], dim=2)))),
    Corruption("keys of another head_dim", _rewrite_blob(_all_keys(lambda k: k[..., :4]))),
    Corruption("values transposed", _rewrite_blob(_all_keys(lambda v: v.transpose(2, 3), "v.1"))),
    Corruption("tokens float64", _rewrite_blob(_tokens(lambda t: t.double()))),
    Corruption("a token outside the vocabulary", _rewrite_blob(_tokens(lambda t: _put(t, 3, 10**6)))),
    Corruption("a negative token", _rewrite_blob(_tokens(lambda t: _put(t, 0, -5)))),
    Corruption("the layer count of its metadata huge", _rewrite_blob(_meta("layers", "1000000")), malformed=False),
    Corruption("another model's", _rewrite_blob(_meta("model", "another")), malformed=False),
    Corruption("a later format", _rewrite_blob(_meta("format", "2")), malformed=False),
]


# -- key kinds and the scenario that reads them --------------------------------------------------------------------


class Scenario(Protocol):
    def prime(self) -> None:
        """Make Redis hold good values of every kind this scenario reads."""

    def read(self, kind: str) -> None:
        """Drive the path that reads keys of `kind`; assert its output equals the reference."""

    def rejected(self) -> int:
        """Entries the readers found malformed (and dropped)."""


@dataclass(frozen=True)
class KeyKind:
    name: str
    pattern: str  # the keys of this kind, as a Redis SCAN pattern
    corruptions: list[Corruption] = field(default_factory=list)


SNAPSHOT_META = "specdec:v1:{s}:kv:target:meta"
SEGMENT_META = "specdec:v1:{*}:kv:target-prefix:meta"
BLOCKS = "specdec:v1:prefix:target:*"


def _point_block(change: Callable[[str, int], tuple[str, int]]) -> Callable[[redis.Redis, str], None]:
    def apply(r: redis.Redis, key: str) -> None:
        segment, _, index = r.get(key).decode().rpartition(":")
        segment, moved = change(segment, int(index))
        r.set(key, f"{segment}:{moved}", keepttl=True)
    return apply


POINTERS = [  # a prefix block key: `<segment>:<index>`
    Corruption("pointing at the next block (the same tokens, after others)", _point_block(lambda s, i: (s, i + 1))),
    Corruption("pointing at the previous block", _point_block(lambda s, i: (s, max(0, i - 1)))),
    Corruption("an index past the segment", _point_block(lambda s, i: (s, 10**6))),
    Corruption("a negative index", _set(b"x:-1")),
    Corruption("an index beyond 64 bits", _point_block(lambda s, i: (s, 10**30))),
    Corruption("another model's segment", _point_block(lambda s, i: ("0" * 16 + s[16:], i))),
    Corruption("a segment that is not there", _point_block(lambda s, i: (s[:-4] + "abcd", i)), malformed=False),
    Corruption("non-UTF-8", _set(b"\xff\xfe:\xff")),
    Corruption("no index", _set(b"nothing-to-see-here")),
    Corruption("empty", _set(b"")),
]

KINDS = [
    KeyKind("snapshot meta", SNAPSHOT_META, count_fields("chunks", "bytes", "tokens")),
    KeyKind("snapshot chunk", "specdec:v1:{s}:kv:target:0", STRING),
    KeyKind("snapshot blob", SNAPSHOT_META, BLOB),
    KeyKind("prefix block", BLOCKS, POINTERS),
    KeyKind("prefix segment meta", SEGMENT_META, count_fields("chunks", "bytes")),
    KeyKind("prefix segment chunk", "specdec:v1:{*}:kv:target-prefix:0", STRING),
    KeyKind("prefix segment blob", SEGMENT_META, BLOB + [
        Corruption("its chain missing (written before segments recorded it)", _rewrite_blob(_meta("parent", None)),
                   malformed=False),
        Corruption("its chain not hex", _rewrite_blob(_meta("parent", "zz"))),
        Corruption("its start elsewhere", _rewrite_blob(_meta("start", "8"))),
    ]),
]

BLOCK, MIN_TOKENS = 8, 32




class EngineScenario:
    """One replica computes a session whose history repeats a block (so that a key pointing at another
    block can find the same tokens there), publishes its prefix blocks and snapshots it; a fresh replica
    then restores the session (the snapshot kinds) or starts another session sharing the prefix (the
    prefix kinds), through a batcher, and scores as a plain forward pass does."""

    def __init__(self, model, redis_url: str) -> None:
        self.model, self.redis_url = model, redis_url
        rng = random.Random(0)
        pattern = [rng.randrange(3, 100) for _ in range(BLOCK)]
        self.history = [rng.randrange(3, 100) for _ in range(32)] + pattern * 8 + [rng.randrange(3, 100)
                                                                                 for _ in range(11)]
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.readers: list[SessionCaches] = []

    def replica(self) -> SessionCaches:
        identity = SnapshotIdentity(model="tiny", dtype="float64", fingerprint="fp",
                                    layers=self.model.config.num_hidden_layers)
        client = connect(RedisSettings(url=self.redis_url, timeout_s=5))
        return SessionCaches(self.model, 512,
                             snapshots=SnapshotPolicy(RedisSnapshotStore(client, "target", 60), identity, MIN_TOKENS),
                             prefix_cache=PrefixCache(BLOCK),
                             prefix_store=RedisPrefixStore(client, "target", identity, 60, min_tokens=MIN_TOKENS))

    async def _score(self, caches: SessionCaches, session_id: str, history: list[int], new: list[int]) -> None:
        batcher = Batcher(caches, BatchConfig(4, 0.0), executor=self.thread)
        try:
            result, _ = await batcher.run(ScoreJob(session_id, history, new))
        finally:
            await batcher.close()
        reference = full_logits(self.model, history + new)[len(history) - 1:]
        torch.testing.assert_close(result.logits, reference, rtol=0, atol=1e-9)

    def prime(self) -> None:
        writer = self.replica()

        async def run() -> None:
            await self._score(writer, "s", self.history, [])
            batcher = Batcher(writer, BatchConfig(4, 0.0), executor=self.thread)
            assert (await save_snapshot(batcher, "s"))[0] == len(self.history)
            await batcher.close()

        asyncio.run(run())
        writer.flush(timeout=30)

    def block_key(self, index: int) -> str:
        """The Redis key of the history's block `index` (blocks 4..11 repeat one block of tokens)."""
        store = self.replica().prefix_store
        assert store is not None
        return store._block_key(block_names(b"", self.history, BLOCK)[index])

    def read(self, kind: str) -> None:
        reader = self.replica()
        reader.table.on_publish = None  # it publishes nothing: Redis then holds what the corruption and drop left
        self.readers.append(reader)
        if kind.startswith("snapshot"):
            asyncio.run(self._score(reader, "s", self.history + [5], [6]))
        else:
            asyncio.run(self._score(reader, "t", self.history[:96] + [7, 7, 7], [4]))

    def rejected(self) -> int:
        return sum(sum(reader.rejected.values()) for reader in self.readers)


CASES = [pytest.param(kind, corruption, id=f"{kind.name}: {corruption.name}")
         for kind in KINDS for corruption in kind.corruptions]


@pytest.mark.parametrize("kind, corruption", CASES)
def test_a_corrupted_key_changes_nothing_but_speed(tiny_model, redis_url, kind, corruption):
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    scenario = EngineScenario(tiny_model, redis_url)
    scenario.prime()
    keys = sorted(k.decode() for k in r.scan_iter(match=kind.pattern, count=1000))
    assert keys, f"priming left no key of kind {kind.name!r} ({kind.pattern})"
    target = scenario.block_key(6) if kind.pattern == BLOCKS else keys[0]  # a block inside the repeated part
    assert target in keys
    corruption.apply(r, target)
    scenario.read(kind.name)
    if corruption.malformed:
        assert scenario.rejected() >= 1, "the corrupted entry was not counted"
        assert not r.exists(target), "the corrupted entry was not dropped"
    else:
        assert scenario.rejected() == 0
    assert r.ping()


@pytest.mark.parametrize("count", [b"1" + b"0" * 12, b"-5", b"junk"])
def test_a_corrupt_chunk_count_bounds_every_loop(redis_url, count):
    """The publishing script drops an earlier snapshot's chunks by the count its meta holds: a corrupt
    count is bounded by the most chunks a snapshot has (else Redis would loop for hours, blocking every
    client); reading and deleting are bounded the same way."""
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    store = RedisSnapshotStore(connect(RedisSettings(url=redis_url, timeout_s=5)), "target", 60, chunk_bytes=1 << 20,
                               max_bytes=8 << 20)
    store.put("s", b"x" * 100, 10)
    r.hset("specdec:v1:{s}:kv:target:meta", "chunks", count)
    start = time.monotonic()
    store.put("s", b"y" * 100, 10)  # the script clamps the old count
    store.delete("s")
    assert time.monotonic() - start < 2
    assert r.keys("specdec:v1:{s}:*") == []


# -- all of it at once, against real processes ---------------------------------------------------------------------


def _scrape(port: int, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'^{name}\{{[^}}]*source="(\w+)"[^}}]*\}} (\S+)$',
                                                              text, re.M)}


def test_a_target_replica_reading_a_corrupted_redis_answers_as_the_target_alone(tiny_models, tmp_path):
    """A session's target replica snapshots it and publishes its prompt's blocks; then every snapshot
    and prefix blob in Redis is rewritten with keys of another dtype and shape (what made the attention
    kernel read past its buffers), and the replica is killed. The other replica, reading all of it,
    continues the session and answers a new one exactly as the target alone does, and counts what it
    dropped."""
    cluster = Cluster(tmp_path, tiny_models)
    try:
        redis_port = cluster.redis()
        url = f"redis://127.0.0.1:{redis_port}/0"
        engine = ("--snapshot-redis-url", url, "--snapshot-min-tokens", "8", "--prefix-redis-url", url,
                  "--prefix-min-fetch-tokens", "16", "--prefix-block-tokens", "8")
        metrics = {name: str(free) for name, free in (("target-1", _free()), ("target-2", _free()))}
        targets = [cluster.target(name, *engine, "--metrics-port", metrics[name]) for name in metrics]
        address = cluster.orchestrator("orchestrator", targets, [cluster.draft("draft")], redis_port, "--kv-snapshots")
        prompt = "The quick brown fox jumps over the lazy dog, and then the quick brown fox rests."
        r = redis.Redis(port=redis_port)
        ch, stub = orchestrator_stub(address)
        with ch:
            first = stub.GenerateUnary(request(prompt, max_new_tokens=16), timeout=120)
            holder = next(n for n in metrics if cached_sessions(cluster.addresses[n]) > 0)
            deadline = time.monotonic() + 30
            while (model_info(cluster.addresses[holder]).snapshot_saves < 1 or not list(r.scan_iter(SEGMENT_META))) \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
            metas = [k.decode() for pattern in (SNAPSHOT_META.replace("{s}", "{*}"), SEGMENT_META)
                     for k in r.scan_iter(pattern)]
            assert len(metas) >= 2, metas
            for meta in metas:
                _rewrite_blob(_all_keys(lambda k: k[:, :1, :, :1].half()))(r, meta)
            history = [int(t) for t in r.lrange(session_tokens_key(first.session_id), 0, -1)]
            cluster.kill(holder)
            survivor = next(n for n in metrics if n != holder)
            second = stub.GenerateUnary(request(" and so", session_id=first.session_id, max_new_tokens=12), timeout=120)
            third = stub.GenerateUnary(request(prompt + " Again", max_new_tokens=12), timeout=120)
        reference = Reference(str(tiny_models["target"]))
        tokenizer = load_tokenizer(str(tiny_models["target"]))
        turn = list(tokenizer(" and so", add_special_tokens=False)["input_ids"])
        assert list(second.token_ids) == reference.greedy_ids(history + turn, 12)
        assert list(third.token_ids) == reference.greedy(prompt + " Again", 12)
        assert cluster.procs[survivor].poll() is None
        rejected = _scrape(int(metrics[survivor]), "specdec_kv_rejected_total")
        assert rejected.get("snapshot", 0) >= 1 and rejected.get("prefix", 0) >= 1, rejected
        assert model_info(cluster.addresses[survivor]).snapshot_restores == 0
    finally:
        cluster.stop()


def _free() -> int:
    from specdec.launcher import free_port

    return free_port()
