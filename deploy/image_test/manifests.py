"""Rendered Kubernetes objects -> the containers that run them on one machine (`translate`).

Every Deployment, StatefulSet, DaemonSet and bare Pod becomes containers that keep the
manifests' own image, command, args, env, ports, user and group, read-only root, capabilities,
limits, volumes and probes; `helm test` Pods become test containers. Pure: nothing here runs.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
LOOPBACK = "127.0.0.1"


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
    volume: str  # key into ChartPod.volumes
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

    @property
    def words(self) -> list[str]:
        """Command and args, as one list."""
        return (self.command or []) + (self.args or [])


@dataclass
class ChartPod:
    """Everything a chart renders, as the containers of one pod on one loopback."""

    namespace: str
    hosts: list[str]  # every Service name, each resolving to the loopback
    volumes: dict[str, Volume]
    containers: list[Container]  # workloads (init containers first), then tests
    replicas: dict[str, int]  # as the chart asks; one runs here

    @property
    def workloads(self) -> list[Container]:
        return [c for c in self.containers if c.kind != "Test"]

    @property
    def tests(self) -> list[Container]:
        return [c for c in self.containers if c.kind == "Test"]


class TranslationError(ValueError):
    """A manifest this translator cannot run faithfully; the message names the object."""


_QUANTITY = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
             "Ti": 2**40, "m": 0.001}


def parse_quantity(value: Any) -> float:
    """A Kubernetes resource quantity (`4Gi`, `500m`, `2`) as a number."""
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value).strip())
    if not m or m.group(2) not in _QUANTITY:
        raise TranslationError(f"cannot read the quantity {value!r}")
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


def hosts_file(pod: ChartPod) -> str:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{LOOPBACK}\t{h}" for h in pod.hosts]
    return "\n".join(lines) + "\n"


# -- pieces of one object -------------------------------------------------------------------------


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
        raise TranslationError(f"probe port {port!r} is not a named port of the container ({sorted(ports)})")
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
    raise TranslationError(f"unknown probe {sorted(spec)}")


@dataclass
class _Context:
    """What every object of one rendering shares."""

    namespace: str
    cluster_domain: str
    data: dict[tuple[str, str], dict[str, bytes]]  # (kind, name) of a Secret or ConfigMap -> its data
    image_map: dict[str, str]
    extra_env: dict[str, dict[str, str]]
    hosts: list[str] = field(default_factory=list)
    volumes: dict[str, Volume] = field(default_factory=dict)

    def service_hosts(self, name: str) -> list[str]:
        """The names a Service is reached by, short to fully qualified."""
        return [name, f"{name}.{self.namespace}", f"{name}.{self.namespace}.svc",
                f"{name}.{self.namespace}.svc.{self.cluster_domain}"]


def _volume(owner: str, vol: dict, ctx: _Context) -> Volume:
    """One pod volume; emptyDir and Secret/ConfigMap volumes belong to their pod, a claim is shared."""
    vname = vol["name"]
    if "emptyDir" in vol:
        return Volume(f"{owner}.{vname}", "emptyDir")
    if "persistentVolumeClaim" in vol:
        return Volume(f"pvc.{vol['persistentVolumeClaim']['claimName']}", "pvc")
    if "secret" in vol or "configMap" in vol:
        src_kind = "Secret" if "secret" in vol else "ConfigMap"
        src = vol["secret"] if "secret" in vol else vol["configMap"]
        src_name = src.get("secretName") or src.get("name")
        values = ctx.data.get((src_kind, src_name))
        if values is None:
            if not src.get("optional"):
                raise TranslationError(f"{owner}: volume {vname} needs {src_kind} {src_name}, which is not rendered")
            values = {}
        if src.get("items"):
            values = {item["path"]: values[item["key"]] for item in src["items"]}
        kind = src_kind[0].lower() + src_kind[1:]
        return Volume(f"{owner}.{vname}", kind, values, int(src.get("defaultMode", 0o644)))
    raise TranslationError(f"{owner}: volume {vname} of type {sorted(set(vol) - {'name'})} is not supported")


def _env_value(owner: str, where: str, pod: dict, item: dict, ctx: _Context) -> str | None:
    """One `valueFrom` env entry (None: an optional reference that is missing)."""
    vf = item.get("valueFrom") or {}
    if "secretKeyRef" in vf or "configMapKeyRef" in vf:
        ref = vf.get("secretKeyRef") or vf["configMapKeyRef"]
        values = ctx.data.get(("Secret" if "secretKeyRef" in vf else "ConfigMap", ref["name"]))
        if values is None or ref["key"] not in values:
            if ref.get("optional"):
                return None
            raise TranslationError(f"{where}: env {item['name']} needs {ref['name']}/{ref['key']}")
        return values[ref["key"]].decode()
    if "fieldRef" in vf:
        return {"metadata.name": f"{owner}-0", "metadata.namespace": ctx.namespace,
                "status.podIP": LOOPBACK, "status.hostIP": LOOPBACK, "spec.nodeName": "localhost",
                "spec.serviceAccountName": pod.get("serviceAccountName", "default"),
                }.get(vf["fieldRef"]["fieldPath"], "")
    return ""  # resourceFieldRef and anything else: empty, as nothing here reads them


def _env(owner: str, pod: dict, spec: dict, component: str, ctx: _Context) -> dict[str, str]:
    """A container's environment: envFrom, then env in order (`$(VAR)` expanded), then extra_env."""
    env: dict[str, str] = {}
    for src in spec.get("envFrom") or []:
        ref = src.get("secretRef") or src.get("configMapRef") or {}
        values = ctx.data.get(("Secret" if "secretRef" in src else "ConfigMap", ref.get("name")), {})
        env.update({src.get("prefix", "") + k: v.decode() for k, v in values.items()})
    for item in spec.get("env") or []:
        value = expand(str(item["value"]), env) if "value" in item else _env_value(
            owner, f"{owner}/{spec['name']}", pod, item, ctx)
        if value is not None:
            env[item["name"]] = value
    env.update(ctx.extra_env.get(component, {}))
    return env


