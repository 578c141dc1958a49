from __future__ import annotations

from typing import Literal

from pydantic import Field

from specdec.server.config import DeviceOption, SnapshotServiceConfig
from specdec.runtime.models import DEFAULT_MODEL


class TargetConfig(SnapshotServiceConfig, DeviceOption):
    """specdec target service: verifies draft blocks with the large model."""

    port: int = Field(50053, ge=0, le=65535, description="Port to listen on (0 picks a free one).")
    model: str = Field(DEFAULT_MODEL, description="Target model: the packaged default name, a local directory or a transformers id.")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = Field("float32", description="Weight dtype.")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: torch's choice).")
    max_sessions: int = Field(256, ge=1, description="KV caches kept at most (least recently used evicted first).")
    idle_ttl_s: float = Field(900.0, gt=0, description="Seconds an unused session cache is kept.")
    max_batch: int = Field(16, ge=1, le=256, description="Most requests verified in one forward pass (1 = no batching).")
    batch_window_ms: float = Field(
        200.0, ge=0, le=1000,
        description="Longest wait for the sessions of the previous forward pass to send their next request (the "
                    "pass starts at once when they are back or max-batch requests wait; the wait adapts to their "
                    "measured turnaround and to the pass time, up to this).",
    )
    max_concurrent: int = Field(64, ge=1, description="Admission: requests served at once; more wait in the queue.")
    max_queued: int = Field(
        256, ge=0, description="Admission: requests that may wait; beyond, RESOURCE_EXHAUSTED with a retry hint."
    )
    emulate_verify_ms: float = Field(0.0, ge=0, description="BENCHMARK SIMULATION: pad each verify to this many ms ...")
    emulate_verify_per_token_ms: float = Field(0.0, ge=0, description="... plus this many ms per scored position (0 = off).")
