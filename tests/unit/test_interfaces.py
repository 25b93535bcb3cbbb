"""The one reader of `ip -j addr show` (airlock/interfaces.py), for the gateway's own addresses and the subnets the
sandbox backends must not reuse. Nothing is sent anywhere: `ip` only lists this namespace's addresses."""

from __future__ import annotations

import ipaddress
import json

import pytest

from airlock.interfaces import interface_addresses, parse_ip_addr

IP_ADDR = [
    {"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
    {
        "ifname": "veth0",
        "addr_info": [
            {"family": "inet", "local": "10.231.4.1", "prefixlen": 30},
            {"family": "inet6", "local": "fe80::1", "prefixlen": 64},
            {"family": "inet6", "local": "2001:db8::7"},  # no prefix: not an address this reader can place
            {"family": "inet", "local": "not-an-address", "prefixlen": 24},
        ],
    },
    {"ifname": "down0"},  # an interface without addresses
]


def test_every_address_with_its_prefix() -> None:
    found = parse_ip_addr(json.dumps(IP_ADDR))
    assert found == [ipaddress.ip_interface(a) for a in ("127.0.0.1/8", "10.231.4.1/30", "fe80::1/64")]
    assert [str(a.network) for a in found] == ["127.0.0.0/8", "10.231.4.0/30", "fe80::/64"]


@pytest.mark.parametrize("text", ["", "  \n", "[]"])
def test_no_output_is_no_address(text: str) -> None:
    assert parse_ip_addr(text) == []


def test_what_is_no_json_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_ip_addr('Object "addr" is unknown')


def test_this_namespace_has_its_loopback_address() -> None:
    assert ipaddress.ip_interface("127.0.0.1/8") in interface_addresses()
