"""`airlock policy suggest AUDIT.jsonl`: the allow rules that would have let through what the audit shows denied, as a
complete policy document that `airlock policy check` accepts as it is — or, with `--merge POLICY`, that policy with
the rules added, its comments and layout kept (written by `airlock.policy.edit`).

Only what an allow rule may open is suggested: a name or public address no rule allowed (`not_allowlisted`) or
allowed on other ports (`port_not_allowed`). Hard blocks (metadata, internal and the gateway's own addresses,
sandbox links), single-label names (`vm`) and what a deny rule closes never are. Rules name exact hosts and ports;
a wildcard is offered only with `--collapse N`, for N or more sibling names under one parent, and never over a
public suffix.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from airlock.policy import (
    Category,
    HostError,
    Policy,
    ReasonCode,
    canonical_host,
    classify,
    decide,
    embedded_ipv4,
    is_ip,
    is_public_suffix,
    is_single_label,
)
from airlock.policy.edit import Suggestion

from .common import UsageError

# What an allow rule can open. Everything else is a hard block, a deny rule's doing, or not about the target.
SUGGESTIBLE = frozenset({ReasonCode.NOT_ALLOWLISTED, ReasonCode.PORT_NOT_ALLOWED})
TARGET_KINDS = frozenset({"http", "connect", "dns"})
DENIED = frozenset({"deny", "report"})  # `report`: what a profile in report mode would have denied
DNS_ONLY_PORT = 443  # a name seen only in DNS: the port an allow rule opens by default


@dataclass
class Seen:
    """One target denied: how often, on which ports (None: a DNS query), by which kinds, when last."""

    count: int = 0
    ports: Counter[int | None] = field(default_factory=Counter)
    kinds: set[str] = field(default_factory=set)
    last: str = ""

    def add(self, other: Seen) -> None:
        self.count += other.count
        self.ports.update(other.ports)
        self.kinds |= other.kinds
        self.last = max(self.last, other.last)

    def rule_ports(self) -> list[int]:
        ports = sorted(p for p in self.ports if p is not None)
        return ports or [DNS_ONLY_PORT]

    def comment(self, names: Iterable[str] = ()) -> str:
        times = "denial" if self.count == 1 else "denials"
        text = f"{self.count} {times} ({', '.join(sorted(self.kinds))}), last {self.last}"
        if None in self.ports and len(self.ports) == 1:
            text += f"; DNS only: port {DNS_ONLY_PORT} assumed"
        names = sorted(names)
        if names:
            text += f"; covers {', '.join(names)} and every other name under it: review"
        return text


def suggest(
    lines: Iterable[str],
    base: Policy | None = None,
    profile: str | None = None,
    since: dt.datetime | None = None,
    collapse: int | None = None,
) -> list[Suggestion]:
    """The rules for the denials in these audit lines (of `profile` only, from `since` on), by profile; with a `base`
    policy, only what it still denies."""
    seen: dict[str, dict[str, Seen]] = defaultdict(dict)
    default = base.default_profile if base is not None else "default"
    for record in _records(lines):
        record_profile = record.get("profile") or default
        if profile is not None and record_profile != profile:
            continue
        if since is not None and _when(record) < since:
            continue
        target, port = _target(record)
        if target is None or not _still_denied(base, record_profile, target, port):
            continue
        entry = seen[record_profile].setdefault(target, Seen())
        entry.count += 1
        entry.ports[port] += 1
        entry.kinds.add(str(record["kind"]))
        entry.last = max(entry.last, str(record.get("ts", "")))
    return [s for name, targets in sorted(seen.items()) for s in _rules(name, targets, collapse)]


def _records(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise UsageError(f"audit line {number}: not JSON ({e})") from None
        if not isinstance(record, dict):
            raise UsageError(f"audit line {number}: not an audit record")
        kind, decision, code = record.get("kind"), record.get("decision"), record.get("code")
        if kind in TARGET_KINDS and decision in DENIED and code in SUGGESTIBLE:
            yield record


def _when(record: dict[str, Any]) -> dt.datetime:
    try:
        return dt.datetime.fromisoformat(str(record.get("ts")))
    except ValueError:
        return dt.datetime.min.replace(tzinfo=dt.UTC)


def _target(record: dict[str, Any]) -> tuple[str | None, int | None]:
    """The rule target a record asks for: a canonical name, or a public address as a /32 or /128 network."""
    port = record.get("port")
    port = port if isinstance(port, int) and 1 <= port <= 65535 else None
    if record["kind"] != "dns" and port is None:
        return None, None
    try:
        host = canonical_host(str(record.get("host", "")))
    except HostError:
        return None, None
    if is_single_label(host):
        return None, None  # no rule may name one (the loader refuses it)
    if not is_ip(host):
        return host, port
    address = ipaddress.ip_address(host)
    if embedded_ipv4(address) is not None or classify(address).category is not Category.PUBLIC:
        return None, None  # an IPv6 form of IPv4, or anything not plainly public: a hard block, never suggested
    return f"{address}/{address.max_prefixlen}", port


def _still_denied(base: Policy | None, profile: str, target: str, port: int | None) -> bool:
    if base is None or profile not in base.profiles:
        return True
    host = target.split("/")[0]
    decision = decide(base.profile(profile), host, port or DNS_ONLY_PORT)
    return (not decision.allow or decision.report) and decision.code in SUGGESTIBLE


def _rules(profile: str, targets: dict[str, Seen], collapse: int | None) -> list[Suggestion]:
    groups: dict[str, list[str]] = defaultdict(list)
    if collapse is not None:
        for target in targets:
            parent = target.partition(".")[2]
            if "/" not in target and "." in parent and not is_public_suffix(parent):
                groups[parent].append(target)
    collapsed = {parent: names for parent, names in groups.items() if len(names) >= (collapse or 0)}
    covered = {name for names in collapsed.values() for name in names}
    suggestions = []
    for parent, names in sorted(collapsed.items()):
        merged = Seen()
        for name in names:
            merged.add(targets[name])
        suggestions.append(Suggestion(profile, f"*.{parent}", merged.rule_ports(), merged.comment(names)))
    for target, entry in sorted(targets.items()):
        if target not in covered:
            suggestions.append(Suggestion(profile, target, entry.rule_ports(), entry.comment()))
    return suggestions


def since_time(text: str) -> dt.datetime:
    """`--since`: an ISO 8601 time (UTC when no zone is given), or a duration back from now (`90m`, `2h`, `1d`)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].isascii() and text[:-1].isdigit():
        return dt.datetime.now(dt.UTC) - dt.timedelta(seconds=int(text[:-1]) * units[text[-1]])
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"--since {text!r}: give an ISO time (2025-01-31T12:00Z) or a duration (90m, 2h, 1d)"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)
