"""The sandbox's trust bundle: the system's CA certificates plus the gateway CA in one 0644 file that OpenSSL loads
whole, never anything but the CA's certificate from what it is given, and the variables that point clients at it."""

from __future__ import annotations

import logging
import os
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509

from airlock.inspection import InspectionError
from airlock.inspection.ca import GatewayCA
from airlock.inspection.trust import SYSTEM_BUNDLE, TRUST_ENV_VARS, trust_env, write_trust_bundle


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> GatewayCA:
    return GatewayCA.create(tmp_path_factory.mktemp("ca") / "state", ["api.model.test"])


def loaded(bundle: Path) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(bundle.read_bytes())


def test_the_system_bundle_plus_the_gateway_ca(ca: GatewayCA, tmp_path: Path) -> None:
    bundle = write_trust_bundle(tmp_path / "trust", [ca.cert_pem])
    system = SYSTEM_BUNDLE.read_bytes()
    assert bundle.read_bytes() == system + (b"" if system.endswith(b"\n") else b"\n") + ca.cert_pem
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o644 and bundle.parent == tmp_path / "trust"
    with_ca = ssl.create_default_context(cafile=str(bundle))  # OpenSSL reads every certificate in it
    without = ssl.create_default_context(cafile=str(SYSTEM_BUNDLE))
    assert len(with_ca.get_ca_certs()) == len(without.get_ca_certs()) + 1


def test_a_system_bundle_without_a_final_newline(ca: GatewayCA, tmp_path: Path) -> None:
    other = GatewayCA.create(tmp_path / "other", [])
    system = tmp_path / "system.crt"
    system.write_bytes(other.cert_pem.rstrip(b"\n"))
    assert loaded(write_trust_bundle(tmp_path / "trust", [ca.cert_pem], system)) == [other.cert, ca.cert]


def test_no_system_bundle_means_the_gateway_ca_alone_and_a_warning(
    ca: GatewayCA, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "airlock.inspection"):
        bundle = write_trust_bundle(tmp_path / "trust", [ca.cert_pem], tmp_path / "missing.crt")
    assert loaded(bundle) == [ca.cert]
    assert [r.getMessage() for r in caplog.records] == [
        f"no system CA bundle at {tmp_path}/missing.crt: sandboxes trust the gateway CA alone"
    ]


def test_a_system_bundle_that_cannot_be_read_is_an_error(ca: GatewayCA, tmp_path: Path) -> None:
    with pytest.raises(InspectionError, match=f"system CA bundle {tmp_path}: not a regular file"):
        write_trust_bundle(tmp_path / "trust", [ca.cert_pem], tmp_path)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(InspectionError, match="not a regular file"):
        write_trust_bundle(tmp_path / "trust", [ca.cert_pem], tmp_path / "fifo")


def test_only_the_ca_certificate_is_taken_from_what_is_given(ca: GatewayCA, tmp_path: Path) -> None:
    """A CA file that holds its key too (as mitmproxy's own does) gives the bundle its certificate only."""
    with_key = ca.key_path.read_bytes() + ca.cert_pem
    bundle = write_trust_bundle(tmp_path / "trust", [with_key], tmp_path / "missing.crt")
    assert b"PRIVATE KEY" not in bundle.read_bytes() and loaded(bundle) == [ca.cert]


@pytest.mark.parametrize(
    "pem", [b"", b"not a certificate", b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"]
)
def test_anything_but_one_certificate_is_refused(tmp_path: Path, pem: bytes) -> None:
    with pytest.raises(InspectionError, match="exactly one PEM certificate"):
        write_trust_bundle(tmp_path / "trust", [pem])


def test_two_certificates_are_refused(ca: GatewayCA, tmp_path: Path) -> None:
    with pytest.raises(InspectionError, match="exactly one PEM certificate"):
        write_trust_bundle(tmp_path / "trust", [ca.cert_pem + ca.cert_pem])


def test_a_bundle_per_ca_replaced_whole(ca: GatewayCA, tmp_path: Path) -> None:
    other = GatewayCA.create(tmp_path / "other", [])
    system = tmp_path / "system.crt"
    system.write_bytes(b"")
    first = write_trust_bundle(tmp_path / "trust", [ca.cert_pem], system)
    second = write_trust_bundle(tmp_path / "trust", [other.cert_pem], system)
    assert first != second and loaded(first) == [ca.cert] and loaded(second) == [other.cert]
    assert write_trust_bundle(tmp_path / "trust", [ca.cert_pem], system) == first
    assert sorted(p.name for p in (tmp_path / "trust").iterdir()) == sorted([first.name, second.name])


def test_a_directory_others_can_write_is_refused(ca: GatewayCA, tmp_path: Path) -> None:
    (tmp_path / "trust").mkdir()
    (tmp_path / "trust").chmod(0o777)
    with pytest.raises(InspectionError, match="others can write into it"):
        write_trust_bundle(tmp_path / "trust", [ca.cert_pem])


def test_the_variables() -> None:
    assert TRUST_ENV_VARS == (
        "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "PIP_CERT", "GIT_SSL_CAINFO",
        "AWS_CA_BUNDLE",
    )  # fmt: skip
    assert trust_env() == dict.fromkeys(TRUST_ENV_VARS, "/etc/ssl/certs/ca-certificates.crt")
    assert set(trust_env("/run/airlock/ca.crt").values()) == {"/run/airlock/ca.crt"}
