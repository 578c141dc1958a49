"""A draft service killed mid-stream: the session continues at k = 0, output unchanged, and
speculation resumes once a draft is back."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from specdec import Client
from specdec.launcher import wait_healthy
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

        # The draft comes back on the same address: speculation resumes without a restart of
        # anything else, and the output is still the target's.
        with open(tmp_path / "draft-restarted.log", "wb") as log:
            revived = subprocess.Popen(pipeline.plan.commands()["draft"], stdout=log, stderr=subprocess.STDOUT)
        pipeline.procs["draft"] = revived
        wait_healthy(pipeline.plan.grpc_addresses()["draft"], 300, revived)
        deadline, speculated = time.monotonic() + 60, False
        with Client(orchestrator_address(pipeline)) as client:
            while not speculated and time.monotonic() < deadline:
                out = client.generate(prompt, max_new_tokens=40)
                assert out.token_ids == expected
                speculated = out.stats["draft_tokens"] > 0 and out.stats["draft_fallbacks"] == 0
                time.sleep(0.2)
        assert speculated, "the orchestrator never used the restarted draft"
    finally:
        pipeline.stop()
