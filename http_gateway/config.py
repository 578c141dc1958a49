from __future__ import annotations

from pydantic import Field

from specdec.server.config import ServiceConfig


class GatewayConfig(ServiceConfig):
    """specdec HTTP gateway: the OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions)."""

    port: int = Field(8000, ge=0, le=65535, description="HTTP port to listen on.")
    orchestrator: str = Field("127.0.0.1:50051",
                              description="Orchestrator address(es), comma-separated; calls fail over between them.")
    model_name: str = Field(
        "", description="Model id the API serves; empty: the target model the orchestrator reports.")
    default_temperature: float = Field(
        1.0, ge=0, description="Temperature when a request leaves it unset (OpenAI's default is 1; 0 is greedy)."
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Deadline of one generation, seconds.")
    health_timeout_s: float = Field(5.0, gt=0, description="Deadline of the orchestrator status call behind /health.")
    health_cache_s: float = Field(
        2.0, ge=0, description="Seconds /health reuses the orchestrator's last status answer (concurrent probes share "
        "one call), so probes never make the orchestrator ask every replica more often; 0 asks on every probe."
    )
    auth_tokens_file: str = Field(
        "", description="Bearer tokens this gateway accepts (TOKEN or NAME:TOKEN per line), checked before a request "
        "goes on; the caller's token is always forwarded to the orchestrator, which checks it too."
    )
    auth_tokens_env: str = Field("SPECDEC_AUTH_TOKENS", description="Environment variable with more tokens.")
    token_file: str = Field(
        "", description="The gateway's own token for /health and model discovery; unset: $SPECDEC_TOKEN, else the "
        "first accepted token."
    )
    orchestrator_tls_ca: str = Field("", description="PEM CA to verify a TLS orchestrator with; set: TLS to it.")
    orchestrator_tls_cert: str = Field("", description="PEM client certificate for the orchestrator (mutual TLS).")
    orchestrator_tls_key: str = Field("", description="PEM private key of --orchestrator-tls-cert.")
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest request body accepted, in bytes (413 beyond)."
    )
