"""specdec: lossless speculative decoding as a pipeline of gRPC services."""

from specdec.client import Chunk, Client, Generation
from specdec.errors import SpecdecError

__all__ = ["Chunk", "Client", "Generation", "SpecdecError"]
