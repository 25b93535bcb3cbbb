"""The gateway's own certificate authority for TLS inspection: made per gateway, short-lived, and name-constrained so
that the certificate the sandbox is made to trust can sign for the inspected hosts and nothing else.

- EC P-256 keys, CA and leaves alike: a key takes ~0.1 ms to make where RSA-2048 takes ~50 ms, and the first
  inspected connection to each host waits for its leaf's key. Every TLS stack a sandbox runs (OpenSSL, GnuTLS, Go,
  Node, Java, rustls) accepts ECDSA P-256.
- Name constraints, critical: a DNS permitted subtree per inspected host (`host` for `host`, `suffix` for
  `*.suffix`; RFC 5280's form: `.suffix` would keep the apex out, but `cryptography`'s verifier refuses it as
  malformed). A DNS subtree also permits every name below it: `leaf()` signs only the inspected hosts themselves.
  IP addresses: a permitted subtree of the single unspecified address per family (no range wider than one address
  is ever permitted) and an excluded subtree of every address, so that no leaf with an IP SAN verifies at all
  (a permitted 0.0.0.0/32 alone would still let a leaf for 0.0.0.0, this host on Linux, verify). An empty host set
  permits the DNS subtree `invalid` (RFC 6761: never a real name): an empty DNS constraint would permit every name.
- Generations: hosts are fixed at creation. A policy reload that changes the inspected hosts gets a new CA from
  `reissue` (new key, its own files in the same directory) for the sandboxes started after it; each sandbox keeps
  the CA it was started with, whose `store_entry` the proxy asks for that sandbox's connections, until it ends
  (then `remove`). A host added by the reload is not inspectable for the sandboxes started before it: their CA
  refuses it (`permits` tells), and the proxy must deny rather than pass such a host through uninspected.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from mitmproxy import certs

from airlock.inspection import InspectionError
from airlock.inspection.files import open_private_directory, replace_file
from airlock.policy import HostError, canonical_host, is_ip, is_public_suffix

VALIDITY = timedelta(days=7)
CLOCK_SKEW = timedelta(minutes=5)  # not_before this far back: a sandbox whose clock is a little behind still trusts
LEAF_CACHE = 1024  # leaves kept per CA (least recently used dropped); one per inspected host in use
_NOTHING = "invalid"  # the DNS subtree of a CA that inspects no host
_SINGLE_ADDRESSES = (ipaddress.ip_network("0.0.0.0/32"), ipaddress.ip_network("::/128"))
_ALL_ADDRESSES = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
_KEY_USAGES = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
               "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Leaf:
    """A server certificate for exactly one DNS name, and its key."""

    host: str
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


class GatewayCA:
    """One generation of the gateway's CA (see the module's doc). Make one with `create`."""

    def __init__(self, directory: Path, hosts: frozenset[str], key: ec.EllipticCurvePrivateKey,
                 cert: x509.Certificate) -> None:  # fmt: skip
        self.directory, self.hosts, self._key, self.cert = directory, hosts, key, cert
        self.cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        name = f"gateway-ca-{hashlib.sha256(self.cert_pem).hexdigest()[:16]}"
        self.cert_path, self.key_path = directory / f"{name}.pem", directory / f"{name}.key"
        self._exact = frozenset(h for h in hosts if not h.startswith("*."))
        self._suffixes = frozenset(h[2:] for h in hosts if h.startswith("*."))
        self._leaves: OrderedDict[str, Leaf] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def create(cls, directory: Path, hosts: Iterable[str], validity: timedelta = VALIDITY) -> GatewayCA:
        """A new CA for `hosts` (canonical names, or `*.suffix`), its key (0600) and certificate (0644) written into
        `directory` (0700, see `open_private_directory`)."""
        ca = cls.unwritten(directory, hosts, validity)
        ca.write()
        return ca

    @classmethod
    def unwritten(cls, directory: Path, hosts: Iterable[str], validity: timedelta = VALIDITY) -> GatewayCA:
        """A new CA as `create` makes it, in memory only until `write` (a reload's, until it is in force)."""
        if validity <= timedelta(0):
            raise InspectionError(f"gateway CA validity must be positive, not {validity}")
        names = frozenset(_checked_host(h) for h in hosts)
        key = ec.generate_private_key(ec.SECP256R1())
        return cls(directory, names, key, _ca_certificate(key, names, validity))

    @classmethod
    def loaded(cls, directory: Path, hosts: Iterable[str], key_pem: bytes, cert_pem: bytes) -> GatewayCA:
        """A generation another process made (a proxy worker's, from its supervisor: `Inspector.adopt`), in memory
        only: nothing is written here."""
        key = serialization.load_pem_private_key(key_pem, None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise InspectionError("a gateway CA's key must be an EC key")
        return cls(directory, frozenset(_checked_host(h) for h in hosts), key, x509.load_pem_x509_certificate(cert_pem))

    @property
    def key_pem(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def write(self) -> None:
        """Its key (0600) and certificate (0644) into its directory, each replaced whole."""
        key_pem = self.key_pem
        fd = open_private_directory(self.directory)
        try:
            replace_file(fd, self.key_path.name, key_pem, 0o600)
            replace_file(fd, self.cert_path.name, self.cert_pem, 0o644)
        except OSError as e:
            raise InspectionError(f"cannot write the gateway CA into {self.directory}: {e.strerror or e}") from None
        finally:
            os.close(fd)

    def reissue(self, hosts: Iterable[str]) -> GatewayCA:
        """The CA for sandboxes started from now on: this one while it inspects exactly `hosts` and has more than half
        its validity left, else a new generation (with this one's validity) beside it. This one stays usable."""
        names = frozenset(_checked_host(h) for h in hosts)
        validity = self.cert.not_valid_after_utc - self.cert.not_valid_before_utc - CLOCK_SKEW
        if names == self.hosts and self.cert.not_valid_after_utc - datetime.now(UTC) > validity / 2:
            return self
        return GatewayCA.create(self.directory, names, validity)

    def remove(self) -> None:
        """Delete this generation's files (once no sandbox trusts it any more)."""
        for path in (self.key_path, self.cert_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def permits(self, host: str) -> bool:
        """Whether `host` (canonical) is one this CA inspects: an exact host, or a name below a `*.suffix`."""
        if host in self._exact:
            return True
        dot = host.find(".")
        while dot != -1:
            if host[dot + 1 :] in self._suffixes:
                return True
            dot = host.find(".", dot + 1)
        return False

    def leaf(self, host: str) -> Leaf:
        """The leaf for `host`, made at the first request and kept (at most LEAF_CACHE hosts, least recently used
        dropped); InspectionError for a host this CA does not inspect, or once the CA has expired."""
        if not self.permits(host):
            raise InspectionError(f"{host!r} is not a host this gateway CA inspects")
        if datetime.now(UTC) >= self.cert.not_valid_after_utc:
            raise InspectionError(f"the gateway CA expired at {self.cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z")
        with self._lock:
            leaf = self._leaves.get(host)
            if leaf is None:
                leaf = self._leaves[host] = self._sign(host)
                if len(self._leaves) > LEAF_CACHE:
                    self._leaves.popitem(last=False)
            self._leaves.move_to_end(host)
            return leaf

    def store_entry(self, host: str) -> certs.CertStoreEntry:
        """What mitmproxy's `TlsConfig.get_cert` returns, for `host`: the leaf, its key, and the CA as the chain
        (not sent: the sandbox trusts the CA itself)."""
        leaf = self.leaf(host)
        return certs.CertStoreEntry(certs.Cert(leaf.cert), leaf.key, None, [certs.Cert(self.cert)])

    def certstore(self) -> certs.CertStore:
        """mitmproxy's store on this CA, for what its TLS addon reads besides the leaf (no DH parameters: the
        gateway offers ECDHE only). Anything of mitmproxy's that signed by it would be bound by the constraints."""
        return certs.CertStore(self._key, certs.Cert(self.cert), None, b"", None)  # type: ignore[arg-type]

    def _sign(self, host: str) -> Leaf:
        now = datetime.now(UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _builder(
                self.cert.subject,
                key,
                max(now - CLOCK_SKEW, self.cert.not_valid_before_utc),
                self.cert.not_valid_after_utc,
            )
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "airlock gateway")]))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage("digital_signature"), critical=True)  # ECDSA signs the handshake
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
        )
        return Leaf(host, builder.sign(self._key, hashes.SHA256()), key)


