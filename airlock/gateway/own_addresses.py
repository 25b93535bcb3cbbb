"""Which addresses are the gateway's own right now (those of its interfaces at start, then whatever the kernel lets it
bind): the `own` of the live policy (policy/live.py) that the proxy and the DNS server vet every resolved address
against.

The interface list read at start goes stale as sandboxes, docker networks or DHCP add addresses; the kernel knows
at once: a socket can be bound only to a local address (also one of a `local` route, such as AnyIP). So an address
is the gateway's own when binding to it succeeds. Each answer is remembered until the kernel reports a change of
any address or route (rtnetlink): the notice is queued on our socket before the change's own system call returns,
and every decision first looks for one (a non-blocking read), so an address the gateway gains counts as its own
from the first decision after it is added. Where the notices cannot be had, every address is probed at every
decision, as without a memory.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Iterable
from pathlib import Path

from airlock.interfaces import interface_addresses
from airlock.policy import IPAddress
from airlock.policy.live import judged_forms

log = logging.getLogger("airlock.gateway")

NONLOCAL_BIND = ("/proc/sys/net/ipv4/ip_nonlocal_bind", "/proc/sys/net/ipv6/ip_nonlocal_bind")
# rtnetlink multicast groups: IPv4 and IPv6 addresses and routes (a `local` route makes addresses bindable too).
RTMGRP_IPV4_IFADDR, RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_IFADDR, RTMGRP_IPV6_ROUTE = 0x10, 0x40, 0x100, 0x400
WATCHED = RTMGRP_IPV4_IFADDR | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_IFADDR | RTMGRP_IPV6_ROUTE
MAX_REMEMBERED = 4096  # addresses; beyond, the memory starts afresh


class AddressChanges:
    """The kernel's notices of address and route changes in this network namespace, read without waiting."""

    def __init__(self) -> None:
        flags = socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
        self._sock = socket.socket(socket.AF_NETLINK, flags, socket.NETLINK_ROUTE)
        try:
            self._sock.bind((0, WATCHED))
        except OSError:
            self._sock.close()
            raise
        self._buffer = memoryview(bytearray(65536))

    def seen(self) -> bool:
        """Has anything changed since the last call? Takes every notice waiting."""
        changed = False
        while True:
            try:
                self._sock.recv_into(self._buffer)
            except BlockingIOError:
                return changed
            except OSError:  # ENOBUFS: notices were lost to an overflow; something changed
                pass
            changed = True

    def close(self) -> None:
        self._sock.close()


class GatewayAddresses:
    def __init__(self, listed: frozenset[IPAddress] = frozenset()) -> None:
        self.listed = listed  # known at start (interfaces, the listen address): own whatever a probe says later
        # With ip_nonlocal_bind every bind succeeds and the probe would call every address local.
        self.probing = not any(_enabled(path) for path in NONLOCAL_BIND)
        self._changes: AddressChanges | None = None
        self._local: dict[IPAddress, bool] = {}
        if not self.probing:
            log.warning("ip_nonlocal_bind is set: only the gateway's addresses known at start are refused")
            return
        try:
            self._changes = AddressChanges()
        except OSError as e:
            log.warning("address changes cannot be watched (%s): the gateway's addresses are probed per decision", e)

    def among(self, addresses: Iterable[IPAddress]) -> frozenset[IPAddress]:
        """The ones that are the gateway's own (an IPv6 form of an IPv4 address asked as that address too)."""
        addresses = judged_forms(addresses)
        own = self.listed.intersection(addresses)
        if not self.probing:
            return own
        local = self._local
        if self._changes is None or self._changes.seen() or len(local) >= MAX_REMEMBERED:
            local.clear()
        for address in addresses:
            is_local = local.get(address)
            if is_local is None:
                is_local = bindable(address)
                if self._changes is not None:
                    local[address] = is_local
            if is_local:
                own |= {address}
        return own

    def close(self) -> None:
        if self._changes is not None:
            self._changes.close()
            self._changes = None
        self._local.clear()


def interface_own_addresses() -> frozenset[IPAddress]:
    """Every address of this network namespace's interfaces: the gateway must never be its own upstream."""
    try:
        return frozenset(address.ip for address in interface_addresses())
    except OSError as e:
        log.warning("the gateway's own addresses could not be listed (%s): each is still found by binding to it", e)
        return frozenset()


def bindable(address: IPAddress) -> bool:
    """Can a socket of this namespace be bound to `address`? A probe that fails otherwise says yes (fail closed)."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(address), 0))
    except OSError as e:
        return e.errno != errno.EADDRNOTAVAIL
    return True


def _enabled(path: str) -> bool:
    try:
        return Path(path).read_text().strip() != "0"
    except OSError:
        return False
