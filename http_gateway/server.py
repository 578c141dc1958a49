"""Entry point: `python -m http_gateway --port 8000 --orchestrator 127.0.0.1:50051`."""

from __future__ import annotations

import gc
import logging
import ssl
import sys
from collections.abc import Sequence

import uvicorn

from http_gateway.app import create_app
from http_gateway.config import GatewayConfig
from http_gateway.metrics import GatewayMetrics
from specdec.server.serving import configure_logging, start_metrics
from specdec.server.tracing import setup as setup_tracing

log = logging.getLogger("specdec.http")


def main(argv: Sequence[str] | None = None) -> None:
    config = GatewayConfig.from_args(argv, prog="python -m http_gateway")
    configure_logging(config.log_level, config.log_format, "http_gateway")
    try:
        setup_tracing("http_gateway", config.otel_endpoint, config.otel_file)
        metrics = GatewayMetrics()
        app = create_app(config, metrics)
        start_metrics(metrics.registry, config.host, config.metrics_port)
    except (RuntimeError, ValueError, OSError) as exc:
        log.error("cannot start: %s", exc)
        sys.exit(2)
    scheme = "https" if config.tls_cert else "http"
    log.info("OpenAI-compatible API on %s://%s/v1 (orchestrator %s)", scheme, config.address, config.orchestrator)
    gc.collect()
    gc.freeze()  # startup's objects out of the collector's sight, as the gRPC services do (serve_servicer)
    # log_config=None: uvicorn's loggers go through ours (the chosen format, with request ids).
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level.lower(),
                timeout_graceful_shutdown=5, log_config=None,
                ssl_certfile=config.tls_cert or None, ssl_keyfile=config.tls_key or None,
                ssl_ca_certs=config.tls_ca or None,
                ssl_cert_reqs=ssl.CERT_REQUIRED if config.tls_client_auth == "required" else ssl.CERT_NONE)
