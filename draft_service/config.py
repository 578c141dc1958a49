from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from specdec.defaults import DEFAULT_MODEL
from specdec.server.config import BatchWindowMs, Dtype, MaxBatch, ModelServiceConfig


class DraftConfig(ModelServiceConfig):
    """specdec draft service: streams draft-token proposals for the orchestrator.

    The --snapshot-* options keep the model proposer's KV caches in Redis under the draft's own
    keys; prompt lookup has no KV cache, so it refuses them.
    """

    port: int = Field(50052, ge=0, le=65535, description="Port to listen on (0 picks a free one).")
    proposer: Literal["model", "ngram"] = Field(
        "ngram", description="Draft source: a causal LM ('model') or prompt lookup ('ngram', no model; the measured "
        "default on CPU)."
    )
    model: str = Field(
        DEFAULT_MODEL, description="Draft model: the packaged default name, a local directory or a transformers id."
    )
    dtype: Dtype = Field("bfloat16", description="Weight dtype of the draft model.")
    max_batch: MaxBatch = Field(
        16, description="Most requests drafted (model proposer) in one forward pass (1 = no batching)."
    )
    batch_window_ms: BatchWindowMs = Field(
        5.0,
        description="Longest wait for the sessions of the previous forward pass to send their next request (the "
                    "pass starts at once when they are back or max-batch requests wait; the wait adapts to their "
                    "measured turnaround, up to this).",
    )
    emulate_draft_per_token_ms: float = Field(
        0.0, ge=0, description="BENCHMARK SIMULATION: pad each draft step to this many ms (0 = off)."
    )
    ngram_max: int = Field(3, ge=1, description="Longest suffix n-gram prompt lookup matches.")
    ngram_min: int = Field(2, ge=1, description="Shortest suffix n-gram prompt lookup matches.")

    @model_validator(mode="after")
    def _snapshots_need_a_model(self):
        if self.proposer == "ngram" and self.snapshot_redis_url:
            raise ValueError("--snapshot-redis-url needs --proposer model: prompt lookup keeps no KV cache to snapshot")
        return self
