from __future__ import annotations

from typing import Literal

from pydantic import Field

from specdec.defaults import DEFAULT_MODEL
from specdec.server.config import BatchWindowMs, Dtype, MaxBatch, ModelServiceConfig


class TargetConfig(ModelServiceConfig):
    """specdec target service: verifies draft blocks with the large model."""

    port: int = Field(50053, ge=0, le=65535, description="Port to listen on (0 picks a free one).")
    model: str = Field(
        DEFAULT_MODEL, description="Target model: the packaged default name, a local directory or a transformers id."
    )
    dtype: Dtype = Field("auto", description="Weight dtype: auto is bfloat16 on a CUDA GPU that computes it natively "
                         "(Ampere and later), float32 elsewhere (a CPU, where the packaged GGUF's blocks run with "
                         "float32 activations; an older GPU).")
    max_batch: MaxBatch = Field(16, description="Most requests verified in one forward pass (1 = no batching).")
    batch_window_ms: BatchWindowMs = Field(
        200.0,
        description="Longest wait for the sessions of the previous forward pass to send their next request (the "
                    "pass starts at once when they are back or max-batch requests wait; the wait adapts to their "
                    "measured turnaround and to the pass time, up to this).",
    )
    logprobs_mode: Literal["raw", "processed"] = Field(
        "raw",
        description="Which distribution returned log-probabilities describe: raw (the model's own softmax, as a plain "
                    "forward pass gives it) or processed (after penalties, biases, grammar, temperature, min-p, top-k "
                    "and top-p: the distribution the token was drawn from).",
    )
    emulate_verify_ms: float = Field(0.0, ge=0, description="BENCHMARK SIMULATION: pad each verify to this many ms ...")
    emulate_verify_per_token_ms: float = Field(
        0.0, ge=0, description="... plus this many ms per scored position (0 = off)."
    )
