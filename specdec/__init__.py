"""specdec: lossless speculative decoding as a pipeline of gRPC services."""

from specdec.client import AsyncClient, AsyncStream, Chunk, Client, Generation, Stream
from specdec.errors import SpecdecError

__all__ = ["AsyncClient", "AsyncStream", "Chunk", "Client", "Generation", "SpecdecError", "Stream"]
