"""The security team's tools on the policy core: `policy explain --json`, `policy test` (expected decisions, judged
as the proxy judges them) and `policy suggest` (rules for what an audit log shows denied)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airlock.cli import main
from airlock.policy import load_policy, parse_policy

POLICY = """\
version: 1
profiles:
  default:
    allow:
      - host: pkg.example
        name: pkg
      - host: "*.cdn.example"
      - cidr: 10.1.2.3/32
        ports: [443]
    deny:
      - host: bad.cdn.example
  strict:
    allow:
      - host: only.example
"""


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY, encoding="utf-8")
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# --- explain --json -----------------------------------------------------------------------------------------------


def test_explain_json_of_a_denial(policy_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["policy", "explain", "--json", "--policy", str(policy_file), "https://x.example/"], capsys)
    assert code == 1
    result = json.loads(out)
    assert {k: result[k] for k in ("decision", "code", "reason", "rule", "hint", "profile")} == {
        "decision": "deny",
        "code": "not_allowlisted",
        "reason": "x.example:443 is not in the allowlist",
        "rule": None,
        "hint": "allow: [{host: x.example, ports: [443]}]",
        "profile": "default",
    }
    assert result["policy_hash"] == load_policy(policy_file).hash


def test_explain_json_names_the_rule_by_its_stable_id(policy_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["policy", "explain", "--json", "--policy", str(policy_file)]
    code, out, _ = _run([*argv, "--resolve", "pkg.example=10.0.0.9,192.0.2.4", "https://pkg.example/"], capsys)
    result = json.loads(out)
    assert code == 0 and (result["decision"], result["rule"], result["rule_source"]) == (
        "allow",
        "pkg",
        f"{policy_file}:5",
    )
    assert result["connect_to"] == "192.0.2.4" and result["blocked_addresses"][0]["code"] == "internal_address"
    code, out, _ = _run([*argv, "https://bad.cdn.example/"], capsys)
    denied_by = load_policy(policy_file).profile().deny[0]
    assert code == 1 and json.loads(out)["rule"] == denied_by.id and denied_by.id.startswith("sha256:")


# --- policy test --------------------------------------------------------------------------------------------------

CASES = """\
cases:
  - {target: "https://pkg.example/", expect: allow, profile: default, resolve: {pkg.example: [198.51.100.10]}}
  - {target: "http://169.254.169.254/", expect: deny}
  - {target: "https://pkg.example/", expect: {decision: allow, rule: pkg}, resolve: {pkg.example: 192.0.2.1}}
  - {target: "https://10.1.2.3/", expect: allow}
  - target: "https://a.cdn.example/"
    expect: {decision: deny, code: internal_address}
    resolve: {a.cdn.example: [10.9.9.9]}
  - {target: "https://pkg.example/", expect: {decision: deny, code: resolve_failed}}
  - {target: "https://pkg.example/", expect: {decision: deny, code: no_address}, resolve: {pkg.example: []}}
  - {target: "https://pkg.example/", expect: deny, profile: strict}
