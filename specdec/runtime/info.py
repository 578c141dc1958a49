"""ModelInfo for a loaded model (what services report through GetInfo)."""

from __future__ import annotations

from specdec.runtime.latency import LatencyProfile
from specdec.runtime.models import LoadedModel
from specdec.v1 import common_pb2


def model_info(loaded: LoadedModel, kind: str, profile: LatencyProfile = LatencyProfile(),
               max_batch: int = 0) -> common_pb2.ModelInfo:
    """What a service hosting `loaded` says about it; `max_batch`: most requests in one forward pass."""
    return common_pb2.ModelInfo(
        model=loaded.name,
        dtype=str(loaded.dtype).removeprefix("torch."),
        tokenizer_fingerprint=loaded.fingerprint,
        vocab_size=loaded.vocab_size,
        max_context=loaded.max_context,
        eos_token_ids=loaded.eos_token_ids,
        kind=kind,
        device=loaded.describe_device() + (f" ({profile.describe()})" if profile.enabled else ""),
        max_batch=max_batch,
        weights=loaded.weights.format or str(loaded.dtype).removeprefix("torch."),
        weights_fingerprint=loaded.weights.fingerprint,
        weights_bytes=loaded.weights.nbytes,
    )
