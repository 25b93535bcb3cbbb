"""`airlock policy test POLICY CASES.yaml`: expected decisions, judged by the policy core exactly as the proxy judges
a request (decide, then the vetting of every address), with each name's addresses taken from the case's `resolve:`
instead of DNS. Exit 0 when every case gets what it expects, 1 with the mismatches side by side, 2 on a bad file.

    cases:
      - {target: "https://pkg.example/", expect: allow, profile: default, resolve: {pkg.example: [198.51.100.10]}}
      - {target: "http://169.254.169.254/", expect: deny}
      - {target: "https://x.example/", expect: {decision: deny, code: not_allowlisted}}
      - {target: "https://y.example/", expect: report, profile: learning}  # a profile with `mode: report`

A name without a `resolve:` entry is judged as the proxy judges a name that does not resolve (`resolve_failed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from airlock.policy import (
    HostError,
    IPAddress,
    Judgement,
    Policy,
    PolicyError,
    ReasonCode,
    canonical_host,
    judge,
    parse_ip_literal,
)
from airlock.policy.loader import NodeReader, compose

from .common import EXIT_DENY, UsageError
from .common import load_policy_file as _load
from .target import parse_target

_CASES_KEYS = frozenset({"cases"})
_CASE_KEYS = frozenset({"target", "expect", "profile", "resolve", "name"})
_EXPECT_KEYS = frozenset({"decision", "code", "rule"})
_DECISIONS = frozenset({"allow", "deny", "report"})  # report: allowed by a profile in report mode
_CODES = frozenset(ReasonCode)


@dataclass(frozen=True)
class Expected:
    decision: str
    code: str | None = None
    rule: str | None = None  # a rule id: its name, or the sha256: hash

    def __str__(self) -> str:
        return " ".join([self.decision, *(f"{k} {v}" for k, v in (("code", self.code), ("rule", self.rule)) if v)])


@dataclass(frozen=True)
class Case:
    where: str  # file:line
    target: str  # as written
    host: str
    port: int
    profile: str | None
    resolve: dict[str, list[IPAddress]]
    expect: Expected


def run_cases(policy_path: str, cases_path: str) -> int:
    """Judge every case, print each mismatch and a count: 0 when all match, 1 otherwise (PolicyError: a bad file)."""
    policy = _load(policy_path)
    cases = load_cases(cases_path, policy)
    failures = 0
    for case in cases:
        got = run_case(policy, case)
        if not matches(case.expect, got):
            failures += 1
            print(f"FAIL {case.where}  {case.target}  expected: {case.expect}  |  got: {_describe(got)}")
    print(f"{len(cases)} cases: {len(cases) - failures} passed, {failures} failed")
    return EXIT_DENY if failures else 0


def run_case(policy: Policy, case: Case) -> Judgement:
    """The case judged as the proxy judges the request: the same policy-core calls, answers from `resolve:`."""
    return judge(policy.profile(case.profile), case.host, case.port, case.resolve.get(case.host))


def matches(expect: Expected, got: Judgement) -> bool:
    decision = got.decision
    return (
        expect.decision == decision.verdict
        and expect.code in {None, decision.code}
        and expect.rule in {None, decision.rule.id if decision.rule else None}
    )


def _describe(got: Judgement) -> str:
    decision = got.decision
    rule = f" rule {decision.rule.id}" if decision.rule else ""
    return f"{decision.verdict} code {decision.code}{rule} — {decision.reason}"


def load_cases(path: str, policy: Policy) -> list[Case]:
    """The cases in `path`, or PolicyError with every problem as file:line (exit 2)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, ValueError) as e:
        raise PolicyError([f"{path}:1: cannot read cases: {e}"]) from None
    reader = _CaseReader(path, policy)
    cases = reader.cases(compose(text, path))
    if reader.errors:
        raise PolicyError(reader.messages())
    if not cases:
        raise PolicyError([f"{path}:1: no cases"])
    return cases


