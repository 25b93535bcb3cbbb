"""`airlock policy check FILE` (exit 0 valid, 2 with FILE:LINE errors), `airlock policy explain` (0 allow, 1 deny,
2 error; `--json`), `airlock policy test POLICY CASES` (0 all match, 1 a mismatch, 2 a bad file) and `airlock policy
suggest AUDIT` (a policy for what was denied): the policy core asked directly, no gateway — but for `airlock policy
reload`, which asks a running gateway to load its file again."""

from __future__ import annotations

import argparse
import json
import sys

from airlock.policy import (
    WEB_PORTS,
    Decision,
    GithubInjection,
    HostError,
    IPAddress,
    Judgement,
    PathError,
    PolicyError,
    RequestDecision,
    Rule,
    canonical_host,
    decide,
    format_host_port,
    is_ip,
    judge,
    judge_request,
    parse_ip_literal,
    split_target,
)

from .common import EXIT_ALLOW, EXIT_DENY, EXIT_USAGE, NeedsRoot, UsageError
from .common import load_policy_file as _load
from .policytest import run_cases
from .status import cmd_policy_reload
from .target import parse_target
from .token import add_admin_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    check = actions.add_parser("check", help="validate policy files: exit 0 all valid, 2 with FILE:LINE errors")
    check.add_argument("file", nargs="+")
    check.set_defaults(func=cmd_policy_check)
    explain = actions.add_parser("explain", help="decide one target: exit 0 allow, 1 deny, 2 error")
    explain.add_argument("--policy", metavar="FILE")
    explain.add_argument("--profile", metavar="P")
    explain.add_argument("--resolve", action="append", metavar="HOST=IP[,IP...]", help="repeatable")
    explain.add_argument("--json", action="store_true", help="print one JSON object (decision, code, rule, hint, ...)")
    explain.add_argument("--method", default="GET", help="of a URL's request, judged on an inspected host (GET)")
    explain.add_argument("--websocket", action="store_true", help="the URL's request is a websocket upgrade")
    explain.add_argument("target", help="URL or host:port")
    explain.set_defaults(func=cmd_policy_explain)
    test = actions.add_parser("test", help="run expected decisions: exit 0 all match, 1 a mismatch, 2 a bad file")
    test.add_argument("policy", metavar="POLICY")
    test.add_argument("cases", metavar="CASES.yaml")
    test.set_defaults(func=cmd_policy_test)
    suggest = actions.add_parser("suggest", help="print a policy of allow rules for what an audit log shows denied")
    suggest.add_argument("audit", metavar="AUDIT.jsonl")
    suggest.add_argument("--profile", metavar="P", help="only this profile's denials")
    suggest.add_argument("--since", metavar="T", help="only denials from T on: an ISO time or a duration (2h, 1d)")
    suggest.add_argument(
        "--collapse", type=int, metavar="N", help="offer *.parent for N or more sibling names (never a public suffix)"
    )
    suggest.add_argument("--merge", metavar="POLICY", help="print POLICY with the rules added (comments kept)")
    suggest.set_defaults(func=cmd_policy_suggest, root_when_refused=NeedsRoot("the audit log is root's"))
    reload = actions.add_parser("reload", help="make a running gateway load its policy file again (admin listener)")
    add_admin_options(reload)
    reload.set_defaults(func=cmd_policy_reload)


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
        if inspected := policy.inspected_hosts():
            print(f"  inspected (TLS terminated at the gateway): {', '.join(sorted(inspected))}")
        if secrets := policy.secret_names():
            print(f"  secrets the gateway needs (--secret NAME=…): {', '.join(sorted(secrets))}")
    return status


def cmd_policy_test(args: argparse.Namespace) -> int:
    return run_cases(args.policy, args.cases)


def cmd_policy_suggest(args: argparse.Namespace) -> int:
    from pathlib import Path

    from airlock.policy.edit import render

    from .suggest import since_time, suggest

    if args.collapse is not None and args.collapse < 2:
        raise UsageError(f"--collapse {args.collapse}: give 2 or more sibling names")
    since = since_time(args.since) if args.since else None
    base = _load(args.merge) if args.merge else None
    try:  # the audit log is root's (0640): a user is refused it, and `root_when_refused` asks sudo
        with open(args.audit, encoding="utf-8") as audit:
            suggestions = suggest(audit, base, args.profile, since, args.collapse)
    except UnicodeDecodeError as e:
        raise UsageError(f"{args.audit}: {e}") from None
    print(render(suggestions, Path(args.merge) if args.merge else None, args.audit), end="")
    return 0


def _parse_resolve(values: list[str]) -> dict[str, list[IPAddress]]:
    table: dict[str, list[IPAddress]] = {}
    for value in values:
        host, sep, ips = value.partition("=")
        if not sep or not ips:
            raise UsageError(f"--resolve {value!r}: expected HOST=IP[,IP...]")
        try:
            parsed = [parse_ip_literal(ip.strip()) for ip in ips.split(",")]
            name = canonical_host(host)
        except HostError as e:
            raise UsageError(f"--resolve {value!r}: {e}") from None
        addresses = [a for a in parsed if a is not None]
        if len(addresses) != len(parsed):
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
    decision = decide(profile, host, port)
    # A name allowed without --resolve: its addresses are not known here, so only the name is judged.
    judged = decision.allow and (is_ip(host) or host in resolved)
    judgement = judge(profile, host, port, resolved.get(host)) if judged else Judgement(decision)
    request = _judge_request(judgement.decision, args)
    target = format_host_port(host, port)
    if args.json:
        print(json.dumps(_explanation(profile.name, target, judgement, judged, policy.hash, request)))
    else:
        _print_explanation(profile.name, target, port, judgement, judged, request)
    return EXIT_ALLOW if judgement.decision.allow and (request is None or request.allow) else EXIT_DENY


