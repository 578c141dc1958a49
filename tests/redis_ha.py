"""Real Redis high-availability deployments on loopback: a Redis Cluster (masters with replicas)
and a master + replica watched by a Sentinel. Every process is stopped on `stop()` (the fixtures
call it even when a test fails); masters are killed with SIGKILL to force a failover."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from specdec.launcher import free_port
from tests.cluster import stop_processes

HOST = "127.0.0.1"
NODE_TIMEOUT_MS = 1000  # a replica takes over a dead master after about two of these


def binaries() -> tuple[str, str]:
    """redis-server and redis-cli from PATH; the test is skipped without them."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not (server and cli):
        pytest.skip("redis-server and redis-cli are needed for Redis Cluster and Sentinel tests")
    return server, cli


def wait_for(what: str, check, timeout_s: float = 30.0, every_s: float = 0.1):
    """Poll `check()` until it returns something truthy; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
            if result:
                return result
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(every_s)


def node_args(port: int, root: Path) -> list[str]:
    """A loopback redis-server without persistence: a failover is the only way its data survives."""
    return ["--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no", "--dir", str(root)]


class RedisProcesses:
    """redis-server processes by port, each logging to its own file in `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.server, self.cli = binaries()
        self.procs: dict[int, subprocess.Popen] = {}

    def spawn(self, port: int, *args: str) -> int:
        with open(self.root / f"redis-{port}.log", "ab") as log:
            proc = subprocess.Popen([self.server, *args], stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        self.procs[port] = proc
        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {port} exited; see {self.root}/redis-{port}.log")
            # The server that answers must be this process: another one on the port would pass a PING.
            return self.client(port).info("server")["process_id"] == proc.pid
        wait_for(f"redis on port {port}", up, 20)
        return port

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host=HOST, port=port, socket_timeout=2, decode_responses=True)

    def kill(self, port: int) -> None:
        """SIGKILL: no shutdown, no last save, no goodbye to the replicas."""
        proc = self.procs[port]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def wait_replicated(self, master: int) -> None:
        """Until every replica of `master` has acknowledged all it was sent (replication is asynchronous)."""
        def caught_up() -> bool:
            info = self.client(master).info("replication")
            replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            return bool(replicas) and all(r["offset"] == info["master_repl_offset"] for r in replicas)
        wait_for(f"the replicas of {master} to catch up", caught_up, 10)

    def signal(self, port: int, signum: int) -> None:
        os.kill(self.procs[port].pid, signum)

    def alive(self) -> list[int]:
        return [port for port, proc in self.procs.items() if proc.poll() is None]

    def stop(self) -> None:
        stop_processes(self.procs.values())


class LocalCluster(RedisProcesses):
    """A Redis Cluster of `masters` masters with one replica each, on free loopback ports."""

    def start(self, masters: int = 3) -> LocalCluster:
        ports = [free_port() for _ in range(2 * masters)]
        for port in ports:
            self.spawn(port, *node_args(port, self.root), "--cluster-enabled", "yes",
                       "--cluster-port", str(free_port()),  # the bus: port + 10000 may be taken or beyond 65535
                       "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS))
        subprocess.run([self.cli, "--cluster", "create", *(f"{HOST}:{p}" for p in ports), "--cluster-replicas", "1",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait_healthy(masters)
        return self

    @property
    def nodes(self) -> list[tuple[str, int]]:
        return [(HOST, port) for port in self.alive()]

    def cluster_nodes(self) -> list[dict]:
        """CLUSTER NODES as seen by a live node: port, flags, master id and slot ranges of each."""
        lines = self.client(self.alive()[0]).execute_command("CLUSTER", "NODES").splitlines()
        nodes = []
        for line in lines:
            fields = line.split()
            slots = [tuple(int(x) for x in r.split("-")) if "-" in r else (int(r), int(r))
                     for r in fields[8:] if not r.startswith("[")]
            nodes.append({"id": fields[0], "port": int(fields[1].split("@")[0].rsplit(":", 1)[1]),
                          "flags": fields[2].split(","), "master": fields[3], "slots": slots})
        return nodes

    def wait_healthy(self, masters: int, timeout_s: float = 60.0) -> None:
        """Every live node says the cluster is ok, and every live replica is in sync with its master."""
        def healthy() -> bool:
            nodes = self.cluster_nodes()
            live = [n for n in nodes if "fail" not in n["flags"] and "fail?" not in n["flags"]
                    and n["port"] in self.alive()]
            if sum("master" in n["flags"] and n["slots"] != [] for n in live) != masters:
                return False
            for port in self.alive():
                client = self.client(port)
                if "cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    return False
                info = client.info("replication")
                if info["role"] == "slave" and info.get("master_link_status") != "up":
                    return False
            return True
        try:
            wait_for("the cluster to be ok", healthy, timeout_s)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; the nodes say:\n{self.describe()}") from None

    def describe(self) -> str:
        """What each node says of the cluster, and the end of its log: for a failure message."""
        parts = []
        for port, proc in self.procs.items():
            parts.append(f"--- node {port} (pid {proc.pid}, exit {proc.poll()})")
            try:
                client = self.client(port)
                parts.append(client.execute_command("CLUSTER", "NODES").strip())
                parts.append(" ".join(line for line in client.execute_command("CLUSTER", "INFO").split()
                                      if line.startswith(("cluster_state", "cluster_known", "cluster_size"))))
            except (redis.RedisError, OSError) as e:
                parts.append(f"unreachable: {e}")
            log = self.root / f"redis-{port}.log"
            parts.extend(log.read_text(errors="replace").splitlines()[-8:] if log.exists() else [])
        return "\n".join(parts)

    def master_for(self, key: str, timeout_s: float = 30.0) -> int:
        """The port of the live master serving `key`'s slot. Right after a failover the node asked may not
        have heard of the promotion yet (gossip takes a moment): wait until it names a live master."""
        slot = self.client(self.alive()[0]).execute_command("CLUSTER", "KEYSLOT", key)

        def serving() -> int:
            return next((n["port"] for n in self.cluster_nodes() if "master" in n["flags"]
                         and not {"fail", "fail?"} & set(n["flags"]) and n["port"] in self.alive()
                         and any(lo <= slot <= hi for lo, hi in n["slots"])), 0)
        return wait_for(f"a live master for slot {slot}", serving, timeout_s)


class LocalSentinel(RedisProcesses):
    """A master, its replica, and one Sentinel (quorum 1) that fails over after 1 s of silence."""

    NAME = "specdec"

    def start(self) -> LocalSentinel:
        master, replica = free_port(), free_port()
        self.master = self.spawn(master, *node_args(master, self.root))
        self.replica = self.spawn(replica, *node_args(replica, self.root), "--replicaof", HOST, str(master))
        wait_for("the replica to sync", lambda: self.client(self.replica).info("replication")
                 .get("master_link_status") == "up")
        self.sentinel = free_port()
        conf = self.root / f"sentinel-{self.sentinel}.conf"  # a Sentinel rewrites its config: a file of its own
        conf.write_text(f"port {self.sentinel}\nbind {HOST}\ndir {self.root}\n"
                        f"sentinel monitor {self.NAME} {HOST} {self.master} 1\n"
                        f"sentinel down-after-milliseconds {self.NAME} {NODE_TIMEOUT_MS}\n"
                        f"sentinel failover-timeout {self.NAME} 10000\n")
        self.spawn(self.sentinel, str(conf), "--sentinel")
        wait_for("the sentinel to see the replica", lambda: any(
            r["port"] == self.replica and "s_down" not in r["flags"]
            for r in self.client(self.sentinel).sentinel_slaves(self.NAME)))
        return self

    def master_port(self) -> int:
        return int(self.client(self.sentinel).sentinel_get_master_addr_by_name(self.NAME)[1])

    def master_for(self, key: str) -> int:
        """The master's port, as the sentinel names it (every key lives there)."""
        return self.master_port()

    def wait_failover(self, old: int, timeout_s: float = 30.0) -> int:
        """The port of the new master, once the sentinel has promoted it."""
        def promoted() -> int:
            port = self.master_port()
            return port if port != old and self.client(port).info("replication")["role"] == "master" else 0
        return wait_for("the sentinel to promote the replica", promoted, timeout_s)
