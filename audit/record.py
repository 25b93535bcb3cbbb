"""The audit record: one JSON line per decision, and the request ids and timestamps those lines carry.

The id counter and the last second's timestamp text are the process's own state (they live here, not in the pure
policy core): cheap enough to stamp every DNS query.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from dataclasses import dataclass, field, fields
from typing import Literal, Protocol

type Kind = Literal["http", "connect", "dns", "broker", "policy", "approval"]
# `report`: allowed by a profile in report mode, which would have denied it (the code and rule say why).
type Verdict = Literal["allow", "deny", "report", "error"]
# The version of the record's shape (docs/audit-record.schema.json): raised when a field changes meaning or goes.
SCHEMA_VERSION = 1


class RuleRef(Protocol):
    """What a record takes from the rule that decided: the policy core's Rule, seen from here."""

    @property
    def id(self) -> str: ...

    @property
    def source(self) -> str: ...


_ID_PREFIX = secrets.token_hex(4)
_ID_COUNTER = itertools.count()


def new_request_id() -> str:
    """Unique per decision: a random per-process prefix and a counter (cheap enough for every DNS query)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True).encode
_second_text: tuple[int, str] = (-1, "")


def _timestamp(ts: float) -> str:
    global _second_text
    second = int(ts)
    if _second_text[0] != second:
        _second_text = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{_second_text[1]}.{int(ts % 1 * 1000):03d}Z"


@dataclass(slots=True)
class AuditRecord:
    kind: Kind
    sandbox: str
    client: str
    host: str
    port: int | None
    decision: Verdict
    reason: str
    code: str  # stable, machine-readable: a ReasonCode, or on broker lines the broker's error code
    request_id: str = field(default_factory=new_request_id)
    ts: float = field(default_factory=time.time)
    schema: int = SCHEMA_VERSION
    profile: str | None = None  # the sandbox's profile; the gateway stamps it (and policy_hash) as it emits
    policy_hash: str | None = None  # Policy.hash of the policy in force
    method: str | None = None
    path: str | None = None  # never the query; inspected requests: the canonical path, as it was sent upstream
    status: int | None = None  # the upstream's HTTP status (plain HTTP and inspected requests)
    rule: str | None = None  # the deciding rule's stable id (Rule.id): its name, else a hash of its content
    rule_source: str | None = None  # that rule's file:line, for the person who edits it (shifts with every edit)
    hint: str | None = None  # on a denial: the rule that would allow it, when one may
    resolved: list[str] = field(default_factory=list)
    chosen_ip: str | None = None
    bytes_in: int | None = None  # from the sandbox towards upstream
    bytes_out: int | None = None  # from upstream back to the sandbox
    duration_ms: float | None = None
    extra: dict[str, object] = field(default_factory=dict)  # kind-specific details, e.g. DNS exfil signals

    @property
    def passed(self) -> bool:
        """Whether the decision let the traffic through: allowed, or reported (allowed in report mode)."""
        return self.decision in ("allow", "report")

    def decided_by(self, rule: RuleRef | None) -> None:
        self.rule, self.rule_source = (rule.id, rule.source) if rule is not None else (None, None)

    def to_json(self) -> str:
        record = {name: getattr(self, name) for name in _AUDIT_FIELDS}  # asdict() deep-copies: too slow per query
        record["ts"] = _timestamp(self.ts)
        return _encode(record)


_AUDIT_FIELDS = tuple(f.name for f in fields(AuditRecord))
_PER_EVENT = ("ts", "request_id", "client")


@dataclass(slots=True)
class RepeatedDecisions:
    """Decisions repeated exactly (remembered DNS answers) in one batch read at time `ts`: one audit line each,
    with its own request id and client; everything else was serialized once, into the template."""

    ts: float
    events: list[tuple[str, str]]  # (template, client)

    @staticmethod
    def template(record: AuditRecord) -> str:
        """The record's fields but its time, id and client, as `"key":value,...}`."""
        fixed = {name: getattr(record, name) for name in _AUDIT_FIELDS if name not in _PER_EVENT}
        return _encode(fixed)[1:]

    def to_json(self) -> str:
        """One JSON line per decision, newline-separated."""
        # client is a socket's address text (digits, hex, '.', ':'): nothing in it needs JSON escaping.
        head = f'{{"ts":"{_timestamp(self.ts)}","request_id":"{_ID_PREFIX}'
        ids = _ID_COUNTER
        return "\n".join([f'{head}{next(ids):08x}","client":"{client}",{fixed}' for fixed, client in self.events])
