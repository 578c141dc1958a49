"""The gateway's GET /health over a stand-in orchestrator client: one status call per interval
however many probes arrive, and the backends' addresses and errors only for authorized callers."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient

from http_gateway.app import create_app
from http_gateway.config import GatewayConfig
from specdec.errors import Unauthenticated, Unavailable

TOKEN = "alice-token-0123456789abcdef"
STATUS = {"address": "orch-0.internal:50051", "backends": [
    {"role": "target", "address": "10.0.0.7:50053", "healthy": True, "error": ""},
    {"role": "draft", "address": "10.0.0.9:50052", "healthy": False, "error": "UNAVAILABLE: connect to 10.0.0.9"}]}


class FakeClient:
    """Counts status calls (each takes a moment, so concurrent probes overlap)."""

    def __init__(self, fail: bool = False, checks_tokens: bool = True) -> None:
        self.calls = 0
        self.fail = fail
        self.checks_tokens = checks_tokens
        self.lock = threading.Lock()

    async def status(self, timeout=None, token=None):
        with self.lock:
            self.calls += 1
        await asyncio.sleep(0.05)
        if self.fail:
            raise Unavailable("orchestrator orch-0.internal:50051: failed to connect to 10.0.0.5:50051")
        if token == "" and self.checks_tokens:
            raise Unauthenticated("missing or invalid bearer token")
        return STATUS

    async def close(self):
        pass


@pytest.fixture
def gateway(tmp_path):
    def make(tokens: bool, fail: bool = False, checks_tokens: bool | None = None, **config):
        if tokens:
            (tmp_path / "tokens").write_text(f"alice:{TOKEN}\n")
            config["auth_tokens_file"] = str(tmp_path / "tokens")
        app = create_app(GatewayConfig(orchestrator="127.0.0.1:1", model_name="m", **config))
        client = TestClient(app)
        client.__enter__()
        fake = app.state.gateway.client = FakeClient(fail, tokens if checks_tokens is None else checks_tokens)
        return client, fake

    yield make


def test_health_asks_the_orchestrator_once_per_interval_however_many_probes(gateway):
    client, fake = gateway(tokens=False, health_cache_s=60)
    with ThreadPool(20) as pool:
        replies = pool.map(lambda _: client.get("/health"), range(100))
    assert {r.status_code for r in replies} == {200}
    assert fake.calls == 1  # 100 probes, 20 at a time: one GetStatus, so one fan-out to the replicas


def test_health_details_need_a_token_where_the_gateway_checks_them(gateway):
    client, fake = gateway(tokens=True, health_cache_s=60)
    reply = client.get("/health")
    assert reply.status_code == 200 and reply.json() == {"status": "degraded"}  # no address, no error text
    for header in ("Bearer wrong-token-wrong-token", "Basic x"):
        assert client.get("/health", headers={"authorization": header}).json() == {"status": "degraded"}
    detailed = client.get("/health", headers={"authorization": f"Bearer {TOKEN}"}).json()
    assert detailed["backends"][1]["error"].startswith("UNAVAILABLE") and detailed["orchestrator"]


def test_an_open_gateway_shows_details_to_all(gateway):
    client, _ = gateway(tokens=False)
    assert client.get("/health").json()["backends"][0]["address"] == "10.0.0.7:50053"


def test_an_unavailable_orchestrator_is_503_without_its_address_unless_authorized(gateway):
    client, fake = gateway(tokens=True, fail=True, health_cache_s=60)
    reply = client.get("/health")
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "unavailable"
    assert "10.0.0" not in reply.text and "orch-0" not in reply.text
    detailed = client.get("/health", headers={"authorization": f"Bearer {TOKEN}"})
    assert detailed.status_code == 503 and "failed to connect" in detailed.json()["error"]["message"]
    assert fake.calls == 1  # failures are kept for the interval too


class ThreadPool:
    def __init__(self, n: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.pool.shutdown()

    def map(self, fn, items):
        return list(self.pool.map(fn, items))


def test_a_gateway_that_checks_tokens_warns_once_of_an_orchestrator_that_does_not(gateway, caplog):
    client, fake = gateway(tokens=True, checks_tokens=False, health_cache_s=0)
    for _ in range(3):
        assert client.get("/health").status_code == 200
    warnings = [r for r in caplog.records if "serves calls without one" in r.getMessage()]
    assert len(warnings) == 1 and "--auth-tokens-file" in warnings[0].getMessage()
    caplog.clear()
    client, fake = gateway(tokens=True, checks_tokens=True, health_cache_s=0)
    client.get("/health")
    assert not [r for r in caplog.records if "serves calls without one" in r.getMessage()]


def test_models_name_the_weights_each_healthy_backend_serves(gateway):
    """/v1/models carries what the orchestrator's status says each backend serves; nothing from a
    backend that is down, and an empty map where the orchestrator cannot be asked."""
    client, fake = gateway(tokens=False, checks_tokens=False)
    served = {"address": "orch", "backends": [
        {"role": "target", "healthy": True, "weights": "gguf:q4_1+q8_0", "weights_fingerprint": "ab12"},
        {"role": "draft", "healthy": False, "weights": "q4_1", "weights_fingerprint": "cd34"}]}

    async def status(timeout=None, token=None):
        return served

    fake.status = status
    body = client.get("/v1/models").json()
    assert body["data"][0]["weights"] == {"target": "gguf:q4_1+q8_0", "target_fingerprint": "ab12"}
    assert client.get("/v1/models/m").json()["weights"] == {"target": "gguf:q4_1+q8_0", "target_fingerprint": "ab12"}

    async def down(timeout=None, token=None):
        raise Unavailable("orchestrator orch: failed to connect")

    fake.status = down
    assert client.get("/v1/models").json()["data"][0]["weights"] == {}
