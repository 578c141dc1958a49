"""The translated containers as podman sees them: `podman run` arguments, the files they mount
(env files, a hosts file, volume folders), and the podman command itself."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

from deploy.image_test.manifests import ChartPod, Container, TranslationError, hosts_file

LABEL = "io.specdec.image-test"


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ...: exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


def log(msg: str) -> None:
    print(f"[image-test {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _security_args(c: Container) -> list[str]:
    args: list[str] = []
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
    return args


def run_args(c: Container, *, pod: str, run_dir: Path, run_id: str) -> list[str]:
    """`podman run` arguments (without `podman run` itself) for one container."""
    args = ["--pod", pod, "--name", f"{pod}-{c.id}", "--label", f"{LABEL}={run_id}",
            "--label", f"{LABEL}.workload={c.workload}",
            "--env-file", str(run_dir / "env" / c.id), "-v", f"{run_dir / 'hosts'}:/etc/hosts:ro",
            "--stop-timeout", str(c.grace_s), "--pull", "never", *_security_args(c)]
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
    if c.args is not None:  # a command without args drops the image's CMD, as --entrypoint does
        args += c.args
    return args


def _write_env_files(pod: ChartPod, run_dir: Path) -> None:
    (run_dir / "env").mkdir(parents=True, exist_ok=True)
    for c in pod.containers:
        lines = []
        for k, v in c.env.items():
            if "\n" in v:
                raise TranslationError(f"{c.id}: env {k} has a newline, which an env file cannot hold")
            lines.append(f"{k}={v}")
        path = run_dir / "env" / c.id
        path.write_text("\n".join(lines) + "\n")
        os.chmod(path, 0o600)


def _write_volumes(pod: ChartPod, run_dir: Path) -> None:
    owners: dict[str, int | None] = {}
    for c in pod.containers:
        for m in c.mounts:
            owners.setdefault(m.volume, c.fs_group)
    for key, vol in pod.volumes.items():
        folder = run_dir / "volumes" / key
        folder.mkdir(parents=True, exist_ok=True)
        for rel, content in vol.files.items():
            f = folder / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(content)
            os.chmod(f, vol.mode)
        gid = owners.get(key)
        if vol.kind in ("emptyDir", "pvc"):
            # As the kubelet makes them: world-writable, group fsGroup with setgid.
            if gid is not None and os.geteuid() == 0:
                os.chown(folder, 0, gid)
            os.chmod(folder, 0o2777 if gid is not None else 0o777)
        else:
            # A Secret's or ConfigMap's files belong to group fsGroup (its defaultMode, e.g. 0440, lets the
            # pod's user read them through that group), as the kubelet writes them.
            if gid is not None and os.geteuid() == 0:
                for rel in vol.files:
                    os.chown(folder / rel, 0, gid)
            os.chmod(folder, 0o755)


def prepare(pod: ChartPod, run_dir: Path) -> None:
    """Write the hosts file, one env file per container and the volumes' folders and files."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "hosts").write_text(hosts_file(pod))
    os.chmod(run_dir / "hosts", 0o644)
    _write_env_files(pod, run_dir)
    _write_volumes(pod, run_dir)


def command_lines(pod: ChartPod, name: str, run_dir: Path) -> list[str]:
    """The `podman run` command lines of every container, for reading."""
    return ["podman run -d " + shlex.join(run_args(c, pod=name, run_dir=run_dir, run_id="RUN"))
            for c in pod.containers]


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


def container_log(name: str) -> list[str]:
    """Everything a container has written, as lines."""
    out = podman("logs", name, check=False)
    return (out.stdout + out.stderr).splitlines()
