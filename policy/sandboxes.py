"""The sandbox registry: a sandbox is named by where its traffic comes from."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from .addresses import Network
from .hosts import IPAddress


@dataclass(frozen=True, slots=True)
class Sandbox:
    id: str
    profile: str
    network: Network


class SandboxRegistry:
    """Sandbox identity from where traffic comes from: each sandbox has its own network, so the source
    address of a connection names the sandbox and a sandbox cannot claim to be another."""

    def __init__(self, sandboxes: list[Sandbox] | None = None) -> None:
        self._sandboxes: list[Sandbox] = []
        self._known: dict[IPAddress | str, Sandbox | None] = {}  # source address → sandbox, asked per packet
        for sandbox in sandboxes or []:
            self.add(sandbox)

    @property
    def sandboxes(self) -> tuple[Sandbox, ...]:
        return tuple(self._sandboxes)

    def add(self, sandbox: Sandbox) -> None:
        self._known.clear()
        for other in self._sandboxes:
            if other.network.version == sandbox.network.version and other.network.overlaps(sandbox.network):
                raise ValueError(f"sandbox {sandbox.id}: {sandbox.network} overlaps {other.id}'s {other.network}")
        self._sandboxes.append(sandbox)

    def ids(self) -> list[str]:
        return list(dict.fromkeys(sandbox.id for sandbox in self._sandboxes))  # a sandbox may have several networks

    def identify(self, address: IPAddress | str) -> Sandbox | None:
        known = self._known.get(address)
        if known is not None or address in self._known:
            return known
        sandbox = self._identify(address)
        if len(self._known) >= 65536:
            self._known.clear()
        self._known[address] = sandbox
        return sandbox

    def _identify(self, address: IPAddress | str) -> Sandbox | None:
        ip = ipaddress.ip_address(address) if isinstance(address, str) else address
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        for sandbox in self._sandboxes:
            if ip.version == sandbox.network.version and ip in sandbox.network:
                return sandbox
        return None
