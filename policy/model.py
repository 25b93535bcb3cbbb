"""The policy model: profiles of allow and deny rules, indexed so that a decision never scans the rule list."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from .addresses import Network
from .declared_tools import ToolDeclaration
from .hosts import IPAddress
from .inspected_rules import GithubInjection as GithubInjection  # re-exported: the model names every part of a rule
from .inspected_rules import HttpRule as HttpRule
from .inspected_rules import Injected, canonical_json
from .inspected_rules import Injection as Injection

DEFAULT_ALLOW_PORTS: frozenset[int] = frozenset({443})
# Where a CONNECT most likely carries TLS (443), or a plain request is proxied as HTTP (80): anywhere else the
# traffic may well be another protocol (ssh on 22), which a tunnel carries only under `tunnel: true`.
WEB_PORTS: frozenset[int] = frozenset({80, 443})
type Action = Literal["allow", "deny"]
# What a profile does with a name or public address no rule lists: deny it, or hold it while a person decides.
type OnUnlisted = Literal["deny", "ask"]
# Enforce the rules, or report: allow what the rules alone would deny and audit it as `report` (hard blocks stay).
type Mode = Literal["enforce", "report"]
DEFAULT_ASK_TIMEOUT = 60.0
MAX_ASK_TIMEOUT = 3600.0
# A rule's id when it has no name: the prefix holds a ':', which no name may, so the two never collide.
RULE_HASH_PREFIX = "sha256:"
RULE_HASH_DIGITS = 12
POLICY_HASH_DIGITS = 16


@dataclass(frozen=True, slots=True, init=False)
class Rule:
    action: Action
    source: str  # "file:line", so every decision can name the line a security team has to edit
    host: str | None = None  # canonical exact name, or "*.suffix"
    cidr: Network | None = None
    ports: frozenset[int] | None = None  # None: every port (deny rules only)
    tunnel: bool = False  # a CONNECT tunnel that is not TLS (e.g. ssh on 22) is allowed
    ech: bool = False  # TLS with Encrypted Client Hello is allowed: the host's operator is trusted with the inner name
    name: str | None = None  # the rule's stable id, unique in its file (the loader checks)
    # The gateway terminates TLS for the rule's hosts (allow host rules only); then, and only then, `http` (empty:
    # every method and path, no websocket) and `inject` apply to the requests inside.
    inspect: bool = False
    http: tuple[HttpRule, ...] = ()
    inject: tuple[Injected, ...] = ()
    _id: str | None = field(default=None, init=False, repr=False, compare=False)  # `id`, once asked for

    def __init__(
        self,
        action: Action,
        source: str,
        host: str | None = None,
        cidr: Network | None = None,
        ports: frozenset[int] | None = None,
        tunnel: bool = False,
        ech: bool = False,
        name: str | None = None,
        inspect: bool = False,
        http: tuple[HttpRule, ...] = (),
        inject: tuple[Injected, ...] = (),
    ) -> None:
        # The dataclass's own __init__, written by hand: that one sets each slot through object.__setattr__ (the
        # class is frozen), which looks the name up every time — a third of a 100,000-rule load. The slots' own
        # setters do the same in half the time. A test holds this signature to the fields above.
        (set_action, set_source, set_host, set_cidr, set_ports, set_tunnel, set_ech, set_name, set_inspect, set_http,
         set_inject, set_id) = _RULE_SLOTS  # fmt: skip
        set_action(self, action)
        set_source(self, source)
        set_host(self, host)
        set_cidr(self, cidr)
        set_ports(self, ports)
        set_tunnel(self, tunnel)
        set_ech(self, ech)
        set_name(self, name)
        set_inspect(self, inspect)
        set_http(self, http)
        set_inject(self, inject)
        set_id(self, None)

    @property
    def id(self) -> str:
        """What audit lines and tools call the rule: its `name`, else a short hash of what it says. Never its
        line, which every edit above it shifts; a rule keeps its id wherever it moves, until its content changes.
        Computed when first asked for (most rules of a large policy never decide anything) and kept."""
        if self._id is not None:
            return self._id
        if (rule_id := self.name) is None:
            rule_id = RULE_HASH_PREFIX + hashlib.sha256(self.canonical().encode()).hexdigest()[:RULE_HASH_DIGITS]
        object.__setattr__(self, "_id", rule_id)
        return rule_id

    def canonical(self) -> str:
        """What the rule decides, in one fixed spelling (no name, no line): equal for rules that decide alike."""
        return self.canonical_with(ports_text(self.ports))

    def canonical_with(self, ports: str) -> str:
        """canonical(), given its ports' spelling (`ports_text`), which a policy's hash reuses across rules."""
        text = f"{self.action} {self.target} ports={ports} tunnel={int(self.tunnel)} ech={int(self.ech)}"
        if self.inspect:  # only when set: the ids and hashes of rules written before inspection stay as they were
            text += f" inspect=1 http={canonical_json(self.http)} inject={canonical_json(self.inject)}"
        return text

    @property
    def secret_names(self) -> frozenset[str]:
        """The --secret names the rule's injections reference."""
        return frozenset().union(*(injection.secrets for injection in self.inject))

    def matches_port(self, port: int | None) -> bool:
        """`port` None asks about a name or address as such (DNS has no port): an allow rule opens it for
        some port, a deny rule closes it only if it covers every port."""
        if port is None:
            return self.action == "allow" or self.ports is None
        return self.ports is None or port in self.ports

    @property
    def target(self) -> str:
        return self.host if self.host is not None else str(self.cidr)

    def describe(self) -> str:
        ports = "any port" if self.ports is None else "port " + ",".join(map(str, sorted(self.ports)))
        label = f" [{self.name}]" if self.name else ""
        flags = (("tunnel", self.tunnel), ("ech", self.ech), ("inspect", self.inspect))
        options = "".join(f" {flag}" for flag, on in flags if on)
        return f"{self.action} {self.target} {ports}{options}{label} ({self.source})"


