"""Admission of the sandbox DNS server (airlock.dns.admission), on its own: which sandbox asks, at what rate, how
many of its queries wait on upstream, how many TCP connections it holds. No socket is opened."""

from __future__ import annotations

import ipaddress

import pytest

from airlock.audit import AuditRecord
from airlock.dns.admission import NO_SANDBOX, Admission, DnsSettings, Overloaded
from airlock.policy import LivePolicy, Sandbox, SandboxRegistry, parse_policy

POLICY = parse_policy("version: 1\nprofiles:\n  default:\n    allow:\n      - host: allowed.test\n")
SBX = Sandbox("sbx", "default", ipaddress.ip_network("10.0.0.0/30"))
OTHER = Sandbox("other", "default", ipaddress.ip_network("10.0.1.0/30"))


def admission(**settings: float) -> tuple[Admission, list[AuditRecord]]:
    audit: list[AuditRecord] = []
    live = LivePolicy(POLICY, SandboxRegistry([SBX, OTHER]))
    return Admission(live, DnsSettings(**settings), audit.append), audit  # type: ignore[arg-type]


def test_each_sandbox_has_its_own_rate_and_one_batch_refills_nothing() -> None:
    gate, _ = admission(rate_per_second=2)  # bursts of 4
    assert [gate.admit("10.0.0.1", 50.0) for _ in range(5)] == [SBX] * 4 + [False]
    assert gate.admit("10.0.1.1", 50.0) == OTHER  # another sandbox's bucket is full
    assert gate.admit("10.0.0.2", 50.5) == SBX  # 0.5 s later: one more token
    assert gate.stats["rate_limited"] == 1


async def test_an_address_of_no_sandbox_is_answered_a_few_times_then_dropped() -> None:
    gate, _ = admission()
    admitted = [gate.admit("192.0.2.9", 10.0) for _ in range(12)]
    assert admitted == [None] * 10 + [False] * 2  # None: answered REFUSED and audited; False: dropped
    assert gate.stats["dropped_unknown_source"] == 2


def test_queries_waiting_on_upstream_are_capped_per_sandbox() -> None:
    gate, _ = admission(max_inflight_per_sandbox=2)
    with gate.upstream("sbx"), gate.upstream("sbx"):
        with pytest.raises(Overloaded), gate.upstream("sbx"):
            pass
        with gate.upstream("other"):  # a sandbox of its own
            pass
    with gate.upstream("sbx"):  # the places are given back
        pass
    assert gate.stats["over_inflight_limit"] == 1


def test_tcp_connections_are_capped_per_sandbox_and_for_strangers_together() -> None:
    gate, _ = admission(max_tcp_per_sandbox=2)
    assert [gate.open_tcp("10.0.0.1"), gate.open_tcp("10.0.0.2"), gate.open_tcp("10.0.0.1")] == ["sbx", "sbx", None]
    assert gate.open_tcp("192.0.2.1") == NO_SANDBOX and gate.open_tcp("192.0.2.2") == NO_SANDBOX
    assert gate.open_tcp("192.0.2.3") is None
    gate.close_tcp("sbx")
    assert gate.tcp_connections("sbx") == 1 and gate.open_tcp("10.0.0.1") == "sbx"
    assert gate.stats["tcp_over_limit"] == 2
