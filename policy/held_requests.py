"""Approvals: what a profile with `on_unlisted: ask` holds while a person decides, and what a decision grants.

Pure: no asyncio, no clock, no randomness. The adapter (airlock/gateway/approval_desk.py) passes the time and the ids,
and holds the futures the waiting requests await. A target is (sandbox, host, port); port None is a DNS query, which
asks for a name, not a port.

Only what no rule lists may be asked (`not_allowlisted`): a deny rule's denial never is, nor a hard block (metadata,
internal addresses, the gateway's own, sandbox links). A name is asked before it is resolved, so an unlisted name
reaches no upstream resolver until a person approves it (asking is no DNS exfiltration channel); its addresses are then
vetted like every allowed name's, so an approval never opens a hard block either."""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from .codes import ReasonCode
from .decide import Decision, vet
from .hosts import IPAddress, format_host_port, is_ip
from .live import Snapshot
from .model import DEFAULT_ALLOW_PORTS, Profile
from .sandboxes import Sandbox

type Scope = Literal["once", "sandbox", "policy"]
SCOPES: tuple[Scope, ...] = ("once", "sandbox", "policy")
MAX_PENDING_PER_SANDBOX = 16
MAX_PENDING = 256
MAX_GRANT_TTL = 7 * 86400


class Asker(Protocol):
    """What the proxy and the DNS resolver await when a profile asks (the adapter, airlock/gateway/approval_desk.py)."""

    async def decide(
        self,
        live: Snapshot,
        sandbox: Sandbox,
        host: str,
        port: int | None,
        decision: Decision,
        kind: str,
        client: str,
        hold: float | None = None,
    ) -> Decision:
        """`decision` as it stands when it may not be asked; else a grant's, or a person's (awaited)."""
        ...


def askable(profile: Profile, host: str, port: int | None, decision: Decision, own: frozenset[IPAddress]) -> bool:
    """May this denial be put to a person? Where the profile asks, for what no rule lists, never a hard block: an
    IP literal is vetted here (a name's addresses are vetted once it is approved, as for any allowed name)."""
    if profile.on_unlisted != "ask" or decision.code is not ReasonCode.NOT_ALLOWLISTED:
        return False
    return not is_ip(host) or bool(vet(profile, [ipaddress.ip_address(host)], port, own).allowed)


def may_ask(live: Snapshot, sandbox: Sandbox, host: str, port: int | None, decision: Decision) -> bool:
    """`askable`, with the sandbox's profile and the gateway's own addresses from the policy in force."""
    own = live.own.among([ipaddress.ip_address(host)]) if is_ip(host) else frozenset()
    return askable(live.profile(sandbox), host, port, decision, own)


@dataclass(frozen=True, slots=True)
class Target:
    sandbox: str
    host: str  # canonical
    port: int | None  # None: a DNS query

    def __str__(self) -> str:
        return self.host if self.port is None else format_host_port(self.host, self.port)

    def rule(self) -> tuple[str, list[int]]:
        """The allow rule a policy approval writes: (host, or an address as /32 or /128; its ports). A DNS query is
        approved as `{host: name}` is written, for the default port."""
        target = self.host
        if is_ip(target):
            target = f"{target}/{ipaddress.ip_address(target).max_prefixlen}"
        return target, sorted(DEFAULT_ALLOW_PORTS) if self.port is None else [self.port]


@dataclass(slots=True)
class Pending:
    id: str
    target: Target
    profile: str
    kind: str  # what asked first: http, connect or dns
    client: str
    asked: float  # the adapter's clock
    deadline: float
    waiting: int = 0  # requests awaiting the answer now (one that gave up leaves; the entry stays till its deadline)
    asks: int = 0  # requests that joined it, in all


@dataclass(frozen=True, slots=True)
class Full:
    """No room for one more pending request: why."""

    reason: str


