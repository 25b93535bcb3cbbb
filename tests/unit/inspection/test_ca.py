"""The gateway CA: its leaves verify for the inspected hosts, and its critical name constraints make every other
certificate its key could sign fail — in `cryptography`'s verifier and in `openssl verify` (OpenSSL, what curl,
Python and Node in a sandbox use). Leaves signed here directly with the CA key stand for a key that signs anything."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import ssl
import stat
import subprocess
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError
from mitmproxy.net import tls as net_tls
from OpenSSL import SSL

from airlock.inspection import InspectionError
from airlock.inspection.ca import CLOCK_SKEW, LEAF_CACHE, GatewayCA

HOSTS = ("api.model.test", "*.pkg.test")


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> GatewayCA:
    return GatewayCA.create(tmp_path_factory.mktemp("ca") / "state", HOSTS)


def forged(ca: GatewayCA, *names: x509.GeneralName) -> x509.Certificate:
    """A leaf for `names` signed with the CA key directly, past `leaf()`'s refusal: what a stolen key could make."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(list(names)), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca._key.public_key()), critical=False)
    )
    return builder.sign(ca._key, hashes.SHA256())


def dns(name: str) -> x509.DNSName:
    return x509.DNSName(name)


def ip(address: str) -> x509.IPAddress:
    return x509.IPAddress(ipaddress.ip_address(address))


def verify_cryptography(ca: GatewayCA, leaf: x509.Certificate, name: str) -> str:
    subject = x509.IPAddress(ipaddress.ip_address(name)) if name[0].isdigit() or ":" in name else x509.DNSName(name)
    verifier = PolicyBuilder().store(Store([ca.cert])).build_server_verifier(subject)
    try:
        verifier.verify(leaf, [])
    except VerificationError as e:
        return f"refused: {e}"
    return "ok"


