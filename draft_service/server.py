"""Build and run the draft service."""

from __future__ import annotations

from typing import Sequence

import torch

from draft_service.config import DraftConfig
from draft_service.servicer import DraftServicer
from specdec.server.admission import Admission
from specdec.server.metrics import ServiceMetrics
from specdec.runtime.batching import BatchConfig, Batcher
from specdec.runtime.info import model_info
from specdec.runtime.kv import SessionCaches
from specdec.runtime.latency import LatencyProfile
from specdec.runtime.models import load_model, load_tokenizer, tokenizer_fingerprint
from specdec.runtime.proposers import ModelProposer, NgramProposer, Proposer
from specdec.runtime.snapshot import policy_of
from specdec.server.serving import run_main, serve_servicer, start_metrics
from specdec.server.tls import server_credentials_of
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


def build_proposer(config: DraftConfig) -> tuple[Proposer, common_pb2.ModelInfo, LatencyProfile]:
    if config.threads:
        torch.set_num_threads(config.threads)
    profile = LatencyProfile(per_token_s=config.emulate_draft_per_token_ms / 1e3)
    if config.proposer == "ngram":
        tokenizer = load_tokenizer(config.model)
        info = common_pb2.ModelInfo(model=config.model, dtype="none", kind="ngram", device="cpu",
                                    tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                                    vocab_size=len(tokenizer))
        return NgramProposer(config.ngram_max, config.ngram_min), info, profile
    loaded = load_model(config.model, dtype=config.dtype, threads=config.threads, device=config.device)
    caches = SessionCaches(loaded.model, loaded.max_context, config.max_sessions, config.idle_ttl_s,
                           policy_of(config, loaded, "draft"))
    info = model_info(loaded, "model", profile)
    info.max_batch = config.max_batch
    return ModelProposer(caches, profile), info, profile


def build_servicer(config: DraftConfig) -> tuple[DraftServicer, ServiceMetrics]:
    """Build the proposer and wire batcher (model proposer), admission and metrics (call inside the event loop)."""
    proposer, info, profile = build_proposer(config)
    metrics = ServiceMetrics("draft")
    admission = Admission(config.max_concurrent, config.max_queued, name="draft service", observer=metrics)
    batcher = None
    if isinstance(proposer, ModelProposer):
        batcher = Batcher(proposer.caches, BatchConfig(config.max_batch, config.batch_window_ms / 1e3), profile,
                          metrics)
    running = (lambda: batcher.running) if batcher is not None else (lambda: admission.running)
    waiting = (lambda: admission.waiting + batcher.waiting) if batcher is not None else (lambda: admission.waiting)
    metrics.track(running=running, waiting=waiting, kv_sessions=proposer.cached_sessions,
                  kv_tokens=proposer.cached_tokens)
    return DraftServicer(proposer, info, admission, batcher), metrics


async def serve(config: DraftConfig) -> None:
    servicer, metrics = build_servicer(config)
    servicer.info.metrics_port = start_metrics(metrics.registry, config.host, config.metrics_port)
    info = servicer.info
    await serve_servicer(config.address, lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s),
                         SERVICE_NAME, f"draft service ({info.kind}, {info.model} {info.dtype})",
                         credentials=server_credentials_of(config))


def main(argv: Sequence[str] | None = None) -> None:
    run_main(DraftConfig, serve, prog="python -m draft_service", argv=argv)
