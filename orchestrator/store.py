"""Session state: the must-not-lose record of every session, behind the `SessionStore` interface.

`RedisSessionStore` is the production store. Keys are namespaced, versioned and hash-tagged
by session id, so a session's keys share a cluster slot: `specdec:v1:{<session>}:meta` (a hash:
`version`, `state` as JSON) and `specdec:v1:{<session>}:tokens` (a list of token ids). Every write
is one Lua script, atomic and checked against the version the writer read (optimistic
concurrency), and refreshes both TTLs. Nothing is pickled.

The store runs on one Redis (`url`), on a Redis Cluster (`cluster_nodes`: the hash tag keeps each
script on one slot) or on the master that Redis Sentinels name (`sentinels`, `sentinel_master`).
On a cluster or behind sentinels a call that meets a failover (connection lost, CLUSTERDOWN, no
master yet, a demoted master) is retried with a bounded backoff for `failover_s`; MOVED and ASK
are followed by redis-py itself. A write whose reply was lost is recognised on its retry, so it
is never applied twice nor reported as a conflict. What a failover may lose: docs/state.md.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from redis.exceptions import (
    ClusterDownError,
    ConnectionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    TimeoutError,
    TryAgainError,
)

from specdec.core.sampling import SamplingParams
from specdec.core.suffix import encode_entry
from specdec.errors import Aborted, FailedPrecondition, ResourceExhausted, Unavailable
from specdec.keys import PRIOR_KEY, owed_releases_key, session_meta_key, session_tokens_key, suffix_outputs_key
from specdec.server.limits import SESSION_ID
from specdec.server.redis import RedisSettings, connect
from specdec.server.wire import constants_digest
from specdec.v1 import orchestrator_pb2 as pb

if TYPE_CHECKING:
    from orchestrator.detokenizer import Detokenizer

# KEYS: meta, tokens. ARGV: expected version ("0" = must not exist), new state JSON, ttl, the generation's
# sampling constants ("" = unchanged, "-" = none, else their JSON), tokens...
_APPEND = """
local current = redis.call('HGET', KEYS[1], 'version')
if current == false then current = '0' end
if current ~= ARGV[1] then return -1 end
local version = tonumber(current) + 1
redis.call('HSET', KEYS[1], 'version', version, 'state', ARGV[2])
if ARGV[4] == '-' then redis.call('HDEL', KEYS[1], 'constants')
elseif ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'constants', ARGV[4]) end
if #ARGV > 4 then redis.call('RPUSH', KEYS[2], unpack(ARGV, 5)) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[3]) end
return version
"""

# KEYS: meta, tokens. The record and the history it describes, read atomically in every mode.
_READ = """
return {redis.call('HGETALL', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1)}
"""

# KEYS: meta, tokens. ARGV: n. What a write that may have landed left: version, state, history
# length and its last n tokens.
_WRITTEN = """
local n = tonumber(ARGV[1])
local tail = {}
if n > 0 then tail = redis.call('LRANGE', KEYS[2], -n, -1) end
return {redis.call('HGET', KEYS[1], 'version'), redis.call('HGET', KEYS[1], 'state'), redis.call('LLEN', KEYS[2]),
        tail}
