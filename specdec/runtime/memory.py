"""How much memory this process may still take: the machine's available memory, and its container's.

In a container (a Kubernetes pod), `/proc/meminfo` and `psutil.virtual_memory()` describe the whole
node: a pod limited to 4 GiB on a 256 GiB node would size its KV budget from the node and be
OOM-killed long before it evicted or refused anything. The limit that kills it is its cgroup's:
`memory.max` (cgroup v2) or `memory.limit_in_bytes` (v1), on its own cgroup or any ancestor that
the container sees. `available_bytes` is the smaller of the machine's available memory and the
tightest of those limits less what the cgroup already holds (less its reclaimable file cache, as
the kubelet counts a working set).

Where the cgroup files are: `/proc/self/cgroup` names this process's cgroup in each hierarchy
(`0::/path` for v2; `N:memory:/path` for v1's memory controller); the hierarchy is mounted at
`/sys/fs/cgroup` (v2), or `/sys/fs/cgroup/memory` (v1). Inside a cgroup namespace the path is `/`
and the mount is the container's own cgroup; on a host the path is below the mount. Either way the
walk goes from the process's cgroup up to the mount's root.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
UNLIMITED = 1 << 60
"""A v1 limit at or above this is "no limit" (the kernel reports one as 2**63 rounded down to a page)."""


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest memory limit on this process's cgroups: the limit, what the cgroup holding it
    uses now (without reclaimable file cache), and the file the limit was read from."""

    limit: int
    used: int
    source: str

    @property
    def headroom(self) -> int:
        return max(0, self.limit - self.used)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, name: str) -> int:
    """A field of a cgroup's memory.stat (0 when absent)."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _own_cgroups(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup path in the v2 hierarchy and in v1's memory hierarchy (None: not in one)."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _walk(mount: Path, path: str) -> list[Path]:
    """The cgroup directories from this process's up to the mount's root (just the root when the path
    is not below the mount: inside a cgroup namespace, the mount is the container's cgroup)."""
    here = mount / path.lstrip("/")
    if not here.is_dir():
        return [mount] if mount.is_dir() else []
    dirs = [here]
    while here != mount and mount in here.parents:
        here = here.parent
        dirs.append(here)
    return dirs


def _tightest(dirs: list[Path], limit_file: str, usage_file: str, inactive: str) -> CgroupMemory | None:
    best: CgroupMemory | None = None
    for folder in dirs:
        limit = _read_int(folder / limit_file)
        if limit is None or limit >= UNLIMITED:
            continue
        usage = _read_int(folder / usage_file) or 0
        used = max(0, usage - _stat(folder / "memory.stat", inactive))
        found = CgroupMemory(limit, used, str(folder / limit_file))
        if best is None or found.headroom < best.headroom:
            best = found
    return best


def cgroup_memory(proc_cgroup: Path | None = None, root: Path | None = None) -> CgroupMemory | None:
    """The tightest memory limit on this process's cgroup and its ancestors, v2 or v1, or None when there
    is none (or no cgroup file can be read). `proc_cgroup`, `root`: `PROC_CGROUP`, `CGROUP_ROOT`."""
    proc_cgroup, root = proc_cgroup or PROC_CGROUP, root or CGROUP_ROOT
    v2, v1 = _own_cgroups(proc_cgroup)
    found = []
    if v2 is not None:
        for mount in (root, root / "unified"):  # pure v2; the v2 part of a hybrid layout
            if (mount / "cgroup.controllers").exists():
                found.append(_tightest(_walk(mount, v2), "memory.max", "memory.current", "inactive_file"))
                break
    if v1 is not None:
        found.append(_tightest(_walk(root / "memory", v1), "memory.limit_in_bytes", "memory.usage_in_bytes",
                               "total_inactive_file"))
    limits = [one for one in found if one is not None]
    return min(limits, key=lambda one: one.headroom) if limits else None


def available_bytes(proc_cgroup: Path | None = None, root: Path | None = None) -> tuple[int, str]:
    """Bytes this process can still take, and where the figure comes from: the machine's available
    memory, or its cgroup's headroom when that is smaller."""
    machine = int(psutil.virtual_memory().available)
    cgroup = cgroup_memory(proc_cgroup, root)
    if cgroup is not None and cgroup.headroom < machine:
        return cgroup.headroom, (f"the cgroup limit of {cgroup.limit} bytes ({cgroup.source}) less the "
                                 f"{cgroup.used} it holds")
    return machine, "the machine's available memory"
