"""A draft service killed mid-stream: the session continues at k = 0, output unchanged."""

from __future__ import annotations

import os
import signal

from specdec import Client
from tests.conftest import orchestrator_address, start_tiny_pipeline
from tests.reference import Reference


def test_draft_killed_mid_stream_falls_back_to_plain_decoding(tiny_models, tmp_path):
    pipeline = start_tiny_pipeline(tmp_path, tiny_models, "good_draft")
    try:
        prompt = "The quick brown fox"
        expected = Reference(str(tiny_models["target"])).greedy(prompt, 40)
        with Client(orchestrator_address(pipeline)) as client:
            chunks = []
            for chunk in client.stream(prompt, max_new_tokens=40):
                chunks.append(chunk)
                if len(chunks) == 2:
                    os.kill(pipeline.procs["draft"].pid, signal.SIGKILL)
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == expected
        stats = chunks[-1].stats
        assert stats["draft_fallbacks"] >= 1
        assert any(c.round.get("draft_fallback") for c in chunks[2:])
        assert all(c.round["proposed"] == 0 for c in chunks[3:])  # skipped while the draft is down
    finally:
        pipeline.stop()
