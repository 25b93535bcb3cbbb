"""The audit record (one JSON line per decision) and the sandbox registry: shared shapes, no I/O."""

from __future__ import annotations

import ipaddress
import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Literal

from .addresses import Network
from .hosts import IPAddress

type Kind = Literal["http", "connect", "dns", "broker"]


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(slots=True)
class AuditRecord:
    kind: Kind
    sandbox: str
    client: str
    host: str
    port: int | None
    decision: Literal["allow", "deny", "error"]
    reason: str
    request_id: str = field(default_factory=new_request_id)
    ts: float = field(default_factory=time.time)
    method: str | None = None
    path: str | None = None
    rule: str | None = None
    resolved: list[str] = field(default_factory=list)
    chosen_ip: str | None = None
    bytes_in: int | None = None  # from the sandbox towards upstream
    bytes_out: int | None = None  # from upstream back to the sandbox
    duration_ms: float | None = None
    extra: dict[str, object] = field(default_factory=dict)  # kind-specific details, e.g. DNS exfil signals

    def to_json(self) -> str:
        record = asdict(self)
        record["ts"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.ts)) + f".{int(self.ts % 1 * 1000):03d}Z"
        return json.dumps(record, separators=(",", ":"), ensure_ascii=True)


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
        for sandbox in sandboxes or []:
            self.add(sandbox)

    def add(self, sandbox: Sandbox) -> None:
        for other in self._sandboxes:
            if other.network.version == sandbox.network.version and other.network.overlaps(sandbox.network):
                raise ValueError(f"sandbox {sandbox.id}: {sandbox.network} overlaps {other.id}'s {other.network}")
        self._sandboxes.append(sandbox)

    def remove(self, sandbox_id: str) -> None:
        self._sandboxes = [s for s in self._sandboxes if s.id != sandbox_id]

    def identify(self, address: IPAddress | str) -> Sandbox | None:
        ip = ipaddress.ip_address(address) if isinstance(address, str) else address
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        for sandbox in self._sandboxes:
            if ip.version == sandbox.network.version and ip in sandbox.network:
                return sandbox
        return None

    def __iter__(self):
        return iter(self._sandboxes)
