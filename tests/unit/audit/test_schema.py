"""docs/audit-record.schema.json is the audit record's published shape: its enums are the code's, its properties are
the record's fields, and the lines the code writes validate against it (the e2e suite validates every line its
gateways write, of every kind)."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import typing

import pytest
from jsonschema import Draft202012Validator
from repo_files import AUDIT_SCHEMA as SCHEMA

from airlock.audit import SCHEMA_VERSION, AuditRecord, Kind, RepeatedDecisions, Verdict
from airlock.gateway.auditing import GatewayAudit
from airlock.policy import LivePolicy, ReasonCode, Sandbox, SandboxRegistry, parse_policy

VALIDATOR = Draft202012Validator(SCHEMA)
POLICY_TEXT = """\
version: 1
profiles:
  default:
    allow:
      - host: a.example
        name: a-rule
      - host: b.example
"""
POLICY = parse_policy(POLICY_TEXT, "p.yaml")
SANDBOX = Sandbox("sbx", "default", ipaddress.ip_network("10.9.0.2/32"))


def _errors(line: str) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(json.loads(line))]


def test_the_schema_is_a_valid_draft_2020_12_schema() -> None:
    Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_the_schema_has_every_field_of_the_record_and_requires_each() -> None:
    fields = {f.name for f in dataclasses.fields(AuditRecord)}
    assert set(SCHEMA["properties"]) == fields
    assert set(SCHEMA["required"]) == fields
    assert SCHEMA["properties"]["schema"]["const"] == SCHEMA_VERSION


def test_the_schema_enums_are_the_codes() -> None:
    assert SCHEMA["properties"]["kind"]["enum"] == list(typing.get_args(Kind.__value__))
    assert SCHEMA["properties"]["decision"]["enum"] == list(typing.get_args(Verdict.__value__))
    not_broker, policy, approval = SCHEMA["allOf"]
    assert not_broker["then"]["properties"]["code"]["enum"] == [code.value for code in ReasonCode]
    policy_codes = {ReasonCode.POLICY_LOADED, ReasonCode.POLICY_REFUSED}
    assert set(policy["then"]["properties"]["code"]["enum"]) == policy_codes
    answers = {ReasonCode.APPROVED, ReasonCode.APPROVAL_DENIED, ReasonCode.APPROVAL_TIMEOUT}
    assert set(approval["then"]["properties"]["code"]["enum"]) == answers


def _stamped(*records: AuditRecord) -> list[str]:
    """The lines the gateway's audit path writes for these records."""
    written: list[AuditRecord | RepeatedDecisions] = []
    audit = GatewayAudit(written.append, [SANDBOX], live=LivePolicy(POLICY, SandboxRegistry([SANDBOX])))
    for record in records:
        audit.emit(record)
    audit.policy_loaded(POLICY, "sha256:0123456789abcdef")
    audit.policy_refused("p.yaml", ["p.yaml:3: bad"], refused_hash=POLICY.hash)
    return [line for item in written for line in item.to_json().split("\n")]


def test_lines_the_gateway_stamps_validate() -> None:
    allowed = AuditRecord("connect", "sbx", "10.9.0.2", "a.example", 443, "allow", "allowed", ReasonCode.ALLOWED)
    allowed.decided_by(POLICY.profile().allow[0])
    denied = AuditRecord("dns", "sbx", "10.9.0.2", "c.example", None, "deny", "no", ReasonCode.NOT_ALLOWLISTED)
    denied.hint = "allow: [{host: c.example}]"
    broker = AuditRecord("broker", "sbx", "10.9.0.2", "-", None, "deny", "bad token", "invalid_token")
    lines = _stamped(allowed, denied, broker)
    assert len(lines) == 5
    for line in lines:
        assert _errors(line) == [], line
    first = json.loads(lines[0])
    assert (first["profile"], first["policy_hash"]) == ("default", POLICY.hash)
    assert (first["rule"], first["rule_source"]) == ("a-rule", "p.yaml:5")


def test_repeated_dns_lines_validate() -> None:
    record = AuditRecord("dns", "sbx", "10.9.0.2", "a.example", None, "allow", "answered", ReasonCode.ALLOWED)
    _stamped(record)  # as the gateway stamps the line it remembers the template from
    batch = RepeatedDecisions(1.5, [(RepeatedDecisions.template(record), "10.9.0.2")] * 2)
    for line in batch.to_json().split("\n"):
        assert _errors(line) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kind", "ftp"),
        ("decision", "maybe"),
        ("code", "no_such_code"),
        ("rule", "p.yaml:5"),  # a line number is never a rule id
        ("policy_hash", "abc"),
        ("surprise", 1),
    ],
)
def test_the_schema_refuses_what_the_code_never_writes(field: str, value: object) -> None:
    line = json.loads(_stamped()[0])
    line["kind"], line["code"] = "dns", "allowed"
    line[field] = value
    assert _errors(json.dumps(line))
