"""Replies remembered at the wire level: a sandbox asking the same question again within a second gets the
same reply bytes, with its own query ID (and spelling of the name) put in. Parsing, deciding and packing are
skipped; the caller still writes one audit line per query.

A reply is remembered per sandbox, for the exact query it answered apart from the ID and the letter case of
the name (0x20 randomization): flags, question type and class, EDNS record must be byte for byte the same, so a
remembered reply is always the reply the full path would have sent for this query under the same policy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dnslib import RCODE

from airlock.audit import AuditRecord, RepeatedDecisions
from airlock.policy import Policy

HEADER = 12
KEPT_RCODES = frozenset({RCODE.NOERROR, RCODE.NXDOMAIN, RCODE.REFUSED})  # failures are asked again


def name_end(query: bytes) -> int | None:
    """Offset just past the question's name for a plain query (one question, records beyond it at most one
    EDNS OPT, opcode QUERY, no compression), else None: anything else is never remembered."""
    if len(query) < HEADER + 5 or query[2] & 0xF8 or query[4:10] != b"\x00\x01\x00\x00\x00\x00" or query[10]:
        return None
    if query[11] > 1:
        return None
    position = HEADER
    while (length := query[position]) != 0:
        if length & 0xC0:
            return None  # compression pointers have no place in a question
        position += length + 1
        if position >= len(query):
            return None
    end = position + 1
    return end if end + 4 <= len(query) else None


@dataclass(slots=True)
class Remembered:
    query: bytes  # the query this reply answered, without its ID
    name_end: int  # offset just past the name in the query (and in the reply: the question is echoed)
    reply: bytes  # the reply without its ID
    audit: str  # the fixed part of its audit line (see RepeatedDecisions)
    expires: float  # time.monotonic()
    policy: Policy  # the policy it was decided under: a reload forgets it

    def reply_to(self, query: bytes) -> bytes | None:
        """The reply for `query` (same question up to letter case and ID), or None when it differs otherwise."""
        tail = query[2:]
        if tail == self.query:
            return query[:2] + self.reply
        end = self.name_end
        if query[2:HEADER] != self.query[: HEADER - 2] or query[end:] != self.query[end - 2 :]:
            return None
        return query[:2] + self.reply[: HEADER - 2] + query[HEADER:end] + self.reply[end - 2 :]


class ReplyMemory:
    def __init__(self, seconds: float = 1.0, size: int = 10_000) -> None:
        self.seconds, self.size = seconds, size
        self._entries: dict[tuple[str, bytes], Remembered] = {}

    def recall(self, sandbox: str, query: bytes, policy: Policy, now: float) -> tuple[bytes, str] | None:
        """(reply bytes, audit template) for a question this sandbox asked moments ago, else None."""
        entry = self._entries.get((sandbox, query[2:].lower()))
        if entry is None or entry.expires < now or entry.policy is not policy:
            return None
        reply = entry.reply_to(query)
        return None if reply is None else (reply, entry.audit)

    def remember(
        self, sandbox: str, query: bytes, reply: bytes, audit: str, ttl: float, policy: Policy, now: float
    ) -> None:
        """Keep `reply` for min(ttl, seconds); a TTL of 0 means ask again every time (a rebinding name gets no
        second helping), so it is not kept at all."""
        lifetime = min(self.seconds, ttl)
        end = name_end(query)
        if lifetime <= 0 or end is None or reply[HEADER:end].lower() != query[HEADER:end].lower():
            return  # not kept, or not a plain query whose question the reply echoes
        if len(self._entries) >= self.size:
            self._entries.pop(next(iter(self._entries)))  # the oldest
        entry = Remembered(query[2:], end, bytes(reply[2:]), audit, now + lifetime, policy)
        self._entries[(sandbox, query[2:].lower())] = entry

    def keep(
        self, sandbox: str, query: bytes, reply: bytes, rcode: int, record: AuditRecord, policy: Policy, now: float
    ) -> None:
        """Remember a reply of the full path with the fixed part of its audit line: an answer or a refusal, for the
        TTL of the upstream answer it used (set even when every address was filtered), under the policy that
        decided it."""
        ttl = record.extra.get("ttl", self.seconds)
        if rcode not in KEPT_RCODES or not isinstance(ttl, int | float):
            return
        repeated = replace(record, duration_ms=0.0, reason=f"{record.reason} (remembered)")
        self.remember(sandbox, query, reply, RepeatedDecisions.template(repeated), ttl, policy, now)

    def __len__(self) -> int:
        return len(self._entries)
