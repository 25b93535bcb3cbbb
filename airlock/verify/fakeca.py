"""A throwaway certificate authority for the fake internet's TLS upstreams.

The CA signs one leaf that covers every fake upstream name and IP (and the names `make_fake_ca` is given: the
hosts a policy allows, for `airlock verify`), so fakenet needs a single certificate and the gateway under test is
told to trust only this CA for upstream TLS.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LEAF_DNS_NAMES = (
    "allowed.test",
    "*.allowed.test",
    "other.test",
    "*.other.test",
    "evil.test",
    "internal.test",
    "*.internal.test",
    "api.github.test",
    "github.test",
    # the walk-throughs of README.md and docs/, typed as printed (registry.py)
    "pypi.org",
    "files.pythonhosted.org",
    "registry.npmjs.org",
    "pkg.example",
    "api.model.example",
)
# 127.0.0.1: the fake GitHub of the fleet tests, which run it on loopback without a topology.
LEAF_IPS = ("192.0.2.10", "192.0.2.20", "198.51.100.10", "203.0.113.66", "10.1.2.3", "10.1.2.4", "127.0.0.1")


@dataclass(frozen=True)
class FakeCA:
    ca_cert: Path
    ca_key: Path
    ca_pem: Path  # key + cert in one file (the layout mitmproxy expects for its own CA)
    leaf_cert: Path
    leaf_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "airlock fake internet"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))  # tolerate clock skew between namespaces' processes
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def _make_ca() -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("airlock fake internet CA")
    cert = (
        _builder(name, name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
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
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _make_leaf(
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, names: tuple[str, ...]
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dict.fromkeys((*LEAF_DNS_NAMES, *names))]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in LEAF_IPS]
    cert = (
        _builder(_name(LEAF_DNS_NAMES[0]), ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),  # strict X.509 checks want it
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def make_fake_ca(directory: Path, names: tuple[str, ...] = ()) -> FakeCA:
    """Write a fresh CA and leaf (EC P-256; `names` besides the fake internet's own) into `directory` and return
    their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _make_ca()
    leaf_key, leaf_cert = _make_leaf(ca_key, ca_cert, names)
    ca_cert_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    paths = FakeCA(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        ca_pem=directory / "ca.pem",
        leaf_cert=directory / "leaf.crt",
        leaf_key=directory / "leaf.key",
    )
    paths.ca_cert.write_bytes(ca_cert_pem)
    paths.ca_key.write_bytes(_key_pem(ca_key))
    paths.ca_pem.write_bytes(_key_pem(ca_key) + ca_cert_pem)
    paths.leaf_cert.write_bytes(leaf_cert.public_bytes(serialization.Encoding.PEM))
    paths.leaf_key.write_bytes(_key_pem(leaf_key))
    for key_path in (paths.ca_key, paths.ca_pem, paths.leaf_key):
        key_path.chmod(0o600)
    return paths
