"""Bundled data: prompt sets for benchmarks and demos."""

from __future__ import annotations

import json
from importlib import resources


def bundled_prompts() -> list[dict]:
    """The bundled prompt set: chat prompts, prompts grounded in their input, and code."""
    text = resources.files(__package__).joinpath("prompts.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]
