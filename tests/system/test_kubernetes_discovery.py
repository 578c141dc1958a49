"""Discovery through the Kubernetes API, with real processes: an orchestrator started with
`--target kubernetes:///ns/target:PORT` against the stand-in API server (tests/k8s_stand_in.py).

Two real target services play two pods of one Service: the same port on two loopback addresses
(127.0.0.1 and 127.0.0.2), each in its own EndpointSlice, on nodes "node-a" and "node-b" (zones
"zone-a" and "zone-b"). The orchestrator runs on node-b, so a new session goes to 127.0.0.2.
While a greedy generation streams, the stand-in marks that endpoint not ready, then deletes its
slice: the session moves to the other pod on its next round (a re-prefill from the history every
call carries), and the client sees the target's own greedy output, without an error. Verify is
padded to 100 ms (a labelled simulation) and the draft length is 1, so the stream lasts long
enough to be moved.
"""

from __future__ import annotations

import sys
import time

import pytest

from specdec.launcher import free_port
from specdec.v1 import orchestrator_pb2 as pb
from tests.cluster import HOST, Cluster, cached_sessions, orchestrator_stub, request
from tests.k8s_stand_in import StandIn, endpoint
from tests.reference import Reference

PROMPT = "The quick brown fox"
MAX_NEW = 40
SLOW = ("--emulate-verify-ms", "100")
PODS = {"target-a": ("127.0.0.1", "node-a", "zone-a"), "target-b": ("127.0.0.2", "node-b", "zone-b")}


@pytest.fixture
def cluster(tiny_models, tmp_path):
    c = Cluster(tmp_path, tiny_models)
    yield c
    c.stop()


@pytest.fixture
def api():
    server = StandIn().start()
    yield server
    server.stop()


def start_targets(cluster: Cluster) -> int:
    """Both target pods on one port, as in a cluster; returns the port."""
    port = free_port()
    for name, (ip, *_) in PODS.items():
        cmd = [sys.executable, "-m", "target_service", "--host", ip, "--port", str(port),
               "--model", str(cluster.models["target"]), "--dtype", "float64", "--threads", "1", *SLOW]
        cluster.start(name, cmd, f"{ip}:{port}")
    return port


def start_orchestrator(cluster: Cluster, target: str, draft: str, redis_port: int) -> str:
    port = free_port()
    cmd = [sys.executable, "-m", "orchestrator", "--host", HOST, "--port", str(port), "--target", target,
           "--draft", draft, "--redis-url", f"redis://{HOST}:{redis_port}/0", "--model", str(cluster.models["target"]),
           "--draft-length", "1", "--replica-refresh-s", "0.5"]
    return cluster.start("orchestrator", cmd, f"{HOST}:{port}")


def wait_for(check, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_session_moves_off_an_endpoint_marked_not_ready_then_deleted(cluster, api, tiny_models, monkeypatch):
    expected = Reference(str(tiny_models["target"])).greedy(PROMPT, MAX_NEW)
    redis_port = cluster.redis()
    port = start_targets(cluster)
    for name, (ip, node, zone) in PODS.items():
        api.put_slice("ns", name, "target", [endpoint(ip, node=node, zone=zone)], port)
    addresses = {name: f"{ip}:{port}" for name, (ip, *_) in PODS.items()}
    draft = cluster.draft("draft")
    monkeypatch.setenv("SPECDEC_KUBERNETES_API", api.url)  # the orchestrator's environment (Cluster copies it)
    monkeypatch.setenv("SPECDEC_NODE_NAME", "node-b")
    address = start_orchestrator(cluster, f"kubernetes:///ns/target:{port}", draft, redis_port)

    ch, stub = orchestrator_stub(address)
    tokens, step = [], "placed"
    with ch:
        for chunk in stub.Generate(request(PROMPT, max_new_tokens=MAX_NEW), timeout=120):
            tokens.extend(chunk.token_ids)
            if step == "placed" and tokens:
                # Same node first: the session is on target-b, the pod on the orchestrator's node.
                assert cached_sessions(addresses["target-b"]) == 1 and cached_sessions(addresses["target-a"]) == 0
                api.put_slice("ns", "target-b", "target", [endpoint("127.0.0.2", ready=False, node="node-b")], port)
                wait_for(lambda: cached_sessions(addresses["target-a"]) == 1, "the session to move to target-a")
                step = "moved"
            elif step == "moved":
                api.delete_slice("ns", "target-b")
                step = "deleted"
        assert chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert step == "deleted", "the generation ended before the endpoint was deleted"
        assert tokens == expected  # moved twice over, and not a token lost, repeated or changed
        targets = [b for b in stub.GetStatus(pb.GetStatusRequest(), timeout=10).backends if b.role == "target"]
        assert [b.address for b in targets] == [addresses["target-a"]]  # the deleted endpoint is gone
        assert stub.GenerateUnary(request(PROMPT, max_new_tokens=MAX_NEW), timeout=120).token_ids == expected
    assert cluster.procs["target-b"].poll() is None  # nothing failed: discovery alone moved the session
    assert api.count("list ns") == 1  # one list, then the watch
    log = (cluster.log_dir / "orchestrator.log").read_text()
    assert f"target replica {addresses['target-b']} is not ready" in log
    assert "moves on" not in log  # no call failed over: the move came from discovery