"""

log = logging.getLogger("specdec.orchestrator")

# What a failover looks like from the client: retried for `failover_s` on a cluster or sentinels.
_FAILOVER = (ConnectionError, TimeoutError, ClusterDownError, TryAgainError, ReadOnlyError, RedisClusterException)
_BACKOFF_S = (0.05, 1.0)  # first and largest pause between retries


PRIOR_TTL_S = 7 * 24 * 3600
SHARED_OUTPUTS_MAXLEN = 20_000  # finished outputs kept for the suffix indexes (approximately, oldest go first)

# Finish reasons by name, as the SDK (specdec.client) names them.
FINISH_NAMES = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_EOS: "eos", pb.FINISH_REASON_STOP: "stop"}
# The `finish_reason` label of specdec_request_success_total speaks OpenAI: EOS counts as "stop".
METRIC_LABELS = {"length": "length", "eos": "stop", "stop": "stop"}


@dataclass
class GenerationRecord:
    """The session's latest generation: enough to resume its stream on any orchestrator replica.

    `finish` is 0 while it runs (or after it was interrupted) and a FinishReason once it ended.
    `lease_until` (epoch seconds) marks it as owned by a running request: another request on the
    session is refused until then, unless it resumes this very generation.
    """

    id: str
    start: int  # index into SessionState.tokens of its first generated token
    prompt_tokens: int
    max_new_tokens: int
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # end it (finish STOP), kept in the output
    ignore_eos: bool = False  # end-of-sequence does not end it
    top_logprobs: int | None = None  # None: no log-probabilities; else alternatives per token
    share_output: bool = True  # its output may join the suffix drafts' corpus once it finishes
    input_tokens: int = 0  # this request's input: the history's last input_tokens before `start`
    finish: int = 0
    lease_until: float = 0.0
    owner: str = ""  # the request holding the lease (a resume becomes the new owner)
    started_at: float = field(default_factory=time.time)
    first_token_s: float = 0.0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    fallbacks: int = 0
    overlapped: int = 0

    def leased(self, now: float | None = None) -> bool:
        return self.finish == 0 and self.lease_until > (time.time() if now is None else now)

    @property
    def finish_label(self) -> str:
        """The metric label of its finish reason."""
        return METRIC_LABELS[FINISH_NAMES[self.finish]]

    def apply_stops(self, emitted: list[int], remaining: int, text: Detokenizer,
                    eos_ids: set[int]) -> tuple[list[int], int]:
        """A round's tokens up to its first stop (an end of sequence unless it ignores them, one of its
        stop tokens or strings, the budget of `remaining` tokens), and the finish reason (0: none)."""
        ends = set() if self.ignore_eos else eos_ids
        kept: list[int] = []
        for token in emitted[:remaining]:
            kept.append(token)
            if token in ends:
                return kept, pb.FINISH_REASON_EOS
            if token in self.stop_token_ids:
                return kept, pb.FINISH_REASON_STOP
            text.push(token)
            if text.stopped:
                return kept, pb.FINISH_REASON_STOP
        return kept, (pb.FINISH_REASON_LENGTH if len(kept) == remaining else pb.FINISH_REASON_UNSPECIFIED)

    def record_round(self, stats: pb.RoundStats, finish: int, lease_s: float, since_start_s: float) -> None:
        """Count a round, and renew the lease (for `lease_s`) or end it with `finish`."""
        self.rounds += 1
        self.draft_tokens += stats.proposed
        self.accepted_tokens += stats.accepted
        self.fallbacks += stats.draft_fallback
        self.overlapped += stats.overlapped
        if not self.first_token_s:
            self.first_token_s = since_start_s
        self.finish = finish
        self.lease_until = 0.0 if finish else time.time() + lease_s

    def stats(self, completion_tokens: int, seed: int) -> pb.GenerationStats:
        """The statistics its last chunk carries."""
        elapsed = max(time.time() - self.started_at, 0.0)
        n = completion_tokens
        return pb.GenerationStats(
            prompt_tokens=self.prompt_tokens, completion_tokens=n, rounds=self.rounds,
            draft_tokens=self.draft_tokens, accepted_tokens=self.accepted_tokens,
            acceptance_rate=self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            mean_accepted_length=n / self.rounds if self.rounds else 0.0,
            elapsed_s=elapsed, tokens_per_second=n / elapsed if elapsed > 0 else 0.0,
            time_to_first_token_s=self.first_token_s, seed=seed, draft_fallbacks=self.fallbacks,
            overlapped_rounds=self.overlapped,
        )


@functools.cache
def _field_names(cls) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


_NOT_IN_RECORD = frozenset({"tokens", "version", "session_id", "constants", "constants_changed"})
# The sampling parameters that stay the same for a whole generation and may be large: kept out of the
# record written every round, in the meta hash's `constants` field written when they change.
CONSTANT_FIELDS = ("logit_bias", "grammar_kind", "grammar_text")


@dataclass
class SessionState:
    """Everything needed to continue a session on any orchestrator replica."""

    session_id: str
    seed: int
    tokens: list[int] = field(default_factory=list)  # the whole history: prompts and generated
    version: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    sampling: dict[str, float] = field(default_factory=dict)  # of the latest request
    draft_length: int = 0  # of the latest request (-1 = auto)
    policy: dict = field(default_factory=dict)  # draft-length controller state (PolicyState.to_dict)
    created_at: float = field(default_factory=time.time)
    generation: GenerationRecord | None = None  # the latest generation
    principal: str = ""  # hash of the identity that opened it (specdec.server.auth.principal_of; "" = anonymous)
    # The latest request's logit_bias and grammar (CONSTANT_FIELDS), when it has any; `sampling` then
    # names their digest as "constants". Not in the record: stored beside it when they change.
    constants: dict | None = None
    constants_changed: bool = field(default=False, compare=False, repr=False)  # to be written with the next save

    def set_sampling(self, params: SamplingParams) -> None:
        """The sampling parameters of a new generation."""
        data = asdict(params)
        constants = {name: data.pop(name) for name in CONSTANT_FIELDS}
        digest = constants_digest(params)
        if digest:
            data["constants"] = digest.hex()
        else:
            constants = None
        self.constants_changed = self.constants_changed or constants != self.constants
        self.sampling, self.constants = data, constants

    def sampling_params(self) -> SamplingParams:
        """The latest generation's sampling parameters, the constants filled in (a record written
        before they were kept apart holds them inline)."""
        data = dict(self.sampling)
        digest = data.pop("constants", None)
        if digest is None:
            return SamplingParams(**data)
        params = SamplingParams(**data, **(self.constants or {}))
        if constants_digest(params).hex() != digest:
            raise FailedPrecondition(f"session {self.session_id!r}: the store lacks its generation's logit_bias and "
                                     "grammar (or holds others); start a new generation")
        return params

    def remaining(self, max_context: int) -> int:
        """Tokens its generation may still add: its own limit, or the room left in the context."""
        gen = self.generation
        assert gen is not None, "no generation to continue"
        return min(gen.max_new_tokens - (len(self.tokens) - gen.start), max_context - len(self.tokens))

    def record_round(self, stats: pb.RoundStats, kept: list[int], finish: int, lease_s: float,
                     since_start_s: float) -> None:
        """Count a round on the generation and the session, and append the tokens it kept."""
        assert self.generation is not None, "a round outside a generation"
        self.generation.record_round(stats, finish, lease_s, since_start_s)
        self.tokens.extend(kept)
        self.rounds += 1
        self.draft_tokens += stats.proposed
        self.accepted_tokens += stats.accepted
        self.generated_tokens += len(kept)

    def record(self) -> str:
        """The JSON record of everything but the history (kept as a Redis list) and the key.

        Written every round: built field by field, since `asdict` would deep-copy the whole
        history only to drop it (O(history) per round)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_IN_RECORD}
        if self.generation is not None:
            data["generation"] = asdict(self.generation)
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_record(cls, session_id: str, version: int, tokens: list[int], raw: bytes,
                    constants: bytes | None = None) -> SessionState:
        data: dict[str, Any] = json.loads(raw)
        generation = data.pop("generation", None)
        # Fields this version does not know (written by a newer replica during a rolling upgrade) are
        # left out; those it knows and the record lacks take their defaults.
        known, known_gen = _field_names(cls) - _NOT_IN_RECORD, _field_names(GenerationRecord)
        return cls(session_id=session_id, version=version, tokens=tokens,
                   generation=GenerationRecord(**{k: v for k, v in generation.items() if k in known_gen})
                   if generation else None, constants=json.loads(constants) if constants else None,
                   **{k: v for k, v in data.items() if k in known})

    def constants_arg(self) -> str:
        """What `save` writes of the constants: "" (unchanged), "-" (none) or their JSON."""
        if not self.constants_changed:
            return ""
        return "-" if self.constants is None else json.dumps(self.constants, separators=(",", ":"))