class PendingTable:
    """The requests waiting for a person: bounded per sandbox and in all, one entry per target however often it is
    asked while pending."""

    def __init__(self, per_sandbox: int = MAX_PENDING_PER_SANDBOX, total: int = MAX_PENDING) -> None:
        self.per_sandbox, self.total = per_sandbox, total
        self._by_id: dict[str, Pending] = {}
        self._by_target: dict[Target, Pending] = {}

    def ask(
        self,
        target: Target,
        profile: str,
        kind: str,
        client: str,
        now: float,
        timeout: float,
        new_id: Callable[[], str],
    ) -> Pending | Full:
        """The entry this request waits on (the target's own if it is pending already), or Full."""
        entry = self._by_target.get(target)
        if entry is None:
            if len(self._by_id) >= self.total:
                return Full(f"{self.total} requests already wait for approval")
            if sum(p.target.sandbox == target.sandbox for p in self._by_id.values()) >= self.per_sandbox:
                return Full(f"{self.per_sandbox} requests of this sandbox already wait for approval")
            entry = Pending(new_id(), target, profile, kind, client, now, now + timeout)
            self._by_id[entry.id] = self._by_target[target] = entry
        entry.waiting += 1
        entry.asks += 1
        return entry

    def leave(self, entry: Pending) -> None:
        entry.waiting = max(0, entry.waiting - 1)

    def get(self, approval_id: str) -> Pending | None:
        return self._by_id.get(approval_id)

    def pop(self, approval_id: str) -> Pending | None:
        entry = self._by_id.pop(approval_id, None)
        if entry is not None:
            del self._by_target[entry.target]
        return entry

    def expired(self, now: float) -> list[Pending]:
        """Entries past their deadline, taken out of the table."""
        late = [entry.id for entry in self._by_id.values() if entry.deadline <= now]
        return [entry for approval_id in late if (entry := self.pop(approval_id)) is not None]

    def pending(self) -> list[Pending]:
        return sorted(self._by_id.values(), key=lambda entry: entry.asked)


@dataclass(frozen=True, slots=True)
class Grant:
    """A sandbox-scope approval: this target for this sandbox, until `until` (None: the sandbox's life)."""

    target: Target
    until: float | None
    by: str
    approval: str

    def decision(self) -> Decision:
        return Decision(True, f"approved by {self.by} for this sandbox (approval {self.approval})", ReasonCode.APPROVED)


class Grants:
    def __init__(self) -> None:
        self._grants: dict[tuple[str, str], dict[int | None, Grant]] = {}

    def add(self, grant: Grant) -> None:
        target = grant.target
        self._grants.setdefault((target.sandbox, target.host), {})[target.port] = grant

    def find(self, sandbox: str, host: str, port: int | None, now: float) -> Grant | None:
        """The grant that lets this sandbox reach host:port now. A DNS approval (port None) opens what the rule
        `{host: name}` opens, the default ports; DNS (port None) may resolve a name granted on any port."""
        grants = self._grants.get((sandbox, host))
        if not grants:
            return None
        for key, grant in list(grants.items()):
            if grant.until is not None and grant.until <= now:
                del grants[key]
        if not grants:
            del self._grants[(sandbox, host)]
            return None
        if port is None:
            return next(iter(grants.values()))
        return grants.get(port) or (grants.get(None) if port in DEFAULT_ALLOW_PORTS else None)


def answer_problem(scope: object, ttl: object) -> str | None:
    """What is wrong with a person's answer (scope, ttl in seconds), if anything."""
    if scope not in SCOPES:
        return f"scope must be one of {', '.join(SCOPES)}"
    if ttl is None:
        return None
    if scope != "sandbox":
        return "ttl applies to scope sandbox only"
    if not isinstance(ttl, int | float) or isinstance(ttl, bool) or not math.isfinite(ttl):
        return "ttl must be a number of seconds"
    if not 0 < ttl <= MAX_GRANT_TTL:
        return f"ttl must be more than 0 and at most {MAX_GRANT_TTL} seconds"
    return None


# --- the decisions a held request ends with -------------------------------------------------------------------------


def approved(by: str, scope: Scope, approval: str) -> Decision:
    return Decision(True, f"approved by {by} (scope {scope}, approval {approval})", ReasonCode.APPROVED)


def denied(by: str, approval: str, hint: str | None) -> Decision:
    return Decision(False, f"denied by {by} (approval {approval})", ReasonCode.APPROVAL_DENIED, None, hint)


def timed_out(timeout: float, approval: str, hint: str | None) -> Decision:
    reason = f"no answer to approval {approval} within {timeout:g} s"
    return Decision(False, reason, ReasonCode.APPROVAL_TIMEOUT, None, hint)


def refused_full(full: Full, hint: str | None) -> Decision:
    return Decision(False, f"not held for approval: {full.reason}", ReasonCode.APPROVAL_LIMIT, None, hint)


def still_pending(hold: float, approval: str, hint: str | None) -> Decision:
    reason = f"approval {approval} still pending after {hold:g} s (SERVFAIL: the client asks again)"
    return Decision(False, reason, ReasonCode.APPROVAL_PENDING, None, hint)
