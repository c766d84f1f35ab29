"""Certificates for tests of TLS connections: a throw-away CA that signs a server certificate for
loopback and a client certificate, laid out as the docker CLI expects them (`DOCKER_CERT_PATH`).

Made with `cryptography` (present through the gateway's `mcp` → `pyjwt[crypto]`), in memory and on
disk under the caller's folder; nothing is ever trusted outside the test that makes them.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True)
class TestCerts:
    """Where the files are: `client` holds `ca.pem`, `cert.pem`, `key.pem` (a `DOCKER_CERT_PATH`);
    `server` the engine's `ca.pem`, `cert.pem`, `key.pem`."""

    client: Path
    server: Path

    def server_context(self, *, require_client: bool = True) -> ssl.SSLContext:
        """The server side: its certificate, and (`require_client`) a client certificate signed by
        the CA required, as `dockerd --tlsverify` does."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.server / "ca.pem"))
        context.load_cert_chain(str(self.server / "cert.pem"), str(self.server / "key.pem"))
        context.verify_mode = ssl.CERT_REQUIRED if require_client else ssl.CERT_NONE
        return context


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _signed(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    usage: x509.ObjectIdentifier | None = None,
    hosts: tuple[str, ...] = (),
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        usage_ext = x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
        )  # fmt: skip
        builder = builder.add_extension(usage_ext, critical=True)
        builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if hosts:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_test_certs(folder: Path, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> TestCerts:
    """A CA, a server certificate for `hosts` and a client certificate, written under `folder`."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _signed("evalbus test CA", ca_key, _name("evalbus test CA"), ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _signed("engine", server_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH, hosts=hosts)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _signed("evalbus dispatcher", client_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    out = TestCerts(client=folder / "client", server=folder / "server")
    for where, cert, key in ((out.client, client, client_key), (out.server, server, server_key)):
        where.mkdir(parents=True, exist_ok=True)
        (where / "ca.pem").write_bytes(ca_pem)
        (where / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (where / "key.pem").write_bytes(_pem_key(key))
        (where / "key.pem").chmod(0o600)
    return out