def _checked_host(host: str) -> str:
    """An inspected host as the policy names it: a canonical DNS name, or `*.` and one. IP addresses are refused
    (no certificate for one may be signed), and so are public suffixes."""
    name = host[2:] if host.startswith("*.") else host
    try:
        canonical = canonical_host(name)
    except HostError as e:
        raise InspectionError(f"inspected host {host!r}: {e}") from None
    if canonical != name or is_ip(canonical):
        raise InspectionError(f"inspected host {host!r}: a canonical DNS name or *.name is needed")
    # The policy loader refuses a wildcard over a public suffix; an exact host's subtree also permits the names below
    # it, so no subtree may be one: the constraints would then permit names anyone can register.
    if "." not in name or is_public_suffix(name):
        raise InspectionError(f"inspected host {host!r}: {name} is a public suffix, which no CA of the gateway covers")
    return host


def _key_usage(*granted: str) -> x509.KeyUsage:
    return x509.KeyUsage(**{usage: usage in granted for usage in _KEY_USAGES})


def _builder(
    issuer: x509.Name, key: ec.EllipticCurvePrivateKey, not_before: datetime, not_after: datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )


def _ca_certificate(key: ec.EllipticCurvePrivateKey, hosts: frozenset[str], validity: timedelta) -> x509.Certificate:
    now = datetime.now(UTC)
    name = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "airlock"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"airlock gateway CA {now:%Y-%m-%d %H:%M:%S}Z"),
    ])  # fmt: skip
    subtrees = sorted({h.removeprefix("*.") for h in hosts}) or [_NOTHING]
    constraints = x509.NameConstraints(
        permitted_subtrees=[*map(x509.DNSName, subtrees), *map(x509.IPAddress, _SINGLE_ADDRESSES)],
        excluded_subtrees=list(map(x509.IPAddress, _ALL_ADDRESSES)),
    )
    builder = (
        _builder(name, key, now - CLOCK_SKEW, now + validity)
        .subject_name(name)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage("key_cert_sign", "crl_sign"), critical=True)
        .add_extension(constraints, critical=True)
    )
    return builder.sign(key, hashes.SHA256())
