"""Build and run the draft service."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from draft_service.config import DraftConfig
from draft_service.servicer import DraftServicer
from specdec.runtime.info import model_info
from specdec.runtime.kv import SessionCaches
from specdec.runtime.latency import LatencyProfile
from specdec.runtime.models import load_model, load_tokenizer, tokenizer_fingerprint
from specdec.runtime.proposers import ModelProposer, NgramProposer, Proposer
from specdec.serving import run_main, serve_servicer
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


def build_proposer(config: DraftConfig) -> tuple[Proposer, common_pb2.ModelInfo]:
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.proposer == "ngram":
        tokenizer = load_tokenizer(config.model)
        info = common_pb2.ModelInfo(model=config.model, dtype="none", kind="ngram", device="cpu",
                                    tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                                    vocab_size=len(tokenizer))
        return NgramProposer(config.ngram_max, config.ngram_min), info
    loaded = load_model(config.model, dtype=config.dtype, threads=config.threads)
    caches = SessionCaches(loaded.model, loaded.max_context, config.max_sessions, config.idle_ttl_s)
    profile = LatencyProfile(per_token_s=config.emulate_draft_per_token_ms / 1e3)
    return ModelProposer(caches, profile), model_info(loaded, "model", profile)


async def serve(config: DraftConfig) -> None:
    proposer, info = build_proposer(config)
    servicer = DraftServicer(proposer, info, ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft"))
    await serve_servicer(config.address, lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s),
                         SERVICE_NAME, f"draft service ({info.kind}, {info.model} {info.dtype})")


def main(argv: Sequence[str] | None = None) -> None:
    run_main(DraftConfig, serve, prog="python -m draft_service", argv=argv)
