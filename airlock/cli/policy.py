"""`airlock policy check FILE` (exit 0 valid, 2 with FILE:LINE errors) and `airlock policy explain` (0 allow,
1 deny, 2 error): the policy core asked directly, no gateway."""

from __future__ import annotations

import argparse
import ipaddress
import sys
from urllib.parse import urlsplit

from airlock.policy import (
    WEB_PORTS,
    HostError,
    PolicyError,
    canonical_host,
    decide,
    format_host_port,
    parse_ip_literal,
    vet,
)

from .common import EXIT_ALLOW, EXIT_DENY, EXIT_USAGE, UsageError
from .common import load_policy_file as _load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    check = actions.add_parser("check", help="validate policy files: exit 0 all valid, 2 with FILE:LINE errors")
    check.add_argument("file", nargs="+")
    check.set_defaults(func=cmd_policy_check)
    explain = actions.add_parser("explain", help="decide one target: exit 0 allow, 1 deny, 2 error")
    explain.add_argument("--policy", metavar="FILE")
    explain.add_argument("--profile", metavar="P")
    explain.add_argument("--resolve", action="append", metavar="HOST=IP[,IP...]", help="repeatable")
    explain.add_argument("target", help="URL or host:port")
    explain.set_defaults(func=cmd_policy_explain)


def cmd_policy_check(args: argparse.Namespace) -> int:
    """Every file is checked and reported, good or bad: exit 2 if any is bad."""
    status = 0
    for path in args.file:
        try:
            policy = _load(path)
        except PolicyError as e:
            print(e, file=sys.stderr)
            status = EXIT_USAGE
            continue
        rules = sum(len(p.allow) + len(p.deny) for p in policy.profiles.values())
        counts = f"{len(policy.profiles)} profiles, {rules} rules, default profile {policy.default_profile!r}"
        print(f"{path}: ok ({counts}), policy {policy.hash}")
    return status


def parse_target(text: str) -> tuple[str, int]:
    """A URL (`https://host/path`) or `host:port` → (canonical host, port)."""
    if "://" in text:
        try:
            parts = urlsplit(text)
        except ValueError as e:  # an unclosed [IPv6 bracket
            raise UsageError(f"{text!r}: {e}") from None
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise UsageError(f"{text!r}: only http:// and https:// URLs")
        if parts.username is not None or parts.password is not None:
            raise UsageError(f"{text!r}: URLs with userinfo are refused")
        try:
            explicit_port = parts.port
        except ValueError as e:
            raise UsageError(f"{text!r}: {e}") from None
        raw_host = parts.netloc.rsplit(":", 1)[0] if explicit_port else parts.netloc
        port = explicit_port or (443 if parts.scheme == "https" else 80)
    else:
        raw_host, sep, port_text = text.rpartition(":")
        if not sep or not port_text.isdigit():
            raise UsageError(f"{text!r}: give a URL or host:port")
        port = int(port_text)
    if not 1 <= port <= 65535:
        raise UsageError(f"{text!r}: port out of range")
    try:
        return canonical_host(raw_host), port
    except HostError as e:
        raise UsageError(str(e)) from None


def _parse_resolve(values: list[str]) -> dict[str, list]:
    table: dict[str, list] = {}
    for value in values:
        host, sep, ips = value.partition("=")
        if not sep or not ips:
            raise UsageError(f"--resolve {value!r}: expected HOST=IP[,IP...]")
        try:
            addresses = [parse_ip_literal(ip.strip()) for ip in ips.split(",")]
            name = canonical_host(host)
        except HostError as e:
            raise UsageError(f"--resolve {value!r}: {e}") from None
        if any(a is None for a in addresses):
            raise UsageError(f"--resolve {value!r}: not an IP address list")
        table[name] = addresses
    return table


def cmd_policy_explain(args: argparse.Namespace) -> int:
    policy = _load(args.policy)
    try:
        profile = policy.profile(args.profile)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None
    host, port = parse_target(args.target)
    resolved = _parse_resolve(args.resolve or [])
    target = format_host_port(host, port)
    decision = decide(profile, host, port)
    print(f"target:   {target} (profile {profile.name})")
    if decision.rule is not None:
        print(f"rule:     {decision.rule.describe()}")
    if not decision.allow:
        print(f"decision: deny [{decision.code}] — {decision.reason}")
        if decision.hint:
            print(f"to allow: {decision.hint}")
        return EXIT_DENY
    if port not in WEB_PORTS and not decision.tunnel:
        print("tunnel:   TLS only; a CONNECT tunnel that is not TLS (e.g. ssh) needs `tunnel: true` on the rule")
    addresses = [ipaddress.ip_address(host)] if parse_ip_literal(host) else resolved.get(host)
    if addresses is None:
        print("decision: allow (name allowed; its addresses are vetted after DNS — pass --resolve to check them)")
        return EXIT_ALLOW
    vetted = vet(profile, addresses, port)
    for rejection in vetted.rejected:
        print(f"blocked:  {rejection.address} — {rejection.reason}")
    if not vetted.allowed:
        print(f"decision: deny [{vetted.code}] — {vetted.reason}")
        return EXIT_DENY
    print(f"decision: allow — would connect to {vetted.allowed[0]}")
    return EXIT_ALLOW
