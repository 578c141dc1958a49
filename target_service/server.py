"""Build and run the target service."""

from __future__ import annotations

from collections.abc import Sequence

from specdec.runtime.grammars import SessionGrammars
from specdec.runtime.info import model_info
from specdec.runtime.latency import LatencyProfile
from specdec.runtime.verifier import Verifier
from specdec.server.metrics import ServiceMetrics
from specdec.server.model_service import admission_and_metrics, batcher_for, load_on, model_thread, serve_model_service
from specdec.server.serving import run_main
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.config import TargetConfig
from target_service.servicer import TargetServicer

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


def build_servicer(config: TargetConfig) -> tuple[TargetServicer, ServiceMetrics]:
    """Load the model and wire caches, verifier, batcher, admission and metrics (call inside the event loop)."""
    thread = model_thread("target")
    loaded, caches = load_on(thread, config, "target")
    profile = LatencyProfile(config.emulate_verify_ms / 1e3, config.emulate_verify_per_token_ms / 1e3)
    admission, metrics = admission_and_metrics(config, "target")
    batcher = batcher_for(config, caches, profile, admission, metrics, thread)
    info = model_info(loaded, "model", profile, config.max_batch)
    grammars = SessionGrammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids, config.max_sessions)
    verifier = Verifier(caches, loaded.vocab_size, grammars, batcher.config.score_positions)
    servicer = TargetServicer(verifier, info, batcher, admission, config.logprobs_mode)
    servicer.grammars = grammars
    metrics.track_ahead(servicer.ahead)
    return servicer, metrics


async def serve(config: TargetConfig) -> None:
    servicer, metrics = build_servicer(config)
    info = servicer.info
    await serve_model_service(config, servicer, metrics,
                              lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s),
                              SERVICE_NAME,
                              f"target service ({info.model} {info.dtype}, batches of up to {config.max_batch})")


def main(argv: Sequence[str] | None = None) -> None:
    run_main(TargetConfig, serve, prog="python -m target_service", argv=argv)
