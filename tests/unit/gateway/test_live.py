"""The live policy (policy/live.py): one snapshot of policy, sandbox registry and the gateway's own addresses, swapped
whole on reload; and the gateway's own addresses as the kernel sees them (airlock/gateway/own_addresses.py): binding
only, nothing is sent anywhere."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import secrets
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from airlock.gateway import own_addresses as live_module
from airlock.gateway.own_addresses import GatewayAddresses
from airlock.policy import KnownAddresses, LivePolicy, PolicyError, Sandbox, SandboxRegistry, parse_policy

SANDBOX = Sandbox("sbx", "build", ipaddress.ip_network("10.231.0.0/30"))
PROFILE = "version: 1\ndefault_profile: {0}\nprofiles:\n  {0}:\n    allow:\n      - host: {1}\n"
ONE = parse_policy(PROFILE.format("build", "one.test"), "one.yaml")
TWO = parse_policy(PROFILE.format("build", "two.test"), "two.yaml")
NO_BUILD = parse_policy(PROFILE.format("other", "two.test"), "other.yaml")


def ips(*texts: str) -> list:
    return [ipaddress.ip_address(t) for t in texts]


# --- the live policy -----------------------------------------------------------------------------------------------


def test_a_reload_swaps_the_whole_snapshot_and_keeps_registry_and_addresses() -> None:
    own = KnownAddresses(frozenset(ips("192.0.2.1")))
    live = LivePolicy(ONE, SandboxRegistry([SANDBOX]), own)
    before = live.current
    live.replace(TWO)
    after = live.current
    assert (before.policy, after.policy) == (ONE, TWO)  # the snapshot read before the reload still says ONE
    assert after.registry is before.registry and after.own is own
    assert after.profile(SANDBOX) is TWO.profile("build")
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.policy = ONE  # type: ignore[misc]


def test_a_policy_without_a_running_sandboxs_profile_is_refused_and_the_old_one_stays() -> None:
    live = LivePolicy(ONE, SandboxRegistry([SANDBOX]))
    before = live.current
    with pytest.raises(
        PolicyError, match=r"other.yaml: no profile 'build', which sandbox sbx uses \(profiles: other\)"
    ):
        live.replace(NO_BUILD)
    assert live.current is before


# --- the gateway's own addresses -----------------------------------------------------------------------------------


def test_loopback_is_own_and_a_documentation_address_is_not() -> None:
    own = GatewayAddresses()
    try:
        assert own.probing
        assert own.among(ips("127.0.0.1", "127.8.9.10", "203.0.113.7", "198.51.100.1")) == frozenset(
            ips("127.0.0.1", "127.8.9.10")
        )
    finally:
        own.close()


def test_addresses_listed_at_start_are_own_whatever_a_probe_says() -> None:
    own = GatewayAddresses(frozenset(ips("198.51.100.1")))
    try:
        assert own.among(ips("198.51.100.1", "203.0.113.7")) == frozenset(ips("198.51.100.1"))
    finally:
        own.close()


def test_with_nonlocal_bind_the_probe_stands_aside(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    switch = tmp_path / "ip_nonlocal_bind"
    switch.write_text("1\n")
    monkeypatch.setattr(live_module, "NONLOCAL_BIND", (str(switch),))
    own = GatewayAddresses(frozenset(ips("192.0.2.1")))
    assert not own.probing and own.among(ips("127.0.0.1", "192.0.2.1", "203.0.113.7")) == frozenset(ips("192.0.2.1"))


def _counting_probes(monkeypatch: pytest.MonkeyPatch) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    probed: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    bindable = live_module.bindable

    def counting(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        probed.append(address)
        return bindable(address)

    monkeypatch.setattr(live_module, "bindable", counting)
    return probed


def test_an_address_is_probed_once_while_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    probed = _counting_probes(monkeypatch)
    own = GatewayAddresses()
    try:
        for _ in range(100):
            assert own.among(ips("127.0.0.1", "203.0.113.7")) == frozenset(ips("127.0.0.1"))
    finally:
        own.close()
    assert probed == ips("127.0.0.1", "203.0.113.7")  # not a socket and a bind per address and decision


@pytest.fixture
def namespace() -> Iterator[str]:
    """A network namespace of the test's own, with only its loopback up; removed afterwards."""
    name = f"allive{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=15)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=15)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False, timeout=15)


def _inside(namespace: str, work: Callable[[], object]) -> object:
    """Run `work` on a thread that has entered `namespace` (setns affects the calling thread alone)."""
    result: dict[str, object] = {}

    def run() -> None:
        try:
            with open(f"/run/netns/{namespace}") as ns:
                os.setns(ns.fileno(), os.CLONE_NEWNET)
            result["value"] = work()
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]


@pytest.mark.netns
def test_an_address_the_gateway_gains_is_its_own_at_the_next_decision(namespace: str) -> None:
    gained, anyip = ipaddress.ip_address("198.51.100.7"), ipaddress.ip_address("203.0.113.9")

    def ip(*argv: str) -> None:
        subprocess.run(["ip", "-n", namespace, *argv], check=True, timeout=15, capture_output=True)

    def work() -> list[frozenset]:
        own = GatewayAddresses()
        seen = []
        try:
            seen.append(own.among([gained, anyip]))  # neither is local: remembered so
            ip("addr", "add", f"{gained}/32", "dev", "lo")
            seen.append(own.among([gained, anyip]))
            ip("route", "add", "local", "203.0.113.0/24", "dev", "lo")  # AnyIP: bindable without an address
            seen.append(own.among([gained, anyip]))
            ip("addr", "del", f"{gained}/32", "dev", "lo")
            ip("route", "del", "local", "203.0.113.0/24", "dev", "lo")
            seen.append(own.among([gained, anyip]))
        finally:
            own.close()
        return seen

    assert _inside(namespace, work) == [frozenset(), {gained}, {gained, anyip}, frozenset()]
