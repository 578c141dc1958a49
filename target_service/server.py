"""Build and run the target service."""

from __future__ import annotations

from typing import Sequence

from specdec.server.admission import Admission
from specdec.server.metrics import ServiceMetrics
from specdec.runtime.batching import BatchConfig, Batcher
from specdec.runtime.info import model_info
from specdec.runtime.kv import SessionCaches
from specdec.runtime.latency import LatencyProfile
from specdec.runtime.models import load_model
from specdec.runtime.snapshot import policy_of
from specdec.runtime.verifier import Verifier
from specdec.server.serving import run_main, serve_servicer, start_metrics
from specdec.server.tls import server_credentials_of
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.config import TargetConfig
from target_service.servicer import TargetServicer

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


def build_servicer(config: TargetConfig) -> tuple[TargetServicer, ServiceMetrics]:
    """Load the model and wire caches, verifier, batcher, admission and metrics (call inside the event loop)."""
    loaded = load_model(config.model, dtype=config.dtype, threads=config.threads, device=config.device)
    caches = SessionCaches(loaded.model, loaded.max_context, config.max_sessions, config.idle_ttl_s,
                           policy_of(config, loaded, "target"))
    profile = LatencyProfile(config.emulate_verify_ms / 1e3, config.emulate_verify_per_token_ms / 1e3)
    metrics = ServiceMetrics("target")
    batcher = Batcher(caches, BatchConfig(config.max_batch, config.batch_window_ms / 1e3), profile, metrics)
    admission = Admission(config.max_concurrent, config.max_queued, name="target service", observer=metrics)
    metrics.track(running=lambda: batcher.running, waiting=lambda: admission.waiting + batcher.waiting,
                  kv_sessions=lambda: len(caches), kv_tokens=lambda: caches.cached_tokens)
    info = model_info(loaded, "model", profile)
    info.max_batch = config.max_batch
    return TargetServicer(Verifier(caches, loaded.vocab_size, profile), info, batcher, admission), metrics


async def serve(config: TargetConfig) -> None:
    servicer, metrics = build_servicer(config)
    servicer.info.metrics_port = start_metrics(metrics.registry, config.host, config.metrics_port)
    info = servicer.info
    await serve_servicer(config.address, lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s),
                         SERVICE_NAME, f"target service ({info.model} {info.dtype}, batches of up to {config.max_batch})",
                         credentials=server_credentials_of(config))


def main(argv: Sequence[str] | None = None) -> None:
    run_main(TargetConfig, serve, prog="python -m target_service", argv=argv)
