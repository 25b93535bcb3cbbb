"""Transparent mode's pure parts: what the DNS told each sandbox (bounded in time and size), what a connection's
first bytes are, the host of a Host header, and the fence's interception rules. The whole path, with real
clients and namespaces, is tests/e2e/test_transparent.py."""

from __future__ import annotations

import ipaddress

import pytest

from airlock.dns.answered import AnsweredAddresses
from airlock.policy import HostError
from airlock.proxy.httppolicy import _authority_host
from airlock.proxy.transparent import _carried
from airlock.sandbox.fence import Fence, Interception

A, B = ipaddress.ip_address("192.0.2.10"), ipaddress.ip_address("192.0.2.11")


def test_an_answer_names_its_addresses_for_its_sandbox_while_it_lives() -> None:
    answered = AnsweredAddresses(grace=5)
    answered.record("sbx", "allowed.test", [A], ttl=10, now=100)
    assert answered.names("sbx", A, now=114) == ["allowed.test"]  # TTL plus the grace
    assert answered.names("sbx", A, now=116) == []
    assert answered.names("other", A, now=101) == []  # another sandbox never asked
    assert answered.names("sbx", B, now=101) == []


def test_the_newest_answer_comes_first_and_a_refresh_extends_it() -> None:
    answered = AnsweredAddresses(grace=0)
    answered.record("sbx", "one.test", [A], ttl=10, now=0)
    answered.record("sbx", "two.test", [A, B], ttl=10, now=1)
    assert answered.names("sbx", A, now=2) == ["two.test", "one.test"]
    answered.record("sbx", "one.test", [A], ttl=10, now=5)
    assert answered.names("sbx", A, now=10.5) == ["one.test", "two.test"]
    assert answered.names("sbx", A, now=12) == ["one.test"]


def test_associations_are_bounded_per_sandbox_and_per_address() -> None:
    answered = AnsweredAddresses(per_sandbox=2, names_per_address=2)
    addresses = [ipaddress.ip_address(f"192.0.2.{i}") for i in range(1, 4)]
    for address in addresses:
        answered.record("sbx", "n.test", [address], ttl=60, now=0)
    assert [answered.names("sbx", a, now=1) for a in addresses] == [[], ["n.test"], ["n.test"]]  # oldest gone
    for name in ("a.test", "b.test", "c.test"):
        answered.record("sbx", name, [A], ttl=60, now=0)
    assert answered.names("sbx", A, now=1) == ["c.test", "b.test"]


@pytest.mark.parametrize(
    ("data", "carried"),
    [
        (b"", None), (b"\x16", "tls"), (b"\x16\x03\x01", "tls"), (b"GE", None), (b"GET ", "http"),
        (b"PRI * HTTP/2.0", "http"), (b"SSH-2.0-x\r\n", "raw"), (b"get / HTTP/1.1", "raw"), (b"\x00\x01", "raw"),
        (b"ABCDEFGHIJKLMNOPQRSTU", "raw"),  # no method is that long
    ],
)  # fmt: skip
def test_the_first_bytes_say_what_a_connection_carries(data: bytes, carried: str | None) -> None:
    assert _carried(data) == carried


@pytest.mark.parametrize(
    ("header", "host"),
    [("allowed.test", "allowed.test"), ("allowed.test:8080", "allowed.test"), ("[2001:db8::1]:80", "[2001:db8::1]")],
)
def test_the_host_of_a_host_header(header: str, host: str) -> None:
    assert _authority_host(header) == host


@pytest.mark.parametrize("header", ["", ":80", "[2001:db8::1"])
def test_a_host_header_without_a_host_is_an_error(header: str) -> None:
    with pytest.raises(HostError):
        _authority_host(header)


def test_interception_redirects_tcp_but_never_to_the_gateways_own_addresses() -> None:
    rules = Fence("airlock_n_t1", "alht1", "10.231.0.1", (3128,), (), Interception(3129)).ruleset()
    assert 'iifname "alht1" fib daddr type local return' in rules
    assert 'iifname "alht1" meta nfproto ipv4 meta l4proto tcp dnat ip to 10.231.0.1:3129' in rules
    assert rules.index("fib daddr type local return") < rules.index("dnat ip to 10.231.0.1:3129")
    # dialled directly, the transparent listener would read its own address as the destination
    assert 'iifname "alht1" tcp dport 3129 ct status & dnat == 0 counter reject with tcp reset' in rules
    assert "tcp dport { 3128, 3129 } socket mark" in rules
    assert "dnat" not in Fence("airlock_n_t1", "alht1", "10.231.0.1", (3128,)).ruleset()


def test_dns_to_any_address_goes_to_the_gateways_dns_even_where_tcp_would_not() -> None:
    rules = Fence("airlock_n_t1", "alht1", "10.231.0.1", (3128, 53), (53,), Interception(3129, 5353)).ruleset()
    dns = 'iifname "alht1" meta nfproto ipv4 meta l4proto { tcp, udp } th dport 53 dnat ip to 10.231.0.1:5353'
    assert dns in rules
    assert rules.index(dns) < rules.index("fib daddr type local return")  # also port 53 of any own address
    assert "th dport 53" not in Fence("airlock_n_t1", "alht1", "10.231.0.1", (3128,), (), Interception(3129)).ruleset()


def test_other_udp_to_elsewhere_is_refused_with_port_unreachable_before_conntrack() -> None:
    rules = Fence("airlock_n_t1", "alht1", "10.231.0.1", (3128, 53), (53,), Interception(3129, 53)).ruleset()
    refuse = 'iifname "alht1" meta l4proto udp fib daddr type != local udp dport != 53 counter reject with icmpx'
    assert refuse in rules and "type filter hook prerouting priority raw" in rules
    without_dns = Fence("airlock_n_t1", "alht1", "10.231.0.1", (3128,), (), Interception(3129)).ruleset()
    assert "meta l4proto udp fib daddr type != local counter reject with icmpx type port-unreachable" in without_dns
