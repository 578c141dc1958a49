"""Build and run the draft service."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import redis

from draft_service.config import DraftConfig
from draft_service.registry import DraftHost, build_proposer
from draft_service.servicer import DraftServicer
from specdec.keys import suffix_outputs_key
from specdec.runtime.drafting import Drafter, Proposer
from specdec.server.metrics import ServiceMetrics
from specdec.server.model_service import serve_model_service
from specdec.server.redis import RedisSettings, connect
from specdec.server.serving import run_main
from specdec.v1 import draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name

log = logging.getLogger(__name__)


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
    new ones. Each entry's `tokens` field holds uint32 little-endian ids (`encode_output`); an
    entry whose optional `tokenizer` field names another tokenizer is skipped. Redis going away
    is logged and retried; the proposer keeps what it has.
    """

    def __init__(self, proposer: Proposer, url: str, fingerprint: str, backlog: int = 1000) -> None:
        self.proposer = proposer
        self.url = url
        self.fingerprint = fingerprint
        self.backlog = backlog
        self.entries = 0  # entries added to the corpus
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="suffix-stream", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        key = suffix_outputs_key()
        client = connect(RedisSettings.from_url(self.url))
        where = self.url.rsplit("@", 1)[-1].split("//")[-1]  # host:port/db, never a password
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
                        self._add(fields)
                        last = entry_id
            except redis.ResponseError:  # no stream yet: start from its beginning once it exists
                last = b"0-0"
            except redis.RedisError as exc:
                log.warning("suffix outputs stream at %s: %s; retrying", where, exc)
                self._stop.wait(1.0)

    def _add(self, fields: dict[bytes, bytes]) -> None:
        from specdec.core.suffix import FINGERPRINT_FIELD, OUTPUT_FIELD, decode_output

        fingerprint = fields.get(FINGERPRINT_FIELD, b"").decode()
        if fingerprint and fingerprint != self.fingerprint:
            return
        try:
            tokens = decode_output(fields.get(OUTPUT_FIELD, b""))
        except ValueError as exc:
            log.warning("suffix outputs stream: entry skipped: %s", exc)
            return
        self.proposer.add_output(tokens)
        self.entries += 1


def build_servicer(config: DraftConfig) -> tuple[DraftServicer, ServiceMetrics]:
    """Build the configured proposer (its model, if it has one, loaded and batched on one thread), admission and
    metrics (call inside the event loop)."""
    host = DraftHost(config)
    proposer = build_proposer(config, host)
    info, grammars = host.info(config.proposer, proposer)
    drafter = Drafter(proposer, info.tokenizer_fingerprint, info.model, grammars=grammars)
    return DraftServicer(drafter, info, host.admission, host.batcher_if_loaded), host.metrics


async def serve(config: DraftConfig) -> None:
    servicer, metrics = build_servicer(config)
    info, proposer = servicer.info, servicer.drafter.proposer
    reader = None
    if config.suffix_redis_url and proposer.learns_outputs:  # every finished output joins the corpus
        reader = SuffixStreamReader(proposer, config.suffix_redis_url, info.tokenizer_fingerprint,
                                    config.suffix_backlog)
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
