"""Reading a policy file: YAML in, a validated `Policy` out, or every problem as `file:line: message`.

The YAML node tree (not plain `safe_load`) is walked so that each error names the line a security team has
to fix, duplicate keys are caught, and nothing half-valid is ever returned.

It is the one reader of the format: `fastload` reads only the common shape (a huge generated policy, the packaged
default; `reading` hands anything else here, importing this module and PyYAML only then), and is held equal to this
one by tests. Past 500 lines because every key of a policy is
checked here with its `file:line` message, in one walk; the sections with a grammar of their own have readers of
their own (`inspected_rules_reader`, `declared_tools_reader`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import TypeGuard
from urllib.parse import urlsplit

import yaml

from .addresses import Network, never_opened
from .declared_tools_reader import ToolsReader
from .hosts import HostError, canonical_host, is_ip, is_single_label
from .inspected_rules import GithubInjection, HttpRule, Injected
from .inspected_rules_reader import InspectionReader
from .model import (
    DEFAULT_ALLOW_PORTS,
    DEFAULT_ASK_TIMEOUT,
    MAX_ASK_TIMEOUT,
    Action,
    DnsLimits,
    Mode,
    OnUnlisted,
    Policy,
    Profile,
    Rule,
)
from .reading import PolicyError
from .suffixes import is_public_suffix

_TOP_KEYS = frozenset({"version", "default_profile", "profiles", "tools", "upstreams"})
_PROFILE_KEYS = frozenset({"description", "allow", "deny", "dns", "on_unlisted", "ask_timeout", "mode"})
_DNS_KEYS = frozenset({"refuse_suspicious", "max_label_length", "max_label_entropy", "max_new_subdomains_per_minute"})
_RULE_KEYS = frozenset({"host", "cidr", "ports", "tunnel", "ech", "name", "comment", "inspect", "http", "inject"})

_YAML = "tag:yaml.org,2002:"
_NULL, _BOOL, _INT, _FLOAT, _SEQ, _MAP = (_YAML + t for t in ("null", "bool", "int", "float", "seq", "map"))
_BOOLEANS = MappingProxyType({"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False})
# Plain ASCII decimal only: YAML reads `0443` as octal 291 and `0x1bb` as hex where a reader sees 443, and int()
# or str.isdigit() would take Arabic-Indic or fullwidth digits, or `²`. [0-9] is ASCII; `\d` is not.
_PORT = re.compile(r"0|[1-9][0-9]*")
# A rule's `name:` is its id in audit lines and tools: letters, digits and `_.-`, starting with a letter.
_RULE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
_NAME_AND_PORT = re.compile(r"([^:\[\]]+):([0-9]+)")  # `pypi.org:443`, written where only a host belongs
_ALIAS = re.compile(r"\*[^\s,\[\]{}]*")  # what YAML took for an alias: the unquoted value from its `*` on
_DECIMAL = MappingProxyType({int: re.compile(r"[0-9]+"), float: re.compile(r"[0-9]+(\.[0-9]+)?")})
# dns key -> (type, YAML tags accepted, exclusive low, inclusive high). A label has at most 63 characters, so at
# most log2(63) < 6 bits of entropy per character: a higher limit could never fire.
_DNS_NUMBERS: Mapping[str, tuple[type[int] | type[float], tuple[str, ...], int, int]] = MappingProxyType(
    {
        "max_label_length": (int, (_INT,), 0, 63),
        "max_label_entropy": (float, (_INT, _FLOAT), 0, 6),
        "max_new_subdomains_per_minute": (int, (_INT,), 0, 1_000_000),
    }
)


# libyaml's loader when present: the pure-Python one takes seconds for a policy of 10,000 rules.
_BASE_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _YAML_LOADER(_BASE_LOADER):  # type: ignore[valid-type,misc]
    """The safe loader, its per-node Python calls cut short where their answer is known (a policy of 100,000
    rules has half a million nodes): no path resolvers exist, so descending and ascending does nothing, and a
    plain scalar whose first character starts no implicit type (`h` of a host name) is a string."""

    def descend_resolver(self, current_node: yaml.Node | None, current_index: object) -> None:
        if self.yaml_path_resolvers:
            super().descend_resolver(current_node, current_index)

    def ascend_resolver(self) -> None:
        if self.yaml_path_resolvers:
            super().ascend_resolver()

    def resolve(self, kind: type[yaml.Node], value: object, implicit: tuple[bool, bool]) -> str:
        if kind is yaml.ScalarNode and implicit[0] and isinstance(value, str) and value:
            implicit_types = self.yaml_implicit_resolvers
            if value[0] not in implicit_types and None not in implicit_types and not self.yaml_path_resolvers:
                return str(self.DEFAULT_SCALAR_TAG)
        return str(super().resolve(kind, value, implicit))


def compose(text: str, filename: str) -> yaml.Node | None:
    """The YAML node tree of `text` (its nodes know their lines), or PolicyError with `file:line: invalid YAML`."""
    try:
        return yaml.compose(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as e:
        raise PolicyError([_yaml_error(e, text, filename)]) from None


def read(text: str, filename: str) -> Policy:
    """The policy in `text` as the full reader reads it, or PolicyError listing every problem (`reading` calls it
    for what `fastload` leaves)."""
    root = compose(text, filename)
    builder = _Builder(filename)
    policy = builder.policy(root)
    if builder.errors or policy is None:
        raise PolicyError(builder.messages() or [f"{filename}:1: empty policy"])
    return policy


def _yaml_error(error: yaml.YAMLError, text: str, filename: str) -> str:
    """`file:line: invalid YAML: …`; an unquoted `*.example.com` (YAML reads `*` as an alias) says to quote it."""
    problem = getattr(error, "problem", None) or str(error)
    mark = getattr(error, "problem_mark", None)
    if getattr(error, "context", None) == "while scanning an alias" or problem == "found undefined alias":
        mark = getattr(error, "context_mark", None) or mark
        lines = text.splitlines()
        alias = _ALIAS.match(lines[mark.line], mark.column) if mark is not None and mark.line < len(lines) else None
        if alias is not None:
            value = alias.group()
            problem = f"{value} is read as a YAML alias (a value that starts with '*'): quote it, as in \"{value}\""
    line = mark.line + 1 if mark is not None else 1
    return f"{filename}:{line}: invalid YAML: {problem}"


class NodeReader:
    """Reads values off a YAML node tree, collecting every problem as `file:line: message` (the policy here; the
    case files of `airlock policy test` too)."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.errors: list[tuple[int, str]] = []

    def error(self, node: yaml.Node | None, message: str) -> None:
        self.errors.append((node.start_mark.line + 1 if node is not None else 1, message))

    def messages(self) -> list[str]:
        """Every error as `file:line: message`, in line order (the walk visits some keys after later lines)."""
        ordered = sorted(self.errors, key=lambda error: error[0])
        return [f"{self.filename}:{line}: {message}" for line, message in ordered]

    def where(self, node: yaml.Node) -> str:
        return f"{self.filename}:{node.start_mark.line + 1}"

    def mapping(
        self, node: yaml.Node | None, what: str, keys: frozenset[str]
    ) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not _is_mapping(node):
            self.error(node, f"{what} must be a mapping")
            return {}
        result: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            key = _text(key_node)
            if key is None:
                self.error(key_node, f"{what}: keys must be plain strings")
            elif key in result:
                self.error(key_node, f"{what}: duplicate key {key!r}")
            elif keys and key not in keys:
                self.error(key_node, f"{what}: unknown key {key!r} (expected one of: {', '.join(sorted(keys))})")
            else:
                result[key] = (key_node, value_node)
        return result

    def scalar(self, node: yaml.Node, what: str) -> str | None:
        text = _text(node)
        if text is None:
            self.error(node, f"{what} must be a single value, not {_kind(node)}")
        return text

    def boolean(self, node: yaml.Node, what: str) -> bool | None:
        # Only YAML's own booleans: a quoted "true" or `1` is a typo a reader would misjudge.
        value = _BOOLEANS.get(node.value.lower()) if isinstance(node, yaml.ScalarNode) and node.tag == _BOOL else None
        if value is None:
            self.error(node, f"{what} must be true or false")
        return value

    def sequence(self, node: yaml.Node | None, what: str) -> list[yaml.Node]:
        if not _is_list(node):
            self.error(node, f"{what} must be a list")
            return []
        return list(node.value)


