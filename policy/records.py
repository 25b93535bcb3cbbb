"""The audit record (one JSON line per decision) and the sandbox registry: shared shapes, no I/O."""

from __future__ import annotations

import ipaddress
import itertools
import json
import secrets
import time
from dataclasses import dataclass, field, fields
from typing import Literal

from .addresses import Network
from .hosts import IPAddress

type Kind = Literal["http", "connect", "dns", "broker"]


_ID_PREFIX = secrets.token_hex(4)
_ID_COUNTER = itertools.count()


def new_request_id() -> str:
    """Unique per decision: a random per-process prefix and a counter (cheap enough for every DNS query)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True).encode
_second_text: tuple[int, str] = (-1, "")


def _timestamp(ts: float) -> str:
    global _second_text
    second = int(ts)
    if _second_text[0] != second:
        _second_text = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{_second_text[1]}.{int(ts % 1 * 1000):03d}Z"


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
        record = {name: getattr(self, name) for name in _AUDIT_FIELDS}  # asdict() deep-copies: too slow per query
        record["ts"] = _timestamp(self.ts)
        return _encode(record)


_AUDIT_FIELDS = tuple(f.name for f in fields(AuditRecord))
_PER_EVENT = ("ts", "request_id", "client")


@dataclass(slots=True)
class RepeatedDecisions:
    """Decisions repeated exactly (remembered DNS answers) in one batch read at time `ts`: one audit line each,
    with its own request id and client; everything else was serialized once, into the template."""

    ts: float
    events: list[tuple[str, str]]  # (template, client)

    @staticmethod
    def template(record: AuditRecord) -> str:
        """The record's fields but its time, id and client, as `"key":value,...}`."""
        fixed = {name: getattr(record, name) for name in _AUDIT_FIELDS if name not in _PER_EVENT}
        return _encode(fixed)[1:]

    def to_json(self) -> str:
        """One JSON line per decision, newline-separated."""
        # client is a socket's address text (digits, hex, '.', ':'): nothing in it needs JSON escaping.
        head = f'{{"ts":"{_timestamp(self.ts)}","request_id":"{_ID_PREFIX}'
        ids = _ID_COUNTER
        return "\n".join([f'{head}{next(ids):08x}","client":"{client}",{fixed}' for fixed, client in self.events])


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