class SessionStoreFull(ResourceExhausted):
    """Redis refused a write: it holds its maxmemory and evicts nothing (as it must not evict sessions)."""


class ReleaseLedger(Protocol):
    """Where the releases a replica did not answer are kept for every orchestrator (the session
    store's part that `ReplicaPool` uses)."""

    async def owe_release(self, address: str, session_id: str, forget_output: bool) -> None:
        """Remember that the replica at `address` did not answer the session's Release."""

    async def owed_releases(self, address: str, limit: int) -> dict[str, bool]:
        """Up to `limit` of the releases owed by `address` (session id -> forget_output); ids that
        are not session ids are dropped, never returned."""

    async def paid_releases(self, address: str, session_ids: list[str]) -> None:
        """`address` answered these sessions' Releases."""


class SessionStore(ReleaseLedger, Protocol):
    """Where sessions live. `save` is optimistic: it raises Aborted when the stored version is
    not `state.version` (another request wrote since this one loaded) and bumps it on success.
    `load` returns a fresh copy: changing it changes nothing stored until `save`. Failures of the
    store itself raise Unavailable."""

    async def ping(self) -> None: ...

    async def load(self, session_id: str) -> SessionState | None: ...

    async def save(self, state: SessionState, new_tokens: list[int]) -> None:
        """Append `new_tokens` (already in `state.tokens`) and write the record."""

    async def delete(self, session_id: str) -> bool: ...

    async def load_prior(self) -> dict | None:
        """The global draft-length prior that new sessions start from, if any."""

    async def save_prior(self, prior: dict) -> None: ...

    async def publish_output(self, tokens: list[int], group: str = "") -> None:
        """Offer a finished generation's output to the suffix corpus of corpus group `group` in every
        draft replica (evictable)."""

    async def close(self) -> None: ...


