"""Build and run the target service."""

from __future__ import annotations

import asyncio
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from specdec.runtime.info import model_info
from specdec.runtime.kv import SessionCaches
from specdec.runtime.models import load_model
from specdec.runtime.verifier import Verifier
from specdec.serving import configure_logging, create_server, mark_serving, serve_until_signalled
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.config import TargetConfig
from target_service.servicer import TargetServicer

log = logging.getLogger("specdec.target")
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


async def serve(config: TargetConfig) -> None:
    loaded = load_model(config.model, dtype=config.dtype, threads=config.threads)
    caches = SessionCaches(loaded.model, loaded.max_context, config.max_sessions, config.idle_ttl_s)
    info = model_info(loaded, "model")
    servicer = TargetServicer(Verifier(caches, loaded.vocab_size), info,
                              ThreadPoolExecutor(max_workers=1, thread_name_prefix="target"))
    server, port, health = create_server(
        config.address, [lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s)], [SERVICE_NAME]
    )
    await server.start()
    await mark_serving(health, [SERVICE_NAME])
    log.info("target service (%s %s) listening on %s:%d", info.model, info.dtype, config.host, port)
    await serve_until_signalled(server)


def main(argv: Sequence[str] | None = None) -> None:
    config = TargetConfig.from_args(argv, prog="python -m target_service")
    configure_logging(config.log_level)
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass
    sys.exit(0)