def verify_openssl(ca: GatewayCA, leaf: x509.Certificate, name: str, folder: Path) -> str:
    (folder / "leaf.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    check = ["-verify_ip", name] if name[0].isdigit() or ":" in name else ["-verify_hostname", name]
    argv = [
        "openssl",
        "verify",
        "-purpose",
        "sslserver",
        "-CAfile",
        str(ca.cert_path),
        *check,
        str(folder / "leaf.pem"),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    return "ok" if done.returncode == 0 else f"refused: {done.stdout}{done.stderr}".strip()


@pytest.mark.parametrize("host", ["api.model.test", "a.pkg.test", "deep.er.pkg.test"])
def test_a_leaf_for_an_inspected_host_verifies(ca: GatewayCA, host: str, tmp_path: Path) -> None:
    leaf = ca.leaf(host)
    assert leaf.cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value == (
        x509.SubjectAlternativeName([dns(host)])
    )
    assert verify_cryptography(ca, leaf.cert, host) == "ok"
    assert verify_openssl(ca, leaf.cert, host, tmp_path) == "ok"


@pytest.mark.parametrize(
    ("sans", "name", "why"),
    [
        ((dns("other.test"),), "other.test", "permitted subtree violation"),
        ((dns("model.test"),), "model.test", "permitted subtree violation"),  # the parent of an exact host
        ((dns("pkg.test.evil"),), "pkg.test.evil", "permitted subtree violation"),
        ((dns("xpkg.test"),), "xpkg.test", "permitted subtree violation"),  # a suffix match, not a label one
        ((ip("192.0.2.1"),), "192.0.2.1", "permitted subtree violation"),
        ((ip("0.0.0.0"),), "0.0.0.0", "excluded subtree violation"),  # the one permitted address: excluded too
        ((ip("::"),), "::", "excluded subtree violation"),
        ((ip("2001:db8::1"),), "2001:db8::1", "permitted subtree violation"),
        ((dns("api.model.test"), ip("192.0.2.1")), "api.model.test", "permitted subtree violation"),
        ((dns("api.model.test"), dns("other.test")), "api.model.test", "permitted subtree violation"),
    ],
)
def test_the_ca_key_signs_nothing_else_that_verifies(
    ca: GatewayCA, sans: tuple[x509.GeneralName, ...], name: str, why: str, tmp_path: Path
) -> None:
    leaf = forged(ca, *sans)
    assert verify_cryptography(ca, leaf, name).startswith("refused:")
    assert why in verify_openssl(ca, leaf, name, tmp_path)


def test_a_forged_leaf_for_an_inspected_host_verifies(ca: GatewayCA, tmp_path: Path) -> None:
    """The control for the test above: the forged leaves fail for their names, not for how they are made."""
    leaf = forged(ca, dns("a.pkg.test"))
    assert (verify_cryptography(ca, leaf, "a.pkg.test"), verify_openssl(ca, leaf, "a.pkg.test", tmp_path)) == (
        "ok",
        "ok",
    )


def test_the_ca_certificate(ca: GatewayCA) -> None:
    extensions = ca.cert.extensions
    basic = extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    usage = extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.key_cert_sign and usage.value.crl_sign and not usage.value.digital_signature
    constraints = extensions.get_extension_for_class(x509.NameConstraints)
    assert constraints.critical
    assert set(constraints.value.permitted_subtrees or ()) == {
        dns("api.model.test"),
        dns("pkg.test"),
        x509.IPAddress(ipaddress.ip_network("0.0.0.0/32")),
        x509.IPAddress(ipaddress.ip_network("::/128")),
    }
    assert set(constraints.value.excluded_subtrees or ()) == {
        x509.IPAddress(ipaddress.ip_network("0.0.0.0/0")),
        x509.IPAddress(ipaddress.ip_network("::/0")),
    }
    assert isinstance(ca.cert.public_key(), ec.EllipticCurvePublicKey)
    now = datetime.now(UTC)
    assert now - CLOCK_SKEW - timedelta(seconds=30) < ca.cert.not_valid_before_utc < now - CLOCK_SKEW / 2
    assert ca.cert.not_valid_after_utc - ca.cert.not_valid_before_utc == timedelta(days=7) + CLOCK_SKEW
    assert ca.hosts == frozenset(HOSTS)


def test_files_and_their_modes(ca: GatewayCA) -> None:
    assert stat.S_IMODE(ca.key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(ca.cert_path.stat().st_mode) == 0o644
    assert stat.S_IMODE(ca.directory.stat().st_mode) == 0o700
    assert ca.cert_path.read_bytes() == ca.cert_pem
    key = serialization.load_pem_private_key(ca.key_path.read_bytes(), None)
    assert key.public_key() == ca.cert.public_key()
    assert {p.name for p in ca.directory.iterdir()} == {ca.key_path.name, ca.cert_path.name}  # no temporary left


def test_the_key_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        made = GatewayCA.create(tmp_path / "state", [])
    finally:
        os.umask(old)
    assert stat.S_IMODE(made.key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(made.directory.stat().st_mode) == 0o700


def test_an_existing_directory_is_tightened(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    GatewayCA.create(folder, [])
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o1777, 0o702])
def test_a_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    folder = tmp_path / "state"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(InspectionError, match="others can write into it"):
        GatewayCA.create(folder, HOSTS)
    assert list(folder.iterdir()) == []


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "state").symlink_to(real)
    with pytest.raises(InspectionError, match="not a symlink"):
        GatewayCA.create(tmp_path / "state", HOSTS)
    assert list(real.iterdir()) == []


def test_a_directory_of_another_user_is_refused(privileged: None, tmp_path: Path) -> None:
    folder = tmp_path / "state"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)  # root's privilege: giving the folder away
    with pytest.raises(InspectionError, match="owned by uid 65534"):
        GatewayCA.create(folder, HOSTS)


def test_leaf_refuses_what_the_ca_does_not_inspect(ca: GatewayCA) -> None:
    for host in ("other.test", "model.test", "x.api.model.test", "pkg.test", "API.model.test", "192.0.2.1", ""):
        with pytest.raises(InspectionError, match="is not a host this gateway CA inspects"):
            ca.leaf(host)


def test_leaves_are_cached_per_host_and_bounded(tmp_path: Path) -> None:
    made = GatewayCA.create(tmp_path / "state", ["*.many.test"])
    first = made.leaf("a.many.test")
    assert made.leaf("a.many.test") is first
    assert made.leaf("b.many.test").key is not first.key  # a key per leaf
    for n in range(LEAF_CACHE):
        made.leaf(f"h{n}.many.test")
    assert made.leaf("a.many.test") is not first  # the least recently used was dropped
    assert len(made._leaves) == LEAF_CACHE


def test_concurrent_requests_for_a_host_get_one_leaf(ca: GatewayCA) -> None:
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(ca.leaf("concurrent.pkg.test"))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(leaf) for leaf in got}) == 1


def test_a_leaf_lies_within_the_ca_validity(ca: GatewayCA) -> None:
    leaf = ca.leaf("api.model.test").cert
    assert ca.cert.not_valid_before_utc <= leaf.not_valid_before_utc
    assert leaf.not_valid_after_utc <= ca.cert.not_valid_after_utc
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert list(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH
    ]