_RULE_SLOTS = tuple(getattr(Rule, f.name).__set__ for f in dataclasses.fields(Rule))


def ports_text(ports: frozenset[int] | None) -> str:
    return "any" if ports is None else ",".join(map(str, sorted(ports)))


class _Keyed:
    """Rules by key, in file order, in tables of a few thousand keys each. Most keys of a large policy have one
    rule: it is the value itself, and only the rest of a key's rules get a list — 100,000 rules make no 100,000
    lists. And no table grows large: a dict of 100,000 keys holds the GIL for milliseconds each time it grows, and
    a reload builds its indexes in a thread beside the event loop."""

    __slots__ = ("_empty", "_first", "_more")
    _TABLES = 64

    def __init__(self) -> None:
        self._first: list[dict[object, Rule]] = [{} for _ in range(self._TABLES)]
        self._more: list[dict[object, list[Rule]]] = [{} for _ in range(self._TABLES)]  # a key's later rules
        self._empty = True

    @classmethod
    def _table(cls, key: object) -> int:
        # Fibonacci hashing: the product's high bits depend on every bit of the hash, and a network's address (an
        # int: its own hash) has its low bits all zero.
        return (hash(key) * 0x9E3779B97F4A7C15 >> 40) % cls._TABLES

    def add(self, key: object, rule: Rule) -> None:
        self._empty = False
        table = self._table(key)
        first = self._first[table]
        if key in first:
            self._more[table].setdefault(key, []).append(rule)
        else:
            first[key] = rule

    def get(self, key: object) -> Iterator[Rule]:
        table = self._table(key)
        if (first := self._first[table].get(key)) is not None:
            yield first
            yield from self._more[table].get(key, ())

    def __bool__(self) -> bool:
        return not self._empty

    # Pickled as its entries: the table a key is in follows hash(), which another process computes differently
    # (string hashes are seeded per process), so a policy pickled to another process places each key again as it
    # is read back, its rules in file order. (A gateway's proxy workers get the policy as text: Policy.text.)
    def __getstate__(self) -> list[tuple[object, list[Rule]]]:
        return [
            (key, [rule, *more.get(key, ())])
            for first, more in zip(self._first, self._more, strict=True)
            for key, rule in first.items()
        ]

    def __setstate__(self, entries: list[tuple[object, list[Rule]]]) -> None:
        self._first = [{} for _ in range(self._TABLES)]
        self._more = [{} for _ in range(self._TABLES)]
        self._empty = True
        for key, rules in entries:
            for rule in rules:
                self.add(key, rule)