class RedisSessionStore:
    """The production `SessionStore`."""

    def __init__(self, redis_at: RedisSettings | str, ttl_s: int, *, failover_s: float = 0.0) -> None:
        """`redis_at`: the deployment (one Redis, a Cluster or Sentinels, with its password, TLS and
        timeouts: `specdec.server.redis`), or the URL of one Redis with no more options.
        `failover_s`: how long a call retries through a failover (cluster and sentinel modes)."""
        settings = RedisSettings(url=redis_at) if isinstance(redis_at, str) else redis_at
        self.ttl_s = ttl_s
        self.failover_s = failover_s if settings.mode != "single" else 0.0
        self.where = settings.where
        self.redis = connect(settings, asyncio=True)
        self.full_refusals = 0  # writes refused because Redis was full
        self.used_bytes = self.max_bytes = 0  # its memory and maxmemory (0: none) at the last refresh_memory
        self._watch: asyncio.Task | None = None
        self._append = self.redis.register_script(_APPEND)
        self._read = self.redis.register_script(_READ)
        self._written = self.redis.register_script(_WRITTEN)

    async def ping(self) -> None:
        await self._call(self.redis.ping)

    async def load(self, session_id: str) -> SessionState | None:
        keys = [session_meta_key(session_id), session_tokens_key(session_id)]
        flat, tokens = await self._call(lambda: self._read(keys=keys))
        if not flat:
            return None
        meta = dict(zip(flat[::2], flat[1::2]))
        return SessionState.from_record(session_id, int(meta[b"version"]), [int(t) for t in tokens], meta[b"state"],
                                        meta.get(b"constants"))

    async def save(self, state: SessionState, new_tokens: list[int]) -> None:
        """Append `new_tokens` and write the record, if nobody else wrote since we read.

        `state.tokens` must already include `new_tokens`; `state.version` is bumped on success.
        """
        keys = [session_meta_key(state.session_id), session_tokens_key(state.session_id)]
        record, constants = state.record(), state.constants_arg()
        result = await self._call(lambda: self._append(keys=keys, args=[state.version, record, self.ttl_s, constants,
                                                                         *new_tokens]))
        if result == -1 and not await self._landed(keys, state, record, new_tokens):
            raise Aborted(f"session {state.session_id} was changed by another request; retry")
        state.version += 1
        state.constants_changed = False

    async def _landed(self, keys: list[str], state: SessionState, record: str, new_tokens: list[int]) -> bool:
        """Whether this very write is what the store holds: a retried write (by redis-py or by
        `_call`) whose first attempt was applied but whose reply was lost looks like a conflict."""
        version, stored, length, tail = await self._call(lambda: self._written(keys=keys, args=[len(new_tokens)]))
        return (version == str(state.version + 1).encode() and stored == record.encode()
                and length == len(state.tokens) and [int(t) for t in tail] == new_tokens)

    async def load_prior(self) -> dict | None:
        """The global draft-length prior that new sessions start from (evictable; JSON)."""
        raw = await self._call(lambda: self.redis.get(PRIOR_KEY))
        return json.loads(raw) if raw else None

    async def save_prior(self, prior: dict) -> None:
        raw = json.dumps(prior, separators=(",", ":"))
        await self._call(lambda: self.redis.set(PRIOR_KEY, raw, ex=PRIOR_TTL_S))

    async def delete(self, session_id: str) -> bool:
        keys = [session_meta_key(session_id), session_tokens_key(session_id)]
        removed = await self._call(lambda: self.redis.delete(*keys))
        return removed > 0

    async def publish_output(self, tokens: list[int], group: str = "") -> None:
        """Append to the capped stream the suffix-speculation draft replicas read (suffix_outputs_key),
        with its corpus group (`encode_entry`)."""
        fields = encode_entry(tokens, group)
        await self._call(lambda: self.redis.xadd(suffix_outputs_key(), fields,
                                                 maxlen=SHARED_OUTPUTS_MAXLEN, approximate=True))

    async def owe_release(self, address: str, session_id: str, forget_output: bool) -> None:
        """One field of `owed_releases_key(address)`, the key's TTL the session TTL (a release owed
        for longer has nothing left to free: the replica's cache went by eviction or a restart)."""
        key = owed_releases_key(address)

        async def write() -> None:
            pipe = self.redis.pipeline(transaction=False)  # one key: one slot in a cluster
            pipe.hset(key, session_id, "1" if forget_output else "0")
            pipe.expire(key, self.ttl_s)
            await pipe.execute()

        await self._call(write)

    async def owed_releases(self, address: str, limit: int) -> dict[str, bool]:
        """One HSCAN page of the owed releases; a field that is not a session id (a hostile or
        corrupted entry) is deleted, never sent."""
        key = owed_releases_key(address)
        _, fields = await self._call(lambda: self.redis.hscan(key, 0, count=limit))
        owed, bad = {}, []
        for raw, value in list(fields.items())[:limit]:
            session = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
            if SESSION_ID.fullmatch(session) and value in (b"0", b"1", "0", "1"):
                owed[session] = value in (b"1", "1")
            else:
                bad.append(raw)
        if bad:
            log.warning("dropping %d malformed entries of %s", len(bad), key)
            await self._call(lambda: self.redis.hdel(key, *bad))
        return owed

    async def paid_releases(self, address: str, session_ids: list[str]) -> None:
        if session_ids:
            await self._call(lambda: self.redis.hdel(owed_releases_key(address), *session_ids))

    async def refresh_memory(self) -> None:
        """Read Redis's used memory and maxmemory (INFO memory; a cluster: the fullest node)."""
        info = await self._call(lambda: self.redis.info("memory"))
        nodes = list(info.values()) if info and all(isinstance(v, dict) for v in info.values()) else [info]
        fullest = max(nodes, key=lambda n: n.get("used_memory", 0) / (n.get("maxmemory") or float("inf")))
        self.used_bytes, self.max_bytes = int(fullest.get("used_memory", 0)), int(fullest.get("maxmemory", 0))

    def watch_memory(self, every_s: float = 15.0) -> None:
        """Refresh the memory figures every `every_s` in the background (for the metrics)."""
        async def watch() -> None:
            while True:
                try:
                    await self.refresh_memory()
                except Unavailable as exc:
                    log.info("could not read the session store's memory: %s", exc)
                await asyncio.sleep(every_s)

        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(watch())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.redis.aclose()
        pool = getattr(self.redis, "connection_pool", None)  # a cluster client has none
        sentinels = getattr(pool, "sentinel_manager", None)  # the Sentinel of a master client
        if sentinels is not None:
            await sentinels.aclose()

    async def _call(self, call):
        """`call()`'s result; through a failover, retried with backoff for `failover_s`."""
        deadline, pause = time.monotonic() + self.failover_s, _BACKOFF_S[0]
        while True:
            try:
                return await call()
            except OutOfMemoryError as exc:
                self.full_refusals += 1
                raise SessionStoreFull(
                    f"session store ({self.where}) is full: it holds its maxmemory and evicts no session; retry later "
                    "(sessions already saved are kept; closing sessions frees room)") from exc
            except (RedisError, RedisClusterException) as exc:
                if not isinstance(exc, _FAILOVER) or time.monotonic() + pause > deadline:
                    raise Unavailable(f"session store unavailable ({self.where}): {exc}") from exc
                log.info("session store (%s): %s; retrying in %.2f s", self.where, exc, pause)
                await asyncio.sleep(pause)
                pause = min(2 * pause, _BACKOFF_S[1])


class SessionStoreMetrics:
    """Prometheus collector of a `RedisSessionStore`'s memory, for alerts before it is full:
    `specdec_session_store_used_bytes`, `specdec_session_store_max_bytes` (gauges, 0: no cap; as of
    its last `refresh_memory`) and `specdec_session_store_full_refusals_total` (writes refused because
    it was full). PromQL: `specdec_session_store_used_bytes / specdec_session_store_max_bytes > 0.8`,
    `increase(specdec_session_store_full_refusals_total[5m]) > 0`."""

    def __init__(self, store: RedisSessionStore) -> None:
        self.store = store

    def collect(self):
        labels, value, store = ["service"], ["orchestrator"], self.store
        for name, doc, number in (
                ("specdec_session_store_used_bytes", "Memory the session store's Redis uses.", store.used_bytes),
                ("specdec_session_store_max_bytes", "The session store's maxmemory (0: no cap).", store.max_bytes)):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(value, number)
            yield gauge
        refusals = CounterMetricFamily("specdec_session_store_full_refusals",
                                       "Session store writes refused because it was full.", labels=labels)
        refusals.add_metric(value, self.store.full_refusals)
        yield refusals