class _Builder(NodeReader):
    def __init__(self, filename: str) -> None:
        super().__init__(filename)
        self.rule_names: dict[str, yaml.Node] = {}  # every rule name in the file, and the rule that has it

    def policy(self, root: yaml.Node | None) -> Policy | None:
        if root is None:
            return None
        top = self.mapping(root, "policy", _TOP_KEYS)
        if "version" in top and self.scalar(top["version"][1], "version") not in {"1", None}:
            self.error(top["version"][1], "version: only version 1 is known")
        if "profiles" not in top:
            self.error(root, "policy: 'profiles' is required")
            return None
        profiles: dict[str, Profile] = {}
        for name, (key_node, value_node) in self.mapping(top["profiles"][1], "profiles", frozenset()).items():
            profile = self.profile(name, key_node, value_node)
            if profile is not None:
                profiles[name] = profile
        default = "default"
        if "default_profile" in top:
            default = self.scalar(top["default_profile"][1], "default_profile") or default
        # Reported alongside other errors (every problem at once), unless `profiles` itself was unreadable.
        if default not in profiles and _is_mapping(top["profiles"][1]):
            self.error(top.get("default_profile", (root, root))[1], f"default profile {default!r} is not defined")
        tools = ToolsReader(self).read(top.get("tools", (None, None))[1], top.get("upstreams", (None, None))[1])
        return Policy(profiles, default, self.filename, tools)

    def profile(self, name: str, key_node: yaml.Node, node: yaml.Node) -> Profile | None:
        fields = self.mapping(node, f"profile {name!r}", _PROFILE_KEYS)
        if "description" in fields:
            self.scalar(fields["description"][1], "description")
        rules: dict[Action, list[Rule]] = {"allow": [], "deny": []}
        for action in ("allow", "deny"):
            if action not in fields:
                continue
            rule_list = fields[action][1]
            if not _is_list(rule_list):
                self.error(rule_list, f"profile {name!r}: {action} must be a list of rules")
                continue
            by_host: dict[str, list[Rule]] = {}  # the rules kept so far, by host pattern: what decides_alone asks
            for rule_node in rule_list.value:
                rule = self.rule(action, rule_node)
                if rule is not None and self.decides_alone(rule, rule_node, by_host):
                    rules[action].append(rule)
        dns = self.dns_limits(fields["dns"][1]) if "dns" in fields else DnsLimits()
        on_unlisted = self.on_unlisted(fields["on_unlisted"][1]) if "on_unlisted" in fields else "deny"
        ask_timeout = DEFAULT_ASK_TIMEOUT
        if "ask_timeout" in fields:
            ask_timeout = self.ask_timeout(fields["ask_timeout"][1]) or ask_timeout
        mode = self.mode(fields["mode"][1]) if "mode" in fields else "enforce"
        if mode == "report" and on_unlisted == "ask":
            # Report mode allows what no rule lists, so nothing would ever be held: the two contradict each other.
            self.error(fields["mode"][1], f"profile {name!r}: mode: report cannot be combined with on_unlisted: ask")
        return Profile(
            name, tuple(rules["allow"]), tuple(rules["deny"]), self.where(key_node), dns, on_unlisted, ask_timeout, mode
        )

    def decides_alone(self, rule: Rule, node: yaml.Node, by_host: dict[str, list[Rule]]) -> bool:
        """An inspected rule is the only rule of its profile for its host pattern and ports: of two, the first in
        the file would decide, and the other's inspection (its `http:` limits, its injections) would never apply.
        `by_host` holds the rules kept before it, by host; the rule joins it when it is kept (looking up its own
        host only, not every earlier rule: a policy of 100,000 rules took minutes)."""
        if rule.host is None:
            return True
        earlier = by_host.setdefault(rule.host, [])
        for other in earlier:
            if not (rule.inspect or other.inspect):
                continue
            if shared := sorted((rule.ports or frozenset()) & (other.ports or frozenset())):
                ports = ",".join(map(str, shared))
                also = f"{rule.host} port {ports} is also allowed by the rule at {other.source}"
                self.error(node, f"{also}: an inspected host and port is one rule's alone")
                return False
        earlier.append(rule)
        return True

    def mode(self, node: yaml.Node) -> Mode:
        value = _text(node)
        if value == "report":
            return "report"
        if value != "enforce":
            self.error(node, "mode must be 'enforce' or 'report'")
        return "enforce"

    def on_unlisted(self, node: yaml.Node) -> OnUnlisted:
        value = _text(node)
        if value == "ask":
            return "ask"
        if value != "deny":
            self.error(node, "on_unlisted must be 'deny' or 'ask'")
        return "deny"

    def ask_timeout(self, node: yaml.Node) -> float | None:
        """Seconds a held request waits for a person: a plain decimal number, more than 0, at most an hour."""
        if not (
            isinstance(node, yaml.ScalarNode) and node.tag in (_INT, _FLOAT) and _DECIMAL[float].fullmatch(node.value)
        ):
            self.error(node, "ask_timeout must be a plain decimal number of seconds")
            return None
        value = float(node.value)
        if not (math.isfinite(value) and 0 < value <= MAX_ASK_TIMEOUT):
            self.error(node, f"ask_timeout must be greater than 0 and at most {MAX_ASK_TIMEOUT:g} seconds")
            return None
        return value

    def dns_limits(self, node: yaml.Node) -> DnsLimits:
        fields = self.mapping(node, "dns", _DNS_KEYS)
        values: dict[str, object] = {}
        for key, (_, value) in fields.items():
            parsed = self.boolean(value, f"dns.{key}") if key == "refuse_suspicious" else self.dns_number(key, value)
            if parsed is not None:
                values["refuse" if key == "refuse_suspicious" else key] = parsed
        return DnsLimits(**values)  # type: ignore[arg-type]

    def dns_number(self, key: str, node: yaml.Node) -> int | float | None:
        kind, tags, low, high = _DNS_NUMBERS[key]
        if not (isinstance(node, yaml.ScalarNode) and node.tag in tags and _DECIMAL[kind].fullmatch(node.value)):
            self.error(node, f"dns.{key} must be a plain decimal {'integer' if kind is int else 'number'}")
            return None
        value = float(node.value)  # a very long digit string gives inf here, not an error
        if not (math.isfinite(value) and low < value <= high):
            self.error(node, f"dns.{key} must be greater than {low} and at most {high}")
            return None
        return kind(value)

    def rule(self, action: Action, node: yaml.Node) -> Rule | None:
        fields = self.mapping(node, f"{action} rule", _RULE_KEYS)
        if not _is_mapping(node):
            return None  # already reported; an empty mapping `{}` falls through to the host/cidr error below
        if ("host" in fields) == ("cidr" in fields):
            self.error(node, f"{action} rule: give exactly one of 'host' or 'cidr'")
            return None
        before = len(self.errors)
        host = self.host_pattern(fields["host"][1]) if "host" in fields else None
        cidr = self.cidr(action, fields["cidr"][1]) if "cidr" in fields else None
        ports = self.ports(action, fields["ports"][1]) if "ports" in fields else None
        if ports is None and action == "allow":
            ports = DEFAULT_ALLOW_PORTS
        tunnel = self.allow_only(action, fields["tunnel"][1], "tunnel") if "tunnel" in fields else False
        ech = self.allow_only(action, fields["ech"][1], "ech") if "ech" in fields else False
        name = self.rule_name(fields["name"][1], node) if "name" in fields else None
        if "comment" in fields:
            self.scalar(fields["comment"][1], "comment")
        inspect, http, inject = self.inspection(action, fields)
        if len(self.errors) != before:
            return None
        rule = Rule(
            action, self.where(node), host, cidr, ports, tunnel, ech, name, inspect=inspect, http=http, inject=inject
        )
        return rule if self.fits_inspection(rule, fields) else None

    def inspection(
        self, action: Action, fields: dict[str, tuple[yaml.Node, yaml.Node]]
    ) -> tuple[bool, tuple[HttpRule, ...], tuple[Injected, ...]]:
        inspect = self.allow_only(action, fields["inspect"][1], "inspect") if "inspect" in fields else False
        reader = InspectionReader(self)
        http = reader.http(fields["http"][1]) if "http" in fields else ()
        inject = reader.inject(fields["inject"][1]) if "inject" in fields else ()
        for key in ("http", "inject"):
            if key in fields and not inspect:
                why = "the gateway sees the requests only where it terminates their TLS"
                self.error(fields[key][0], f"{key}: needs inspect: true ({why})")
        return inspect, http, inject

    def fits_inspection(self, rule: Rule, fields: dict[str, tuple[yaml.Node, yaml.Node]]) -> bool:
        """Whether an inspected rule's other keys agree with inspection; each disagreement reported."""
        if not rule.inspect:
            return True
        before = len(self.errors)
        where = fields["inspect"][1]
        if rule.cidr is not None:
            self.error(where, "inspect: true needs a host rule: the gateway's certificate names hosts, never addresses")
        for key, on in (("tunnel", rule.tunnel), ("ech", rule.ech)):
            if on:
                self.error(where, f"inspect: true cannot be combined with {key}: true (the gateway terminates the TLS)")
        if rule.inject and rule.ports is not None and 80 in rule.ports:
            self.error(fields["inject"][0], "inject: secrets never go over plain HTTP: take port 80 out of ports")
        if rule.target.startswith("*.") and any(isinstance(i, GithubInjection) for i in rule.inject):
            self.error(
                fields["inject"][0], "inject: a github token goes to one exact host, never to a wildcard's names"
            )
        return len(self.errors) == before

    def rule_name(self, node: yaml.Node, rule: yaml.Node) -> str | None:
        """A rule's stable id: a simple identifier, unique in the file (across profiles)."""
        name = self.scalar(node, "name")
        if name is None:
            return None
        if not _RULE_NAME.fullmatch(name):
            self.error(node, f"name {name!r}: use letters, digits, '_', '.' and '-' (at most 64, a letter first)")
            return None
        if (first := self.rule_names.setdefault(name, rule)) is not rule:
            self.error(node, f"name {name!r} is already the name of the rule at {self.where(first)}")
            return None
        return name

    def allow_only(self, action: Action, node: yaml.Node, key: str) -> bool:
        """A switch that widens what an allow rule lets through (`tunnel`, `ech`)."""
        value = self.boolean(node, key)
        if value is not None and action == "deny":
            self.error(node, f"{key} is only meaningful on allow rules")
        return bool(value)

    def host_pattern(self, node: yaml.Node) -> str | None:
        raw = self.scalar(node, "host")
        if raw is None:
            return None
        problem = _misplaced_in_host(raw)
        if problem is not None:
            self.error(node, f"host {raw!r} {problem}")
            return None
        wildcard = raw.startswith("*.")
        if "*" in (raw[2:] if wildcard else raw):
            self.error(node, f"host {raw!r}: '*' may only stand alone as the first label, as in '*.example.com'")
            return None
        try:
            host = canonical_host(raw[2:] if wildcard else raw)
        except HostError as e:
            self.error(node, f"host: {e}")
            return None
        if is_ip(host):
            self.error(node, f"host {raw!r} is an IP address: use 'cidr: {host}/{32 if '.' in host else 128}'")
            return None
        if not wildcard and is_single_label(host):
            self.error(
                node,
                f"host {raw!r} is a single-label name, which the gateway never resolves: name the host "
                "in full (a sandbox finds its own host name in its /etc/hosts)",
            )
            return None
        if wildcard:
            if "." not in host or is_public_suffix(host):
                self.error(node, f"host {raw!r}: {host} is a public suffix; anyone can own names under it")
                return None
            return "*." + host
        return host

    def cidr(self, action: Action, node: yaml.Node) -> Network | None:
        raw = self.scalar(node, "cidr")
        if raw is None:
            return None
        if "%" in raw:
            # ipaddress accepts `fd12::%eth0/64`; a zone ID names an interface of the gateway, never a remote net.
            self.error(node, f"cidr {raw!r}: IPv6 zone IDs are not allowed")
            return None
        try:
            network = ipaddress.ip_network(raw, strict=True)
        except ValueError as e:
            self.error(node, f"cidr {raw!r}: {e}")
            return None
        problem = never_opened(network) if action == "allow" else None
        if problem is not None:
            self.error(node, f"cidr {raw!r} {problem}")
            return None
        return network

    def ports(self, action: Action, node: yaml.Node) -> frozenset[int] | None:
        if _text(node) == "any" and action == "deny":
            return None
        if not _is_list(node) or not node.value:
            self.error(
                node,
                "ports must be a non-empty list of port numbers" + (" or 'any'" if action == "deny" else ""),
            )
            return frozenset()
        ports = (self.port(item) for item in node.value)
        return frozenset(p for p in ports if p is not None)

    def port(self, node: yaml.Node) -> int | None:
        if not isinstance(node, yaml.ScalarNode):
            self.error(node, f"port must be a number, not {_kind(node)}")
            return None
        if node.tag != _INT:
            self.error(node, f"port {node.value!r} is not a number")
            return None
        if not _PORT.fullmatch(node.value):
            self.error(node, f"port {node.value} must be written as a plain decimal number")
            return None
        # The length test first: int() refuses strings of more than 4,300 digits with a ValueError.
        if len(node.value) > 5 or not 1 <= int(node.value) <= 65535:
            self.error(node, f"port {node.value} is out of range 1-65535")
            return None
        return int(node.value)


