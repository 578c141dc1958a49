"""Build and run the draft service."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import redis
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from draft_service.config import DraftConfig
from draft_service.registry import DraftHost, build_proposer
from draft_service.servicer import DraftServicer
from specdec.keys import suffix_outputs_key
from specdec.runtime.batch_drafting import BatchDrafter, OutputSink
from specdec.runtime.drafting import Drafter, Proposer
from specdec.server.metrics import ServiceMetrics
from specdec.server.model_service import serve_model_service
from specdec.server.redis import RedisSettings, connect
from specdec.server.serving import run_main
from specdec.v1 import draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name

log = logging.getLogger(__name__)
SHARED_OUTPUTS_MAXLEN = 20_000  # as the orchestrator's stream of finished outputs (oldest go first)


def redis_password(url: str) -> dict[str, str]:
    """$REDIS_PASSWORD as the password of `url` when the URL carries none (a Kubernetes Secret fills the
    variable; a password in argv would show in `ps` and in the pod spec)."""
    if redis.connection.parse_url(url).get("password") is None and os.environ.get("REDIS_PASSWORD"):
        return {"password": os.environ["REDIS_PASSWORD"]}
    return {}


class SuffixStreamReader:
    """Feeds a proposer's corpus of outputs (`Proposer.add_output`: suffix speculation) from the shared
    Redis stream of finished outputs.

    A daemon thread: first the newest `backlog` entries, then XREAD blocking (1 s at a time) for
    new ones. Each entry's `tokens` field holds uint32 little-endian ids (`encode_output`), its
    optional `group` field the corpus group it joins; an entry that cannot be used (malformed, of
    another tokenizer, empty, or holding an id outside [0, `vocab_size`)) is skipped and counted in
    `skipped` by reason (`specdec.core.suffix.decode_entry`), and reading goes on. Redis going away
    is logged and retried, and so is anything unexpected; the proposer keeps what it has.
    """

    def __init__(self, proposer: Proposer, redis_at: RedisSettings, fingerprint: str, backlog: int = 1000,
                 vocab_size: int | None = None) -> None:
        from specdec.core.suffix import SKIP_REASONS

        self.proposer = proposer
        self.redis_at = redis_at
        self.fingerprint = fingerprint
        self.backlog = backlog
        self.vocab_size = vocab_size
        self.entries = 0  # entries added to the corpus
        self.skipped: dict[str, int] = dict.fromkeys(SKIP_REASONS, 0)  # entries skipped, by reason
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="suffix-stream", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        key = suffix_outputs_key()
        client = connect(self.redis_at)
        where = self.redis_at.where  # never a password
        last, reading = None, False
        while not self._stop.is_set():
            try:
                if last is None:
                    backlog = client.xrevrange(key, count=self.backlog) if self.backlog else []
                    last = backlog[0][0] if backlog else client.xinfo_stream(key)["last-generated-id"]
                    for _, fields in reversed(backlog):
                        self._add(fields)
                new = client.xread({key: last}, block=1000, count=256)
                if not reading:  # the first round trip that got through (connected, authenticated)
                    reading = True
                    log.info("suffix corpus: reading finished outputs from %s (%d from its backlog)", where,
                             self.entries)
                for _, entries in new or []:
                    for entry_id, fields in entries:
                        last = entry_id
                        self._add(fields)
            except redis.ResponseError:  # no stream yet: start from its beginning once it exists
                last = b"0-0"
            except redis.RedisError as exc:
                log.warning("suffix outputs stream (%s): %s; retrying", where, exc)
                self._stop.wait(1.0)
            except Exception:  # never a silent end: the corpus would stop learning for good
                log.exception("suffix outputs stream (%s): unexpected error; retrying", where)
                self._stop.wait(1.0)

    def _add(self, fields: dict[bytes, bytes]) -> None:
        from specdec.core.suffix import SkippedEntry, decode_entry

        try:
            entry = decode_entry(fields, self.fingerprint, self.vocab_size)
        except SkippedEntry as exc:
            if exc.reason != "other_tokenizer":  # another tokenizer's replicas may share the stream
                level = logging.WARNING if not self.skipped[exc.reason] else logging.DEBUG  # the first of each kind
                log.log(level, "suffix outputs stream: entry skipped (%s); counted in "
                        "specdec_suffix_stream_skipped_total", exc)
            self.skipped[exc.reason] += 1
            return
        self.proposer.add_output(entry.tokens, entry.group)
        self.entries += 1


class SuffixStreamCollector(Collector):
    """The reader's counts for /metrics: entries added to the corpus, and entries skipped by reason."""

    def __init__(self, service: str, reader: SuffixStreamReader) -> None:
        self.service, self.reader = service, reader

    def collect(self):
        added = CounterMetricFamily("specdec_suffix_stream_entries", "Outputs stream entries added to the "
                                    "suffix corpus.", labels=["service"])
        added.add_metric([self.service], self.reader.entries)
        skipped = CounterMetricFamily("specdec_suffix_stream_skipped", "Outputs stream entries skipped: malformed, "
                                      "of another tokenizer, holding an id outside the vocabulary, or empty.",
                                      labels=["service", "reason"])
        for reason, count in self.reader.skipped.items():
            skipped.add_metric([self.service, reason], count)
        yield added
        yield skipped


