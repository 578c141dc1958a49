"""The default KV budget fits the container the service runs in: the memory it may take is the smaller
of the machine's available memory and its cgroup's limit (v2 `memory.max`, v1
`memory.limit_in_bytes`, on its own cgroup or an ancestor) less what the cgroup holds, read from
cgroup trees laid out here as the kernel lays them out."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from specdec.runtime import kv, memory

GiB = 1 << 30


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def proc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(text)
    return path


def test_cgroup_v2_in_a_namespace_reads_the_mounts_own_limit(tmp_path):
    """A pod: the container's cgroup is mounted at /sys/fs/cgroup and /proc/self/cgroup says `0::/`."""
    root = tree(tmp_path / "cg", {"cgroup.controllers": "cpu memory", "memory.max": str(4 * GiB),
                                  "memory.current": str(GiB + 300), "memory.stat": "anon 1\ninactive_file 300\n"})
    found = memory.cgroup_memory(proc(tmp_path, "0::/\n"), root)
    assert found is not None and (found.limit, found.used, found.headroom) == (4 * GiB, GiB, 3 * GiB)


def test_cgroup_v2_on_a_host_takes_the_tightest_of_the_path_up(tmp_path):
    root = tree(tmp_path / "cg", {
        "cgroup.controllers": "memory",
        "kubepods/memory.max": str(64 * GiB), "kubepods/memory.current": str(10 * GiB),
        "kubepods/pod1/memory.max": str(4 * GiB), "kubepods/pod1/memory.current": str(GiB),
        "kubepods/pod1/ctr/memory.max": "max", "kubepods/pod1/ctr/memory.current": str(GiB),
    })
    found = memory.cgroup_memory(proc(tmp_path, "0::/kubepods/pod1/ctr\n"), root)
    assert found is not None and found.limit == 4 * GiB and found.headroom == 3 * GiB
    assert found.source.endswith("kubepods/pod1/memory.max")


def test_cgroup_v1_memory_hierarchy_and_its_unlimited_value(tmp_path):
    root = tree(tmp_path / "cg", {
        "memory/memory.limit_in_bytes": "9223372036854771712",
        "memory/docker/abc/memory.limit_in_bytes": str(2 * GiB),
        "memory/docker/abc/memory.usage_in_bytes": str(GiB),
        "memory/docker/abc/memory.stat": "cache 5\ntotal_inactive_file 268435456\n",
    })
    cgroups = "12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n"
    found = memory.cgroup_memory(proc(tmp_path, cgroups), root)
    assert found is not None and found.limit == 2 * GiB and found.headroom == GiB + 256 * 2**20
    unlimited = tree(tmp_path / "free", {"memory/memory.limit_in_bytes": "9223372036854771712",
                                        "memory/memory.usage_in_bytes": "1"})
    assert memory.cgroup_memory(proc(tmp_path, "4:memory:/\n"), unlimited) is None


def test_no_cgroup_files_means_no_limit(tmp_path):
    assert memory.cgroup_memory(proc(tmp_path, "0::/\n"), tmp_path / "nothing") is None
    assert memory.cgroup_memory(tmp_path / "no-proc-file", tmp_path) is None
    root = tree(tmp_path / "junk", {"cgroup.controllers": "memory", "memory.max": "lots"})
    assert memory.cgroup_memory(proc(tmp_path, "0::/\n"), root) is None


@pytest.mark.parametrize("machine, limit, expected", [
    (64 * GiB, 4 * GiB, 3 * GiB // 2),  # a pod on a large node: its limit, less what it holds, halved
    (2 * GiB, 4 * GiB, GiB),  # a small machine: what it has
])
def test_the_default_budget_is_half_of_what_the_process_can_still_take(tmp_path, monkeypatch, machine, limit,
                                                                        expected):
    root = tree(tmp_path / "cg", {"cgroup.controllers": "memory", "memory.max": str(limit),
                                  "memory.current": str(GiB)})
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: SimpleNamespace(available=machine))
    monkeypatch.setattr(memory, "PROC_CGROUP", proc(tmp_path, "0::/\n"))
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    assert kv.default_budget_bytes("cpu") == expected
