"""The layout's promises: what a library import loads, and which way imports point."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("loadtest", "bench", "drafts", "tests")  # tools and tests sit above the library


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("package", ["specdec.core", "specdec.core.acceptance", "specdec.core.sampling",
                                     "specdec.core.policy", "specdec.core.ngram", "specdec.core.suffix"])
def test_the_pure_core_loads_no_grpc_client_or_server_code(package):
    loaded = _loaded_after(f"import {package}")
    assert package in loaded
    assert not {m for m in loaded if m == "grpc" or m.startswith("grpc.")}
    assert not {m for m in loaded if m.startswith(("specdec.client", "specdec.server", "specdec.runtime"))}


def test_the_sdk_loads_on_first_use():
    loaded = _loaded_after("import specdec")
    assert "specdec.client" not in loaded and "grpc" not in loaded
    loaded = _loaded_after("from specdec import Client, SpecdecError")
    assert "specdec.client" in loaded and "specdec.server.serving" not in loaded  # no server code in the SDK


@pytest.mark.parametrize("package", ["specdec", "orchestrator", "draft_service", "target_service", "http_gateway"])
def test_the_library_and_services_never_import_a_tool(package):
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / package).rglob("*.py")) if "_pb2" not in path.name
        for name in _imported_modules(path) if name.split(".")[0] in TOOLS
    ]
    assert not offenders


def test_the_core_imports_nothing_with_io():
    io = ("grpc", "redis", "specdec.server", "specdec.runtime", "specdec.client", "orchestrator", "transformers")
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "specdec" / "core").rglob("*.py"))
        for name in _imported_modules(path) if any(name == p or name.startswith(p + ".") for p in io)
    ]
    assert not offenders


def test_tool_subcommands_register_through_entry_points():
    from specdec.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"draft", "loadtest", "up", "down", "generate", "chat", "status"} <= set(commands)
