"""Build and run the draft service."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draft_service.config import DraftConfig
from draft_service.servicer import DraftServicer
from specdec.runtime.drafting import Drafter
from specdec.runtime.grammars import SessionGrammars
from specdec.runtime.info import model_info
from specdec.runtime.latency import LatencyProfile
from specdec.runtime.models import load_model, load_tokenizer, tokenizer_fingerprint
from specdec.runtime.proposers import ModelProposer, NgramProposer, Proposer
from specdec.server.metrics import ServiceMetrics
from specdec.server.model_service import admission_and_metrics, batcher_for, serve_model_service, session_caches
from specdec.server.serving import run_main
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


def build_proposer(config: DraftConfig) -> tuple[Proposer, common_pb2.ModelInfo, LatencyProfile, SessionGrammars]:
    if config.threads:
        torch.set_num_threads(config.threads)
    profile = LatencyProfile(per_token_s=config.emulate_draft_per_token_ms / 1e3)
    if config.proposer == "ngram":
        tokenizer = load_tokenizer(config.model)
        info = common_pb2.ModelInfo(model=config.model, dtype="none", kind="ngram", device="cpu",
                                    tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                                    vocab_size=len(tokenizer))
        grammars = SessionGrammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], config.max_sessions)
        return NgramProposer(config.ngram_max, config.ngram_min), info, profile, grammars
    loaded = load_model(config.model, dtype=config.dtype, threads=config.threads, device=config.device)
    caches = session_caches(config, loaded, "draft")
    grammars = SessionGrammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids, config.max_sessions)
    return ModelProposer(caches, profile), model_info(loaded, "model", profile, config.max_batch), profile, grammars


def build_servicer(config: DraftConfig) -> tuple[DraftServicer, ServiceMetrics]:
    """Build the proposer and wire batcher (model proposer), admission and metrics (call inside the event loop)."""
    proposer, info, profile, grammars = build_proposer(config)
    admission, metrics = admission_and_metrics(config, "draft")
    batcher = None  # prompt lookup computes nothing to batch
    if isinstance(proposer, ModelProposer):
        batcher = batcher_for(config, proposer.caches, profile, admission, metrics)
    drafter = Drafter(proposer, info.tokenizer_fingerprint, info.model, batcher, grammars=grammars)
    servicer = DraftServicer(drafter, info, admission)
    servicer.grammars = grammars
    return servicer, metrics


async def serve(config: DraftConfig) -> None:
    servicer, metrics = build_servicer(config)
    info = servicer.info
    await serve_model_service(config, servicer, metrics,
                              lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s), SERVICE_NAME,
                              f"draft service ({info.kind}, {info.model} {info.dtype})")


def main(argv: Sequence[str] | None = None) -> None:
    run_main(DraftConfig, serve, prog="python -m draft_service", argv=argv)
