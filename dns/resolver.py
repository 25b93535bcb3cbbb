"""The sandbox's only resolver: answers allowlisted names with vetted addresses, and nothing else.

`PolicyResolver.resolve(request, handler)` is the one entry point, in the shape of dnslib's `BaseResolver`; it is
a coroutine because it asks the gateway's shared `Resolver` (one cache, one upstream configuration, so the proxy
and the sandbox see the same addresses). It judges queries the transport (dns/server.py) has admitted
(dns/admission.py), and reads the exfiltration signals of each name it allows.

Choices (docs/operations.md, "DNS"): unlisted names get REFUSED, without any upstream query (an honest "not for
you": NXDOMAIN would claim the name does not exist and be cached as such), except in report mode (answered, audited
`report`); a single-label name (a machine's own name, which /etc/hosts answers) gets NXDOMAIN: for a sandbox it
exists nowhere; only A and AAAA are answered with data, other types of an allowed name get an empty answer; CNAME
chains are flattened to the final, vetted addresses (the sandbox never sees intermediate names), and refused when a
deny rule closes a name on the chain; an answer whose every address was filtered becomes NXDOMAIN.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from dnslib import AAAA, CLASS, QTYPE, RCODE, RR, A, DNSRecord

from airlock.audit import AuditRecord, Verdict
from airlock.policy import (
    Decision,
    DnsLimits,
    HostError,
    LivePolicy,
    Policy,
    Profile,
    ReasonCode,
    Sandbox,
    Snapshot,
    canonical_host,
    decide_alias,
    decide_name,
    registrable_domain,
    vet,
)
from airlock.policy.held_requests import Asker

from .admission import NO_SANDBOX, STRANGER, Admission, DnsSettings, Overloaded
from .answered import AnsweredAddresses
from .upstream import Answer, NameNotFound, ResolveError, Resolver

log = logging.getLogger("airlock.dns")

ANSWERED_TYPES = frozenset({QTYPE.A, QTYPE.AAAA})


class SubdomainRate:
    """Distinct names seen under each registrable domain in the last minute, per sandbox."""

    WINDOW = 60.0

    def __init__(self) -> None:
        # name → when last asked, oldest first: constant work per query, however many names a sandbox tries
        self._seen: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)

    def observe(self, sandbox: str, base: str, name: str, now: float) -> int:
        window = self._seen[(sandbox, base)]
        window.pop(name, None)
        window[name] = now
        while (oldest := next(iter(window.items())))[1] < now - self.WINDOW:
            del window[oldest[0]]
        return len(window)


def label_entropy(label: str) -> float:
    """Shannon entropy in bits per character: random-looking (encoded) labels score high."""
    if not label:
        return 0.0
    counts = Counter(label)
    return -sum(c / len(label) * math.log2(c / len(label)) for c in counts.values())


@dataclass(slots=True)
class Handler:
    """Who asked (dnslib passes its request handler here): the client address, the transport and the sandbox the
    transport admitted the query for (None: an address of no sandbox). `resolve` sets the audit record it logged
    and the policy it judged under."""

    client: str
    protocol: str  # "udp" | "tcp"
    sandbox: Sandbox | None = None
    record: AuditRecord | None = None
    policy: Policy | None = None


class PolicyResolver:
    """Judges each admitted query (`resolve(request, handler)`, dnslib's resolver shape) and audits it."""

    def __init__(
        self,
        live: LivePolicy,
        resolver: Resolver,
        emit: Callable[[AuditRecord], None],
        settings: DnsSettings,
        admission: Admission | None = None,
        stats: Counter[str] | None = None,
        answered: AnsweredAddresses | None = None,
        approvals: Asker | None = None,
    ) -> None:
        self.live = live
        self.resolver = resolver
        self.emit = emit
        self.settings = settings
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.admission = admission or Admission(live, settings, emit, self.stats)  # its in-flight cap
        self._subdomains = SubdomainRate()
        self.approvals = approvals  # where profiles with `on_unlisted: ask` hold what no rule lists
        # What this DNS told each sandbox, for the proxy to judge connections that carry no name (shared with it).
        self.answered = answered if answered is not None else AnsweredAddresses()

    async def resolve(self, request: DNSRecord, handler: Handler) -> DNSRecord:
        """The reply to a query the transport admitted, judged whole under one snapshot of the live policy; the
        handler is given the audit record it was logged with and that policy (what the transport may remember the
        reply under). A failure anywhere is SERVFAIL, audited as an error: every query leaves its audit line."""
        live = self.live.current
        started = time.monotonic()
        reply = request.reply()
        reply.header.ra = 1
        qtype = QTYPE.get(request.q.qtype, str(request.q.qtype))
        sandbox = handler.sandbox
        sandbox_id, name = sandbox.id if sandbox else NO_SANDBOX, str(request.q.qname)
        record = AuditRecord("dns", sandbox_id, handler.client, name, None, "deny", "", ReasonCode.INTERNAL_ERROR)
        record.method = qtype
        handler.record, handler.policy = record, live.policy
        try:
            answered = await self._judge(live, request, reply, record, sandbox, started)
            if "approved" in record.extra:
                handler.policy = None  # a person's answer, not the policy's: never remembered, "once" is once
            return answered
        except Exception as e:
            log.exception("DNS query failed: answering SERVFAIL")
            failed = request.reply()
            failed.header.ra, failed.header.rcode = 1, RCODE.SERVFAIL
            reason = f"internal error: {type(e).__name__}: {e}"
            return self._finish(failed, record, "error", reason, ReasonCode.INTERNAL_ERROR, started)

    async def _judge(
        self,
        live: Snapshot,
        request: DNSRecord,
        reply: DNSRecord,
        record: AuditRecord,
        sandbox: Sandbox | None,
        started: float,
    ) -> DNSRecord:
        if sandbox is None:
            return self._refuse(reply, record, STRANGER, ReasonCode.UNKNOWN_SANDBOX, started)
        if (unanswered := self._unanswered(request, reply, record, started)) is not None:
            return unanswered
        try:
            name = canonical_host(record.host)
        except HostError as e:
            return self._refuse(reply, record, f"invalid name: {e}", ReasonCode.INVALID_HOST, started)
        record.host = name
        profile = live.profile(sandbox)
        decision = await self._decide(live, sandbox, profile, name, record)
        if (denied := self._denied(reply, record, decision, started)) is not None:
            return denied
        flags = self._signals(record, sandbox.id, name, profile.dns)
        if flags and profile.dns.refuse:
            reason = "suspicious name: " + "; ".join(flags)
            return self._refuse(reply, record, reason, ReasonCode.SUSPICIOUS_NAME, started)
        if decision.report:
            record.hint = decision.hint
        if request.q.qtype not in ANSWERED_TYPES:
            reason = f"{record.method} is not answered with data"
            return self._allowed(reply, record, decision, reason, ReasonCode.TYPE_NOT_ANSWERED, started)
        return await self._answer(live, request, reply, record, profile, decision, started)

    def _unanswered(
        self, request: DNSRecord, reply: DNSRecord, record: AuditRecord, started: float
    ) -> DNSRecord | None:
        """The reply to a query no name makes answerable: while the audit log cannot be written, or of a shape or a
        class the gateway does not answer; None for the rest."""
        if (failure := self.settings.audit_failure()) is not None:
            reply.header.rcode = RCODE.SERVFAIL
            reason = f"audit log unavailable ({failure}): no query is answered until it can be written"
            return self._finish(reply, record, "error", reason, ReasonCode.AUDIT_UNAVAILABLE, started)
        if request.header.opcode != 0 or len(request.questions) != 1:
            reply.header.rcode = RCODE.NOTIMP if request.header.opcode != 0 else RCODE.FORMERR
            reason, code = "only standard queries with one question", ReasonCode.UNSUPPORTED_QUERY
            return self._finish(reply, record, "deny", reason, code, started)
        if request.q.qclass != CLASS.IN:
            reason = f"class {CLASS.get(request.q.qclass)} is not answered (only IN)"
            return self._refuse(reply, record, reason, ReasonCode.UNSUPPORTED_CLASS, started)
        return None

    async def _decide(
        self, live: Snapshot, sandbox: Sandbox, profile: Profile, name: str, record: AuditRecord
    ) -> Decision:
        """The profile's decision on the name, or a person's when the profile denies it and approvals are on."""
        decision = decide_name(profile, name)
        if not decision.allow and self.approvals is not None:
            decision = await self.approvals.decide(
                live, sandbox, name, None, decision, "dns", record.client, self.settings.approval_hold
            )
        record.decided_by(decision.rule)
        if decision.code is ReasonCode.APPROVED:
            record.extra["approved"] = decision.reason  # the answer's line says `allowed`, and by whom
        return decision

    def _denied(self, reply: DNSRecord, record: AuditRecord, decision: Decision, started: float) -> DNSRecord | None:
        """The reply to a name the decision does not allow (an approval still pending, a single label, a denial);
        None when it allows the name."""
        if decision.code is ReasonCode.APPROVAL_PENDING:
            reply.header.rcode, record.hint = RCODE.SERVFAIL, decision.hint
            return self._finish(reply, record, "error", decision.reason, decision.code, started)
        if decision.code is ReasonCode.SINGLE_LABEL:  # no such name for the sandbox: a resolver stops at once
            reply.header.rcode = RCODE.NXDOMAIN
            return self._finish(reply, record, "deny", decision.reason, decision.code, started)
        if not decision.allow:
            record.hint = decision.hint
            return self._refuse(reply, record, decision.reason, decision.code, started)
        return None

    async def _answer(
        self,
        live: Snapshot,
        request: DNSRecord,
        reply: DNSRecord,
        record: AuditRecord,
        profile: Profile,
        decision: Decision,
        started: float,
    ) -> DNSRecord:
        name = record.host
        try:
            answer = self.resolver.cached(name, request.q.qtype)
            if answer is None:
                answer = await self._ask_upstream(record.sandbox, name, request.q.qtype)
        except Overloaded:
            reply.header.rcode = RCODE.SERVFAIL
            limit = self.settings.max_inflight_per_sandbox
            reason = f"not asked upstream: {limit} queries of this sandbox are already waiting on upstream"
            return self._finish(reply, record, "error", reason, ReasonCode.INFLIGHT_LIMIT, started)
        except NameNotFound:
            reply.header.rcode = RCODE.NXDOMAIN
            reason = "name does not exist upstream"
            return self._allowed(reply, record, decision, reason, ReasonCode.NAME_NOT_FOUND, started)
        except (ResolveError, TimeoutError) as e:
            reply.header.rcode = RCODE.SERVFAIL
            reason = f"upstream failed: {e or 'timeout'}"
            return self._finish(reply, record, "error", reason, ReasonCode.RESOLVE_FAILED, started)
        record.extra["upstream_ms"] = round(answer.upstream_ms, 1)
        record.extra["ttl"] = answer.ttl
        record.resolved = [str(a) for a in answer.addresses]
        if answer.cnames:
            record.extra["cnames"] = list(answer.cnames)
            denied = decide_alias(profile, answer.cnames, None)
            if denied is not None:
                record.decided_by(denied.rule)
                reply.header.rcode = RCODE.REFUSED
                return self._finish(reply, record, "deny", denied.reason, denied.code, started)
        vetted = vet(profile, answer.addresses, None, live.own.among(answer.addresses))
        if answer.addresses and not vetted.allowed:
            reply.header.rcode = RCODE.NXDOMAIN
            return self._finish(reply, record, "deny", vetted.reason, vetted.code, started)
        self.answered.record(record.sandbox, name, vetted.allowed, answer.ttl, time.monotonic())
        for address in vetted.allowed:
            rdata = A(str(address)) if address.version == 4 else AAAA(str(address))
            reply.add_answer(RR(request.q.qname, request.q.qtype, rdata=rdata, ttl=answer.ttl))
        reason = "answered" if not vetted.rejected else vetted.reason
        return self._allowed(reply, record, decision, reason, ReasonCode.ALLOWED, started)

    async def _ask_upstream(self, sandbox: str, name: str, qtype: int) -> Answer:
        """The shared resolver's answer, holding one of the sandbox's in-flight places while it waits."""
        with self.admission.upstream(sandbox):
            return await asyncio.wait_for(self.resolver.query(name, qtype), self.settings.answer_timeout)

    def _signals(self, record: AuditRecord, sandbox: str, name: str, limits: DnsLimits) -> list[str]:
        base = registrable_domain(name)
        labels = name[: -len(base)].rstrip(".").split(".") if name != base else []
        longest = max(labels, key=len, default="")
        entropy = label_entropy(longest)
        new_subdomains = self._subdomains.observe(sandbox, base, name, time.monotonic())
        flags = limits.flags(len(longest), entropy, new_subdomains)
        record.extra.update(
            base=base, longest_label=len(longest), entropy=round(entropy, 2), subdomains_per_min=new_subdomains
        )
        if flags:
            record.extra["suspicious"] = flags
        return flags

    def _allowed(
        self, reply: DNSRecord, record: AuditRecord, decision: Decision, reason: str, code: ReasonCode, started: float
    ) -> DNSRecord:
        """Finish an answered query: `allow` with what happened, or in report mode `report` with the denial it
        would have been (code and reason) and what happened instead."""
        if decision.report:
            return self._finish(
                reply, record, "report", f"{decision.reason} (report mode: {reason})", decision.code, started
            )
        return self._finish(reply, record, "allow", reason, code, started)

    def _refuse(
        self, reply: DNSRecord, record: AuditRecord, reason: str, code: ReasonCode, started: float
    ) -> DNSRecord:
        reply.header.rcode = RCODE.REFUSED
        return self._finish(reply, record, "deny", reason, code, started)

    def _finish(
        self, reply: DNSRecord, record: AuditRecord, decision: Verdict, reason: str, code: ReasonCode, started: float
    ) -> DNSRecord:
        record.decision, record.reason, record.code = decision, reason, code
        record.resolved = record.resolved or []
        record.extra["answers"] = [str(rr.rdata) for rr in reply.rr]
        record.extra["rcode"] = RCODE.get(reply.header.rcode)
        record.duration_ms = round((time.monotonic() - started) * 1000, 1)
        self.stats[f"rcode_{RCODE.get(reply.header.rcode)}"] += 1
        self.emit(record)
        return reply