class _CaseReader(NodeReader):
    def __init__(self, filename: str, policy: Policy) -> None:
        super().__init__(filename)
        self.policy = policy

    def cases(self, root: yaml.Node | None) -> list[Case]:
        top = self.mapping(root, "cases file", _CASES_KEYS)
        if "cases" not in top:
            if root is not None and top:
                self.error(root, "cases file: 'cases' is required")
            return []
        found = (self.case(node) for node in self.sequence(top["cases"][1], "cases"))
        return [case for case in found if case is not None]

    def case(self, node: yaml.Node) -> Case | None:
        before = len(self.errors)
        fields = self.mapping(node, "case", _CASE_KEYS)
        if not isinstance(node, yaml.MappingNode):
            return None  # reported
        for key in ("target", "expect"):
            if key not in fields:
                self.error(node, f"case: '{key}' is required")
        if "name" in fields:
            self.scalar(fields["name"][1], "name")
        target = self.target(fields["target"][1]) if "target" in fields else None
        expect = self.expect(fields["expect"][1]) if "expect" in fields else None
        profile = self.profile(fields["profile"][1]) if "profile" in fields else None
        resolve = self.resolve(fields["resolve"][1]) if "resolve" in fields else {}
        if len(self.errors) != before or target is None or expect is None:
            return None
        raw, host, port = target
        return Case(self.where(node), raw, host, port, profile, resolve, expect)

    def target(self, node: yaml.Node) -> tuple[str, str, int] | None:
        raw = self.scalar(node, "target")
        if raw is None:
            return None
        try:
            host, port = parse_target(raw)
        except UsageError as e:
            self.error(node, f"target: {e}")
            return None
        return raw, host, port

    def expect(self, node: yaml.Node) -> Expected | None:
        if isinstance(node, yaml.ScalarNode):
            decision = self.decision(node)
            return Expected(decision) if decision else None
        fields = self.mapping(node, "expect", _EXPECT_KEYS)
        if not fields:
            return None
        if "decision" not in fields:
            self.error(node, "expect: 'decision' is required")
            return None
        decision = self.decision(fields["decision"][1])
        code = self.scalar(fields["code"][1], "code") if "code" in fields else None
        if code is not None and code not in _CODES:
            self.error(fields["code"][1], f"code {code!r} is not a reason code (docs/audit-codes.md)")
            return None
        rule = self.scalar(fields["rule"][1], "rule") if "rule" in fields else None
        return Expected(decision, code, rule) if decision else None

    def decision(self, node: yaml.Node) -> str | None:
        decision = self.scalar(node, "expect")
        if decision is not None and decision not in _DECISIONS:
            self.error(node, f"expect {decision!r}: give allow, deny or report")
            return None
        return decision

    def profile(self, node: yaml.Node) -> str | None:
        name = self.scalar(node, "profile")
        if name is not None and name not in self.policy.profiles:
            known = ", ".join(sorted(self.policy.profiles))
            self.error(node, f"profile {name!r} is not in {self.policy.source} (profiles: {known})")
            return None
        return name

    def resolve(self, node: yaml.Node) -> dict[str, list[IPAddress]]:
        table: dict[str, list[IPAddress]] = {}
        for name, (key_node, value_node) in self.mapping(node, "resolve", frozenset()).items():
            try:
                host = canonical_host(name)
            except HostError as e:
                self.error(key_node, f"resolve: {e}")
                continue
            one = isinstance(value_node, yaml.ScalarNode)
            values = [value_node] if one else self.sequence(value_node, f"resolve {name!r}: addresses")
            addresses = [self.address(value) for value in values]
            table[host] = [a for a in addresses if a is not None]
        return table

    def address(self, node: yaml.Node) -> IPAddress | None:
        raw = self.scalar(node, "address")
        address = parse_ip_literal(raw.strip()) if raw is not None else None
        if raw is not None and address is None:
            self.error(node, f"resolve: {raw!r} is not an IP address")
        return address
