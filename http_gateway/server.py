"""Entry point: `python -m http_gateway --port 8000 --orchestrator 127.0.0.1:50051`."""

from __future__ import annotations

import logging
from typing import Sequence

import uvicorn

from http_gateway.app import create_app
from http_gateway.config import GatewayConfig
from specdec.serving import configure_logging

log = logging.getLogger("specdec.http")


def main(argv: Sequence[str] | None = None) -> None:
    config = GatewayConfig.from_args(argv, prog="python -m http_gateway")
    configure_logging(config.log_level)
    log.info("OpenAI-compatible API on http://%s/v1 (orchestrator %s)", config.address, config.orchestrator)
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level=config.log_level.lower(),
                timeout_graceful_shutdown=5)
