"""What the kubelet does for the running containers: probe them and restart those that exit or
fail liveness. Runs in the pod's network namespace, so gRPC, TCP and HTTP probes reach the
containers' loopback ports as the kubelet's would; exec probes run with `podman exec`."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from deploy.image_test.manifests import LOOPBACK, Container, Probe
from deploy.image_test.podman import LABEL, log, podman


def check_probe(probe: Probe, container_name: str) -> bool:
    """One probe attempt, as the kubelet makes it (this process is in the pod's network namespace)."""
    try:
        if probe.kind == "exec":
            proc = subprocess.run(["podman", "exec", container_name, *probe.command], capture_output=True,
                                  timeout=probe.timeout_s + 10, check=False)
            return proc.returncode == 0
        if probe.kind == "tcp":
            with socket.create_connection((LOOPBACK, probe.port), timeout=probe.timeout_s):
                return True
        if probe.kind == "http":
            with urllib.request.urlopen(f"http://{LOOPBACK}:{probe.port}{probe.path}",
                                        timeout=probe.timeout_s) as resp:
                return 200 <= resp.status < 400
        if probe.kind == "grpc":
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            with grpc.insecure_channel(f"{LOOPBACK}:{probe.port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=probe.service), timeout=probe.timeout_s)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
    except Exception:  # noqa: BLE001 - any failure is a failed probe
        return False
    return False


@dataclass
class State:
    """One running container, as the kubelet tracks it."""

    container: Container
    name: str  # the podman container's name
    started: float = 0.0
    started_ok: bool = False
    ready: bool = False
    restarts: int = 0
    fails: dict[str, int] = field(default_factory=dict)
    due: dict[str, float] = field(default_factory=dict)
    backoff_until: float = 0.0

    def reset(self) -> None:
        self.started, self.started_ok, self.ready = time.monotonic(), False, False
        self.fails, self.due = {}, {}


class Kubelet(threading.Thread):
    """Probes and restarts the workload containers in the background."""

    def __init__(self, states: list[State]):
        super().__init__(daemon=True)
        self.states = states
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.events: list[str] = []

    def note(self, msg: str) -> None:
        log(msg)
        with self.lock:
            self.events.append(msg)

    def running(self) -> dict[str, str]:
        """podman's state ("running", "exited", ...) of every container of the image test, by name."""
        proc = podman("ps", "-a", "--filter", f"label={LABEL}", "--format", "json", check=False)
        try:
            found = json.loads(proc.stdout or "[]")
        except json.JSONDecodeError:
            return {}
        return {name: str(c.get("State", "")).lower() for c in found for name in c.get("Names") or []}

    def restart(self, s: State, why: str) -> None:
        s.restarts += 1
        self.note(f"{s.container.id}: {why}; restart {s.restarts}")
        podman("stop", "-t", "2", s.name, check=False, timeout=60)
        podman("start", s.name, check=False, timeout=60)
        s.reset()

    def _not_running(self, s: State, state: str, now: float) -> None:
        """A container that is not running: restarted (with backoff) if its pod restarts them."""
        if s.ready or s.started_ok:
            self.note(f"{s.container.id}: container {state}")
        s.ready = s.started_ok = False
        if s.container.restart and now >= s.backoff_until and state in ("exited", "stopped", "created"):
            s.restarts += 1
            s.backoff_until = now + min(10.0, 2.0 ** min(s.restarts, 4))
            self.note(f"{s.container.id}: exited; restart {s.restarts}")
            podman("start", s.name, check=False, timeout=60)
            s.reset()

    def _probe_result(self, s: State, kind: str, probe: Probe, ok: bool) -> bool:
        """Record one probe's outcome; True when it restarted the container."""
        if ok:
            s.fails[kind] = 0
            if kind == "startup":
                s.started_ok = True
                s.due.pop("readiness", None)
            elif kind == "readiness" and not s.ready:
                s.ready = True
                self.note(f"{s.container.id}: ready ({time.monotonic() - s.started:.0f} s after start)")
            return False
        s.fails[kind] = s.fails.get(kind, 0) + 1
        if kind == "readiness":
            if s.ready:
                self.note(f"{s.container.id}: not ready")
            s.ready = False
        elif s.fails[kind] >= probe.failure_threshold:
            self.restart(s, f"{kind} probe failed {s.fails[kind]} times")
            return True
        return False

    def _probe_running(self, s: State, now: float) -> None:
        """The probes that are due: startup until it passes, then readiness and liveness."""
        probes = s.container.probes
        order = ["startup"] if "startup" in probes and not s.started_ok else ["readiness", "liveness"]
        if not probes.get("startup"):
            s.started_ok = True
        for kind in order:
            probe = probes.get(kind)
            if probe is None:
                if kind == "readiness":
                    s.ready = True
                continue
            if now < s.due.get(kind, s.started + probe.initial_delay_s):
                continue
            s.due[kind] = now + probe.period_s
            if self._probe_result(s, kind, probe, check_probe(probe, s.name)):
                break

    def run(self) -> None:
        while not self.stop.is_set():
            states = self.running()
            now = time.monotonic()
            for s in self.states:
                state = states.get(s.name, "missing")
                if state == "running":
                    self._probe_running(s, now)
                else:
                    self._not_running(s, state, now)
            self.stop.wait(0.5)
