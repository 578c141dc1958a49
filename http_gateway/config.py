from __future__ import annotations

from pydantic import Field

from specdec.config import ServiceConfig


class GatewayConfig(ServiceConfig):
    """specdec HTTP gateway: the OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions)."""

    port: int = Field(8000, ge=0, le=65535, description="HTTP port to listen on.")
    orchestrator: str = Field("127.0.0.1:50051",
                              description="Orchestrator address(es), comma-separated; calls fail over between them.")
    model_name: str = Field("", description="Model id the API serves; empty: the target model the orchestrator reports.")
    default_temperature: float = Field(
        1.0, ge=0, description="Temperature when a request leaves it unset (OpenAI's default is 1; 0 is greedy)."
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Deadline of one generation, seconds.")
    health_timeout_s: float = Field(5.0, gt=0, description="Deadline of the orchestrator status call behind /health.")
