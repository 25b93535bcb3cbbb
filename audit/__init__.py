"""The audit side of the gateway: the record every decision leaves (one JSON line), the sink that writes the lines,
and the throttle for refusals that come in floods. Proxy, DNS server and broker import it; it imports nothing of
theirs, and of the policy core nothing at all."""

from .record import SCHEMA_VERSION, AuditRecord, Kind, RepeatedDecisions, Verdict, new_request_id
from .sink import AuditLog
from .throttle import REFUSAL_LINES, AuditThrottle

__all__ = [
    "REFUSAL_LINES",
    "SCHEMA_VERSION",
    "AuditLog",
    "AuditRecord",
    "AuditThrottle",
    "Kind",
    "RepeatedDecisions",
    "Verdict",
    "new_request_id",
]