class _CidrIndex:
    """Longest-prefix style lookup: one table per prefix length, so a lookup costs at most 33 or 129 probes
    however many networks are listed."""

    def __init__(self, rules: Iterable[Rule]) -> None:
        self._by_length: dict[tuple[int, int], _Keyed] = {}
        for rule in rules:
            assert rule.cidr is not None
            key = (rule.cidr.version, rule.cidr.prefixlen)
            if (table := self._by_length.get(key)) is None:
                table = self._by_length[key] = _Keyed()
            table.add(int(rule.cidr.network_address), rule)

    def lookup(self, address: IPAddress) -> Iterator[Rule]:
        bits = address.max_prefixlen
        value = int(address)
        for (version, length), table in self._by_length.items():
            if version != address.version:
                continue
            masked = value >> (bits - length) << (bits - length) if length else 0
            yield from table.get(masked)


class _HostIndex:
    """Exact names in one table, `*.suffix` wildcards in another keyed by suffix: a lookup walks the
    host's own labels (at most 127), never the rules."""

    def __init__(self, rules: Iterable[Rule]) -> None:
        self._exact = _Keyed()
        self._wildcard = _Keyed()
        for rule in rules:
            assert rule.host is not None
            if rule.host.startswith("*."):
                self._wildcard.add(rule.host[2:], rule)
            else:
                self._exact.add(rule.host, rule)

    def lookup(self, host: str) -> Iterator[Rule]:
        yield from self._exact.get(host)
        # `*.example.com` covers every name below example.com, at any depth, but not example.com itself.
        if not self._wildcard:
            return
        dot = host.find(".")
        while dot != -1:
            yield from self._wildcard.get(host[dot + 1 :])
            dot = host.find(".", dot + 1)


@dataclass(frozen=True, slots=True)
class DnsLimits:
    """Exfiltration signals for DNS names. Always measured and audited; enforced when `refuse` is set."""

    refuse: bool = False
    max_label_length: int = 40
    max_label_entropy: float = 4.0  # bits per character of the longest label
    max_new_subdomains_per_minute: int = 60  # distinct names under one registrable domain

    def flags(self, longest_label: int, entropy: float, new_subdomains: int) -> list[str]:
        found = []
        if longest_label > self.max_label_length:
            found.append(f"label of {longest_label} characters > {self.max_label_length}")
        if entropy > self.max_label_entropy:
            found.append(f"label entropy {entropy:.2f} > {self.max_label_entropy}")
        if new_subdomains > self.max_new_subdomains_per_minute:
            found.append(f"{new_subdomains} distinct subdomains/min > {self.max_new_subdomains_per_minute}")
        return found


@dataclass(frozen=True)
class Profile:
    name: str
    allow: tuple[Rule, ...]
    deny: tuple[Rule, ...]
    source: str
    dns: DnsLimits = DnsLimits()
    on_unlisted: OnUnlisted = "deny"
    ask_timeout: float = DEFAULT_ASK_TIMEOUT  # seconds a held request waits for a person (`on_unlisted: ask`)
    mode: Mode = "enforce"
    _allow_hosts: _HostIndex = field(init=False, repr=False, compare=False)
    _deny_hosts: _HostIndex = field(init=False, repr=False, compare=False)
    _allow_cidrs: _CidrIndex = field(init=False, repr=False, compare=False)
    _deny_cidrs: _CidrIndex = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "_allow_hosts", _HostIndex(r for r in self.allow if r.host is not None))
        set_(self, "_deny_hosts", _HostIndex(r for r in self.deny if r.host is not None))
        set_(self, "_allow_cidrs", _CidrIndex(r for r in self.allow if r.cidr is not None))
        set_(self, "_deny_cidrs", _CidrIndex(r for r in self.deny if r.cidr is not None))

    def allow_rules_for_host(self, host: str) -> list[Rule]:
        return list(self._allow_hosts.lookup(host))

    def deny_rules_for_host(self, host: str) -> list[Rule]:
        return list(self._deny_hosts.lookup(host))

    def allow_rules_for_address(self, address: IPAddress) -> list[Rule]:
        return list(self._allow_cidrs.lookup(address))

    def deny_rules_for_address(self, address: IPAddress) -> list[Rule]:
        return list(self._deny_cidrs.lookup(address))


