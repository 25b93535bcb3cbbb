"""The sandbox's only resolver: answers allowlisted names with vetted addresses, and nothing else.

`PolicyResolver.resolve(request, handler)` is the one entry point, in the shape of dnslib's `BaseResolver`; it is
a coroutine because it asks the gateway's shared `Resolver` (one cache, one upstream configuration, so the proxy
and the sandbox see the same addresses). The transports are asyncio endpoints rather than dnslib's threaded
`DNSServer`: the whole gateway is one asyncio loop, and a thread per packet plus a cross-thread hop into that loop
would cost more than the resolver itself.

Choices (README "DNS"): unlisted names get REFUSED, without any upstream query (an honest "not for you": NXDOMAIN
would claim the name does not exist and be cached as such); only A and AAAA are answered with data, other types of
an allowed name get an empty answer; CNAME chains are flattened to the final, vetted addresses (the sandbox never
sees intermediate names), and refused when a deny rule closes a name on the chain; an answer whose every address
was filtered becomes NXDOMAIN.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import struct
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dnslib import AAAA, CLASS, QTYPE, RCODE, RR, A, DNSRecord

from airlock.audit import AuditRecord, AuditThrottle, RepeatedDecisions
from airlock.policy import (
    HostError,
    LivePolicy,
    Policy,
    ReasonCode,
    Sandbox,
    Snapshot,
    canonical_host,
    decide_alias,
    decide_name,
    registrable_domain,
    vet,
)

from .memory import ReplyMemory
from .upstream import Answer, NameNotFound, ResolveError, Resolver

log = logging.getLogger("airlock.dns")

MAX_QUERY_BYTES = 1232  # a query is small; anything larger is not a query we want (EDNS's safe size)
ANSWERED_TYPES = {QTYPE.A, QTYPE.AAAA}
STRANGER = "query from an address that belongs to no sandbox"


@dataclass
class DnsSettings:
    rate_per_second: float = 100.0  # per sandbox; bursts of twice that are absorbed
    answer_timeout: float = 4.0  # the whole upstream exchange; then SERVFAIL
    max_tcp_per_sandbox: int = 16  # open TCP connections; more are closed at once (no exhausting the gateway)
    max_inflight_per_sandbox: int = 32  # queries waiting on upstream at once; more get SERVFAIL, nothing is asked
    tcp_timeout: float = 10.0  # to receive each TCP query, and to hand over each reply
    # Why the audit log cannot be written, or None: while it cannot, every query is SERVFAIL (fail closed).
    audit_failure: Callable[[], str | None] = field(default=lambda: None)


class _Overloaded(Exception):
    """The sandbox already has max_inflight_per_sandbox queries waiting on upstream."""


class _TokenBucket:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = float(burst), time.monotonic()

    def take(self, now: float) -> bool:
        if now != self.stamp:  # the UDP server reads the clock once per batch of datagrams
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


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


@dataclass
class Handler:
    """Who asked: the client address and the transport (dnslib passes its request handler here)."""

    client: str
    protocol: str  # "udp" | "tcp"


class PolicyResolver:
    def __init__(
        self,
        live: LivePolicy,
        resolver: Resolver,
        emit: Callable[[AuditRecord | RepeatedDecisions], None],
        settings: DnsSettings,
    ) -> None:
        self.live = live
        self.resolver = resolver
        self.emit = emit
        self.settings = settings
        self.stats: Counter[str] = Counter()
        self._buckets: dict[str, _TokenBucket] = {}
        self._inflight: Counter[str] = Counter()  # per sandbox id: queries waiting on upstream
        self._subdomains = SubdomainRate()
        self.memory = ReplyMemory()
        self.strangers = AuditThrottle(emit)

    def admit(self, client: str, now: float | None = None) -> Sandbox | bool | None:
        """The asking sandbox; None for an address of no sandbox, whose query is still answered (REFUSED) and
        audited; False to drop the query unanswered: over its sandbox's rate, or one more from addresses of no
        sandbox beyond their few audit lines per interval (counted into one summary line instead)."""
        sandbox = self.live.current.registry.identify(client)
        now = time.monotonic() if now is None else now
        if sandbox is None:
            if self.strangers.admit("dns", "-", STRANGER, ReasonCode.UNKNOWN_SANDBOX, client, now):
                return None
            self.stats["dropped_unknown_source"] += 1
            return False
        bucket = self._buckets.get(sandbox.id)
        if bucket is None:
            rate = self.settings.rate_per_second
            bucket = self._buckets[sandbox.id] = _TokenBucket(rate, max(1, int(rate * 2)))
        if not bucket.take(now):
            self.stats["rate_limited"] += 1
            return False
        return sandbox

    async def resolve(self, request: DNSRecord, handler: Handler) -> DNSRecord | None:
        """The reply to send, or None to stay silent (rate limit exceeded: no amplification, no answer)."""
        sandbox = self.admit(handler.client)
        if sandbox is False:
            return None
        reply, _, _ = await self.decide(request, sandbox or None, handler.client)
        return reply

    async def decide(
        self, request: DNSRecord, sandbox: Sandbox | None, client: str
    ) -> tuple[DNSRecord, AuditRecord, Policy]:
        """The full judgement of one admitted query, under one snapshot of the live policy: the reply, the audit
        record it was logged with, and the policy it was decided under. A failure anywhere is SERVFAIL, audited as
        an error: every query leaves its audit line."""
        live = self.live.current
        started = time.monotonic()
        reply = request.reply()
        reply.header.ra = 1
        qtype = QTYPE.get(request.q.qtype, str(request.q.qtype))
        sandbox_id, name = sandbox.id if sandbox else "-", str(request.q.qname)
        record = AuditRecord("dns", sandbox_id, client, name, None, "deny", "", ReasonCode.INTERNAL_ERROR)  # set below
        record.method = qtype
        try:
            reply, record = await self._judge(live, request, reply, record, sandbox, started)
            return reply, record, live.policy
        except Exception as e:
            log.exception("DNS query failed: answering SERVFAIL")
            failed = request.reply()
            failed.header.ra, failed.header.rcode = 1, RCODE.SERVFAIL
            reason = f"internal error: {type(e).__name__}: {e}"
            return (*self._finish(failed, record, "error", reason, ReasonCode.INTERNAL_ERROR, started), live.policy)

    async def _judge(
        self,
        live: Snapshot,
        request: DNSRecord,
        reply: DNSRecord,
        record: AuditRecord,
        sandbox: Sandbox | None,
        started: float,
    ) -> tuple[DNSRecord, AuditRecord]:
        if sandbox is None:
            return self._refuse(reply, record, STRANGER, ReasonCode.UNKNOWN_SANDBOX, started)
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
        try:
            name = canonical_host(record.host)
        except HostError as e:
            return self._refuse(reply, record, f"invalid name: {e}", ReasonCode.INVALID_HOST, started)
        record.host = name
        profile = live.profile(sandbox)
        decision = decide_name(profile, name)
        if not decision.allow:
            record.rule = decision.rule.source if decision.rule else None
            return self._refuse(reply, record, decision.reason, decision.code, started)
        record.rule = decision.rule.source if decision.rule else None
        flags = self._signals(record, sandbox.id, name, profile.dns)
        if flags and profile.dns.refuse:
            reason = "suspicious name: " + "; ".join(flags)
            return self._refuse(reply, record, reason, ReasonCode.SUSPICIOUS_NAME, started)
        if request.q.qtype not in ANSWERED_TYPES:
            reason = f"{record.method} is not answered with data"
            return self._finish(reply, record, "allow", reason, ReasonCode.TYPE_NOT_ANSWERED, started)
        return await self._answer(live, request, reply, record, profile, name, started)

    async def _answer(self, live, request, reply, record, profile, name, started) -> tuple[DNSRecord, AuditRecord]:
        try:
            answer = self.resolver.cached(name, request.q.qtype)
            if answer is None:
                answer = await self._ask_upstream(record.sandbox, name, request.q.qtype)
        except _Overloaded:
            self.stats["over_inflight_limit"] += 1
            reply.header.rcode = RCODE.SERVFAIL
            limit = self.settings.max_inflight_per_sandbox
            reason = f"not asked upstream: {limit} queries of this sandbox are already waiting on upstream"
            return self._finish(reply, record, "error", reason, ReasonCode.INFLIGHT_LIMIT, started)
        except NameNotFound:
            reply.header.rcode = RCODE.NXDOMAIN
            reason = "name does not exist upstream"
            return self._finish(reply, record, "allow", reason, ReasonCode.NAME_NOT_FOUND, started)
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
                record.rule = denied.rule.source if denied.rule else None
                reply.header.rcode = RCODE.REFUSED
                return self._finish(reply, record, "deny", denied.reason, denied.code, started)
        vetted = vet(profile, answer.addresses, None, live.own.among(answer.addresses))
        if answer.addresses and not vetted.allowed:
            reply.header.rcode = RCODE.NXDOMAIN
            return self._finish(reply, record, "deny", vetted.reason, vetted.code, started)
        for address in vetted.allowed:
            rdata = A(str(address)) if address.version == 4 else AAAA(str(address))
            reply.add_answer(RR(request.q.qname, request.q.qtype, rdata=rdata, ttl=answer.ttl))
        reason = "answered" if not vetted.rejected else vetted.reason
        return self._finish(reply, record, "allow", reason, ReasonCode.ALLOWED, started)

    async def _ask_upstream(self, sandbox: str, name: str, qtype: int) -> Answer:
        """The shared resolver's answer, at most max_inflight_per_sandbox at once per sandbox: with a silent
        upstream, distinct names at the full query rate would otherwise hold hundreds of sockets."""
        if self._inflight[sandbox] >= self.settings.max_inflight_per_sandbox:
            raise _Overloaded
        self._inflight[sandbox] += 1
        try:
            return await asyncio.wait_for(self.resolver.query(name, qtype), self.settings.answer_timeout)
        finally:
            self._inflight[sandbox] -= 1

    def _signals(self, record: AuditRecord, sandbox: str, name: str, limits) -> list[str]:
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

    def _refuse(
        self, reply: DNSRecord, record: AuditRecord, reason: str, code: ReasonCode, started: float
    ) -> tuple[DNSRecord, AuditRecord]:
        reply.header.rcode = RCODE.REFUSED
        return self._finish(reply, record, "deny", reason, code, started)

    def _finish(
        self, reply: DNSRecord, record: AuditRecord, decision: str, reason: str, code: ReasonCode, started: float
    ) -> tuple[DNSRecord, AuditRecord]:
        record.decision, record.reason, record.code = decision, reason, code
        record.resolved = record.resolved or []
        record.extra["answers"] = [str(rr.rdata) for rr in reply.rr]
        record.extra["rcode"] = RCODE.get(reply.header.rcode)
        record.duration_ms = round((time.monotonic() - started) * 1000, 1)
        self.stats[f"rcode_{RCODE.get(reply.header.rcode)}"] += 1
        self.emit(record)
        return reply, record

    # --- replies remembered at the wire level (dns/memory.py) ---------------------------------------------------

    def remember(
        self, data: bytes, sandbox: Sandbox, packet: bytes, reply: DNSRecord, record: AuditRecord, policy: Policy
    ) -> None:
        if reply.header.rcode not in (RCODE.NOERROR, RCODE.NXDOMAIN, RCODE.REFUSED):
            return  # failures are asked again
        ttl = record.extra.get("ttl", self.memory.seconds)  # set when an upstream answer was used, even if filtered
        if not isinstance(ttl, int | float):
            return
        repeated = replace(record, duration_ms=0.0, reason=f"{record.reason} (remembered)")
        template = RepeatedDecisions.template(repeated)
        self.memory.remember(sandbox.id, data, packet, template, ttl, policy, time.monotonic())


class DnsServer:
    """UDP and TCP listeners on the gateway's sandbox-facing address; malformed input is dropped and counted."""

    def __init__(self, resolver: PolicyResolver, host: str, port: int = 53) -> None:
        self.resolver = resolver
        self.host, self.port = host, port
        self._udp: socket.socket | None = None
        self._tcp: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._tcp_open: Counter[str] = Counter()  # per sandbox id ("-": sources that are no sandbox)
        self._tcp_writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        udp = socket.socket(family, socket.SOCK_DGRAM)
        try:
            udp.setblocking(False)
            udp.bind((self.host, self.port))
        except OSError:
            udp.close()
            raise
        self._udp = udp
        # Drain many datagrams per wakeup and answer remembered questions inline: a task and a 256 KiB
        # receive buffer per packet (asyncio's datagram transport) cost more than answering.
        loop.add_reader(udp.fileno(), self._readable)
        self._tcp = await asyncio.start_server(self._tcp_client, self.host, self.port, reuse_address=True)

    async def stop(self) -> None:
        if self._udp is not None:
            asyncio.get_running_loop().remove_reader(self._udp.fileno())
            self._udp.close()
            self._udp = None
        if self._tcp is not None:
            self._tcp.close()
            for writer in list(self._tcp_writers):  # wait_closed() waits for every open connection
                writer.transport.abort()
            await self._tcp.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        self.resolver.strangers.flush()

    def spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _readable(self) -> None:
        udp, resolver, memory = self._udp, self.resolver, self.resolver.memory
        assert udp is not None
        now, wall = time.monotonic(), time.time()
        repeated: list[tuple[str, str]] = []  # (audit template, client) of the remembered replies sent
        recall = resolver.settings.audit_failure() is None  # else every query goes where it is refused
        policy = resolver.live.current.policy  # remembered replies are of the policy in force: a reload forgets them
        try:
            for _ in range(64):
                try:
                    data, address = udp.recvfrom(MAX_QUERY_BYTES + 1)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    return  # e.g. an ICMP error queued on the socket: nothing to answer
                if len(data) > MAX_QUERY_BYTES:
                    resolver.stats["dropped_oversize"] += 1
                    continue
                client = address[0]
                sandbox = resolver.admit(client, now)
                if sandbox is False:
                    continue
                remembered = memory.recall(sandbox.id, data, policy, now) if sandbox and recall else None
                if remembered is None:
                    self.spawn(self._udp_query(data, address, sandbox))
                    continue
                repeated.append((remembered[1], client))
                try:
                    udp.sendto(remembered[0], address)
                except OSError:  # the sandbox went away: nothing to tell it
                    continue
        finally:
            if repeated:
                resolver.emit(RepeatedDecisions(wall, repeated))

    async def _udp_query(self, data: bytes, address: tuple, sandbox: Sandbox | None) -> None:
        request = self._parse(data)
        if request is None:
            return
        reply, record, policy = await self.resolver.decide(request, sandbox, address[0])
        packet = reply.pack()
        if len(packet) > 512:
            # Classic UDP limit: send the header and question with TC set; the client retries over TCP.
            packet = reply.truncate().pack()
        elif sandbox is not None:
            self.resolver.remember(data, sandbox, packet, reply, record, policy)
        self._send(packet, address)

    def _send(self, packet: bytes, address: tuple) -> None:
        if self._udp is not None:
            with contextlib.suppress(OSError):
                self._udp.sendto(packet, address)

    def _parse(self, data: bytes) -> DNSRecord | None:
        stats = self.resolver.stats
        try:
            request = DNSRecord.parse(data)
        except Exception:  # hostile bytes can make dnslib raise anything (e.g. RecursionError on pointer chains)
            stats["dropped_malformed"] += 1
            return None
        if request.header.qr or not request.questions:
            stats["dropped_malformed"] += 1  # a response, or nothing asked: not for us to answer
            return None
        return request

    async def handle(self, data: bytes, handler: Handler) -> DNSRecord | None:
        """The reply to one query of at most MAX_QUERY_BYTES, or None to send nothing."""
        request = self._parse(data)
        return None if request is None else await self.resolver.resolve(request, handler)

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        sandbox = self.resolver.live.current.registry.identify(peer[0])
        owner = sandbox.id if sandbox is not None else "-"
        if self._tcp_open[owner] >= self.resolver.settings.max_tcp_per_sandbox:
            self.resolver.stats["tcp_over_limit"] += 1
            writer.close()
            return
        self._tcp_open[owner] += 1
        self._tcp_writers.add(writer)
        timeout = self.resolver.settings.tcp_timeout
        try:
            while True:
                (length,) = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), timeout))
                if length > MAX_QUERY_BYTES:
                    self.resolver.stats["dropped_oversize"] += 1
                    break  # no query is that long: not worth reading
                data = await asyncio.wait_for(reader.readexactly(length), timeout)
                reply = await self.handle(data, Handler(peer[0], "tcp"))
                if reply is None:
                    break
                packet = reply.pack()
                writer.write(struct.pack("!H", len(packet)) + packet)
                await asyncio.wait_for(writer.drain(), timeout)  # a client that never reads must not hold on
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            self._tcp_open[owner] -= 1
            self._tcp_writers.discard(writer)
            # Not close(): it keeps the socket until a client that never reads has taken the buffered replies.
            # What the kernel already holds is still delivered.
            writer.transport.abort()
