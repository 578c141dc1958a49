"""specdec: lossless speculative decoding as a pipeline of gRPC services.

The SDK (`Client`, `AsyncClient` and their types) is imported on first use, so that
`import specdec.core` or `import specdec.runtime` loads neither gRPC nor the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["AsyncClient", "AsyncStream", "Chunk", "Client", "Generation", "Logprob", "SpecdecError", "Stream"]

if TYPE_CHECKING:
    from specdec.client import AsyncClient, AsyncStream, Chunk, Client, Generation, Logprob, Stream
    from specdec.errors import SpecdecError


def __getattr__(name: str) -> Any:
    if name == "SpecdecError":
        from specdec.errors import SpecdecError

        return SpecdecError
    if name in __all__:
        from specdec import client

        return getattr(client, name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
