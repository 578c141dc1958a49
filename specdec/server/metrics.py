"""Prometheus metrics, named as users know them from vLLM (`spec_decode_*`, TTFT, ITL, TPOT).

Every process has its own `CollectorRegistry` (no module-level globals), served over HTTP on
`--metrics-port` by `serve_metrics`. Every metric carries a `service` label (`target`, `draft`
or `orchestrator`).

Model services (`ServiceMetrics`):

- `specdec_batch_size` (histogram): jobs per batched forward pass.
- `specdec_queue_wait_seconds` (histogram): submission to first step of a request.
- `specdec_compute_seconds` (histogram): one batched step (forward pass + per-job logic).
- `specdec_num_requests_running`, `specdec_num_requests_waiting` (gauges): in a batch / queued
  (admission queue plus batch queue).
- `specdec_kv_cache_sessions`, `specdec_kv_cache_tokens` (gauges): session caches held and the
  tokens they cover; both return to 0 once every session is released.
- `specdec_kv_cache_used_bytes`, `specdec_kv_cache_free_bytes`, `specdec_kv_cache_usage_ratio`
  (gauges): keys/values held (own buffers and shared prefixes) against the `--kv-cache-bytes`
  budget (as vLLM's `kv_cache_usage_perc`); `specdec_kv_cache_evictions_total` (counter):
  sessions evicted for room.
- `specdec_prefix_cache_queries_total`, `specdec_prefix_cache_hits_total` (counters, tokens, as
  vLLM's), `specdec_prefix_cache_blocks`, `specdec_prefix_cache_shared_blocks` (gauges).
- `specdec_admission_rejections_total` (counter): RESOURCE_EXHAUSTED refusals.
- `specdec_requests_dropped_total{reason="deadline"|"cancelled"}` (counter): dropped before compute.

Orchestrator (`OrchestratorMetrics`; the orchestrator feeds it each round's `SpecDecodingStats`
through `observe_round`, the same object GetStatus's counters read, and calls a `RequestTimer`'s
`observe_chunk` / `observe_finish`):

- `specdec_time_to_first_token_seconds`, `specdec_inter_token_latency_seconds` (between
  streamed chunks: one round, 1..k+1 tokens), `specdec_time_per_output_token_seconds`
  (`(e2e - ttft) / (tokens - 1)`), `specdec_e2e_request_latency_seconds` (histograms).
- `specdec_spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
  `..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total{position}` (counters).
- `specdec_spec_decode_num_drafts_by_source_total{source}`,
  `..._num_draft_tokens_by_source_total{source}`, `..._num_accepted_tokens_by_source_total{source}`
  (counters): the same by the proposer that drafted the block (`model`, `ngram`, `suffix`;
  `unspecified` from a draft service that does not say): a hybrid draft's two sources apart.
- `specdec_spec_decode_draft_length` (histogram): the k chosen each round.
- `specdec_round_trip_seconds{backend}`, `specdec_backend_compute_seconds{backend}`
  (histograms): a call's wall time minus the compute the service reports, and that compute.
- `specdec_round_part_seconds{part}` (histogram): a round's time outside the model, by part
  (`target_rpc`, `target_queue`, `between`, `save`, `detokenize`; `bench/round_overhead.py`).
- `specdec_num_requests_running`, `specdec_num_requests_waiting` (gauges),
  `specdec_request_success_total{finish_reason}`, `specdec_prompt_tokens_total`,
  `specdec_generation_tokens_total`, `specdec_draft_fallbacks_total`, and with
  `track_admission(admission)` `specdec_admission_rejections_total` and
  `specdec_requests_dropped_total{reason}` (counters).

Useful PromQL::

    # mean acceptance rate and mean accepted tokens per draft
    rate(specdec_spec_decode_num_accepted_tokens_total[1m]) / rate(specdec_spec_decode_num_draft_tokens_total[1m])
    1 + rate(specdec_spec_decode_num_accepted_tokens_total[1m]) / rate(specdec_spec_decode_num_drafts_total[1m])
    # acceptance rate of each draft source (a hybrid draft: model and suffix speculation apart)
    sum by (source) (rate(specdec_spec_decode_num_accepted_tokens_by_source_total[1m]))
      / sum by (source) (rate(specdec_spec_decode_num_draft_tokens_by_source_total[1m]))
    # acceptance at draft position 2 (0-based) relative to drafts
    rate(specdec_spec_decode_num_accepted_tokens_per_pos_total{position="2"}[1m])
      / rate(specdec_spec_decode_num_drafts_total[1m])
    # p90 time per output token, mean batch size of the target
    histogram_quantile(0.9, rate(specdec_time_per_output_token_seconds_bucket[5m]))
    rate(specdec_batch_size_sum{service="target"}[1m]) / rate(specdec_batch_size_count{service="target"}[1m])
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specdec.errors import CANCELLATIONS

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
PART_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)  # a round's parts
DRAFT_LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[int, Callable[[], None]]:
    """Serve `registry` at http://host:port/metrics in a daemon thread; port 0 picks a free one.

    Returns the bound port and a function that stops the server.
    """
    server, thread = start_http_server(port, addr=host, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return server.server_port, stop


class ServiceMetrics:
    """The metrics of a draft or target service; also the batcher's observer (`BatchObserver` hooks)."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = registry if registry is not None else CollectorRegistry()
        r, labels = self.registry, ["service"]
        self.batch_size = Histogram("specdec_batch_size", "Jobs per batched forward pass.", labels,
                                    buckets=BATCH_BUCKETS, registry=r).labels(service)
        self.queue_wait = Histogram("specdec_queue_wait_seconds", "Time from submission to a request's first step.",
                                    labels, buckets=LATENCY_BUCKETS, registry=r).labels(service)
        self.compute = Histogram("specdec_compute_seconds",
                                 "Time of one batched step (forward pass and per-job logic).",
                                 labels, buckets=LATENCY_BUCKETS, registry=r).labels(service)
        self.running = Gauge("specdec_num_requests_running", "Requests in a running batch.", labels,
                             registry=r).labels(service)
        self.waiting = Gauge("specdec_num_requests_waiting", "Requests queued (admission and batch queues).", labels,
                             registry=r).labels(service)
        self.kv_sessions = Gauge("specdec_kv_cache_sessions", "Session KV caches held.", labels,
                                 registry=r).labels(service)
        self.kv_tokens = Gauge("specdec_kv_cache_tokens", "Tokens covered by the session KV caches held.", labels,
                               registry=r).labels(service)
        self.rejections = Counter("specdec_admission_rejections", "Requests refused with RESOURCE_EXHAUSTED.", labels,
                                  registry=r).labels(service)
        self._dropped = Counter("specdec_requests_dropped", "Requests dropped before compute.", ["service", "reason"],
                                registry=r)
        for reason in ("deadline", "cancelled"):
            self._dropped.labels(service, reason)  # exported at 0 from the start

    def track(self, running: Callable[[], float], waiting: Callable[[], float],
              kv_sessions: Callable[[], float], kv_tokens: Callable[[], float]) -> None:
        """Read the gauges from these callbacks at every scrape."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.kv_sessions.set_function(kv_sessions)
        self.kv_tokens.set_function(kv_tokens)

    def track_ahead(self, ahead) -> None:
        """Export the rounds a target verified ahead (`target_service.ahead.DecodeAhead`) at every scrape."""
        self.registry.register(_AheadCollector(self.service, ahead))

    def track_kv(self, caches) -> None:
        """Export the KV memory and prefix cache figures of `caches` (a `SessionCaches`) at every scrape."""
        self.registry.register(_KVCollector(self.service, caches))

    # -- specdec.runtime.batching.BatchObserver hooks ---------------------------------------------

    def on_step(self, batch_size: int, compute_s: float) -> None:
        self.batch_size.observe(batch_size)
        self.compute.observe(compute_s)

    def on_start(self, queue_s: float) -> None:
        self.queue_wait.observe(queue_s)

    def on_dropped(self, reason: str) -> None:
        self._dropped.labels(self.service, reason).inc()

    def on_reject(self) -> None:
        self.rejections.inc()


class RequestTimer:
    """Latency metrics of one generation request (create with `OrchestratorMetrics.start_request`)."""

    def __init__(self, metrics: OrchestratorMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first_s: float | None = None  # time to the first chunk
        self.last = self.start
        self.finished = False
        metrics._started()

    def observe_chunk(self, n_tokens: int) -> None:
        """A chunk of `n_tokens` new tokens was sent to the client (call once per chunk)."""
        if n_tokens <= 0:
            return
        now = time.perf_counter()
        if self.first_s is None:
            self.first_s = now - self.start
            self.metrics.ttft.observe(self.first_s)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def observe_finish(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        """The request ended; once only. `finish_reason` is the label as OpenAI and vLLM name it: stop
        (an end-of-sequence token or a stop string), length, cancelled, error."""
        if self.finished:
            return
        self.finished = True
        m = self.metrics
        e2e = time.perf_counter() - self.start
        m.e2e.observe(e2e)
        if completion_tokens > 1 and self.first_s is not None:
            m.tpot.observe((e2e - self.first_s) / (completion_tokens - 1))
        m.requests.labels(m.service, finish_reason).inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(completion_tokens)
        m._finished()

    def __enter__(self) -> RequestTimer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.finished:  # left without observe_finish: an error or a cancellation
            # A client that leaves shows as a cancelled task, or as a stream closed at a yield.
            reason = "cancelled" if exc_type is not None and issubclass(exc_type, CANCELLATIONS) else "error"
            self.observe_finish(reason, 0, 0)


@dataclass(frozen=True)
class SpecDecodingStats:
    """What one speculative round adds to the orchestrator's counters: built once per round and read
    by every sink (the Prometheus counters of `OrchestratorMetrics.observe_round`, GetStatus's of
    `orchestrator.status.Counters.observe_round`), as vLLM's spec-decode metrics do.

    A *draft* is a round that proposed tokens; its *accepted* tokens are the draft tokens the target
    kept; `num_emitted_tokens` are the tokens the round added to the output (the accepted ones and
    the target's own, cut at a stop condition).
    """

    draft_length: int = 0  # k asked for
    num_draft_tokens: int = 0  # proposed (may be fewer than k)
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    source: str = ""  # the source that drafted the block ("model", "ngram", "suffix"; "" unknown or none)
    fallback: bool = False  # the draft failed: the round ran at k = 0
    draft_ns: int = 0  # the draft call's wall time, and the compute the draft reported
    draft_compute_ns: int = 0
    verify_ns: int = 0  # the verify call's
    verify_compute_ns: int = 0
    verify_queue_ns: int = 0  # of verify_ns: waited in the target's queues
    between_ns: int = 0  # the orchestrator's time between rounds (RoundStats.between_ns)
    save_ns: int = 0  # the round's session save
    detokenize_ns: int = 0  # detokenizing its tokens

    @classmethod
    def of_round(cls, stats, emitted: int, source: str = "") -> SpecDecodingStats:
        """From a round's `specdec.v1.orchestrator_pb2.RoundStats` and the tokens it emitted."""
        return cls(stats.draft_length, stats.proposed, stats.accepted, emitted, source, stats.draft_fallback,
                   stats.draft_ns, stats.draft_compute_ns, stats.verify_ns, stats.verify_compute_ns,
                   stats.verify_queue_ns, stats.between_ns, stats.save_ns, stats.detokenize_ns)

    @property
    def num_drafts(self) -> int:
        return 1 if self.num_draft_tokens > 0 else 0


class OrchestratorMetrics:
    """The orchestrator's metrics. Feed `observe_round` each round's stats and time each request::

        with metrics.start_request() as timer:
            ...
            metrics.observe_round(SpecDecodingStats.of_round(chunk.round, len(chunk.token_ids)))
            timer.observe_chunk(len(chunk.token_ids))
            ...
            timer.observe_finish("length", prompt_tokens, completion_tokens)
    """

    service = "orchestrator"

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, s = self.registry, self.service

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, ["service"], buckets=buckets, registry=r).labels(s)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["service"], registry=r).labels(s)

        self.ttft = histogram("specdec_time_to_first_token_seconds", "Time to the first generated token.")
        self.itl = histogram("specdec_inter_token_latency_seconds",
                             "Time between consecutive streamed chunks (one round: 1..k+1 tokens).")
        self.tpot = histogram("specdec_time_per_output_token_seconds",
                              "Per request: (e2e latency - time to first token) / (output tokens - 1).")
        self.e2e = histogram("specdec_e2e_request_latency_seconds", "End-to-end latency of a request.")
        self.num_drafts = counter("specdec_spec_decode_num_drafts", "Rounds in which draft tokens were proposed.")
        self.num_draft_tokens = counter("specdec_spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._accepted_per_pos = Counter("specdec_spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by 0-based position in the block.",
                                         ["service", "position"], registry=r)
        by_source = ["service", "source"]
        self._drafts_by_source = Counter("specdec_spec_decode_num_drafts_by_source",
                                         "Rounds in which draft tokens were proposed, by draft source.", by_source,
                                         registry=r)
        self._draft_tokens_by_source = Counter("specdec_spec_decode_num_draft_tokens_by_source",
                                               "Draft tokens proposed, by draft source.", by_source, registry=r)
        self._accepted_by_source = Counter("specdec_spec_decode_num_accepted_tokens_by_source",
                                           "Draft tokens accepted, by draft source.", by_source, registry=r)
        self.draft_length = histogram("specdec_spec_decode_draft_length", "Draft length k chosen for a round.",
                                      DRAFT_LENGTH_BUCKETS)
        self._round_trip = Histogram("specdec_round_trip_seconds",
                                     "Call wall time minus the compute time the service reports.",
                                     ["service", "backend"], buckets=LATENCY_BUCKETS, registry=r)
        self._compute = Histogram("specdec_backend_compute_seconds", "Compute time a backend reports for a call.",
                                  ["service", "backend"], buckets=LATENCY_BUCKETS, registry=r)
        self._round_part = Histogram(
            "specdec_round_part_seconds",
            "A round's time outside the model, by part: target_rpc (verify wall time minus the target's queue and "
            "compute), target_queue (waited in the target service before its pass), between (the orchestrator's "
            "time between one round's verify and the next round's calls), save (the round's session save) and "
            "detokenize (its text and stop strings).", ["service", "part"], buckets=PART_BUCKETS, registry=r)
        self.fallbacks = counter("specdec_draft_fallbacks", "Rounds run at k = 0 because the draft failed.")
        self.requests = Counter("specdec_request_success", "Finished requests by finish reason.",
                                ["service", "finish_reason"], registry=r)
        self.prompt_tokens = counter("specdec_prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("specdec_generation_tokens", "Tokens generated by finished requests.")
        self.running = Gauge("specdec_num_requests_running", "Generation requests in progress.", ["service"],
                             registry=r).labels(s)
        self.waiting = Gauge("specdec_num_requests_waiting", "Generation requests queued for admission.", ["service"],
                             registry=r).labels(s)
        self.rejections = counter("specdec_admission_rejections", "Requests refused with RESOURCE_EXHAUSTED.")
        self._dropped = Counter("specdec_requests_dropped", "Requests dropped while queued for admission.",
                                ["service", "reason"], registry=r)
        self._lock = threading.Lock()
        self._active = 0
        self.running.set_function(lambda: self._active)
        self.waiting.set(0)

    def track_admission(self, admission) -> None:
        """Read running/waiting from a `specdec.server.admission.Admission` (and count its refusals and drops)."""
        self.running.set_function(lambda: admission.running)
        self.waiting.set_function(lambda: admission.waiting)
        admission.observer = self

    def on_reject(self) -> None:
        self.rejections.inc()

    def on_dropped(self, reason: str) -> None:
        self._dropped.labels(self.service, reason).inc()

    def start_request(self) -> RequestTimer:
        return RequestTimer(self)

    def observe_round(self, stats: SpecDecodingStats) -> None:
        """The Prometheus sink of one round's stats."""
        self.draft_length.observe(stats.draft_length)
        if stats.fallback:
            self.fallbacks.inc()
        if stats.num_drafts:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(stats.num_draft_tokens)
            self.num_accepted_tokens.inc(stats.num_accepted_tokens)
            for position in range(stats.num_accepted_tokens):
                self._accepted_per_pos.labels(self.service, str(position)).inc()
            label = stats.source or "unspecified"
            self._drafts_by_source.labels(self.service, label).inc()
            self._draft_tokens_by_source.labels(self.service, label).inc(stats.num_draft_tokens)
            self._accepted_by_source.labels(self.service, label).inc(stats.num_accepted_tokens)
        if stats.draft_ns > 0:
            self._observe_call("draft", stats.draft_ns, stats.draft_compute_ns)
        if stats.verify_ns > 0:
            self._observe_call("target", stats.verify_ns, stats.verify_compute_ns)
            rpc_ns = stats.verify_ns - stats.verify_compute_ns - stats.verify_queue_ns
            for part, ns in (("target_rpc", rpc_ns), ("target_queue", stats.verify_queue_ns),
                             ("between", stats.between_ns), ("save", stats.save_ns),
                             ("detokenize", stats.detokenize_ns)):
                self._round_part.labels(self.service, part).observe(max(0, ns) / 1e9)

    def _observe_call(self, backend: str, wall_ns: int, compute_ns: int) -> None:
        self._round_trip.labels(self.service, backend).observe(max(0, wall_ns - compute_ns) / 1e9)
        self._compute.labels(self.service, backend).observe(compute_ns / 1e9)

    def _started(self) -> None:
        with self._lock:
            self._active += 1

    def _finished(self) -> None:
        with self._lock:
            self._active -= 1


class _AheadCollector(Collector):
    """Reads a `DecodeAhead`'s counts of rounds verified ahead, by what came of them."""

    def __init__(self, service: str, ahead) -> None:
        self.service, self.ahead = service, ahead

    def collect(self):
        metric = CounterMetricFamily("specdec_verified_ahead", "Rounds verified before their request came "
                                     "(VerifyRequest.continues): used to answer it, used to answer a greedy block "
                                     "whose first draft token the guess refuted, or dropped.",
                                     labels=["service", "outcome"])
        metric.add_metric([self.service, "used"], self.ahead.used)
        metric.add_metric([self.service, "refuted"], self.ahead.refuted)
        metric.add_metric([self.service, "dropped"], self.ahead.dropped)
        yield metric


class _KVCollector(Collector):
    """Reads a `SessionCaches`' memory and prefix cache figures at scrape time (plain attribute
    reads: no lock, a scrape never waits for a forward pass)."""

    def __init__(self, service: str, caches) -> None:
        self.service, self.caches = service, caches

    def collect(self):
        caches, labels = self.caches, [self.service]
        used, budget = caches.used_bytes, caches.budget_bytes
        figures = [
            (GaugeMetricFamily, "specdec_kv_cache_used_bytes", "Bytes of keys/values held.", used),
            (GaugeMetricFamily, "specdec_kv_cache_free_bytes", "Bytes of the KV budget not held.",
             max(0, budget - used)),
            (GaugeMetricFamily, "specdec_kv_cache_usage_ratio", "KV bytes held over the budget.",
             used / max(1, budget)),
            (CounterMetricFamily, "specdec_kv_cache_evictions", "Sessions evicted for room.", caches.evictions),
        ]
        prefix = caches.prefix
        if prefix is not None:
            figures += [
                (CounterMetricFamily, "specdec_prefix_cache_queries", "Tokens looked up in the prefix cache.",
                 prefix.queries),
                (CounterMetricFamily, "specdec_prefix_cache_hits", "Tokens found in the prefix cache.", prefix.hits),
                (GaugeMetricFamily, "specdec_prefix_cache_blocks", "Prefix blocks held.", prefix.blocks),
                (GaugeMetricFamily, "specdec_prefix_cache_shared_blocks", "Prefix blocks viewed by 2+ sessions.",
                 prefix.shared_blocks),
            ]
        for family, name, help_text, value in figures:
            metric = family(name, help_text, labels=["service"])
            metric.add_metric(labels, value)
            yield metric
        rejected = getattr(caches, "rejected", {})
        if rejected:
            metric = CounterMetricFamily("specdec_kv_rejected", "Entries read from Redis (KV snapshots, prefix "
                                         "blocks) that were malformed, by source; each was deleted.",
                                         labels=["service", "source"])
            for source, count in sorted(rejected.items()):
                metric.add_metric([self.service, source], count)
            yield metric