def output_sink(config: DraftConfig, proposer: Proposer, fingerprint: str) -> OutputSink | None:
    """Where the outputs of finished batched sessions go (`ProposeBatch`): the shared stream of finished
    outputs when this replica reads one (every replica learns them, this one through its reader), else
    this proposer's own corpus; None for a proposer without a corpus."""
    if not proposer.learns_outputs:
        return None
    if not config.suffix_redis_url:
        return proposer.add_output
    client = connect(config.redis_settings(config.suffix_redis_url))

    def publish(tokens: list[int], group: str) -> None:
        from specdec.core.suffix import FINGERPRINT_FIELD, encode_entry

        fields = {**encode_entry(tokens, group), FINGERPRINT_FIELD: fingerprint.encode()}
        try:
            client.xadd(suffix_outputs_key(), fields, maxlen=SHARED_OUTPUTS_MAXLEN, approximate=True)
        except redis.RedisError as exc:  # the corpus misses one output; drafting goes on
            log.warning("suffix outputs stream: an output was not published: %s", exc)

    return publish


# A batched call's session first seen with a longer history than this has its prompt prefilled by a
# draft model in the background (specdec.runtime.batch_drafting): a few passes' worth of tokens.
WARM_TOKENS = 16


def build_servicer(config: DraftConfig) -> tuple[DraftServicer, ServiceMetrics]:
    """Build the configured proposer (its model, if it has one, loaded and batched on one thread), admission and
    metrics (call inside the event loop)."""
    host = DraftHost(config)
    proposer = build_proposer(config, host)
    info, grammars = host.info(config.proposer, proposer)
    drafter = Drafter(proposer, info.tokenizer_fingerprint, info.model, grammars=grammars)
    batched = BatchDrafter(drafter, output_sink(config, proposer, info.tokenizer_fingerprint),
                           warm_tokens=WARM_TOKENS if host.batcher_if_loaded is not None else None)
    return DraftServicer(drafter, info, host.admission, host.batcher_if_loaded, batched), host.metrics


async def serve(config: DraftConfig) -> None:
    servicer, metrics = build_servicer(config)
    info, proposer = servicer.info, servicer.drafter.proposer
    reader = None
    if config.suffix_redis_url and proposer.learns_outputs:  # every finished output joins the corpus
        reader = SuffixStreamReader(proposer, config.redis_settings(config.suffix_redis_url),
                                    info.tokenizer_fingerprint, config.suffix_backlog,
                                    vocab_size=info.vocab_size or None)
        metrics.registry.register(SuffixStreamCollector("draft", reader))
        reader.start()
        info.reads_shared_outputs = True  # orchestrators publish finished outputs only for drafts that read them
    try:
        await serve_model_service(config, servicer, metrics,
                                  lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s),
                                  SERVICE_NAME, f"draft service ({info.kind}, {info.model} {info.dtype})")
    finally:
        if reader is not None:
            reader.stop()


def main(argv: Sequence[str] | None = None) -> None:
    run_main(DraftConfig, serve, prog="python -m draft_service", argv=argv)
