"""TLS and mutual TLS with a throwaway CA: who completes the handshake and who does not."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.channel import channel
from specdec.server.config import ServiceConfig
from specdec.server.serving import create_server, mark_serving
from specdec.server.tls import ClientTLS, make_pki, server_credentials


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _server(pki, client_auth: str):
    creds = server_credentials(str(pki.server_cert), str(pki.server_key), str(pki.ca) if client_auth == "required"
                               else "", client_auth)
    server, port, health = create_server("127.0.0.1:0", [], [], credentials=creds)
    await server.start()
    await mark_serving(health, [])
    return server, f"127.0.0.1:{port}"


async def _check(ch: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return grpc.StatusCode.OK


def _tls(pki, **kw) -> ClientTLS:
    return ClientTLS(**{"ca": str(pki.ca), **kw})


async def test_mutual_tls_lets_in_only_clients_with_a_certificate_of_the_ca(pki):
    server, address = await _server(pki, "required")
    try:
        good = _tls(pki, cert=str(pki.client_cert), key=str(pki.client_key))
        async with channel(address, good.credentials()) as ch:
            assert await _check(ch) == grpc.StatusCode.OK
        refused = {
            "no client certificate": _tls(pki),
            "a certificate of another CA": _tls(pki, cert=str(pki.rogue_cert), key=str(pki.rogue_key)),
            "a server that the client does not trust": ClientTLS(str(pki.rogue_ca), str(pki.client_cert),
                                                                 str(pki.client_key)),
        }
        for why, tls in refused.items():
            async with channel(address, tls.credentials()) as ch:
                assert await _check(ch) == grpc.StatusCode.UNAVAILABLE, why
        async with channel(address) as ch:  # plaintext
            assert await _check(ch) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_server_tls_refuses_plaintext_and_checks_the_name(pki):
    server, address = await _server(pki, "none")
    try:
        async with channel(address, _tls(pki).credentials()) as ch:
            assert await _check(ch) == grpc.StatusCode.OK
        async with channel(address) as ch:
            assert await _check(ch) == grpc.StatusCode.UNAVAILABLE
        wrong_name = _tls(pki, server_name="not-this-server.example")
        async with channel(address, wrong_name.credentials(), wrong_name.options()) as ch:
            assert await _check(ch) == grpc.StatusCode.UNAVAILABLE
        right_name = _tls(pki, server_name="localhost")
        async with channel(address, right_name.credentials(), right_name.options()) as ch:
            assert await _check(ch) == grpc.StatusCode.OK
    finally:
        await server.stop(0)


def test_client_tls_errors_name_the_flag(pki, tmp_path):
    with pytest.raises(ValueError, match="--backend-tls-ca .*cannot read"):
        ClientTLS(str(tmp_path / "missing.pem"), flag="--backend-tls").credentials()
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match="--tls-ca .*not a PEM file"):
        ClientTLS(str(not_pem)).credentials()
    with pytest.raises(ValueError, match="go together"):
        ClientTLS(str(pki.ca), cert=str(pki.client_cert)).credentials()


@pytest.mark.parametrize("argv, message", [
    (["--tls-cert", "{cert}"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-client-auth", "required"],
     "needs --tls-cert, --tls-key and --tls-ca"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-ca", "{ca}"], "add --tls-client-auth required"),
    (["--tls-cert", "/no/such/file.pem", "--tls-key", "{key}"], "no such file"),
])
def test_the_config_refuses_half_a_tls_setup(pki, capsys, argv, message):
    paths = {"cert": str(pki.server_cert), "key": str(pki.server_key), "ca": str(pki.ca)}
    with pytest.raises(SystemExit):
        ServiceConfig.from_args([a.format(**paths) for a in argv])
    assert message in capsys.readouterr().err


def test_a_complete_mutual_tls_config_parses(pki):
    config = ServiceConfig.from_args(["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                                      "--tls-ca", str(pki.ca), "--tls-client-auth", "required"])
    assert config.tls_client_auth == "required"
