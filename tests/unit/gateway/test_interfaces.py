"""The one reader of this namespace's addresses (airlock/interfaces.py: the kernel's rtnetlink dump, or the JSON of
`ip -j addr show`), for the gateway's own addresses and the subnets the sandbox backends must not reuse. Nothing is
sent anywhere: both only list this namespace's addresses."""

from __future__ import annotations

import ipaddress
import json
import secrets
import subprocess
import sys

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


def test_the_kernels_list_is_the_one_ip_shows() -> None:
    """The rtnetlink dump gives every address `ip addr show` gives, each with its prefix, and nothing else."""
    shown = parse_ip_addr(
        subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, check=True).stdout
    )
    assert sorted(interface_addresses(), key=str) == sorted(shown, key=str)


COMPARE = (
    "import json, subprocess\nfrom airlock.interfaces import interface_addresses, parse_ip_addr\n"
    "shown = parse_ip_addr(subprocess.run(['ip', '-j', 'addr', 'show'], capture_output=True, text=True).stdout)\n"
    "print(json.dumps([sorted(map(str, interface_addresses())), sorted(map(str, shown))]))"
)


def test_in_a_namespace_of_its_own_every_kind_of_address_is_listed_as_ip_shows_it(privileged: None) -> None:
    """Secondary addresses, a point-to-point one (whose peer is no address of ours), IPv6 global and link-local,
    on an interface that is down and one that is up."""
    name = f"alif{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        setup = (
            "link set lo up\nlink add d0 type veth peer name d1\nlink set d1 up\n"
            "addr add 10.9.0.1/24 dev d0\naddr add 10.9.0.7/24 dev d0\naddr add 10.9.1.1 peer 10.9.1.2/32 dev d1\n"
            "addr add 2001:db8::5/64 dev d1\naddr add fd00:9::1/48 dev d1 nodad\n"
        )
        subprocess.run(["ip", "-n", name, "-batch", "-"], input=setup, text=True, check=True)
        out = subprocess.run(
            ["ip", "netns", "exec", name, sys.executable, "-c", COMPARE], capture_output=True, text=True, check=True
        ).stdout
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
    listed, shown = json.loads(out)
    assert listed == shown
    assert {"10.9.0.1/24", "10.9.0.7/24", "10.9.1.1/32", "2001:db8::5/64", "::1/128"} <= set(listed)
    assert "10.9.1.2/32" not in listed
