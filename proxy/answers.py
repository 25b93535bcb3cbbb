"""The gateway's own answers to the sandbox (a refusal, an answer withheld): a JSON body the agent can read."""

from __future__ import annotations

import json

from mitmproxy import http

from airlock.audit import AuditRecord

DECISION_HEADER = "X-Airlock-Decision"
REQUEST_ID_HEADER = "X-Airlock-Request-Id"


def answer(record: AuditRecord, hint: str | None, status: int = 403, decision: str = "deny") -> http.Response:
    """The answer whose audit line is `record`: the decision (a refusal, even one a fault made: "deny"), the line's
    reason, code and request id, and the hint, as JSON."""
    body = {
        "decision": decision, "reason": record.reason, "code": record.code, "rule_hint": hint,
        "request_id": record.request_id,
    }  # fmt: skip
    return http.Response.make(
        status,
        json.dumps(body, indent=None).encode() + b"\n",
        {
            "Content-Type": "application/json",
            DECISION_HEADER: decision,
            REQUEST_ID_HEADER: record.request_id,
            "Connection": "close",
        },
    )