def test_an_expired_ca_signs_no_leaf(tmp_path: Path) -> None:
    made = GatewayCA.create(tmp_path / "state", HOSTS, validity=timedelta(seconds=1))
    expired = datetime.now(UTC) + timedelta(seconds=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("airlock.inspection.ca.datetime", _Clock(expired))
        with pytest.raises(InspectionError, match="expired"):
            made.leaf("api.model.test")


class _Clock:
    def __init__(self, now: datetime) -> None:
        self._now = now

    def now(self, tz: object = None) -> datetime:
        return self._now


def test_no_host_permits_nothing(tmp_path: Path) -> None:
    """An empty DNS constraint would permit every name: a CA inspecting no host permits `invalid` (RFC 6761)."""
    empty = GatewayCA.create(tmp_path / "state", [])
    constraints = empty.cert.extensions.get_extension_for_class(x509.NameConstraints).value
    assert [s for s in constraints.permitted_subtrees or () if isinstance(s, x509.DNSName)] == [dns("invalid")]
    for name in ("example.com", "localhost"):
        assert verify_cryptography(empty, forged(empty, dns(name)), name).startswith("refused:")
        assert "permitted subtree violation" in verify_openssl(empty, forged(empty, dns(name)), name, tmp_path)
    with pytest.raises(InspectionError):
        empty.leaf("example.com")


@pytest.mark.parametrize("host", ["192.0.2.1", "*.192.0.2", "Api.model.test", "a..b", "*", "*.", "a b", "x.test."])
def test_create_refuses_hosts_that_are_not_canonical_dns_names(tmp_path: Path, host: str) -> None:
    with pytest.raises(InspectionError, match=re.escape(f"inspected host {host!r}")):
        GatewayCA.create(tmp_path / "state", [host])


@pytest.mark.parametrize("host", ["*.com", "com", "github.io", "*.co.uk", "intranet", "*.test"])
def test_create_refuses_public_suffixes(tmp_path: Path, host: str) -> None:
    """Their subtree would permit names anyone can register (an exact host's subtree covers the names below it)."""
    with pytest.raises(
        InspectionError, match=re.escape(f"inspected host {host!r}: {host.removeprefix('*.')} is a pub")
    ):
        GatewayCA.create(tmp_path / "state", ["api.model.test", host])


def test_create_refuses_a_validity_that_is_not_positive(tmp_path: Path) -> None:
    with pytest.raises(InspectionError, match="validity must be positive"):
        GatewayCA.create(tmp_path / "state", HOSTS, validity=timedelta(0))


def test_reissue(tmp_path: Path) -> None:
    first = GatewayCA.create(tmp_path / "state", ["api.model.test"], validity=timedelta(days=2))
    assert first.reissue(["api.model.test"]) is first
    second = first.reissue(["api.model.test", "new.model.test"])
    assert second.hosts == {"api.model.test", "new.model.test"} and second.cert_path != first.cert_path
    assert second.cert.public_key() != first.cert.public_key()
    assert second.cert.not_valid_after_utc - second.cert.not_valid_before_utc == timedelta(days=2) + CLOCK_SKEW
    assert verify_cryptography(second, second.leaf("new.model.test").cert, "new.model.test") == "ok"
    assert not first.permits("new.model.test")  # the older sandboxes' CA cannot sign the new host
    assert first.leaf("api.model.test")  # and still serves them
    first.remove()
    assert not first.cert_path.exists() and not first.key_path.exists() and second.key_path.exists()


def test_reissue_renews_a_ca_past_half_its_validity(tmp_path: Path) -> None:
    made = GatewayCA.create(tmp_path / "state", HOSTS, validity=timedelta(days=2))
    later = made.cert.not_valid_before_utc + CLOCK_SKEW + timedelta(days=1, minutes=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("airlock.inspection.ca.datetime", _Clock(later))
        assert made.reissue(HOSTS) is not made


def test_store_entry_serves_a_handshake_python_verifies(ca: GatewayCA) -> None:
    """The entry as mitmproxy's `tls_start_client` uses it (its own context factory, then the cert and key), and a
    client that trusts the CA alone: the handshake completes and the name is checked."""
    entry = ca.store_entry("api.model.test")
    context = net_tls.create_client_proxy_context(
        method=net_tls.Method.TLS_SERVER_METHOD,
        min_version=net_tls.Version.TLS1_2,
        max_version=net_tls.Version.UNBOUNDED,
        cipher_list=None,
        ecdh_curve=None,
        chain_file=entry.chain_file,
        alpn_select_callback=None,
        request_client_cert=False,
        extra_chain_certs=(),
        dhparams=None,
    )
    server_socket, client_socket = socket.socketpair()
    server = SSL.Connection(context, server_socket)
    server.use_certificate(entry.cert.to_cryptography())
    server.use_privatekey(entry.privatekey)
    server.set_accept_state()
    handshake = threading.Thread(target=server.do_handshake)
    handshake.start()
    client = ssl.create_default_context(cadata=ca.cert_pem.decode())
    with client.wrap_socket(client_socket, server_hostname="api.model.test") as tls:
        assert tls.getpeercert()["subjectAltName"] == (("DNS", "api.model.test"),)
    handshake.join(5)
    server_socket.close()
