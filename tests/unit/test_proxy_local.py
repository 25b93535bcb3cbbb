"""The probe for the gateway's own addresses (proxy/local.py): binding only, nothing is sent anywhere."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from airlock.proxy import local
from airlock.proxy.local import LocalAddresses


def ips(*texts: str) -> list:
    return [ipaddress.ip_address(t) for t in texts]


def test_loopback_is_own_and_a_documentation_address_is_not() -> None:
    probe = LocalAddresses()
    assert probe.probing
    assert probe.among(ips("127.0.0.1", "127.8.9.10", "203.0.113.7", "198.51.100.1")) == frozenset(
        ips("127.0.0.1", "127.8.9.10")
    )


def test_with_nonlocal_bind_the_probe_stands_aside(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    switch = tmp_path / "ip_nonlocal_bind"
    switch.write_text("1\n")
    monkeypatch.setattr(local, "NONLOCAL_BIND", (str(switch),))
    probe = LocalAddresses()
    assert not probe.probing and probe.among(ips("127.0.0.1", "203.0.113.7")) == frozenset()
