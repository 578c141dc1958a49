"""The layout's promises, each checked here:

1. Layers. Every project module belongs to one layer, and imports (at module level or inside a
   function) point only at its own layer or at the layers `LAYERS` lets it use:

       leaf      specdec.errors, defaults, extras, keys, data, v1   imports nothing of ours
       core      specdec.core: pure maths                           leaf
       runtime   specdec.runtime: the engine                        leaf, core
       testing   specdec.testing: tiny models for tests, benches    leaf, core, runtime
       sdk       specdec (the package), client, channel, rpc_errors leaf
       server    specdec.server: what the services share            leaf, core, runtime, sdk
       integrations specdec.integrations: other engines' proposers  leaf, core (gRPC inside functions)
       <service> orchestrator, draft_service, target_service,       leaf, core, runtime, sdk, server
                 http_gateway (each its own: no service imports another)
       cli       specdec.cli, specdec.launcher                      leaf, sdk, runtime (`specdec up` only)
       tools     loadtest, drafts, bench, deploy                    anything above, and each other
       tests     tests                                              anything

   So the library never imports a tool, nothing but tools and tests import `specdec.testing`,
   and the SDK never imports server, engine or service code.
2. What an import loads. `import specdec.core` and `import specdec.runtime` (every module of
   either) load no gRPC; `import specdec` loads nothing but itself; the SDK and the light CLI
   (`specdec.cli`, `specdec.launcher`) need only the standard library, grpcio and protobuf at
   import time (what a light `pip install specdec` has: tests/deploy/test_packaging.py installs
   it); the core imports no I/O (gRPC, Redis, transformers).
3. No import cycle anywhere: the modules of every project file, linked by every import they
   make, form no cycle.
4. No function over `MAX_FUNCTION_LINES` lines in the library, the services or the gateway
   (tools, benchmarks and tests may keep longer `main`s).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("orchestrator", "draft_service", "target_service", "http_gateway")
TOOLS = ("loadtest", "drafts", "bench", "deploy")
PROJECT = ("specdec", *SERVICES, *TOOLS, "tests")
MAX_FUNCTION_LINES = 60

# layer: (its module prefixes, the layers it may import besides itself)
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "leaf": (("specdec.errors", "specdec.defaults", "specdec.extras", "specdec.keys", "specdec.data", "specdec.v1"),
             ()),
    "core": (("specdec.core",), ("leaf",)),
    "runtime": (("specdec.runtime",), ("leaf", "core")),
    "testing": (("specdec.testing",), ("leaf", "core", "runtime")),
    "sdk": (("specdec", "specdec.client", "specdec.channel", "specdec.rpc_errors"), ("leaf",)),
    "server": (("specdec.server",), ("leaf", "core", "runtime", "sdk")),
    "integrations": (("specdec.integrations",), ("leaf", "core")),
    **{service: ((service,), ("leaf", "core", "runtime", "sdk", "server")) for service in SERVICES},
    "cli": (("specdec.cli", "specdec.launcher"), ("leaf", "sdk", "runtime")),
    "tools": (TOOLS, ("leaf", "core", "runtime", "testing", "sdk", "server", *SERVICES, "cli", "integrations")),
    "tests": (("tests",), ("leaf", "core", "runtime", "testing", "sdk", "server", *SERVICES, "cli", "tools",
                           "integrations")),
}
# What the SDK and the light CLI may import at module level besides the standard library: grpcio
# and protobuf. The services' packages are imported inside the functions that need them.
LIGHT_PACKAGES = {"grpc", "google"}
GRPC = ("grpc", "grpc_health", "grpc_reflection")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, Path]:
    """Every project module (generated stubs aside) by dotted name."""
    return {_module_name(path): path for package in PROJECT for path in sorted((ROOT / package).rglob("*.py"))
            if "_pb2" not in path.name}


def _own(name: str) -> str | None:
    """The project module an imported name lives in (`specdec.client.Client` -> `specdec.client`)."""
    modules = _modules()
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def _imports(module: str) -> tuple[tuple[str, int, bool], ...]:
    """(imported name, line, at module level) for every import a module makes; `from a import b`
    names `a.b` where that is a module."""
    path = _modules()[module]
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in _modules() else base for a in node.names]
        else:
            continue
        found += [(name, node.lineno, id(node) in top) for name in names]
    return tuple(found)


def _layer(module: str) -> str:
    best, layer = -1, ""
    for name, (prefixes, _) in LAYERS.items():
        for prefix in prefixes:
            matches = module == prefix or (module.startswith(prefix + ".") and prefix != "specdec")
            if matches and len(prefix) > best:
                best, layer = len(prefix), name
    assert layer, f"{module} is in no layer: add it to LAYERS"
    return layer


def _edges(lazy: bool = True) -> dict[str, set[str]]:
    """Project module -> the project modules it imports (module-level only unless `lazy`)."""
    graph: dict[str, set[str]] = {}
    for module in _modules():
        targets = {_own(name) for name, _, top in _imports(module) if top or lazy}
        graph[module] = {t for t in targets if t and t != module}
    return graph


def _external(module: str, lazy: bool) -> set[str]:
    """Top-level packages outside the project a module imports (module-level only unless `lazy`)."""
    return {name.split(".")[0] for name, _, top in _imports(module) if (top or lazy) and _own(name) is None}


def _loaded_by(modules: list[str]) -> set[str]:
    """Every project module importing `modules` runs (their module-level imports, transitively)."""
    graph, seen, todo = _edges(lazy=False), set(), list(modules)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph[module]
    return seen


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def _grpc(loaded: set[str]) -> set[str]:
    return {m for m in loaded if m.split(".")[0] in GRPC}


def _in(layer: str) -> list[str]:
    return [m for m in _modules() if _layer(m) == layer]


# -- 1. layers -----------------------------------------------------------------------------------


def test_every_project_module_is_in_a_layer():
    assert {_layer(m) for m in _modules()} <= set(LAYERS)


@pytest.mark.parametrize("layer", list(LAYERS))
def test_imports_point_only_at_the_layers_a_layer_may_use(layer):
    allowed = {layer, *LAYERS[layer][1]}
    offenders = [
        f"{_modules()[module].relative_to(ROOT)}:{line} ({layer}) imports {name} ({_layer(target)})"
        for module in _in(layer) for name, line, _ in _imports(module)
        if (target := _own(name)) and target != module and _layer(target) not in allowed
    ]
    assert not offenders


def test_the_library_and_services_never_import_a_tool_or_the_test_models():
    below_tools = [m for m in _modules() if _layer(m) not in ("tools", "tests")]
    offenders = [f"{m} imports {name}" for m in below_tools for name, _, _ in _imports(m)
                 if (t := _own(name)) and (_layer(t) in ("tools", "tests") or (_layer(t) == "testing"
                                                                               and _layer(m) != "testing"))]
    assert not offenders


# -- 2. what an import loads ---------------------------------------------------------------------


@pytest.mark.parametrize("layer", ["core", "runtime", "leaf"])
def test_the_core_the_engine_and_the_leaves_load_no_grpc(layer):
    offenders = {m: _grpc(_external(m, lazy=True)) for m in _in(layer)}
    offenders.update({m: _grpc(_external(m, lazy=False)) for m in _loaded_by(_in(layer))})
    assert not {m: found for m, found in offenders.items() if found}


@pytest.mark.parametrize("layer", ["sdk", "cli", "leaf"])
def test_the_sdk_and_the_light_cli_need_only_grpcio_and_protobuf_at_import(layer):
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    loaded = _loaded_by(_in(layer))
    offenders = {m: _external(m, lazy=False) - stdlib - LIGHT_PACKAGES for m in loaded}
    assert not {m: found for m, found in offenders.items() if found}
    assert not [m for m in loaded if _layer(m) not in ("leaf", "sdk", "cli")]


def test_the_core_imports_nothing_with_io():
    io = ("grpc", "redis", "transformers", "fastapi", "kubernetes")
    offenders = [f"{m} imports {package}" for m in _in("core") for package in _external(m, lazy=True)
                 if package in io]
    assert not offenders


@pytest.mark.parametrize("package", ["specdec.core", "specdec.core.acceptance", "specdec.core.sampling",
                                     "specdec.core.policy", "specdec.core.ngram", "specdec.core.suffix",
                                     "specdec.runtime", "specdec.runtime.batching", "specdec.errors"])
def test_a_library_import_loads_no_grpc_client_or_server_code(package):
    loaded = _loaded_after(f"import {package}")
    assert package in loaded and not _grpc(loaded)
    assert not {m for m in loaded if m.startswith(("specdec.client", "specdec.server", "specdec.channel"))}


def test_the_sdk_loads_on_first_use_and_brings_no_server_code():
    loaded = _loaded_after("import specdec")
    assert {m for m in loaded if m.startswith("specdec")} == {"specdec"} and not _grpc(loaded)
    loaded = _loaded_after("from specdec import Client, SpecdecError; from specdec.client import call_metadata; "
                           "call_metadata('token')")
    assert "specdec.client" in loaded
    assert not {m for m in loaded if m.startswith(("specdec.server", "specdec.runtime", "specdec.core"))}
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "transformers", "pydantic", "fastapi", "redis")}


def test_the_cli_parser_loads_no_service_packages():
    loaded = _loaded_after("from specdec.cli import build_parser; build_parser()")
    heavy = ("torch", "transformers", "pydantic", "fastapi", "redis", "kubernetes")
    assert not {m for m in loaded if m.split(".")[0] in heavy}


def test_tool_subcommands_register_through_entry_points():
    from specdec.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"draft", "loadtest", "up", "down", "generate", "chat", "status"} <= set(commands)


# -- 3. no import cycle --------------------------------------------------------------------------


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_among_the_modules_of_any_project_file():
    assert _cycles(_edges(lazy=True)) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# -- 4. short functions --------------------------------------------------------------------------


def test_no_function_in_the_library_services_or_gateway_is_over_a_screen():
    offenders = []
    for package in ("specdec", *SERVICES):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                    if lines > MAX_FUNCTION_LINES:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not offenders, f"over {MAX_FUNCTION_LINES} lines: split them"


def test_the_vllm_proposer_imports_without_vllm_torch_or_grpc():
    loaded = _loaded_after("import specdec.integrations.vllm")
    assert not {m for m in loaded if m.split(".")[0] in ("vllm", "torch", "transformers", *GRPC)}
