"""Transport security: TLS for the public API, mutual TLS between the orchestrator and its backends.

Every service takes the same server-side flags (`specdec.server.config.ServiceConfig`):

    --tls-cert server.pem --tls-key server.key                     TLS (clients verify the server)
    ... --tls-ca ca.pem --tls-client-auth required                   mutual TLS (the server verifies clients)

Draft and target run with mutual TLS, so only holders of a certificate signed by the CA (the
orchestrators) reach them; the orchestrator's public API runs with TLS and bearer tokens
(`specdec.server.auth`). The orchestrator's own client side is `ClientTLS` (`--backend-tls-*`).

`make_pki` writes a throwaway CA with server and client certificates, for tests and local
development only (it needs the `cryptography` package, a dev dependency).
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc


def read_pem(path: str, flag: str) -> bytes:
    """The bytes of a PEM file, or a ValueError naming the flag that pointed at it."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
    return data


def server_credentials(cert: str, key: str, ca: str = "", client_auth: str = "none") -> grpc.ServerCredentials | None:
    """Server credentials from PEM paths; None when no certificate is configured (plaintext)."""
    if not cert:
        return None
    chain, private_key = read_pem(cert, "--tls-cert"), read_pem(key, "--tls-key")
    required = client_auth == "required"
    roots = read_pem(ca, "--tls-ca") if required else None
    return grpc.ssl_server_credentials([(private_key, chain)], root_certificates=roots,
                                       require_client_auth=required)


def server_credentials_of(config) -> grpc.ServerCredentials | None:
    """`server_credentials` for a `ServiceConfig` (its --tls-* flags)."""
    return server_credentials(config.tls_cert, config.tls_key, config.tls_ca, config.tls_client_auth)


@dataclass(frozen=True)
class ClientTLS:
    """How a client verifies a server (ca) and proves who it is (cert + key, for mutual TLS).

    `server_name` overrides the name checked against the server certificate, for servers
    reached by an IP address or a name the certificate does not list.
    """

    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""
    flag: str = "--tls"  # flag prefix named in error messages

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert)

    def credentials(self) -> grpc.ChannelCredentials:
        roots = read_pem(self.ca, f"{self.flag}-ca") if self.ca else None  # None: the system's roots
        if bool(self.cert) != bool(self.key):
            raise ValueError(f"{self.flag}-cert and {self.flag}-key go together")
        chain = read_pem(self.cert, f"{self.flag}-cert") if self.cert else None
        key = read_pem(self.key, f"{self.flag}-key") if self.key else None
        return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=chain)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


# -- a throwaway PKI (tests, local development) ---------------------------------------------------


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files `make_pki` wrote."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path  # a second CA that signed nothing the servers trust
    rogue_cert: Path  # a client certificate signed by the rogue CA
    rogue_key: Path


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "specdec test"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key, path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _write_cert(cert, path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _builder(subject: str, issuer, public_key, days: int):
    """A certificate builder valid from five minutes ago for `days` days."""
    from cryptography import x509

    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _ca(cn: str, days: int):
    """A self-signed CA: (key, certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(cn, _name(cn), key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(cn: str, issuer_key, issuer_cert, usage, days: int, sans: Sequence[str] = ()):
    """A certificate for `usage` (server or client auth) signed by the issuer: (key, certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    builder = (_builder(cn, issuer_cert.subject, key.public_key(), days)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if sans:
        entries: list[x509.GeneralName] = []
        for host in sans:
            try:
                entries.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                entries.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(entries), critical=False)
    return key, builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: str | Path, hosts: Sequence[str] = ("localhost", "127.0.0.1"), days: int = 2) -> Pki:
    """Write a CA, a server certificate for `hosts`, a client certificate and a rogue pair.

    For tests and local development only: keys are written unencrypted (mode 0600).
    """
    from cryptography.x509.oid import ExtendedKeyUsageOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("specdec test CA", days)
    server_key, server_cert = _leaf(hosts[0], ca_key, ca_cert, ExtendedKeyUsageOID.SERVER_AUTH, days, hosts)
    client_key, client_cert = _leaf("orchestrator", ca_key, ca_cert, ExtendedKeyUsageOID.CLIENT_AUTH, days)
    rogue_ca_key, rogue_ca_cert = _ca("rogue CA", days)
    rogue_key, rogue_cert = _leaf("orchestrator", rogue_ca_key, rogue_ca_cert, ExtendedKeyUsageOID.CLIENT_AUTH, days)

    pki = Pki(out / "ca.pem", out / "server.pem", out / "server.key", out / "client.pem", out / "client.key",
              out / "rogue-ca.pem", out / "rogue.pem", out / "rogue.key")
    for cert, path in ((ca_cert, pki.ca), (server_cert, pki.server_cert), (client_cert, pki.client_cert),
                       (rogue_ca_cert, pki.rogue_ca), (rogue_cert, pki.rogue_cert)):
        _write_cert(cert, path)
    for key, path in ((server_key, pki.server_key), (client_key, pki.client_key), (rogue_key, pki.rogue_key)):
        _write_key(key, path)
    return pki
