"""`specdec up` in the foreground stops every process it started, whatever stops it: SIGTERM
(supervisors, `docker stop`, systemd, CI runners), SIGINT (Ctrl-C), SIGHUP (a closed terminal),
and even SIGKILL, after which its children must not outlive it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from specdec.launcher import free_port

STARTED = re.compile(r"^started (\S+)\s+pid (\d+)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead: it only waits for its parent to read its status
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][:1] != "Z"
    except FileNotFoundError:
        return False


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _up(tiny_models, tmp_path, until: str = "pipeline up") -> tuple[subprocess.Popen, dict[str, int], list[int]]:
    """A foreground `specdec up` on the tiny models with every service (gateway included), once
    it prints a line starting with `until` (by default: the pipeline is up): the process, the pid
    of each service started by then, and the ports of all."""
    ports = {name: free_port() for name in ("redis", "target", "draft", "orchestrator", "http")}
    cmd = [sys.executable, "-m", "specdec.cli", "up", "--target-model", str(tiny_models["target"]),
           "--target-dtype", "float64", "--target-threads", "1", "--draft-model", str(tiny_models["good_draft"]),
           "--draft-dtype", "float64", "--draft-threads", "1", "--proposer", "model",
           "--log-dir", str(tmp_path / "logs"), *[a for name, port in ports.items()
                                                  for a in (f"--{name}-port", str(port))]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    pids: dict[str, int] = {}
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        if m := STARTED.match(line):
            pids[m.group(1)] = int(m.group(2))
        if line.startswith(until) or time.monotonic() > deadline:
            break
    assert until != "pipeline up" or set(pids) == set(ports), f"not all services started: {pids}"
    return proc, pids, list(ports.values())


def _gone(pids: dict[str, int], ports: list[int], within_s: float) -> tuple[list[str], list[int]]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [name for name, pid in pids.items() if _alive(pid)]
        taken = [port for port in ports if not _port_free(port)]
        if not alive and not taken:
            break
        time.sleep(0.2)
    return alive, taken


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_stops_every_process_and_frees_every_port(tiny_models, tmp_path, sig):
    proc, pids, ports = _up(tiny_models, tmp_path)
    try:
        assert all(_alive(pid) for pid in pids.values())
        proc.send_signal(sig)  # at once: the signal may land anywhere after start-up
        assert proc.wait(timeout=60) == 0  # a requested stop is a clean exit
        alive, taken = _gone(pids, ports, within_s=5)  # `specdec up` waited for them: nothing is left
        assert not alive and not taken, (alive, taken)
    finally:
        _kill(proc, pids)


@pytest.mark.parametrize("signals", [1, 2])
def test_a_stop_signal_during_start_up_stops_what_was_started(tiny_models, tmp_path, signals):
    proc, pids, ports = _up(tiny_models, tmp_path, until="started draft")  # redis and target running too
    try:
        assert {"redis", "target", "draft"} <= set(pids)
        for _ in range(signals):  # a second one (an impatient supervisor) must not cut the shutdown short
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        assert proc.wait(timeout=60) == 1  # the pipeline never came up
        alive, taken = _gone(pids, ports, within_s=5)
        assert not alive and not taken, (alive, taken)
    finally:
        _kill(proc, pids)


def test_children_do_not_outlive_a_killed_specdec_up(tiny_models, tmp_path):
    proc, pids, ports = _up(tiny_models, tmp_path)
    proc.kill()  # SIGKILL: no handler runs in `specdec up` itself
    proc.wait(timeout=10)
    alive, taken = _gone(pids, ports, within_s=30)  # each child gets SIGTERM and shuts down
    _kill(proc, pids)  # leave nothing behind even if the assertion below fails
    assert not alive and not taken, (alive, taken)


def _kill(proc: subprocess.Popen, pids: dict[str, int]) -> None:
    """SIGKILL whatever a failed check left running."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    for pid in pids.values():
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
