"""A stop requested while `specdec up` starts or runs ends every wait, even when no exception reaches it.

The launcher's signal handler sets a flag and raises; the raise can be dropped (Python runs handlers at
the next bytecode of the main thread, which may be a finaliser, where exceptions are only printed), so
each wait polls the flag. Here the flag is set from another thread and nothing is raised: only the
polling can end the wait.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from specdec.launcher import Pipeline, PipelineSpec, Stopped, StopRequest, _wait_redis, wait_healthy, wait_http_healthy


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers: every health check waits out its timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def _stop_soon(stop: StopRequest, reason: str, after_s: float = 0.5) -> threading.Timer:
    timer = threading.Timer(after_s, stop.request, args=(reason,))
    timer.start()
    return timer


def _ends_with_stop(wait, reason: str) -> float:
    stop = StopRequest()
    _stop_soon(stop, reason)
    started = time.monotonic()
    with pytest.raises(Stopped, match=reason):
        wait(stop)
    return time.monotonic() - started


def test_a_grpc_health_wait_ends_when_a_stop_is_requested(silent_port):
    took = _ends_with_stop(lambda stop: wait_healthy(f"127.0.0.1:{silent_port}", 300, stop=stop), "SIGTERM")
    assert took < 60  # far below the 300 s it would otherwise wait


def test_an_http_health_wait_ends_when_a_stop_is_requested(silent_port):
    took = _ends_with_stop(lambda stop: wait_http_healthy(f"http://127.0.0.1:{silent_port}/health", 300,
                                                          stop=stop), "SIGHUP")
    assert took < 60


def test_a_redis_wait_ends_when_a_stop_is_requested(silent_port):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        took = _ends_with_stop(lambda stop: _wait_redis("127.0.0.1", silent_port, sleeper, 300, stop=stop),
                               "SIGINT")
        assert took < 60
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_wait_on_running_processes_ends_on_a_stop_or_when_one_exits(tmp_path):
    pipeline = Pipeline(PipelineSpec(log_dir=str(tmp_path)))
    long = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    short = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    try:
        pipeline.procs = {"long": long}
        _stop_soon(pipeline.stopping, "SIGTERM")
        with pytest.raises(Stopped, match="SIGTERM"):
            pipeline.wait(poll_s=0.1)
        pipeline.stopping.clear()
        pipeline.procs = {"long": long, "short": short}
        assert pipeline.wait(poll_s=0.1) == ["short"]  # the one that exited, named
    finally:
        for proc in (long, short):
            proc.kill()
            proc.wait()



def _down(monkeypatch, tmp_path) -> int:
    """`specdec down` with its run directory under `tmp_path`; its exit status."""
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        main(["down"])
    return exited.value.code


def _stale(identity: dict | None) -> dict | None:
    """`identity` as recorded for a process that held the same PID before (another start time)."""
    return None if identity is None else {**identity, "started": identity["started"] - 1}


@pytest.mark.parametrize("recorded", ["none (an older run file)", "another start time", "another boot"])
def test_down_leaves_alone_an_unrelated_process_that_took_a_recorded_pid(monkeypatch, tmp_path, capsys, recorded):
    """After a reboot the run file's PIDs may belong to anything: `specdec down` signals only a process
    that is still the one it started (same boot, start time and command line)."""
    import json

    from specdec.launcher import process_identity, state_file

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    stranger = subprocess.Popen(["sleep", "600"])
    try:
        now = process_identity(stranger.pid)
        identity = {"none (an older run file)": None, "another start time": _stale(now),
                    "another boot": {**now, "boot": "an-earlier-boot"}}[recorded]
        # A run file as an earlier `specdec up --detach` wrote it, whose PID is now the stranger's.
        state = {"pids": {"orchestrator": stranger.pid}, "plan": {}}
        if identity is not None:
            state["identities"] = {"orchestrator": identity}
        state_file().write_text(json.dumps(state))
        assert _down(monkeypatch, tmp_path) == 0
        time.sleep(0.3)
        assert stranger.poll() is None, "specdec down killed a process it did not start"
        assert f"orchestrator: pid {stranger.pid} is no longer the process" in capsys.readouterr().out
        assert not state_file().exists()  # the stale file is gone: the next `specdec up --detach` may start
    finally:
        stranger.kill()
        stranger.wait()


def test_down_stops_the_processes_it_recorded(monkeypatch, tmp_path):
    from specdec.launcher import Pipeline, PipelineSpec, state_file

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    pipeline = Pipeline(PipelineSpec(log_dir=str(tmp_path)))
    pipeline.procs = {"redis": subprocess.Popen(["sleep", "600"]),
                      "target": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])}
    try:
        pipeline.save()
        assert _down(monkeypatch, tmp_path) == 0
        for proc in pipeline.procs.values():
            assert proc.wait(timeout=15) is not None
        assert not state_file().exists()
    finally:
        for proc in pipeline.procs.values():
            proc.kill()
            proc.wait()


def test_a_process_identity_reads_names_with_spaces_and_parentheses(tmp_path):
    from specdec.launcher import process_identity

    odd = tmp_path / "a b) (c"
    odd.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(odd), "600"])
    try:
        identity = process_identity(proc.pid)
        assert identity is not None and identity["cmdline"][:2] == [str(odd), "600"]
        assert identity == process_identity(proc.pid)  # stable while the process lives
    finally:
        proc.kill()
        proc.wait()
    assert process_identity(proc.pid) is None


def test_a_process_identity_read_right_after_popen_has_its_command_line():
    """Popen returns while the child may still be inside its exec (its command line reads empty
    then): the identity waits for it, or `down` would later take the process for another."""
    from specdec.launcher import process_identity

    procs = [subprocess.Popen(["/bin/sleep", "600"]) for _ in range(20)]
    try:
        assert [process_identity(p.pid)["cmdline"][:2] for p in procs] == [["/bin/sleep", "600"]] * 20
    finally:
        for p in procs:
            p.kill()
            p.wait()