def _security(pod_sc: dict, sc: dict, where: str) -> dict[str, Any]:
    """The Container fields of a merged (pod + container) security context."""
    user = sc.get("runAsUser")
    if sc.get("runAsNonRoot") and user == 0:
        raise TranslationError(f"{where}: runAsNonRoot with runAsUser 0")
    caps = sc.get("capabilities") or {}
    return dict(
        user=None if user is None else int(user),
        group=None if sc.get("runAsGroup") is None else int(sc["runAsGroup"]),
        extra_groups=[int(g) for g in pod_sc.get("supplementalGroups") or []],
        fs_group=None if pod_sc.get("fsGroup") is None else int(pod_sc["fsGroup"]),
        run_as_non_root=bool(sc.get("runAsNonRoot")), read_only=bool(sc.get("readOnlyRootFilesystem")),
        cap_drop=[str(c) for c in caps.get("drop") or []], cap_add=[str(c) for c in caps.get("add") or []],
        no_new_privileges=sc.get("allowPrivilegeEscalation") is False,
        seccomp_unconfined=(sc.get("seccompProfile") or {}).get("type") == "Unconfined")


def _container(owner: str, kind: str, template: dict, spec: dict, init: bool, pod_volumes: dict[str, str],
               ctx: _Context) -> Container:
    """One container (or init container) of a pod template."""
    pod = template["spec"]
    where = f"{owner}/{spec['name']}"
    component = (template.get("metadata", {}).get("labels") or {}).get("app.kubernetes.io/component", "")
    pod_sc = pod.get("securityContext") or {}
    ports = {p["name"]: int(p["containerPort"]) for p in spec.get("ports") or [] if p.get("name")}
    env = _env(owner, pod, spec, component, ctx)
    limits = (spec.get("resources") or {}).get("limits") or {}
    probes = {k: p for k, p in (("startup", _probe(spec.get("startupProbe"), ports)),
                                ("readiness", _probe(spec.get("readinessProbe"), ports)),
                                ("liveness", _probe(spec.get("livenessProbe"), ports))) if p}
    mounts = []
    for m in spec.get("volumeMounts") or []:
        if m["name"] not in pod_volumes:
            raise TranslationError(f"{where}: mount of the unknown volume {m['name']}")
        mounts.append(Mount(pod_volumes[m["name"]], m["mountPath"], bool(m.get("readOnly")), m.get("subPath", "")))
    restart = pod.get("restartPolicy", "Always") != "Never" and kind != "Test"
    return Container(
        workload=owner, kind=kind, name=spec["name"], component=component,
        image=ctx.image_map.get(spec["image"], spec["image"]),
        command=[expand(str(a), env) for a in spec["command"]] if spec.get("command") else None,
        args=[expand(str(a), env) for a in spec["args"]] if spec.get("args") is not None else None,
        env=env, **_security(pod_sc, {**pod_sc, **(spec.get("securityContext") or {})}, where),
        workdir=spec.get("workingDir", ""), ports=ports, mounts=mounts, probes={} if init else probes,
        memory_limit=int(parse_quantity(limits["memory"])) if "memory" in limits else None,
        cpu_limit=parse_quantity(limits["cpu"]) if "cpu" in limits else None,
        restart=restart and not init, init=init, grace_s=int(pod.get("terminationGracePeriodSeconds", 30)))


