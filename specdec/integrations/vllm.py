"""specdec's draft pool as vLLM's proposer: `--speculative-config '{"method": "custom_class",
"model": "specdec.integrations.vllm.SpecdecProposer", "num_speculative_tokens": 4}'`.

vLLM (0.32 and later: the "custom_class" method) builds `SpecdecProposer(vllm_config)` in each
engine process and calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)` once per
engine step, after sampling. Each call:

1. matches every row of the batch to the request it held before (`RequestTracker`), learns what
   the last step accepted, and finds the requests that left the batch (finished);
2. chooses each request's draft length `k` with the project's policy (`specdec.core.policy`: the
   measured draft round trip, draft compute, acceptance, and vLLM's own step time as the verify
   cost), 0 where speculation does not pay;
3. makes one `ProposeBatch` call to the draft pool with every request that wants drafts (only
   the tokens the pool has not seen) and the finished requests (their outputs join the shared
   suffix corpus, in the configured corpus group), bounded by a timeout (50 ms by default);
4. returns each row's block: vLLM verifies the tokens as deterministic proposals (greedy drafts,
   no `q`: the custom-class interface takes token ids only), which keeps its output lossless.

Drafting ahead (on by default): the call of step 3 goes out as step 4 returns, for the *next*
step, so the pool drafts while vLLM verifies. Each request's block is sent as its history's guess
(the pool keeps it; the next call rewrites it from the first token vLLM rejected) and one token
more is asked for: the draft's guess of the token vLLM samples after the block. When vLLM accepts
the whole block and samples that token, the next step's block is ready (no call waited for); for a
request whose guess failed, that step makes its own call as in step 3. With a draft model, whose
block takes about as long as vLLM's step and is mostly accepted, this takes the draft's time out
of every step; with suffix speculation it changes little.

With tensor parallelism vLLM builds the proposer on every rank but uses the first rank's drafts:
only that one calls the pool.

A draft pool that is slow, dead or refusing costs a step its drafts (every block empty), never an
error: after a failure the pool is left alone for a short, growing while (`Failover`), then tried
again, and drafting resumes as soon as a replica answers (it asks for the histories it lacks).

Configured from the environment of the vLLM server (vLLM's speculative config takes no keys of
its own for a custom class): `SPECDEC_DRAFT_ADDRESS` (a gRPC target, e.g. `draft:50052` or
`dns:///draft-headless:50052`; required), `SPECDEC_DRAFT_TLS_CA` (a CA bundle: TLS on),
`SPECDEC_DRAFT_TOKEN` (a bearer token), `SPECDEC_DRAFT_TIMEOUT_MS` (50), `SPECDEC_DRAFT_LENGTH`
(`auto`, or a fixed k), `SPECDEC_CORPUS_GROUP` (the corpus group of this server's outputs, ""),
`SPECDEC_SHARE_OUTPUTS` (1: finished outputs join the corpus; 0: never), `SPECDEC_METRICS_PORT`
(the proposer's counters for Prometheus, from the engine process), `SPECDEC_DRAFT_AHEAD` (1: draft
ahead; 0: draft in the step). See docs/vllm.md.

Importing this module needs neither vLLM nor torch: vLLM hands the proposer numpy arrays.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specdec.core.policy import Observation, PolicyConfig, PolicyState, initial_state, merge_prior, step

log = logging.getLogger(__name__)

PREFIX = 64  # prompt tokens a request's identity checks
AHEAD_DEADLINE_S = 30.0  # the gRPC deadline of a call drafting ahead (its wait is bounded by the timeout)
# A step waits for the blocks drafted ahead during it at most this share of vLLM's step (and at least
# AHEAD_WAIT_MIN_S, at most the timeout): a draft held up (behind prompts it prefills, say) costs those
# requests this step's drafts, not every request's step.
AHEAD_WAIT_SHARE = 0.5
AHEAD_WAIT_MIN_S = 0.005
MAX_FINISHED_QUEUED = 1024  # finished outputs waiting for the pool to answer (oldest dropped first)


@dataclass(frozen=True)
class Settings:
    """Where the draft pool is and how to call it (`from_env`: the SPECDEC_* variables)."""

    address: str
    tls_ca: str = ""  # path of a CA bundle (PEM): TLS on
    token: str = ""  # bearer token
    timeout_s: float = 0.05  # the longest a step waits for its drafts
    draft_length: int | None = None  # None: the policy chooses; else a fixed k (capped at vLLM's)
    corpus_group: str = ""
    share_outputs: bool = True
    metrics_port: int | None = None  # serve the proposer's counters for Prometheus on this port
    retry_min_s: float = 0.2  # after a failure, the pool is left alone this long, doubling per failure
    retry_max_s: float = 2.0
    ahead: bool = True  # draft each request's next block during vLLM's step, guessing its verdict

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        address = env.get("SPECDEC_DRAFT_ADDRESS", "")
        if not address:
            raise ValueError("SPECDEC_DRAFT_ADDRESS is not set: the draft pool's gRPC address, e.g. draft:50052")
        length = env.get("SPECDEC_DRAFT_LENGTH", "auto")
        timeout_ms = float(env.get("SPECDEC_DRAFT_TIMEOUT_MS", "50"))
        if not timeout_ms > 0:
            raise ValueError(f"SPECDEC_DRAFT_TIMEOUT_MS={timeout_ms}: must be > 0")
        return cls(address=address, tls_ca=env.get("SPECDEC_DRAFT_TLS_CA", ""),
                   token=env.get("SPECDEC_DRAFT_TOKEN", ""), timeout_s=timeout_ms / 1e3,
                   draft_length=None if length == "auto" else int(length),
                   corpus_group=env.get("SPECDEC_CORPUS_GROUP", ""),
                   share_outputs=env.get("SPECDEC_SHARE_OUTPUTS", "1") not in ("0", "false", "no"),
                   metrics_port=int(env["SPECDEC_METRICS_PORT"]) if env.get("SPECDEC_METRICS_PORT") else None,
                   ahead=env.get("SPECDEC_DRAFT_AHEAD", "1") not in ("0", "false", "no"))


# -- which request a row holds ----------------------------------------------------------------------

@dataclass
class Tracked:
    """A running request as the proposer knows it: its history, what the pool holds of it, its policy."""

    session_id: str
    row: int
    prompt_len: int
    tokens: list[int]
    prefix: np.ndarray  # its first min(prompt_len, PREFIX) tokens: part of its identity
    state: PolicyState
    sent: int = 0  # tokens of its history the pool holds (0: send it whole)
    asked: int = 0  # the k asked for in the last step's call (0: none)
    proposed: int = 0  # tokens that call drafted for it
    draft_compute_s: float = 0.0
    draft_prefill: int = 0  # history tokens that call (re-)prefilled: its compute is no steady draft cost
    warming: bool = False  # that call found the pool prefilling its prompt (no block)
    draft_wall_s: float = 0.0  # how long the step waited for that block
    ahead_base: int = -1  # history length when its block was sent ahead (-1: none in flight)
    ahead_block: list[int] = field(default_factory=list)  # the block sent ahead as its history's guess
    asked_failed: bool = False  # the last step's call failed or was not made (the pool is failing)
    seen: int = 0  # history length when the last step's draft length was chosen
    scheduled: bool = True  # vLLM scheduled it in the last step

    def holds(self, row_tokens: np.ndarray, n: int) -> bool:
        """Whether a row of `n` tokens is this request, `n` no shorter than what it held: same prompt
        prefix, same token where its history ended."""
        known = len(self.tokens)
        return (n >= known and np.array_equal(row_tokens[:len(self.prefix)], self.prefix)
                and int(row_tokens[known - 1]) == self.tokens[-1])


class RequestTracker:
    """Stable identities for the rows vLLM's persistent batch holds (it passes no request ids).

    A request is known by its prompt's first `PREFIX` tokens and its history: at each step a row is
    the request it held last step when its first tokens are that request's prefix and its token
    at that request's last position is the same (its history only grows). vLLM moves requests
    between rows when others finish (its batch is condensed): a row that is not its old request is
    matched against the requests no row claimed yet, then taken as a new request (its prompt: the
    row's tokens less the ones sampled this step). A request no row holds any more has finished (or
    was preempted: its output so far is then learned, and it comes back as a new request). Two
    requests with the same prefix and the same history are indistinguishable, and so is their
    drafting: swapping them changes no block. Session ids are random, never reused.
    """

    def __init__(self, new_state: Callable[[], PolicyState]) -> None:
        self.new_state = new_state
        self.by_row: dict[int, Tracked] = {}
        self.prefix = uuid.uuid4().hex[:12]
        self.counter = itertools.count()

    def step(self, sampled: Sequence[Sequence[int]], num_tokens: np.ndarray,
             token_ids: np.ndarray) -> tuple[list[Tracked | None], list[Tracked]]:
        """(the request of each row, None for a row that sampled nothing; the requests that left)."""
        old, self.by_row = self.by_row, {}
        unclaimed = {id(t): t for t in old.values()}
        rows: list[Tracked | None] = []
        for i, new in enumerate(sampled):
            if not new:
                rows.append(None)
                continue
            n = int(num_tokens[i])
            row = token_ids[i]
            mine = old.get(i)
            if mine is None or id(mine) not in unclaimed or not mine.holds(row, n):
                mine = next((t for t in unclaimed.values() if t.holds(row, n)), None)
            if mine is None:
                mine = self._new(i, row, n, len(new))
            unclaimed.pop(id(mine), None)
            mine.tokens.extend(int(t) for t in row[len(mine.tokens):n])
            mine.row, mine.scheduled = i, True
            self.by_row[i] = mine
            rows.append(mine)
        gone = []
        for t in unclaimed.values():  # still in its row but not scheduled this step: not finished
            if t.row < len(sampled) and t.row not in self.by_row and t.holds(token_ids[t.row], int(num_tokens[t.row])):
                t.scheduled = False
                self.by_row[t.row] = t
            else:
                gone.append(t)
        return rows, gone

    def _new(self, i: int, row: np.ndarray, n: int, sampled: int) -> Tracked:
        prompt_len = max(n - sampled, 1)
        return Tracked(f"vllm-{self.prefix}-{next(self.counter)}", i, prompt_len, [int(t) for t in row[:n]],
                       np.array(row[:min(prompt_len, PREFIX)]), self.new_state())


# -- failover --------------------------------------------------------------------------------------

class Failover:
    """When the pool may be called: always while it answers; after a failure, not for `min_s`, doubling
    per failure in a row up to `max_s`, then once (a probe)."""

    def __init__(self, min_s: float, max_s: float) -> None:
        self.min_s, self.max_s = min_s, max_s
        self.failures = 0
        self.retry_at = 0.0

    def allowed(self, now: float) -> bool:
        return now >= self.retry_at

    def failed(self, now: float) -> None:
        self.failures += 1
        self.retry_at = now + min(self.min_s * 2 ** (self.failures - 1), self.max_s)

    def succeeded(self) -> None:
        self.failures, self.retry_at = 0, 0.0


# -- the pool --------------------------------------------------------------------------------------

class DraftPool:
    """A blocking gRPC client of the draft pool's ProposeBatch (built on first use)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._stub: Any = None  # a DraftServiceStub, once connected

    def _connect(self):
        import grpc

        from specdec.v1 import draft_pb2_grpc

        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20)]
        if self.settings.tls_ca:
            with open(self.settings.tls_ca, "rb") as f:
                credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
            channel = grpc.secure_channel(self.settings.address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(self.settings.address, options=options)
        return draft_pb2_grpc.DraftServiceStub(channel)

    def call(self, entries: list, finished: list):
        """The pool's ProposeBatchResponse; raises (grpc.RpcError) past the timeout or on any failure."""
        return self._stub_for_call().ProposeBatch(self._request(entries, finished), timeout=self.settings.timeout_s,
                                                  metadata=self._metadata())

    def start(self, entries: list, finished: list):
        """The same call, not waited for: a future (`result(timeout)`, `cancel()`). Its own deadline is
        long (AHEAD_DEADLINE_S): the caller bounds its wait when it needs the answer."""
        return self._stub_for_call().ProposeBatch.future(self._request(entries, finished), timeout=AHEAD_DEADLINE_S,
                                                         metadata=self._metadata())

    def _stub_for_call(self):
        if self._stub is None:
            self._stub = self._connect()
        return self._stub

    def _metadata(self):
        return [("authorization", f"Bearer {self.settings.token}")] if self.settings.token else None

    @staticmethod
    def _request(entries: list, finished: list):
        from specdec.v1 import draft_pb2

        return draft_pb2.ProposeBatchRequest(entries=entries, finished=finished)


# -- statistics ------------------------------------------------------------------------------------

@dataclass
class DraftStats:
    """What the proposer measured (`SpecdecProposer.stats`): per step and in total.

    A verdict is read from the next step's history, so the drafts of a request's last step (the
    one it finished at) are drafted but never verified here: short requests undercount
    `accepted` and `verified` (vLLM's own `vllm:spec_decode_*` counters see every verdict)."""

    steps: int = 0
    calls: int = 0
    failures: int = 0
    late: int = 0  # calls drafting ahead given up as not done by the end of vLLM's step (no failure)
    drafted: int = 0  # draft tokens returned to vLLM
    accepted: int = 0  # of those, accepted by vLLM's verification
    verified: int = 0  # draft tokens whose verdict is known
    outputs_shared: int = 0
    draft_wall_s: list[float] = field(default_factory=list)  # the latest calls' wall times (at most 1000)
    step_accepted: int = 0  # the last step's verdicts: accepted of verified draft tokens
    step_verified: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0

    def draft_latency(self, quantile: float) -> float:
        """A quantile of the latest calls' wall times, in seconds (0 before any call)."""
        walls = sorted(self.draft_wall_s)
        return walls[min(int(quantile * len(walls)), len(walls) - 1)] if walls else 0.0

    def summary(self) -> str:
        walls = sorted(self.draft_wall_s)
        p50 = walls[len(walls) // 2] * 1e3 if walls else 0.0
        return (f"specdec drafts: {self.steps} steps, {self.calls} calls ({self.failures} failed, {self.late} late), "
                f"acceptance {self.acceptance:.2f} ({self.accepted}/{self.verified}), draft latency p50 {p50:.1f} ms")


# -- the proposer ----------------------------------------------------------------------------------

class SpecdecProposer:
    """vLLM's proposer (method "custom_class"): drafts from the specdec draft pool, one call a step.

    `vllm_config`: vLLM's `VllmConfig` (its `speculative_config.num_speculative_tokens` caps `k`).
    `settings`, `pool` and `clock` replace the environment, the gRPC client and `time.monotonic`
    (tests)."""

    def __init__(self, vllm_config=None, settings: Settings | None = None, pool: DraftPool | None = None,
                 clock: Callable[[], float] = time.monotonic, k_max: int | None = None) -> None:
        if k_max is None:
            k_max = int(vllm_config.speculative_config.num_speculative_tokens)
        model_config = getattr(vllm_config, "model_config", None)
        self.max_model_len = int(getattr(model_config, "max_model_len", 0) or 0)  # 0: no limit known
        self.active = vllm_config is None or _first_tensor_parallel_rank()
        self.settings = settings or Settings.from_env()
        self.pool = pool or DraftPool(self.settings)
        self.clock = clock
        self.k_max = k_max
        self.policy = PolicyConfig(k_max=k_max)
        self.prior: PolicyState | None = None
        self.tracker = RequestTracker(lambda: initial_state(self.policy, self.prior, k0=min(2, k_max)))
        self.failover = Failover(self.settings.retry_min_s, self.settings.retry_max_s)
        self.finished: deque = deque(maxlen=MAX_FINISHED_QUEUED)
        self.stats = DraftStats()
        self._returned_at: float | None = None
        # The call drafting ahead during vLLM's step: (its future, its requests, the finished sessions
        # it carries); None when none is out.
        self._ahead: tuple[Any, list[Tracked], list] | None = None
        self._logged_at = clock()
        if self.settings.metrics_port is not None and self.active:
            serve_metrics(self.stats, self.settings.metrics_port)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's hook for a drafter with weights: the pool holds any draft model."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None, **_) -> list[list[int]]:
        """Each row's draft tokens (at most `k_max`; empty: no speculation for that row this step)."""
        if not self.active:  # vLLM takes the drafts of the first tensor-parallel rank alone
            return [[] for _ in sampled_token_ids]
        started = self.clock()
        step_s = started - self._returned_at if self._returned_at is not None else 0.0
        rows, gone = self.tracker.step(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        ready = self._collect_ahead(started, step_s)
        self._observe(rows, step_s)
        for t in gone:
            self._finish(t)
        wanted = [t for t in rows if t is not None and t.state.k > 0]
        blocks = {}
        for t in wanted:
            if t.session_id in ready:
                tokens, compute_s, waited = ready[t.session_id]
                blocks[t.session_id] = self._took(t, tokens[:t.state.k], compute_s, waited, 0)
        missing = [t for t in wanted if t.session_id not in blocks]
        if missing or (self.finished and not self.settings.ahead):
            blocks.update(self._draft(missing, self.clock()))
        out = [blocks.get(t.session_id, []) if t is not None else [] for t in rows]
        if self.settings.ahead:
            self._send_ahead([t for t in rows if t is not None and blocks.get(t.session_id)], blocks)
        self.stats.steps += 1
        self.stats.drafted += sum(len(b) for b in out)
        self._returned_at = self.clock()
        if self._returned_at - self._logged_at > 30:
            self._logged_at = self._returned_at
            log.info(self.stats.summary())
        return out

    def _observe(self, rows: list[Tracked | None], step_s: float) -> None:
        """Fold the last step into each request's policy state and choose its next `k`."""
        live = [t for t in rows if t is not None]
        positions = sum(t.proposed + 1 for t in live)
        self.stats.step_accepted = self.stats.step_verified = 0
        for t in live:
            obs = None
            if t.scheduled and (t.asked or t.state.rounds):
                accepted = min(max(len(t.tokens) - t.seen - 1, 0), t.proposed) if t.asked else 0
                self.stats.accepted += accepted
                self.stats.verified += t.proposed
                self.stats.step_accepted += accepted
                self.stats.step_verified += t.proposed
                obs = Observation(k=t.asked, proposed=t.proposed, accepted=accepted,
                                  draft_wall_s=t.draft_wall_s if t.asked else 0.0,
                                  draft_compute_s=min(t.draft_compute_s, t.draft_wall_s) if t.asked else 0.0,
                                  draft_prefill_tokens=t.draft_prefill if t.asked else 0,
                                  verify_wall_s=step_s, verify_compute_s=step_s, draft_failed=t.asked_failed,
                                  batch_size=max(len(live), 1), batch_positions=positions)
            if not t.warming:  # while the pool prefills its prompt, its draft length waits as it was
                k, _, t.state = step(t.state, obs, self.policy)
            if self.settings.draft_length is not None:
                t.state = _with_k(t.state, min(self.settings.draft_length, self.k_max))
            if self.max_model_len and len(t.tokens) + t.state.k >= self.max_model_len:  # no drafts past the context
                t.state = _with_k(t.state, max(self.max_model_len - len(t.tokens) - 1, 0))
            t.asked, t.proposed, t.draft_compute_s, t.draft_prefill, t.asked_failed = 0, 0, 0.0, 0, False
            t.draft_wall_s = 0.0
            t.seen, t.warming = len(t.tokens), False

    def _finish(self, t: Tracked) -> None:
        """A request left the batch: its output may join the corpus; its estimates join the prior."""
        from specdec.v1 import draft_pb2

        self.prior = merge_prior(self.prior, t.state)
        start = t.sent
        self.finished.append(draft_pb2.FinishedSession(
            session_id=t.session_id, start=start, tokens=t.tokens[start:],
            forget_output=not self.settings.share_outputs, output_start=t.prompt_len,
            corpus_group=self.settings.corpus_group))

    def _draft(self, wanted: list[Tracked], now: float) -> dict[str, list[int]]:
        """One bounded call to the pool: {session id: block}; nothing when it is failing or fails."""
        if not self.failover.allowed(now):
            for t in wanted:
                t.asked_failed = True
            return {}
        from specdec.v1 import draft_pb2

        entries = [draft_pb2.BatchEntry(session_id=t.session_id, start=t.sent, tokens=t.tokens[t.sent:],
                                        num_tokens=t.state.k, output_start=t.prompt_len,
                                        corpus_group=self.settings.corpus_group) for t in wanted]
        finished = list(self.finished)
        self.stats.calls += 1
        try:
            reply = self.pool.call(entries, finished)
        except Exception as exc:  # noqa: BLE001 (timeout, unavailable, refused, anything: never an engine error)
            self._pool_failed(exc)
            for t in wanted:
                t.asked, t.asked_failed = t.state.k, True
            return {}
        return self._answered(wanted, finished, reply, now)

    def _pool_failed(self, exc: Exception) -> None:
        """A call that failed: the pool is left alone for a while (`Failover`), the first failure logged."""
        self.stats.failures += 1
        self.failover.failed(self.clock())
        if self.failover.failures == 1:
            log.warning("specdec draft pool at %s failed (%s): no drafts until it answers",
                        self.settings.address, _reason(exc))

    def _pool_answered(self, finished: list, reply, waited: float) -> None:
        """A call that answered after `waited` s: the pool is well, the finished sessions it carried are sent."""
        if self.failover.failures:
            log.info("specdec draft pool at %s answers again", self.settings.address)
        self.failover.succeeded()
        self.stats.draft_wall_s = self.stats.draft_wall_s[-999:] + [waited]
        for _ in finished:
            if self.finished:
                self.finished.popleft()
        self.stats.outputs_shared += reply.outputs_learned

    def _answered(self, wanted: list[Tracked], finished: list, reply, now: float) -> dict[str, list[int]]:
        waited = self.clock() - now
        self._pool_answered(finished, reply, waited)
        blocks: dict[str, list[int]] = {}
        for t, block in zip(wanted, reply.blocks):
            if block.history_missing:
                t.sent = 0  # a replica that lacks it: the whole history next time
                continue
            t.sent = len(t.tokens)
            if block.warming:  # its prompt is being prefilled: no block, and nothing to learn from
                t.warming = True
                continue
            tokens = [int(x) for x in block.token_ids[:t.state.k]]
            blocks[t.session_id] = self._took(t, tokens, block.compute_ns / 1e9, waited, block.prefill_tokens)
        return blocks

    def _took(self, t: Tracked, tokens: list[int], compute_s: float, waited_s: float, prefilled: int) -> list[int]:
        """Record the block a request gets this step (what the next step's verdict is judged against)."""
        t.asked, t.proposed, t.draft_compute_s, t.draft_wall_s = t.state.k, len(tokens), compute_s, waited_s
        t.draft_prefill = prefilled
        return tokens

    # -- drafting ahead ------------------------------------------------------------------------------

    def _send_ahead(self, rows: list[Tracked], blocks: dict[str, list[int]]) -> None:
        """While vLLM verifies this step's blocks, draft each request's next one: after its history and
        its block, as if vLLM accepts the whole block; the first token drafted is the guess of the
        token vLLM samples after it (one more than the request's draft length is asked for). The pool
        keeps the block as the request's history (the next call rewrites it from where the guess failed)."""
        if not rows and not self.finished:
            return
        if not self.failover.allowed(self.clock()):
            return
        from specdec.v1 import draft_pb2

        entries = []
        for t in rows:
            block = blocks[t.session_id]
            entries.append(draft_pb2.BatchEntry(
                session_id=t.session_id, start=t.sent, tokens=t.tokens[t.sent:] + block, num_tokens=min(
                    t.state.k, self.k_max) + 1, output_start=t.prompt_len, corpus_group=self.settings.corpus_group))
            t.ahead_base, t.ahead_block = len(t.tokens), list(block)
        finished = list(self.finished)
        self.stats.calls += 1
        try:
            future = self.pool.start(entries, finished)
        except Exception as exc:  # noqa: BLE001 (never an engine error)
            self._pool_failed(exc)
            _forget_guesses(rows)
            return
        self._ahead = (future, rows, finished)

    def _collect_ahead(self, now: float, step_s: float) -> dict[str, tuple[list[int], float, float]]:
        """The blocks drafted ahead whose guess held: {session id: (tokens, compute s, s waited)}. Every
        request sent ahead gets `sent` set to what the pool now holds of its history. Waited for at
        most AHEAD_WAIT_SHARE of vLLM's step: past that the call is given up (its requests draft in
        the step, resending their history from before the guess), the pool not counted failing."""
        if self._ahead is None:
            return {}
        future, rows, finished = self._ahead
        self._ahead = None
        wait = self.settings.timeout_s
        if step_s > 0:
            wait = min(wait, max(AHEAD_WAIT_MIN_S, AHEAD_WAIT_SHARE * step_s))
        try:
            reply = future.result(timeout=wait)
        except Exception as exc:  # noqa: BLE001 (late, the pool down, anything: this step drafts again)
            future.cancel()
            if _late(exc):
                self.stats.late += 1
            else:
                self._pool_failed(exc)
            _forget_guesses(rows)
            return {}
        waited = self.clock() - now
        self._pool_answered(finished, reply, waited)
        ready = {}
        for t, block in zip(rows, reply.blocks):
            base, guess, t.ahead_base = t.ahead_base, t.ahead_block, -1
            if block.history_missing:
                t.sent = 0
                continue
            new = t.tokens[base:]
            held = next((i for i, (a, b) in enumerate(zip(guess, new)) if a != b), min(len(guess), len(new)))
            t.sent = min(base + held, len(t.tokens))  # the pool's history holds the guess up to there
            tokens = [int(x) for x in block.token_ids]
            if block.warming or held < len(guess) or len(new) != len(guess) + 1 or not tokens or tokens[0] != new[-1]:
                continue  # the guess failed (a draft rejected, another bonus token): drafted again now
            ready[t.session_id] = (tokens[1:], block.compute_ns / 1e9, waited)
        return ready


def serve_metrics(stats: DraftStats, port: int) -> None:
    """Serve `stats` for Prometheus on `port` (all interfaces; 0: a free one) from this engine process."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self):
            for name, help_text, value in (
                    ("steps", "Engine steps the proposer served.", stats.steps),
                    ("draft_calls", "ProposeBatch calls made to the draft pool.", stats.calls),
                    ("draft_failures", "Calls that failed or timed out (their steps had no drafts).", stats.failures),
                    ("draft_late", "Calls drafting ahead not done half a step after vLLM's step ended (their "
                     "requests drafted in the step).", stats.late),
                    ("draft_tokens", "Draft tokens returned to vLLM.", stats.drafted),
                    ("verified_tokens", "Draft tokens whose verdict is known.", stats.verified),
                    ("accepted_tokens", "Draft tokens vLLM accepted.", stats.accepted),
                    ("outputs_shared", "Finished outputs that joined the suffix corpus.", stats.outputs_shared)):
                yield CounterMetricFamily(f"specdec_vllm_{name}", help_text, value=value)
            step = stats.step_accepted / stats.step_verified if stats.step_verified else 0.0
            yield GaugeMetricFamily("specdec_vllm_step_acceptance", "Acceptance of the last step's drafts.", value=step)
            latency = GaugeMetricFamily("specdec_vllm_draft_latency_seconds", "Wall time of the latest draft calls "
                                        "(1000 at most), by quantile.", labels=["quantile"])
            for q in (0.5, 0.9, 0.99):
                latency.add_metric([str(q)], stats.draft_latency(q))
            yield latency

    registry = CollectorRegistry()
    registry.register(Collector())
    start_http_server(port, registry=registry)


def _first_tensor_parallel_rank() -> bool:
    """Whether this engine process is its tensor-parallel group's first rank: vLLM builds the proposer
    on every rank of the last pipeline stage but takes the drafts of the first alone, so the others
    neither call the pool nor report finished outputs (which would count them once per rank)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore[import-not-found]

        return get_tensor_model_parallel_rank() == 0
    except Exception:  # noqa: BLE001 (no vLLM, or no group yet: a single process)
        return True


def _with_k(state: PolicyState, k: int) -> PolicyState:
    from dataclasses import replace

    return replace(state, k=k)


def _forget_guesses(rows: list[Tracked]) -> None:
    """Requests whose call drafting ahead was given up: whether the pool kept their guesses is unknown,
    so each resends its history from before its guess."""
    for t in rows:
        if t.ahead_base >= 0:
            t.sent = min(t.sent, t.ahead_base)
        t.ahead_base = -1


def _late(exc: Exception) -> bool:
    """Whether a wait for a gRPC future ended because it was not done in time."""
    import grpc

    return isinstance(exc, grpc.FutureTimeoutError)


def _reason(exc: Exception) -> str:
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    return f"{code().name}: {details()}" if callable(code) and callable(details) else repr(exc)

