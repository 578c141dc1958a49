"""Build and run the orchestrator: check the backends, then serve the public API."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from orchestrator.backends import DraftBackend, TargetBackend
from orchestrator.config import OrchestratorConfig
from orchestrator.discovery import locality_from_env
from orchestrator.generation import Orchestrator
from orchestrator.replicas import DraftPool, TargetPool
from orchestrator.servicer import OrchestratorServicer
from orchestrator.store import RedisSessionStore, SessionStoreMetrics
from specdec.errors import Unavailable
from specdec.runtime.models import load_tokenizer, tokenizer_fingerprint
from specdec.server import tracing
from specdec.server.auth import AuthInterceptor, Tokens
from specdec.server.interceptors import DecodeGuard
from specdec.server.limits import ConcurrencyLimit, PerIdentityLimit, PerIdentityRate, RateLimit
from specdec.server.serving import StartupError, run_main, serve_servicer, start_metrics
from specdec.server.tls import ClientTLS, server_credentials_of
from specdec.server.tracing import ServerTracing
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

log = logging.getLogger("specdec.orchestrator")
SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name


def session_store(config: OrchestratorConfig) -> RedisSessionStore:
    """The session store in the configured Redis mode: one Redis, a cluster, or behind sentinels."""
    try:
        settings = config.session_redis()
    except ValueError as exc:  # e.g. TLS files for a plain redis:// URL
        raise StartupError(str(exc)) from exc
    return RedisSessionStore(settings, config.session_ttl_s, failover_s=config.redis_failover_s)


def backend_tls(config: OrchestratorConfig) -> ClientTLS | None:
    tls = ClientTLS(config.backend_tls_ca, config.backend_tls_cert, config.backend_tls_key,
                    config.backend_tls_server_name, flag="--backend-tls")
    if not tls.enabled:
        return None
    try:
        tls.credentials()  # read the files now: a wrong path fails the start, not the first call
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    return tls


async def build_orchestrator(config: OrchestratorConfig) -> Orchestrator:
    store = session_store(config)
    await store.ping()
    store.watch_memory()  # its memory against its maxmemory, for the metrics
    tls = backend_tls(config)
    try:
        node, zone = locality_from_env()  # where this orchestrator runs: nearer replicas are preferred
        verify_stream, propose_stream = (setting == "on" or (setting == "auto" and not tracing.exporting())
                                         for setting in (config.verify_stream, config.propose_stream))
        target = TargetPool(config.target,
                            lambda a: TargetBackend(a, config.target_timeout_s, tls, verify_stream),
                            config.target_retry_s, config.replica_refresh_s, node, zone)
        draft = DraftPool(config.draft, lambda a: DraftBackend(a, config.draft_timeout_s, tls, propose_stream),
                          config.draft_retry_s, config.replica_refresh_s, node, zone) if config.draft else None
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    for pool in (target, draft):
        if pool is not None:
            pool.ledger = store  # releases a replica misses are resent by whichever orchestrator sees it back
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
        await start_draft(draft, config, target_info)
    elif "share_outputs" in config.model_fields_set and config.share_outputs:
        raise StartupError("--share-outputs: there is no draft (--draft is unset), so no corpus of outputs to share; "
                           "drop the flag")
    log.info("target %s: %s (weights %s %s)", config.target, target_info.model,
             target_info.weights or target_info.dtype, target_info.weights_fingerprint or "-")
    for pool in (target, draft):
        if pool is not None:
            pool.watch()
    return Orchestrator(config, store, target, draft, tokenizer, target_info)


async def start_draft(draft: DraftPool, config: OrchestratorConfig, target_info: common_pb2.ModelInfo) -> None:
    """Wait for a draft replica and check that it shares the target's tokenizer."""
    try:
        draft_info = await draft.start(timeout_s=60.0)
    except Unavailable as exc:
        raise StartupError(f"draft service at {config.draft} is not reachable: {exc}") from exc
    mismatch = irreconcilable(draft_info, target_info)
    if mismatch:
        raise StartupError(mismatch)
    if "share_outputs" in config.model_fields_set and config.share_outputs and not draft_info.learns_outputs:
        raise StartupError(f"--share-outputs: the draft at {config.draft} is a {draft_info.kind!r} draft, which keeps "
                           "no corpus of outputs, so nothing would be shared; drop the flag, or run the draft with "
                           "--proposer suffix or hybrid")
    draft.expected_fingerprint = target_info.tokenizer_fingerprint
    await draft.refresh()  # now with the fingerprint: a mismatched replica is left out
    log.info("draft %s: %s (%s, weights %s %s)", config.draft, draft_info.model, draft_info.kind,
             draft_info.weights or draft_info.dtype, draft_info.weights_fingerprint or "-")


def irreconcilable(draft: common_pb2.ModelInfo, target: common_pb2.ModelInfo) -> str:
    """Why a draft cannot speculate for a target ("" when it can). A pair is reconciled by its
    token ids, not its weights: the draft must share the target's tokenizer (the same strings to
    the same ids) and, where it scores tokens with a model (its q rows), the width of the target's
    logits. Its weights may be anything, and that is the point of a draft: a quantized copy of a
    full-precision target (or the target itself) stays lossless, since the target's p decides."""
    if draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        return (f"draft model {draft.model!r} and target model {target.model!r} have different tokenizers "
                f"({draft.tokenizer_fingerprint} vs {target.tokenizer_fingerprint}); speculative decoding needs a "
                "draft that shares the target's tokenizer")
    if "model" in draft.draft_sources and draft.vocab_size and draft.vocab_size != target.vocab_size:
        return (f"draft model {draft.model!r} scores {draft.vocab_size} token ids, the target {target.vocab_size}: "
                "their distributions cannot be compared token by token")
    return ""


def public_api_security(config: OrchestratorConfig) -> dict:
    """Credentials, interceptors and options of the public API: TLS, bearer tokens, message size."""
    try:
        tokens = Tokens.load(config.auth_tokens_file, config.auth_tokens_env)
        credentials = server_credentials_of(config)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    if tokens.enabled:
        log.info("bearer tokens required: %d configured", len(tokens))
    else:
        log.warning("no bearer tokens configured (--auth-tokens-file, $%s): the API is open to anyone who "
                    "reaches it", config.auth_tokens_env)
    return dict(credentials=credentials,
                interceptors=[ServerTracing(logging.INFO), AuthInterceptor(tokens),
                              ConcurrencyLimit(PerIdentityLimit(config.max_concurrent_per_token)),
                              RateLimit(PerIdentityRate(config.max_closes_per_s, "--max-closes-per-s")), DecodeGuard()],
                options=[("grpc.max_receive_message_length", config.max_message_bytes)])


async def serve(config: OrchestratorConfig) -> None:
    security = public_api_security(config)
    orchestrator = await build_orchestrator(config)
    orchestrator.metrics.registry.register(SessionStoreMetrics(orchestrator.store))
    start_metrics(orchestrator.metrics.registry, config.host, config.metrics_port)
    servicer = OrchestratorServicer(orchestrator)
    await serve_servicer(config.address,
                         lambda s: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, s),
                         SERVICE_NAME, "orchestrator", **security)


def main(argv: Sequence[str] | None = None) -> None:
    run_main(OrchestratorConfig, serve, prog="python -m orchestrator", argv=argv)
