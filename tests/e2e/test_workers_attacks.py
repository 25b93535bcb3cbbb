"""Held attack tests of tests/e2e/test_proxy.py run again, as they are, against `airlock gateway --workers 2`: the
metadata address and loopback in every spelling, a CONNECT whose SNI is another host, Host-header fronting, an
unlisted host, the allowlisted name resolving inside, the gateway's own addresses. One gateway with workers serves
the module (the shared one is stopped meanwhile, and restarted after)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import test_proxy

from airlock.verify.fakeca import FakeCA
from airlock.verify.topology import FakeNet, Topology

from gateway_proc import GatewayProcess


@pytest.fixture(scope="module")
def workers_gateway(
    topology: Topology,
    fakenet: FakeNet,
    fence: object,
    gateway: GatewayProcess,
    broker_args: tuple[str, ...],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    gateway.stop()
    gw = GatewayProcess(topology, tmp_path_factory.mktemp("workers"), extra=(*broker_args, "--workers", "2"))
    try:
        yield gw.start()
        assert "(2 workers)" in gw.log()
    finally:
        gw.stop()
        gateway.start()


@pytest.fixture(autouse=True)
def _served_by_workers(workers_gateway: GatewayProcess) -> Iterator[None]:
    """After each test: what it sent was judged in the workers (every proxy line says which)."""
    before = len(workers_gateway.audit())
    yield
    lines = [r for r in workers_gateway.audit()[before:] if r["kind"] in ("http", "connect")]
    assert all(r["extra"].get("worker") in (0, 1) for r in lines), lines


@pytest.mark.parametrize(
    ("host", "code"),
    [(h, "metadata") for h in test_proxy.METADATA_SPELLINGS[:5]]
    + [(h, "internal_address") for h in test_proxy.LOOPBACK_SPELLINGS[:3]],
)
def test_metadata_and_loopback_in_any_spelling_are_denied(
    topology: Topology, fakenet: FakeNet, workers_gateway: GatewayProcess, host: str, code: str
) -> None:
    test_proxy.test_metadata_and_loopback_in_any_spelling_are_denied(topology, fakenet, workers_gateway, host, code)


@pytest.mark.parametrize(
    ("name", "blocked_ip", "code"),
    [
        ("internal.allowed.test", test_proxy.INTERNAL_IP, "internal_address"),
        ("meta.allowed.test", test_proxy.METADATA_IP, "metadata"),
    ],
)
def test_allowlisted_name_resolving_inside_is_denied(
    topology: Topology, fakenet: FakeNet, workers_gateway: GatewayProcess, name: str, blocked_ip: str, code: str
) -> None:
    test_proxy.test_allowlisted_name_resolving_inside_is_denied(
        topology, fakenet, workers_gateway, name, blocked_ip, code
    )


def test_connect_with_mismatched_sni_is_closed(
    topology: Topology, fakenet: FakeNet, workers_gateway: GatewayProcess, test_ca: FakeCA
) -> None:
    test_proxy.test_connect_with_mismatched_sni_is_closed(topology, fakenet, workers_gateway, test_ca)


def test_host_header_fronting_is_denied(topology: Topology, fakenet: FakeNet, workers_gateway: GatewayProcess) -> None:
    test_proxy.test_host_header_fronting_is_denied(topology, fakenet, workers_gateway)


def test_unlisted_host_gets_403_with_reason(
    topology: Topology, fakenet: FakeNet, workers_gateway: GatewayProcess
) -> None:
    test_proxy.test_unlisted_host_gets_403_with_reason(topology, fakenet, workers_gateway)


@pytest.mark.parametrize("target", ["10.254.0.1:3128", "10.253.0.1:80", "127.0.0.1:3128"])
def test_the_gateways_own_addresses_are_denied(
    topology: Topology, fakenet: FakeNet, workers_gateway: GatewayProcess, target: str
) -> None:
    test_proxy.test_the_gateways_own_addresses_are_denied(topology, fakenet, workers_gateway, target)


def test_allowed_connect_tls_returns_the_real_body(
    topology: Topology, fakenet: FakeNet, workers_gateway: GatewayProcess, test_ca: FakeCA
) -> None:
    test_proxy.test_allowed_connect_tls_returns_the_real_body(topology, fakenet, workers_gateway, test_ca)
