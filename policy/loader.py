"""Reading a policy file: YAML in, a validated `Policy` out, or every problem as `file:line: message`.

The YAML node tree (not plain `safe_load`) is walked so that each error names the line a security team has
to fix, duplicate keys are caught, and nothing half-valid is ever returned.
"""

from __future__ import annotations

import functools
import ipaddress
from pathlib import Path

import yaml
from publicsuffixlist import PublicSuffixList

from .addresses import covers_metadata
from .hosts import HostError, canonical_host, is_ip
from .model import DEFAULT_ALLOW_PORTS, Action, DnsLimits, Policy, Profile, Rule

_TOP_KEYS = {"version", "default_profile", "profiles"}
_PROFILE_KEYS = {"description", "allow", "deny", "dns"}
_DNS_KEYS = {"refuse_suspicious", "max_label_length", "max_label_entropy", "max_new_subdomains_per_minute"}
_RULE_KEYS = {"host", "cidr", "ports", "tunnel", "name", "comment"}
# Ranges a rule may never open: they are the gateway host itself.
_EMBEDDING_NETWORKS = tuple(
    ipaddress.IPv6Network(n) for n in ("::ffff:0:0/96", "::/96", "64:ff9b::/96", "64:ff9b:1::/48", "2002::/16")
)
_SELF_NETWORKS = tuple(ipaddress.ip_network(n) for n in ("0.0.0.0/8", "127.0.0.0/8", "::/128", "::1/128"))


# libyaml's loader when present: the pure-Python one takes seconds for a policy of 10,000 rules.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class PolicyError(Exception):
    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


@functools.cache
def _public_suffixes() -> PublicSuffixList:
    return PublicSuffixList()


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError([f"{path}:1: cannot read policy: {e}"]) from None
    return parse_policy(text, str(path))


