"""Build and run the target service."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from specdec.runtime.info import model_info
from specdec.runtime.kv import SessionCaches
from specdec.runtime.latency import LatencyProfile
from specdec.runtime.models import load_model
from specdec.runtime.verifier import Verifier
from specdec.serving import run_main, serve_servicer
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.config import TargetConfig
from target_service.servicer import TargetServicer

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


async def serve(config: TargetConfig) -> None:
    loaded = load_model(config.model, dtype=config.dtype, threads=config.threads)
    caches = SessionCaches(loaded.model, loaded.max_context, config.max_sessions, config.idle_ttl_s)
    profile = LatencyProfile(config.emulate_verify_ms / 1e3, config.emulate_verify_per_token_ms / 1e3)
    info = model_info(loaded, "model", profile)
    servicer = TargetServicer(Verifier(caches, loaded.vocab_size, profile), info,
                              ThreadPoolExecutor(max_workers=1, thread_name_prefix="target"))
    await serve_servicer(config.address, lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s),
                         SERVICE_NAME, f"target service ({info.model} {info.dtype})")


def main(argv: Sequence[str] | None = None) -> None:
    run_main(TargetConfig, serve, prog="python -m target_service", argv=argv)
