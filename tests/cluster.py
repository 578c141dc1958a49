"""Real processes for fault tests: several replicas of a role, killed with SIGKILL and restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc

from specdec.launcher import _wait_redis, free_port, redis_server_binary, wait_healthy
from specdec.v1 import common_pb2, orchestrator_pb2 as pb, orchestrator_pb2_grpc, target_pb2_grpc

HOST = "127.0.0.1"


class Cluster:
    """Processes by name; each keeps its command so it can be restarted on the same port."""

    def __init__(self, log_dir: Path, models: dict[str, Path]) -> None:
        self.log_dir = log_dir
        self.models = models
        self.procs: dict[str, subprocess.Popen] = {}
        self.cmds: dict[str, list[str]] = {}
        self.addresses: dict[str, str] = {}

    def _spawn(self, name: str) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(self.cmds[name], stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        self.procs[name] = proc
        return proc

    def start(self, name: str, cmd: list[str], address: str, redis_port: int | None = None) -> str:
        self.cmds[name], self.addresses[name] = cmd, address
        proc = self._spawn(name)
        if redis_port is not None:
            _wait_redis(HOST, redis_port, proc, timeout_s=20)
        else:
            wait_healthy(address, 300, proc)
        return address

    def redis(self, name: str = "redis", data_dir: Path | None = None) -> int:
        port = free_port()
        cmd = [redis_server_binary(), "--port", str(port), "--bind", HOST]
        if data_dir is None:
            cmd += ["--save", "", "--appendonly", "no"]
        else:  # persistence: every write is in the append-only file before it is acknowledged
            cmd += ["--dir", str(data_dir), "--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        self.start(name, cmd, f"{HOST}:{port}", redis_port=port)
        return port

    def target(self, name: str, *extra: str) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "target_service", "--host", HOST, "--port", str(port),
               "--model", str(self.models["target"]), "--dtype", "float64", "--threads", "1", *extra]
        return self.start(name, cmd, f"{HOST}:{port}")

    def draft(self, name: str, model: str = "good_draft", *extra: str) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "draft_service", "--host", HOST, "--port", str(port), "--proposer", "model",
               "--model", str(self.models[model]), "--dtype", "float64", "--threads", "1", *extra]
        return self.start(name, cmd, f"{HOST}:{port}")

    def orchestrator(self, name: str, targets: list[str], drafts: list[str], redis_port: int, *extra: str) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "orchestrator", "--host", HOST, "--port", str(port),
               "--target", ",".join(targets), "--draft", ",".join(drafts),
               "--redis-url", f"redis://{HOST}:{redis_port}/0", "--model", str(self.models["target"]),
               "--draft-length", "4", "--draft-retry-s", "0.5", "--replica-refresh-s", "0.5", *extra]
        return self.start(name, cmd, f"{HOST}:{port}")

    def kill(self, name: str) -> None:
        """SIGKILL: no cleanup, no graceful shutdown."""
        proc = self.procs[name]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def restart(self, name: str, wait: bool = True) -> None:
        proc = self._spawn(name)
        if wait:
            if self.cmds[name][0] == redis_server_binary():
                _wait_redis(HOST, int(self.addresses[name].rsplit(":", 1)[1]), proc, timeout_s=20)
            else:
                wait_healthy(self.addresses[name], 300, proc)

    def stop(self) -> None:
        stop_processes(self.procs.values())


def stop_processes(procs) -> None:
    """SIGTERM every process still running, then SIGKILL what has not exited 10 s later."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def model_info(address: str, stub_class=target_pb2_grpc.TargetServiceStub) -> common_pb2.ModelInfo:
    """GetInfo of a target (or, with `draft_pb2_grpc.DraftServiceStub`, a draft) replica."""
    with grpc.insecure_channel(address) as ch:
        return stub_class(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)


def cached_sessions(address: str) -> int:
    return model_info(address).cached_sessions


def orchestrator_stub(address: str) -> tuple[grpc.Channel, orchestrator_pb2_grpc.OrchestratorStub]:
    ch = grpc.insecure_channel(address)
    return ch, orchestrator_pb2_grpc.OrchestratorStub(ch)


def request(prompt: str, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, **fields)