"""


def _cases(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cases.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_policy_test_passes_when_every_case_matches(
    policy_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(["policy", "test", str(policy_file), _cases(tmp_path, CASES)], capsys)
    assert (code, out) == (0, "8 cases: 8 passed, 0 failed\n")


def test_policy_test_prints_each_mismatch_side_by_side(
    policy_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = CASES.replace('"http://169.254.169.254/", expect: deny', '"http://169.254.169.254/", expect: allow')
    wrong = wrong.replace("rule: pkg}", "rule: other}")
    cases = _cases(tmp_path, wrong)
    code, out, _ = _run(["policy", "test", str(policy_file), cases], capsys)
    assert code == 1
    assert out.splitlines() == [
        f"FAIL {cases}:3  http://169.254.169.254/  expected: allow  |  got: deny code metadata — "
        "169.254.169.254 is a metadata/link-local address: never reachable",
        f"FAIL {cases}:4  https://pkg.example/  expected: allow rule other  |  "
        "got: allow code allowed rule pkg — allowed",
        "8 cases: 6 passed, 2 failed",
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("cases:\n  - {target: 'ftp://x/', expect: allow}\n", ":2: target: 'ftp://x/': only http:// and https://"),
        ("cases:\n  - {target: 'https://x/', expect: maybe}\n", ":2: expect 'maybe': give allow, deny or report"),
        ("cases:\n  - {target: 'https://x/', expect: allow, profile: p}\n", ":2: profile 'p' is not in"),
        ("cases:\n  - {expect: {decision: deny, code: zzz}}\n", ":2: case: 'target' is required"),
        ("cases:\n  - {target: 'https://x/', expect: deny, resolve: {x: [a-name]}}\n", ":2: resolve: 'a-name' is not"),
        ("cases:\n  - {target: 'https://x/', expect: deny, surprise: 1}\n", ":2: case: unknown key 'surprise'"),
        ("cases:\n  - {target: [1], expect: deny}\n", ":2: target must be a single value"),
        ("cases: [\n", ":2: invalid YAML"),
        ("cases: []\n", ":1: no cases"),
    ],
)
def test_policy_test_refuses_a_bad_cases_file_with_file_and_line(
    policy_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, error: str
) -> None:
    cases = _cases(tmp_path, text)
    code, out, err = _run(["policy", "test", str(policy_file), cases], capsys)
    assert code == 2 and out == ""
    assert err.startswith(cases + error), err


def test_policy_test_refuses_a_bad_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "bad.yaml"
    policy.write_text("version: 1\nprofiles:\n  default:\n    allow:\n      - host: '*.com'\n", encoding="utf-8")
    code, _, err = _run(["policy", "test", str(policy), _cases(tmp_path, CASES)], capsys)
    assert code == 2 and err.startswith(f"{policy}:5: ")


# --- policy suggest -----------------------------------------------------------------------------------------------


def _line(host: str, port: int | None, code: str = "not_allowlisted", kind: str = "connect", **fields: object) -> str:
    record = {
        "kind": kind, "host": host, "port": port, "decision": "deny", "code": code, "profile": "default",
        "ts": "2025-03-01T10:00:00.000Z", **fields,
    }  # fmt: skip
    return json.dumps(record)


AUDIT = [
    _line("example.com", 443),
    _line("example.com", 443),
    _line("example.com", 8443, "port_not_allowed"),
    _line("quiet.example", None, kind="dns"),
    _line("vm", None, kind="dns"),  # a machine's own name, denied by an older airlock: never a rule
    _line("169.254.169.254", 80, "metadata", kind="http"),
    _line("10.0.0.1", 443, "internal_address"),
    _line("internal.example", 443, "no_address_left"),
    _line("192.0.2.53", 443, "own_address"),
    _line("bad.cdn.example", 443, "denied_by_rule"),
    _line("198.51.100.7", 443),
    _line("2001:db8::1", 443),  # documentation IPv6: not public, never suggested
    _line("::ffff:198.51.100.9", 443),  # an IPv6 form of IPv4: never suggested
    _line("allowed.example", 443, decision="allow", code="allowed"),
    _line("-", None, "not_allowlisted"),
    _line("a.cdn2.example", 443),
    _line("b.cdn2.example", 443),
    _line("c.cdn2.example", 443),
    _line("a.github.io", 443),
    _line("b.github.io", 443),
    _line("c.github.io", 443),
    _line("old.example", 443, ts="2024-01-01T00:00:00.000Z"),
    _line("x.example", 443, profile="strict"),
]


def _suggest(tmp_path: Path, capsys: pytest.CaptureFixture[str], *options: str) -> tuple[int, str, str]:
    audit = tmp_path / "audit.jsonl"
    audit.write_text("\n".join(AUDIT) + "\n", encoding="utf-8")
    return _run(["policy", "suggest", str(audit), *options], capsys)


def _allowed(text: str, profile: str = "default") -> list[tuple[str, list[int]]]:
    policy = parse_policy(text)
    return [(rule.target, sorted(rule.ports or ())) for rule in policy.profile(profile).allow]


def test_suggest_prints_a_policy_of_exact_hosts_and_ports_that_passes_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _suggest(tmp_path, capsys)
    assert code == 0
    assert _allowed(out) == [
        ("198.51.100.7/32", [443]),
        ("a.cdn2.example", [443]),
        ("a.github.io", [443]),
        ("b.cdn2.example", [443]),
        ("b.github.io", [443]),
        ("c.cdn2.example", [443]),
        ("c.github.io", [443]),
        ("example.com", [443, 8443]),
        ("old.example", [443]),
        ("quiet.example", [443]),
    ]
    assert _allowed(out, "strict") == [("x.example", [443])]
    assert "- host: example.com  # 3 denials (connect), last 2025-03-01T10:00:00.000Z\n" in out
    assert "quiet.example  # 1 denial (dns), last 2025-03-01T10:00:00.000Z; DNS only: port 443 assumed" in out
    suggested = tmp_path / "suggested.yaml"
    suggested.write_text(out, encoding="utf-8")
    assert main(["policy", "check", str(suggested)]) == 0


def test_suggest_never_suggests_a_hard_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _suggest(tmp_path, capsys)
    for never in ("169.254", "10.0.0.1", "internal.example", "192.0.2.53", "bad.cdn", "2001:db8", "ffff", "allowed."):
        assert never not in out
    assert "host: vm" not in out


def test_suggest_filters_by_profile_and_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _suggest(tmp_path, capsys, "--profile", "strict")
    assert list(parse_policy(out).profiles) == ["strict"] and _allowed(out, "strict") == [("x.example", [443])]
    _, out, _ = _suggest(tmp_path, capsys, "--since", "2025-01-01")
    assert "old.example" not in out and "example.com" in out
    _, out, _ = _suggest(tmp_path, capsys, "--since", "1h")
    assert _allowed(out) == []


def test_suggest_collapses_siblings_only_when_asked_and_never_over_a_public_suffix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = _suggest(tmp_path, capsys, "--collapse", "3")
    targets = [target for target, _ in _allowed(out)]
    assert "*.cdn2.example" in targets and not any("cdn2" in t for t in targets if not t.startswith("*"))
    assert {"a.github.io", "b.github.io", "c.github.io"} <= set(targets)  # github.io is a public suffix
    assert "*.github.io" not in out
    _, out, _ = _suggest(tmp_path, capsys, "--collapse", "4")
    assert "*.cdn2.example" not in out


def test_suggest_merge_keeps_the_policy_and_adds_only_what_it_still_denies(
    policy_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = POLICY.replace("version: 1\n", "# our policy, reviewed\nversion: 1  # the only version\n")
    policy_file.write_text(original.replace('      - host: "*.cdn.example"\n', "      - host: example.com\n"))
    before = policy_file.read_text()
    code, out, _ = _suggest(tmp_path, capsys, "--merge", str(policy_file))
    assert code == 0
    assert out.startswith(before.split("    deny:")[0])  # the original lines, comments and layout, unchanged
    rest = iter(out.splitlines())
    assert all(line in rest for line in before.splitlines())  # ... and every one of them, in order
    allowed = _allowed(out)
    assert ("example.com", [8443]) in allowed  # 443 was allowed already: only the port it still denies
    assert ("example.com", [443, 8443]) not in allowed
    assert parse_policy(out).profile("strict").allow[-1].target == "x.example"
    assert out.count("pkg.example") == 1


def test_suggest_refuses_a_file_that_is_not_an_audit_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    audit = tmp_path / "audit.jsonl"
    audit.write_text('{"kind": "http"}\nnot json\n', encoding="utf-8")
    code, _, err = _run(["policy", "suggest", str(audit)], capsys)
    assert code == 2 and "audit line 2: not JSON" in err
    code, _, err = _run(["policy", "suggest", str(tmp_path / "absent.jsonl")], capsys)
    assert code == 2 and "absent.jsonl" in err
