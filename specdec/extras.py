"""What a light install of specdec lacks, and how a command that needs it says so.

`pip install specdec` is the SDK and the client commands (`specdec generate`, `chat`, `status`):
grpcio, protobuf and the generated stubs. The services (draft, target, orchestrator, the HTTP
gateway) and `specdec up` need the `serve` extra: `pip install 'specdec[serve]'`.
"""

from __future__ import annotations

import importlib.util

SERVE_HINT = "pip install 'specdec[serve]'"
# One module of each package the services import that the light install does not bring.
SERVE_MODULES = ("torch", "transformers", "redis", "pydantic", "grpc_health", "grpc_reflection", "fastapi",
                 "uvicorn", "opentelemetry", "llguidance", "kubernetes")


def missing_for_serving() -> list[str]:
    """The modules of `SERVE_MODULES` that cannot be imported here."""
    return [name for name in SERVE_MODULES if importlib.util.find_spec(name) is None]


def require_serving(command: str) -> None:
    """Exit with a message naming the pip command when the services' packages are missing."""
    missing = missing_for_serving()
    if missing:
        raise SystemExit(f"{command} runs the specdec services, which need the serve extra "
                         f"(not installed here: {', '.join(missing)}): {SERVE_HINT}")
