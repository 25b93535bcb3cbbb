"""What the gateway adds to every audit line (the sandbox's profile, the policy hash), and `--audit -`."""

from __future__ import annotations

import argparse
import ipaddress

import pytest

from airlock.audit import AuditRecord, RepeatedDecisions
from airlock.audit.notices import DenialNotices
from airlock.cli.gateway import add_arguments, gateway_config
from airlock.gateway.auditing import GatewayAudit
from airlock.policy import LivePolicy, ReasonCode, Sandbox, SandboxRegistry, parse_policy

POLICY = parse_policy("version: 1\nprofiles:\n  default: {}\n  strict: {}\n", "p.yaml")
SANDBOXES = [Sandbox("sbx", "strict", ipaddress.ip_network("10.0.0.2/32"))]


def _audit(notices: DenialNotices | None = None) -> tuple[GatewayAudit, list[AuditRecord | RepeatedDecisions]]:
    written: list[AuditRecord | RepeatedDecisions] = []
    audit = GatewayAudit(written.append, SANDBOXES, notices, live=LivePolicy(POLICY, SandboxRegistry(SANDBOXES)))
    return audit, written


def test_every_line_gets_the_sandboxs_profile_and_the_policy_hash() -> None:
    audit, written = _audit()
    audit.emit(AuditRecord("dns", "sbx", "10.0.0.2", "a.test", None, "allow", "answered", ReasonCode.ALLOWED))
    audit.emit(AuditRecord("connect", "-", "10.9.9.9", "-", None, "deny", "who", ReasonCode.UNKNOWN_SANDBOX))
    assert [(r.profile, r.policy_hash) for r in written] == [("strict", POLICY.hash), (None, POLICY.hash)]


def test_a_line_stamped_already_keeps_its_stamp() -> None:
    audit, written = _audit()
    record = AuditRecord("connect", "sbx", "10.0.0.2", "a.test", 443, "allow", "allowed", ReasonCode.ALLOWED)
    record.policy_hash = "sha256:0000000000000000"
    audit.emit(record)
    assert written[0].policy_hash == "sha256:0000000000000000"  # type: ignore[union-attr]


def test_denials_are_told_when_asked() -> None:
    lines: list[str] = []
    audit, _ = _audit(DenialNotices(lines.append, schedule=lambda delay, callback: None))
    audit.emit(AuditRecord("http", "sbx", "10.0.0.2", "b.test", 80, "deny", "b.test:80 is not in the allowlist", "x"))
    assert lines == ["airlock: denied b.test:80 — b.test:80 is not in the allowlist"]


@pytest.mark.parametrize(
    ("given", "path", "stdout"),
    [(["--audit", "-"], None, True), (["--audit", "a.jsonl"], "ABS", False), ([], None, False)],
)
def test_audit_dash_is_stdout(given: list[str], path: str | None, stdout: bool, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--listen", "127.0.0.1", *given])
    config = gateway_config(args, POLICY, "127.0.0.1", [])
    assert config.audit_path == (str(tmp_path / "a.jsonl") if path else None)
    assert config.audit_stdout is stdout
