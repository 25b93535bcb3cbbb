"""Which addresses belong to the gateway right now. The interface list read at start-up goes stale when sandboxes,
docker networks or DHCP add addresses; the kernel knows at once: a socket can be bound only to a local address."""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Iterable
from pathlib import Path

from airlock.policy import IPAddress

log = logging.getLogger("airlock.proxy")

NONLOCAL_BIND = ("/proc/sys/net/ipv4/ip_nonlocal_bind", "/proc/sys/net/ipv6/ip_nonlocal_bind")


class LocalAddresses:
    def __init__(self) -> None:
        # With ip_nonlocal_bind every bind succeeds and the probe would call every address local.
        self.probing = not any(_enabled(path) for path in NONLOCAL_BIND)
        if not self.probing:
            log.warning("ip_nonlocal_bind is set: only the gateway's addresses known at start are refused")

    def among(self, addresses: Iterable[IPAddress]) -> frozenset[IPAddress]:
        """The ones the gateway could bind to: its own. A probe that fails otherwise counts as own (fail closed)."""
        if not self.probing:
            return frozenset()
        own = set()
        for address in addresses:
            family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
            try:
                with socket.socket(family, socket.SOCK_DGRAM) as probe:
                    probe.bind((str(address), 0))
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    continue
            own.add(address)
        return frozenset(own)


def _enabled(path: str) -> bool:
    try:
        return Path(path).read_text().strip() != "0"
    except OSError:
        return False