def _misplaced_in_host(raw: str) -> str | None:
    """What a newcomer writes in `host:` that belongs elsewhere (a URL, a port, `*` for everything): said so, with
    the rule to write, rather than the parser's complaint about the character it stumbled on."""
    if raw.strip() == "*":
        return (
            "would allow every host, and is refused: list the hosts, or '*.example.com' for the names under one domain"
        )
    if "/" in raw:
        with contextlib.suppress(ValueError):
            return f"is a network: write it as {{cidr: {ipaddress.ip_network(raw, strict=False)}}}"
        parts = urlsplit(raw if "://" in raw else "//" + raw)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname:
            return "looks like a URL: write the host alone"
        ports = f", ports: [{port}]" if port else ""
        return f"looks like a URL: write the host alone, as in {{host: {parts.hostname}{ports}}}"
    if name_and_port := _NAME_AND_PORT.fullmatch(raw):
        name, port_text = name_and_port.groups()
        return f"has a port: ports go in 'ports:', as in {{host: {name}, ports: [{port_text}]}}"
    return None


def _text(node: yaml.Node) -> str | None:
    """A scalar's text, or None for a list, a mapping, a null or an application tag (`!secret x`)."""
    if not isinstance(node, yaml.ScalarNode) or node.tag == _NULL or not node.tag.startswith(_YAML):
        return None
    return str(node.value)


def _is_mapping(node: yaml.Node | None) -> TypeGuard[yaml.MappingNode]:
    # An explicit tag must agree with the node's kind: safe_load refuses `!!int {a: 1}` or `!secret [443]` too.
    return isinstance(node, yaml.MappingNode) and node.tag == _MAP


def _is_list(node: yaml.Node | None) -> TypeGuard[yaml.SequenceNode]:
    return isinstance(node, yaml.SequenceNode) and node.tag == _SEQ


def _kind(node: yaml.Node) -> str:
    """How an error names a node that is not a value: never its repr, which prints the whole subtree."""
    if isinstance(node, yaml.ScalarNode) and node.tag == _NULL:
        return "null"
    kinds: dict[type[yaml.Node], str] = {yaml.SequenceNode: "a list", yaml.MappingNode: "a mapping"}
    kind = kinds.get(type(node), "a value")
    return kind if node.tag in {_SEQ, _MAP} else f"{kind} tagged {node.tag.replace(_YAML, '!!', 1)}"