def _judge_request(decision: Decision, args: argparse.Namespace) -> RequestDecision | None:
    """A URL's request (its method and path), judged as the gateway judges it inside an inspected host's TLS; None
    when nothing is judged (not a URL, a denied host, a host passed through)."""
    if "://" not in args.target or not decision.allow or decision.rule is None or not decision.rule.inspect:
        return None
    try:
        split_target(args.target)
    except PathError as e:
        raise UsageError(f"{args.target!r}: {e}") from None
    return judge_request(decision.rule, args.method, args.target, args.websocket)


def _explanation(
    profile: str, target: str, judgement: Judgement, judged: bool, policy_hash: str, request: RequestDecision | None
) -> dict[str, object]:
    """`explain --json`: the fields an audit line of this decision would carry, and the addresses' vetting. A
    request an inspected host refuses is the decision (its code, reason, hint); `request` tells it whole."""
    decision, vetted = judgement.decision, judgement.vetted
    refused = request if request is not None and not request.allow else None
    return {
        "target": target,
        "profile": profile,
        "policy_hash": policy_hash,
        "decision": "deny" if refused else decision.verdict,
        "code": refused.code if refused else decision.code,
        "reason": refused.reason if refused else decision.reason,
        "rule": decision.rule.id if decision.rule else None,
        "rule_source": decision.rule.source if decision.rule else None,
        "hint": refused.hint if refused else decision.hint,
        "addresses_vetted": judged,
        "allowed_addresses": [str(a) for a in vetted.allowed] if vetted else [],
        "blocked_addresses": [
            {"address": str(r.address), "code": r.code, "reason": r.reason} for r in (vetted.rejected if vetted else ())
        ],
        "connect_to": str(judgement.chosen) if judgement.chosen else None,
        **(_inspection(decision.rule) if decision.rule is not None else {"inspect": False}),
        "request": _request(request) if request is not None else None,
    }


def _inspection(rule: Rule) -> dict[str, object]:
    """What the deciding rule says about the requests inside its TLS; injections by secret names, never values."""
    if not rule.inspect:
        return {"inspect": False}
    return {
        "inspect": True,
        "http": [{**sub.canonical(), "source": sub.source} for sub in rule.http],
        "inject": [
            {"github": dict(i.permissions), "source": i.source}
            if isinstance(i, GithubInjection)
            else {"header": i.header, "value": i.template(), "secrets": sorted(i.secrets), "source": i.source}
            for i in rule.inject
        ],
    }


def _request(request: RequestDecision) -> dict[str, object]:
    return {
        "decision": "allow" if request.allow else "deny",
        "code": request.code,
        "reason": request.reason,
        "path": request.path,
        "http_rule": request.http_rule.source if request.http_rule else None,
        "hint": request.hint,
    }


def _print_explanation(
    profile: str, target: str, port: int, judgement: Judgement, judged: bool, request: RequestDecision | None
) -> None:
    decision, vetted = judgement.decision, judgement.vetted
    print(f"target:   {target} (profile {profile})")
    if decision.rule is not None:
        print(f"rule:     {decision.rule.describe()}")
        _print_inspection(decision.rule)
    for rejection in vetted.rejected if vetted else ():
        print(f"blocked:  {rejection.address} — {rejection.reason}")
    if request is not None and not request.allow:
        decision = Decision(False, request.reason, request.code, decision.rule, request.hint)
    elif request is not None:
        by = f" by the sub-rule at {request.http_rule.source}" if request.http_rule else " (the rule has no http:)"
        print(f"request:  allowed {request.path}{by}")
    if not decision.allow:
        print(f"decision: deny [{decision.code}] — {decision.reason}")
        if decision.hint:
            print(f"to allow: {decision.hint}")
        return
    _print_allowed(decision, judgement, port, judged)


def _print_allowed(decision: Decision, judgement: Judgement, port: int, judged: bool) -> None:
    """The lines of an allowed target: report mode's denial, a tunnel's limits, the address it connects to."""
    if decision.report:
        print(f"report:   would deny [{decision.code}] — {decision.reason}; allowed: the profile is in report mode")
        if decision.hint:
            print(f"to allow: {decision.hint}")
    if port not in WEB_PORTS and not decision.tunnel:
        print("tunnel:   TLS only; a CONNECT tunnel that is not TLS (e.g. ssh) needs `tunnel: true` on the rule")
    if not judged:
        print(
            f"decision: {decision.verdict} (name allowed; its addresses are vetted after DNS —"
            " pass --resolve to check them)"
        )
        return
    print(f"decision: {decision.verdict} — would connect to {judgement.chosen}")


def _print_inspection(rule: Rule) -> None:
    if not rule.inspect:
        return
    within = "these requests only" if rule.http else "every method and path, no websocket"
    print(f"inspect:  TLS terminated at the gateway; {within}")
    for sub in rule.http:
        print(f"http:     {sub.describe()}")
    for injection in rule.inject:
        print(f"inject:   {injection.describe()} ({injection.source})")
