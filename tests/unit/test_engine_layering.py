"""Which way the engine's imports point: the runtime never imports the server layer above it (key
names live in `specdec.keys`), and uses Redis clients the services build (`specdec.server.redis`)
but builds none."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "specdec" / "runtime"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_runtime_never_imports_the_server_layer():
    offenders = [f"{path.name} imports {name}" for path in sorted(RUNTIME.glob("*.py"))
                 for name in _imports(path) if name.startswith("specdec.server")]
    assert not offenders


def test_the_runtime_builds_no_redis_connection():
    offenders = [path.name for path in sorted(RUNTIME.glob("*.py"))
                 if any(call in path.read_text() for call in ("from_url(", "Redis(", "RedisCluster(", "Sentinel("))]
    assert not offenders
