"""Throw-away TLS certificates made at test time (no private key is checked in).

`make_certificates(directory)` writes a CA, a server certificate for
`localhost`/`127.0.0.1`, a client certificate (both signed by the CA) and an
unrelated "rogue" CA with its own server certificate, all as PEM files.

Tests use the `certificates` fixture (import it into the test module):

```python
from tests.rpc.certs_fixture import certificates  # noqa: F401 (a fixture)

def test_tls(certificates):
    server = Security(certificate_file=certificates.server_cert, ...)
```
"""

import dataclasses
import datetime
import ipaddress
from pathlib import Path

import pytest

# `cryptography` is a test-only dependency, imported when certificates are made
# so that tests which need none still run without it.

# Long enough for any test run, short enough that a leaked file is useless soon.
VALIDITY = datetime.timedelta(days=2)


@dataclasses.dataclass(frozen=True)
class Certificates:
    """Paths of the PEM files `make_certificates` wrote."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    rogue_ca_cert: str
    rogue_server_cert: str
    rogue_server_key: str
    rogue_client_cert: str
    rogue_client_key: str


def make_certificates(directory):
    """Writes the certificates and keys under `directory`; returns their paths."""
    from cryptography.hazmat.primitives.asymmetric import ec

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}

    def write(name, data):
        path = directory / name
        path.write_bytes(data)
        paths[name] = str(path)
        return str(path)

    for prefix in ("", "rogue_"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _certificate(f"kdist test {prefix}CA", ca_key, ca_key, None, ca=True)
        write(f"{prefix}ca.pem", _pem(ca_cert))
        for role in ("server", "client"):
            key = ec.generate_private_key(ec.SECP256R1())
            cert = _certificate(f"kdist test {prefix}{role}", key, ca_key, ca_cert, role=role)
            write(f"{prefix}{role}.pem", _pem(cert))
            write(f"{prefix}{role}.key", _pem_key(key))
    return Certificates(
        ca_cert=paths["ca.pem"],
        server_cert=paths["server.pem"],
        server_key=paths["server.key"],
        client_cert=paths["client.pem"],
        client_key=paths["client.key"],
        rogue_ca_cert=paths["rogue_ca.pem"],
        rogue_server_cert=paths["rogue_server.pem"],
        rogue_server_key=paths["rogue_server.key"],
        rogue_client_cert=paths["rogue_client.pem"],
        rogue_client_key=paths["rogue_client.key"],
    )


@pytest.fixture(scope="session")
def certificates(tmp_path_factory):
    """A `Certificates` made once per test session."""
    pytest.importorskip("cryptography", reason="making test certificates needs `cryptography`")
    return make_certificates(tmp_path_factory.mktemp("certificates"))


def _certificate(common_name, key, issuer_key, issuer_cert, ca=False, role=None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject if issuer_cert is None else issuer_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if role == "server":
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.DNSName("ps.kdist.test"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    elif role == "client":
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(certificate):
    from cryptography.hazmat.primitives import serialization

    return certificate.public_bytes(serialization.Encoding.PEM)


def _pem_key(key):
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