def _pod_containers(owner: dict, template: dict, ctx: _Context) -> list[Container]:
    """The containers of one workload or Pod (init containers first); records its volumes and hosts."""
    name = owner["metadata"]["name"]
    kind = "Test" if owner["kind"] == "Pod" and _is_test(owner) else owner["kind"]
    if owner["kind"] == "StatefulSet" and owner["spec"].get("serviceName"):
        ctx.hosts += [f"{name}-0.{h}" for h in ctx.service_hosts(owner["spec"]["serviceName"])]
    pod_volumes: dict[str, str] = {}
    for vol in template["spec"].get("volumes") or []:
        volume = _volume(name, vol, ctx)
        if volume.kind == "pvc":  # one claim, shared by every pod that mounts it
            ctx.volumes.setdefault(volume.key, volume)
        else:
            ctx.volumes[volume.key] = volume
        pod_volumes[vol["name"]] = volume.key
    specs = [(True, c) for c in template["spec"].get("initContainers") or []]
    specs += [(False, c) for c in template["spec"]["containers"]]
    return [_container(name, kind, template, spec, init, pod_volumes, ctx) for init, spec in specs]


def _check_ports(containers: list[Container]) -> None:
    """Every workload shares one loopback: no two may listen on the same port."""
    seen: dict[int, str] = {}
    for c in containers:
        if c.kind == "Test":
            continue
        for port in c.ports.values():
            if port in seen and seen[port] != c.id:
                raise TranslationError(f"{c.id} and {seen[port]} both listen on {port}: they share one loopback")
            seen[port] = c.id


def translate(docs: list[dict], *, image_map: dict[str, str] | None = None, cluster_domain: str = "cluster.local",
              extra_env: dict[str, dict[str, str]] | None = None) -> ChartPod:
    """Rendered objects -> the containers of one pod (see the module docstring); `image_map` runs
    another image where a manifest names one, `extra_env` adds env by component."""
    namespaces = {d["metadata"].get("namespace") for d in docs if d["metadata"].get("namespace")}
    ctx = _Context(namespace=namespaces.pop() if len(namespaces) == 1 else "default", cluster_domain=cluster_domain,
                   data={(d["kind"], d["metadata"]["name"]): _data_of(d) for d in docs
                         if d["kind"] in ("Secret", "ConfigMap")},
                   image_map=image_map or {}, extra_env=extra_env or {})
    for svc in (d for d in docs if d["kind"] == "Service"):
        ctx.hosts += ctx.service_hosts(svc["metadata"]["name"])
    owners = [(d, d["spec"]["template"]) for d in docs if d["kind"] in WORKLOAD_KINDS]
    owners += [(d, d) for d in docs if d["kind"] == "Pod" and not _is_test(d)]
    owners += [(d, d) for d in docs if d["kind"] == "Pod" and _is_test(d)]
    containers: list[Container] = []
    replicas: dict[str, int] = {}
    for owner, template in owners:
        replicas[owner["metadata"]["name"]] = int(owner["spec"].get("replicas", 1)) \
            if owner["kind"] in WORKLOAD_KINDS else 1
        containers += _pod_containers(owner, template, ctx)
    _check_ports(containers)
    return ChartPod(ctx.namespace, sorted(set(ctx.hosts)), ctx.volumes, containers, replicas)