def parse_policy(text: str, filename: str = "<policy>") -> Policy:
    errors: list[str] = []
    try:
        root = yaml.compose(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        raise PolicyError([f"{filename}:{line}: invalid YAML: {getattr(e, 'problem', None) or e}"]) from None
    builder = _Builder(filename, errors)
    policy = builder.policy(root)
    if errors or policy is None:
        raise PolicyError(errors or [f"{filename}:1: empty policy"])
    return policy


class _Builder:
    def __init__(self, filename: str, errors: list[str]) -> None:
        self.filename = filename
        self.errors = errors

    def error(self, node: yaml.Node | None, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else 1
        self.errors.append(f"{self.filename}:{line}: {message}")

    def where(self, node: yaml.Node) -> str:
        return f"{self.filename}:{node.start_mark.line + 1}"

    def mapping(self, node: yaml.Node | None, what: str, keys: set[str]) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            self.error(node, f"{what} must be a mapping")
            return {}
        result: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str):
                self.error(key_node, f"{what}: keys must be plain strings")
            elif key in result:
                self.error(key_node, f"{what}: duplicate key {key!r}")
            elif keys and key not in keys:
                self.error(key_node, f"{what}: unknown key {key!r} (expected one of: {', '.join(sorted(keys))})")
            else:
                result[key] = (key_node, value_node)
        return result

    def scalar(self, node: yaml.Node, what: str) -> str | None:
        if not isinstance(node, yaml.ScalarNode) or node.tag == "tag:yaml.org,2002:null":
            self.error(node, f"{what} must be a single value")
            return None
        return str(node.value)

    def policy(self, root: yaml.Node | None) -> Policy | None:
        if root is None:
            return None
        top = self.mapping(root, "policy", _TOP_KEYS)
        if "version" in top and self.scalar(top["version"][1], "version") != "1":
            self.error(top["version"][1], "version: only version 1 is known")
        if "profiles" not in top:
            self.error(root, "policy: 'profiles' is required")
            return None
        profiles: dict[str, Profile] = {}
        for name, (key_node, value_node) in self.mapping(top["profiles"][1], "profiles", set()).items():
            profile = self.profile(name, key_node, value_node)
            if profile is not None:
                profiles[name] = profile
        default = "default"
        if "default_profile" in top:
            default = self.scalar(top["default_profile"][1], "default_profile") or default
        # Reported alongside other errors (every problem at once), unless `profiles` itself was unreadable.
        if default not in profiles and isinstance(top["profiles"][1], yaml.MappingNode):
            self.error(top.get("default_profile", (root, root))[1], f"default profile {default!r} is not defined")
        return Policy(profiles, default, self.filename)

    def profile(self, name: str, key_node: yaml.Node, node: yaml.Node) -> Profile | None:
        fields = self.mapping(node, f"profile {name!r}", _PROFILE_KEYS)
        rules: dict[Action, list[Rule]] = {"allow": [], "deny": []}
        for action in ("allow", "deny"):
            if action not in fields:
                continue
            rule_list = fields[action][1]
            if not isinstance(rule_list, yaml.SequenceNode):
                self.error(rule_list, f"profile {name!r}: {action} must be a list of rules")
                continue
            for rule_node in rule_list.value:
                rule = self.rule(action, rule_node)
                if rule is not None:
                    rules[action].append(rule)
        dns = self.dns_limits(fields["dns"][1]) if "dns" in fields else DnsLimits()
        return Profile(name, tuple(rules["allow"]), tuple(rules["deny"]), self.where(key_node), dns)

    def dns_limits(self, node: yaml.Node) -> DnsLimits:
        fields = self.mapping(node, "dns", _DNS_KEYS)
        values: dict[str, object] = {}
        for key, (_, value) in fields.items():
            if key == "refuse_suspicious":
                if value.tag != "tag:yaml.org,2002:bool":
                    self.error(value, "dns.refuse_suspicious must be true or false")
                else:
                    values["refuse"] = value.value.lower() in {"true", "yes", "on"}
                continue
            number = self.scalar(value, f"dns.{key}")
            try:
                parsed = float(number) if key == "max_label_entropy" else int(number or "")
            except ValueError:
                self.error(value, f"dns.{key} must be a number")
                continue
            if parsed <= 0:
                self.error(value, f"dns.{key} must be positive")
                continue
            values[key] = parsed
        return DnsLimits(**values)  # type: ignore[arg-type]

    def rule(self, action: Action, node: yaml.Node) -> Rule | None:
        fields = self.mapping(node, f"{action} rule", _RULE_KEYS)
        if not isinstance(node, yaml.MappingNode):
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
        tunnel = False
        if "tunnel" in fields:
            value = fields["tunnel"][1]
            if value.tag != "tag:yaml.org,2002:bool":
                self.error(value, "tunnel must be true or false")
            elif action == "deny":
                self.error(value, "tunnel is only meaningful on allow rules")
            else:
                tunnel = value.value.lower() in {"true", "yes", "on"}
        name = self.scalar(fields["name"][1], "name") if "name" in fields else None
        if len(self.errors) != before:
            return None
        return Rule(action, self.where(node), host=host, cidr=cidr, ports=ports, tunnel=tunnel, name=name)

    def host_pattern(self, node: yaml.Node) -> str | None:
        raw = self.scalar(node, "host")
        if raw is None:
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
        if wildcard:
            if "." not in host or _public_suffixes().is_public(host):
                self.error(node, f"host {raw!r}: {host} is a public suffix; anyone can own names under it")
                return None
            return "*." + host
        return host

    def cidr(self, action: Action, node: yaml.Node) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
        raw = self.scalar(node, "cidr")
        if raw is None:
            return None
        try:
            network = ipaddress.ip_network(raw, strict=True)
        except ValueError as e:
            self.error(node, f"cidr {raw!r}: {e}")
            return None
        if action == "allow":
            if covers_metadata(network):
                self.error(node, f"cidr {raw!r} covers cloud metadata / link-local addresses, which never open")
                return None
            if any(network.version == s.version and network.overlaps(s) for s in _SELF_NETWORKS):
                self.error(node, f"cidr {raw!r} covers the gateway's own loopback/unspecified addresses")
                return None
            if any(network.version == 6 and network.subnet_of(e) for e in _EMBEDDING_NETWORKS):
                # Addresses here are judged by the IPv4 they carry, so only an IPv4 rule can open them.
                self.error(node, f"cidr {raw!r} is an IPv6 form of IPv4 addresses: write the IPv4 network instead")
                return None
        return network

    def ports(self, action: Action, node: yaml.Node) -> frozenset[int] | None:
        if isinstance(node, yaml.ScalarNode) and node.value == "any" and action == "deny":
            return None
        if not isinstance(node, yaml.SequenceNode) or not node.value:
            self.error(
                node,
                "ports must be a non-empty list of port numbers" + (" or 'any'" if action == "deny" else ""),
            )
            return frozenset()
        ports: set[int] = set()
        for item in node.value:
            if not (isinstance(item, yaml.ScalarNode) and item.tag == "tag:yaml.org,2002:int"):
                self.error(item, f"port {getattr(item, 'value', item)!r} is not a number")
                continue
            # Plain decimal only: YAML reads `0443` as octal 291 and `0x1bb` as hex, a reader sees 443.
            if not item.value.isdigit() or (len(item.value) > 1 and item.value.startswith("0")):
                self.error(item, f"port {item.value} must be written as a plain decimal number")
                continue
            port = int(item.value)
            if not 1 <= port <= 65535:
                self.error(item, f"port {item.value} is out of range 1-65535")
            ports.add(port)
        return frozenset(ports)
