"""Emulated accelerator latency, a labelled simulation for benchmarks only.

With tiny models whose real compute is far below a GPU's, a service can pad every forward pass
up to a declared profile (`base + per_token * tokens`) so that the draft-length controller can
be judged in the regime it is built for. Real compute above the profile is never hidden: the
pad only fills the gap. Services report the padded time as their compute time and say in
their ModelInfo that the profile is on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyProfile:
    base_s: float = 0.0
    per_token_s: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.base_s > 0 or self.per_token_s > 0

    def target_s(self, tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens

    def pad(self, started_ns: int, tokens: int) -> None:
        """Sleep until `base + per_token * tokens` seconds have passed since `started_ns`."""
        if not self.enabled:
            return
        remaining = self.target_s(tokens) - (time.perf_counter_ns() - started_ns) / 1e9
        if remaining > 0:
            time.sleep(remaining)

    def describe(self) -> str:
        return f"emulated {self.base_s * 1e3:g} ms + {self.per_token_s * 1e3:g} ms/token" if self.enabled else ""
