"""The gateway's side of the audit: every line of proxy, DNS and broker passes through `GatewayAudit.emit`, which
stamps it with what only the gateway knows (the sandbox's profile, the hash of the policy in force) and tells
denials on stderr where asked; policy reloads and their refusals become audit lines of their own (kind `policy`)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Literal

from airlock.audit import AuditRecord, RepeatedDecisions
from airlock.audit.notices import DenialNotices
from airlock.policy import LivePolicy, Policy, ReasonCode, Sandbox

MAX_AUDITED_ERRORS = 20  # of a refused policy's errors, on its audit line (`error_count` says how many in all)


def tell(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class GatewayAudit:
    def __init__(
        self,
        write: Callable[[AuditRecord | RepeatedDecisions], None],
        sandboxes: Iterable[Sandbox],
        notices: DenialNotices | None = None,
        observe: Callable[[AuditRecord | RepeatedDecisions], None] | None = None,
        live: LivePolicy | None = None,
    ) -> None:
        self.write, self.notices = write, notices
        self.observe = observe  # the gateway's metrics: each line counted as it is written
        self.live = live  # the policy in force, whose hash stamps every line
        self._profiles = {sandbox.id: sandbox.profile for sandbox in sandboxes}
        self._decisions: Counter[tuple[str, str]] = Counter()  # (kind, decision) of every line written

    def emit(self, record: AuditRecord | RepeatedDecisions) -> None:
        """Stamp and write one line. A tunnel's line is written, and stamped, when it closes: its `policy_hash` is
        of the policy in force then. Repeated DNS decisions are copies of a line stamped when first written."""
        if isinstance(record, AuditRecord):
            if record.profile is None:
                record.profile = self._profiles.get(record.sandbox)
            if record.policy_hash is None and self.live is not None:
                record.policy_hash = self.live.current.policy.hash
            if self.notices is not None:
                self.notices.observe(record)
            self._decisions[record.kind, record.decision] += 1
        self.write(record)
        if self.observe is not None:  # after the write: a line is never lost to its counting
            self.observe(record)

    def counters(self) -> dict[str, dict[str, int]]:
        """Audit lines written since start, by kind and then decision (`GET /v1/status`); repeated DNS answers,
        written as copies of a line already counted, are not counted again."""
        counts: dict[str, dict[str, int]] = {}
        for (kind, decision), count in sorted(self._decisions.items()):
            counts.setdefault(kind, {})[decision] = count
        return counts

    def policy_loaded(self, policy: Policy, previous_hash: str) -> None:
        record = _policy_record("allow", f"policy reloaded from {policy.source}", ReasonCode.POLICY_LOADED)
        record.policy_hash = policy.hash
        record.extra = {"source": policy.source, "previous_hash": previous_hash}
        self.emit(record)

    def policy_refused(self, source: str, errors: list[str], refused_hash: str | None = None) -> None:
        """A policy not put in force (it did not load, or lacks a running sandbox's profile): the line carries the
        hash of the policy that stays, the refused one's when it loaded, and the errors."""
        reason = f"policy from {source} refused: the running policy stays"
        record = _policy_record("deny", reason, ReasonCode.POLICY_REFUSED)
        record.extra = {"source": source, "errors": errors[:MAX_AUDITED_ERRORS], "error_count": len(errors)}
        if refused_hash is not None:
            record.extra["refused_hash"] = refused_hash
        self.emit(record)


def _policy_record(decision: Literal["allow", "deny"], reason: str, code: ReasonCode) -> AuditRecord:
    return AuditRecord("policy", "-", "-", "-", None, decision, reason, code)