@dataclass(frozen=True)
class Policy:
    profiles: dict[str, Profile]
    default_profile: str
    source: str
    tools: tuple[ToolDeclaration, ...] = ()  # declared tools (the `tools:` section), in file order
    # The text it was parsed from (the loader sets it; "" for a policy built otherwise): what a gateway sends its proxy
    # workers, each parsing it again and checking the hash (pickling 100,000 rules holds the GIL far longer).
    text: str = field(default="", repr=False, compare=False, kw_only=True)

    @cached_property
    def hash(self) -> str:
        """`sha256:` and the start of the digest of what the policy decides (profiles, rules with their names, DNS
        limits, the default profile), so comments, layout and line numbers never change it; `policy check` prints
        it and every audit line carries it. The loader computes it as it loads (off the event loop)."""
        digest = hashlib.sha256(json.dumps(["default_profile", self.default_profile]).encode())
        for name, profile in sorted(self.profiles.items()):
            asks = [profile.on_unlisted, profile.ask_timeout] if profile.on_unlisted != "deny" else []
            # Only when set, like `asks`: the hashes of policies written before either existed stay as they were.
            reports = ["mode", profile.mode] if profile.mode != "enforce" else []
            digest.update(
                json.dumps(["profile", name, dataclasses.asdict(profile.dns), *asks, *reports], sort_keys=True).encode()
            )
            _digest_rules(digest, (*profile.allow, *profile.deny))
        return "sha256:" + digest.hexdigest()[:POLICY_HASH_DIGITS]

    @cached_property
    def inspected_rules(self) -> tuple[Rule, ...]:
        """Every profile's inspected allow rules, the only ones with `http` or `inject`. Found as the policy loads
        (off the event loop, like `hash`): a reload's swap then never walks 100,000 rules for them."""
        return tuple(rule for profile in self.profiles.values() for rule in profile.allow if rule.inspect)

    def inspected_hosts(self) -> frozenset[str]:
        """The host patterns (exact or `*.suffix`) of every profile's inspected allow rules: what the gateway's CA
        may sign for."""
        return frozenset(rule.host for rule in self.inspected_rules if rule.host)

    def secret_names(self) -> frozenset[str]:
        """Every --secret name an injection references, in any profile (only inspected rules inject)."""
        return frozenset().union(*(rule.secret_names for rule in self.inspected_rules))

    def profile(self, name: str | None = None) -> Profile:
        try:
            return self.profiles[name or self.default_profile]
        except KeyError:
            known = ", ".join(sorted(self.profiles))
            raise KeyError(f"no profile {name!r} in {self.source} (profiles: {known})") from None


def _digest_rules(digest: hashlib._Hash, rules: tuple[Rule, ...]) -> None:
    """Each rule's `\n{canonical} name={name}`, a thousand rules to an update: hashlib lets go of the GIL for
    long inputs, and a policy of 100,000 rules spells its few port sets once each, not once per rule."""
    spelled: dict[frozenset[int] | None, str] = {}
    for start in range(0, len(rules), 1000):
        lines = []
        for rule in rules[start : start + 1000]:
            ports = spelled.get(rule.ports)
            if ports is None:
                ports = spelled[rule.ports] = ports_text(rule.ports)
            lines.append(f"\n{rule.canonical_with(ports)} name={rule.name or ''}")
        digest.update("".join(lines).encode())
