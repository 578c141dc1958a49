"""Defaults that light modules (CLI, launcher, SDK) need without importing torch."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
MAX_DECODE_STEPS = 64  # the most k = 0 rounds one Verify may run (VerifyRequest.decode_steps)


def cache_dir() -> Path:
    """`$SPECDEC_CACHE` if set, else `~/.cache/specdec`."""
    env = os.environ.get("SPECDEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"
