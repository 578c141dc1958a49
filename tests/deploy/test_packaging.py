"""`pip install .` gives a working package: the gRPC stubs are generated from protos/ at build
time, and every console script and service entry point runs from the installed wheel alone.

Without extras it is the light install: the SDK and the client commands over grpcio and protobuf,
with no torch, transformers, FastAPI or Kubernetes client; the services come with
`pip install '.[serve]'`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return [f for f in out.stdout.splitlines() if (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the source tree as git sees it: no generated stubs, no build leftovers."""
    if shutil.which("git") is None:
        pytest.skip("git is needed to list the source tree")
    src = tmp_path_factory.mktemp("src")
    for name in _tracked_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    assert not list(src.glob("specdec/v1/*_pb2*")), "the copy must start without stubs"
    return src


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    """A wheel built from a copy of the source tree that holds no generated stubs."""
    src = source
    out = tmp_path_factory.mktemp("dist")
    # No build isolation: the build needs setuptools and grpcio-tools, both in the test venv
    # (the network may be unreachable); a normal `pip install .` fetches them itself.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True)
    (built,) = out.glob("specdec-*.whl")
    return built


def test_the_wheel_contains_the_generated_stubs_and_the_tool_commands(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for proto in ("common", "draft", "target", "orchestrator"):
        assert f"specdec/v1/{proto}_pb2.py" in names and f"specdec/v1/{proto}_pb2_grpc.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "specdec = specdec.cli:main" in text and "loadtest = loadtest.cli:add_loadtest_parser" in text


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; its dependencies are borrowed from the test venv
    through a path entry (a plain path: the test venv's own .pth files, such as the editable
    install of this checkout, are not run)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", purelib],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, text=True)
    return venv


@pytest.mark.parametrize("command", [
    ["bin/specdec", "--help"],
    ["bin/specdec", "loadtest", "--help"],
    ["bin/python", "-m", "orchestrator", "--help"],
    ["bin/python", "-m", "draft_service", "--help"],
    ["bin/python", "-m", "target_service", "--help"],
    ["bin/python", "-m", "http_gateway", "--help"],
])
def test_every_entry_point_runs_from_the_installed_wheel(installed, tmp_path, command):
    result = subprocess.run([str(installed / command[0]), *command[1:]], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    where = subprocess.run([str(installed / "bin" / "python"), "-c",
                            "import specdec.v1.orchestrator_pb2_grpc as m; print(m.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(installed)), where  # the wheel's own stubs, not this checkout's


# What a light install must not bring: the services' packages.
HEAVY = ("torch", "transformers", "fastapi", "kubernetes", "redis", "pydantic", "llguidance", "opentelemetry")
_PROBE = """
import importlib.util, json, sys
from specdec import Client, AsyncClient, SpecdecError
from specdec.errors import InvalidArgument
client = Client("127.0.0.1:9")
client.close()
print(json.dumps({"loaded": sorted(sys.modules), "installed": [m for m in %r if importlib.util.find_spec(m)]}))
"""


@pytest.fixture(scope="module")
def light(source, tmp_path_factory) -> Path:
    """A clean venv (no system site-packages) with the project installed from PyPI as a user would:
    the wheel built by `pip wheel --no-deps` (build isolation: setuptools and grpcio-tools come
    from PyPI), then installed without extras."""
    out, venv = tmp_path_factory.mktemp("light-dist"), tmp_path_factory.mktemp("light-venv")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(out), str(source)], check=True, capture_output=True,
                   text=True, timeout=300)
    (built,) = out.glob("specdec-*.whl")
    subprocess.run([*pip, "install", str(built)], check=True, capture_output=True, text=True, timeout=300)
    return venv


@pytest.mark.network
def test_the_light_install_is_the_sdk_without_the_services_packages(light, tmp_path):
    proc = subprocess.run([str(light / "bin" / "python"), "-c", _PROBE % (HEAVY,)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    probe = json.loads(proc.stdout)
    assert probe["installed"] == [], f"a light install brought {probe['installed']}"
    assert "specdec.client" in probe["loaded"] and "grpc" in probe["loaded"]
    assert not [m for m in probe["loaded"] if m.split(".")[0] in HEAVY or m.startswith("specdec.server")]
    listed = subprocess.run([str(light / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                            capture_output=True, text=True, check=True).stdout
    names = {p["name"].lower() for p in json.loads(listed)} - {"pip", "setuptools", "wheel"}
    assert names <= {"specdec", "grpcio", "protobuf", "typing-extensions", "typing_extensions"}, names


@pytest.mark.network
def test_the_light_cli_runs_the_client_commands_and_names_the_serve_extra(light, tmp_path):
    def specdec(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(light / "bin" / "specdec"), *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)

    assert specdec("--help").returncode == 0
    status = specdec("status", "--address", "127.0.0.1:9", "--timeout", "2")
    assert status.returncode == 2 and "UNREACHABLE" in status.stdout, status.stderr
    for command in (["up"], ["draft", "build", "--layers", "2", "--budget", "1", "--out", str(tmp_path / "d")]):
        refused = specdec(*command)
        assert refused.returncode != 0 and "pip install 'specdec[serve]'" in refused.stderr, refused.stderr
