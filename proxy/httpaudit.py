"""The audit line of each allowed plain-HTTP request, written once its response (or error) is in."""

from __future__ import annotations

import time

from mitmproxy import http

from airlock.audit import AuditRecord
from airlock.policy import ReasonCode

from .failclosed import fail_closed, nothing_to_deny
from .shared import ProxyState


class HttpAudit:
    """One audit line per plain-HTTP request that was allowed (denials are written where they happen)."""

    def __init__(self, shared: ProxyState) -> None:
        self.shared = shared

    def _withhold(self, flow: http.HTTPFlow) -> None:
        """A response whose audit line could not be made is not delivered."""
        if flow.killable:
            flow.kill()  # type: ignore[no-untyped-call]  # mitmproxy's Flow.kill is unannotated

    def _finish(self, flow: http.HTTPFlow, error: str | None = None) -> None:
        record: AuditRecord | None = flow.metadata.pop("airlock", None)
        if record is None or not record.passed:
            return
        started = flow.metadata.get("airlock_started", time.monotonic())
        record.duration_ms = round((time.monotonic() - started) * 1000, 1)
        record.bytes_in = len(flow.request.raw_content or b"")
        if flow.response is not None:
            record.status = flow.response.status_code
            streamed = flow.metadata.get("airlock_bytes_out")  # counted as the scrubber streamed it
            record.bytes_out = streamed if streamed is not None else len(flow.response.raw_content or b"")
        peer = flow.server_conn.peername
        record.chosen_ip = peer[0] if peer else None
        # What the connection in use resolved to; a failed connect has been forgotten: keep the early answer.
        record.resolved = self.shared.resolved.get(flow.server_conn.id, record.resolved)
        if error is not None:  # mitmproxy's words, which may quote what the upstream sent
            record.decision, record.code = "error", ReasonCode.REQUEST_FAILED
            record.reason = self.shared.credentials.scrubbed(error)
        self.shared.emit(record)

    @fail_closed(_withhold)
    def answered(self, flow: http.HTTPFlow) -> None:
        """A response is in (called by `Inspection.response`, the hook, once it has scrubbed it)."""
        self._finish(flow)

    @fail_closed(nothing_to_deny)
    def error(self, flow: http.HTTPFlow) -> None:
        self._finish(flow, flow.error.msg if flow.error else "error")
