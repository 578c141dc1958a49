"""The README's runnable blocks, run as a reader would run them.

Every block marked `<!-- runnable -->` runs against a pipeline of real processes (Redis, draft,
target, orchestrator and the OpenAI-compatible gateway) built from the tiny test models and
started by the same launcher as `specdec up`. What differs from a reader's machine, and only
that: `specdec up` and `specdec down` in a block are left to the fixture (they would load the
packaged 135M model); the CLI finds the orchestrator through `$SPECDEC_ADDRESS`; the addresses the
Python and curl snippets name (127.0.0.1:50051 and 127.0.0.1:8000) are replaced by the fixture's;
and the gateway serves the tiny model under the packaged model's name, so the snippets' model ids
hold.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.defaults import DEFAULT_MODEL
from specdec.launcher import free_port
from tests.conftest import orchestrator_address, start_tiny_pipeline

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = re.compile(r"<!-- runnable -->\n```(\w+)\n(.*?)\n```", re.S)
BLOCKS = RUNNABLE.findall((ROOT / "README.md").read_text(encoding="utf-8"))

SHIM = """#!/bin/sh
# `specdec` as this checkout runs it; `up` and `down` are the fixture's.
case "$1" in up|down) exit 0;; esac
exec "{python}" -m specdec.cli "$@"
"""


@pytest.fixture(scope="module")
def readme_pipeline(tiny_models, tmp_path_factory):
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-readme"), tiny_models, "poor_draft",
                                   http_port=free_port(), extra_http_args=["--model-name", DEFAULT_MODEL])
    yield pipeline
    pipeline.stop()


@pytest.fixture(scope="module")
def environment(readme_pipeline, tmp_path_factory) -> dict[str, str]:
    bin_dir = tmp_path_factory.mktemp("bin")
    shim = bin_dir / "specdec"
    shim.write_text(SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
            "SPECDEC_ADDRESS": orchestrator_address(readme_pipeline)}


def _localised(block: str, pipeline) -> str:
    http = pipeline.plan.http_url().removesuffix("/v1")
    return block.replace("http://127.0.0.1:8000", http).replace("127.0.0.1:50051", orchestrator_address(pipeline))


def test_the_readme_has_runnable_blocks():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("lang,block", BLOCKS, ids=[f"{i}-{lang}" for i, (lang, _) in enumerate(BLOCKS)])
def test_a_runnable_block_runs(readme_pipeline, environment, tmp_path, lang, block):
    code = _localised(block, readme_pipeline)
    command = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    run = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-2000:]}\nstderr:\n{run.stderr[-4000:]}"
    assert '"error":' not in run.stdout, run.stdout[-2000:]  # curl exits 0 on an HTTP error
    if "curl" in block:
        assert json.loads(run.stdout.strip().splitlines()[-1])["choices"]
