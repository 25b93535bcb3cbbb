"""The addresses of this network namespace's interfaces: read by the gateway (its own addresses, which it must never
dial) and by both sandbox backends (the subnets already in use).

`interface_addresses()` asks the kernel itself (an rtnetlink dump, as `ip addr show` does): a launch reads the list
twice, and a subprocess each time cost it more than the reading. `parse_ip_addr()` reads the JSON of
`ip -j addr show` where the list comes from another namespace's `ip` (the docker backend's)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import struct

type Interface = ipaddress.IPv4Interface | ipaddress.IPv6Interface

# rtnetlink (linux/netlink.h, linux/rtnetlink.h, linux/if_addr.h)
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWADDR, RTM_GETADDR = 20, 22
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
IFA_ADDRESS, IFA_LOCAL = 1, 2
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefix length, flags, scope, interface index
_RTATTR = struct.Struct("=HH")  # length, type
_FAMILIES = {socket.AF_INET: 4, socket.AF_INET6: 16}  # → the address's length in bytes
DUMP_TIMEOUT = 5.0  # seconds for the kernel's answer (it answers at once)


def parse_ip_addr(text: str) -> list[Interface]:
    """Each address with its prefix, from the JSON of `ip -j addr show`; entries without both are left out, text
    that is no such JSON is ValueError."""
    found: list[Interface] = []
    for interface in json.loads(text.strip() or "[]"):
        for info in interface.get("addr_info", []):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                found.append(ipaddress.ip_interface(f"{info['local']}/{info['prefixlen']}"))
    return found


def interface_addresses() -> list[Interface]:
    """Every address of this namespace's interfaces, with its prefix (`ip addr show`'s `local`: IFA_LOCAL, else
    IFA_ADDRESS — they differ on point-to-point links, where IFA_ADDRESS is the peer); OSError when the kernel
    cannot say."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE) as nl:
        nl.settimeout(DUMP_TIMEOUT)
        nl.bind((0, 0))
        request = _IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        nl.send(_HEADER.pack(_HEADER.size + len(request), RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + request)
        found: list[Interface] = []
        while True:
            data = nl.recv(65536)
            if _read_dump(data, found):
                return found


def _read_dump(data: bytes, found: list[Interface]) -> bool:
    """Add the addresses of one datagram of the dump to `found`; whether the dump is done. OSError for the
    kernel's error, or a datagram that is no rtnetlink message."""
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, _, _, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            raise OSError("rtnetlink: a truncated message")
        body = data[offset + _HEADER.size : offset + length]
        if kind == NLMSG_DONE:
            return True
        if kind == NLMSG_ERROR:
            code = -struct.unpack_from("=i", body)[0]
            raise OSError(code, f"rtnetlink address dump: {os.strerror(code)}")
        if kind == RTM_NEWADDR and (address := _address(body)) is not None:
            found.append(address)
        offset += (length + 3) & ~3  # NLMSG_ALIGN
    return False


def _address(body: bytes) -> Interface | None:
    """The address of one RTM_NEWADDR message's body (ifaddrmsg and its attributes); None for a family or an
    attribute this reader does not place."""
    if len(body) < _IFADDRMSG.size:
        return None
    family, prefix, _, _, _ = _IFADDRMSG.unpack_from(body)
    size = _FAMILIES.get(family)
    if size is None:
        return None
    attributes: dict[int, bytes] = {}
    offset = _IFADDRMSG.size
    while offset + _RTATTR.size <= len(body):
        length, kind = _RTATTR.unpack_from(body, offset)
        if length < _RTATTR.size:
            break
        attributes[kind] = body[offset + _RTATTR.size : offset + length]
        offset += (length + 3) & ~3  # RTA_ALIGN
    raw = attributes.get(IFA_LOCAL) or attributes.get(IFA_ADDRESS)
    if raw is None or len(raw) != size:
        return None
    return ipaddress.ip_interface((ipaddress.ip_address(raw), prefix))
