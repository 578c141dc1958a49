"""Build and run the orchestrator: check the backends, then serve the public API."""

from __future__ import annotations

import logging
from typing import Sequence

from orchestrator.backends import DraftBackend, TargetBackend
from orchestrator.config import OrchestratorConfig
from orchestrator.generation import Generator
from orchestrator.replicas import DraftPool, TargetPool
from orchestrator.servicer import OrchestratorServicer
from orchestrator.store import RedisSessionStore
from specdec.errors import Unavailable
from specdec.runtime.models import load_tokenizer, tokenizer_fingerprint
from specdec.serving import run_main, serve_servicer, start_metrics
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

log = logging.getLogger("specdec.orchestrator")
SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name


class StartupError(RuntimeError):
    """The orchestrator cannot serve with this configuration; the message says why."""


async def build_generator(config: OrchestratorConfig) -> Generator:
    store = RedisSessionStore(config.redis_url, config.session_ttl_s)
    await store.ping()
    try:
        target = TargetPool(config.target, lambda a: TargetBackend(a, config.target_timeout_s),
                            config.target_retry_s, config.replica_refresh_s)
        draft = DraftPool(config.draft, lambda a: DraftBackend(a, config.draft_timeout_s),
                          config.draft_retry_s, config.replica_refresh_s) if config.draft else None
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    try:
        target_info = await target.start(timeout_s=60.0)
    except Unavailable as exc:
        raise StartupError(f"target service at {config.target} is not reachable: {exc}") from exc
    tokenizer = load_tokenizer(config.model)
    if tokenizer_fingerprint(tokenizer) != target_info.tokenizer_fingerprint:
        raise StartupError(
            f"tokenizer of --model {config.model!r} does not match the target's ({target_info.model!r}); "
            "pass the target's model as --model"
        )
    target.expected_fingerprint = target_info.tokenizer_fingerprint
    await target.refresh()
    if draft is not None:
        try:
            draft_info = await draft.start(timeout_s=60.0)
        except Unavailable as exc:
            raise StartupError(f"draft service at {config.draft} is not reachable: {exc}") from exc
        if draft_info.tokenizer_fingerprint != target_info.tokenizer_fingerprint:
            raise StartupError(
                f"draft model {draft_info.model!r} and target model {target_info.model!r} have different "
                f"tokenizers ({draft_info.tokenizer_fingerprint} vs {target_info.tokenizer_fingerprint}); "
                "speculative decoding needs a draft that shares the target's tokenizer"
            )
        draft.expected_fingerprint = target_info.tokenizer_fingerprint
        await draft.refresh()  # now with the fingerprint: a mismatched replica is left out
        log.info("draft %s: %s (%s, %s)", config.draft, draft_info.model, draft_info.kind, draft_info.dtype)
    log.info("target %s: %s (%s)", config.target, target_info.model, target_info.dtype)
    for pool in (target, draft):
        if pool is not None:
            pool.watch()
    return Generator(config, store, target, draft, tokenizer, target_info)


async def serve(config: OrchestratorConfig) -> None:
    generator = await build_generator(config)
    start_metrics(generator.metrics.registry, config.host, config.metrics_port)
    servicer = OrchestratorServicer(generator)
    await serve_servicer(config.address, lambda s: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, s),
                         SERVICE_NAME, "orchestrator")


def main(argv: Sequence[str] | None = None) -> None:
    run_main(OrchestratorConfig, serve, prog="python -m orchestrator", argv=argv, startup_errors=(StartupError,))
