"""The gateway's one resolver: asks the configured upstream servers, caches, and never guesses.

The proxy resolves names here (mitmproxy itself does no DNS), and the sandbox-facing DNS server will answer
from the same cache, so a rebinding name cannot show the two of them different addresses. Every failure is an
exception: the caller denies, it never falls back to another resolver.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import secrets
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from dnslib import CLASS, OPCODE, QTYPE, RCODE, RR, DNSRecord

from airlock.policy import IPAddress

from .servers import Server

MAX_CNAME_HOPS = 8


class ResolveError(Exception):
    """The name could not be resolved; the message says why, for the audit log."""


class NameNotFound(ResolveError):
    pass


class ResolverUnavailable(ResolveError):
    pass


class MalformedReply(ValueError):
    """Bytes from an upstream server that are no reply to our question: unparsable, or answering something else."""


@dataclass(frozen=True, slots=True)
class Answer:
    addresses: tuple[IPAddress, ...]
    ttl: int
    cnames: tuple[str, ...] = ()  # the chain followed from the query name, in order
    upstream_ms: float = 0.0  # time spent asking upstream; 0 when served from cache


@dataclass
class ResolverConfig:
    servers: list[Server]
    timeout: float = 2.0
    attempts: int = 2
    min_ttl: int = 5
    max_ttl: int = 3600
    # NXDOMAIN and NODATA: as long as the zone's SOA says (RFC 2308), within min_ttl..max_negative_ttl; min_ttl
    # without a SOA. Failures (SERVFAIL, REFUSED, timeouts, ...): failure_ttl. Either way an upstream that cannot
    # answer a name is asked about it once per that time, not once per request.
    max_negative_ttl: int = 60
    failure_ttl: float = 3.0
    cache_size: int = 10_000
    negative_cache_size: int = 10_000  # apart: a flood of names that do not exist evicts no real answer


@dataclass(slots=True)
class _Entry:
    expires: float
    answer: Answer | ResolveError  # an answer (maybe without addresses: NODATA), or the error to raise again


class Resolver:
    def __init__(self, config: ResolverConfig, timed: Callable[[str, float], None] | None = None) -> None:
        if not config.servers:
            raise ValueError("no upstream DNS server configured")
        self.config = config
        self._cache: dict[tuple[str, int], _Entry] = {}  # answers with addresses
        self._negative: dict[tuple[str, int], _Entry] = {}  # NXDOMAIN, NODATA and failures
        self._inflight: dict[tuple[str, int], asyncio.Future[Answer]] = {}
        self.stats: Counter[str] = Counter()  # malformed_replies, mismatched_replies
        self.timed = timed  # told each upstream resolution: result, seconds

    async def resolve(self, name: str) -> Answer:
        """All A and AAAA addresses of a canonical name (CNAMEs followed)."""
        results = [self._cached_result(name, QTYPE.A), self._cached_result(name, QTYPE.AAAA)]
        if results[0] is None and results[1] is None:
            results = list(await asyncio.gather(self._result(name, QTYPE.A), self._result(name, QTYPE.AAAA)))
        else:  # one family cached (both: the common case, answered without a task)
            for i, qtype in enumerate((QTYPE.A, QTYPE.AAAA)):
                if results[i] is None:
                    results[i] = await self._result(name, qtype)
        answers = [r for r in results if isinstance(r, Answer)]
        if not answers:
            first = results[0]
            raise first if isinstance(first, BaseException) else ResolveError("no answer")
        addresses = tuple(a for answer in answers for a in answer.addresses)
        if not addresses:
            unavailable = [r for r in results if isinstance(r, ResolverUnavailable)]
            raise unavailable[0] if unavailable else NameNotFound(f"{name} has no A/AAAA records")
        # Both chains: a caller refusing chains through denied names must see the AAAA lookup's as well.
        cnames = tuple(dict.fromkeys(name for answer in answers for name in answer.cnames))
        return Answer(addresses, min(a.ttl for a in answers), cnames, sum(a.upstream_ms for a in answers))

    async def _result(self, name: str, qtype: int) -> Answer | ResolveError:
        try:
            return await self.query(name, qtype)
        except ResolveError as e:
            return e

    def _cached_result(self, name: str, qtype: int) -> Answer | ResolveError | None:
        try:
            return self.cached(name, qtype)
        except ResolveError as e:
            return e

    def cached(self, name: str, qtype: int) -> Answer | None:
        """The cached answer, or None when upstream must be asked. A remembered negative answer or failure is
        raised again: NameNotFound (NXDOMAIN), ResolverUnavailable (the upstream failed a moment ago)."""
        key = (name, qtype)
        entry = self._cache.get(key) or self._negative.get(key)
        if entry is None:
            return None
        now = time.monotonic()
        if entry.expires <= now:
            (self._cache if key in self._cache else self._negative).pop(key, None)
            return None
        if isinstance(entry.answer, ResolveError):
            raise type(entry.answer)(*entry.answer.args)
        remaining = math.ceil(entry.expires - now)  # what is left, as a downstream cache must be told
        return Answer(entry.answer.addresses, remaining, entry.answer.cnames)

    async def query(self, name: str, qtype: int) -> Answer:
        """One cached question; concurrent identical questions share one upstream exchange."""
        answer = self.cached(name, qtype)
        if answer is not None:
            return answer
        key = (name, qtype)
        if key in self._inflight:
            return await asyncio.shield(self._inflight[key])
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            answer = await self._timed_resolution(name, qtype)
        except ResolveError as e:
            if not isinstance(e, NameNotFound):  # NXDOMAIN was stored with its own TTL
                self._store(key, e, self.config.failure_ttl)
            future.set_exception(e)
            raise
        except BaseException as e:
            # The caller was cancelled (e.g. its own timeout) or hit a bug: callers sharing this exchange must
            # still get an answer, never wait forever on a future nobody completes.
            future.set_exception(ResolverUnavailable(f"lookup of {name} abandoned ({type(e).__name__})"))
            raise
        else:
            future.set_result(answer)
            return answer
        finally:
            del self._inflight[key]
            if future.done() and not future.cancelled():
                future.exception()  # mark retrieved: a lone caller must not leave a warning behind

    async def _timed_resolution(self, name: str, qtype: int) -> Answer:
        """`_resolve_uncached`, its result (ok, nxdomain, error) and duration told to `timed`."""
        started, result = time.perf_counter(), "error"
        try:
            answer = await self._resolve_uncached(name, qtype)
            result = "ok"
            return answer
        except NameNotFound:
            result = "nxdomain"
            raise
        finally:
            if self.timed is not None:
                self.timed(result, time.perf_counter() - started)

    async def _resolve_uncached(self, name: str, qtype: int) -> Answer:
        started = time.perf_counter()
        cnames: list[str] = []
        target = name
        ttl = self.config.max_ttl
        for _ in range(MAX_CNAME_HOPS):
            reply = await self._exchange(target, qtype)
            if reply.header.rcode == RCODE.NXDOMAIN:
                error = NameNotFound(f"{name} does not exist")
                self._store((name, qtype), error, max(self.config.min_ttl, min(ttl, self._negative_ttl(reply))))
                raise error
            if reply.header.rcode != RCODE.NOERROR:
                raise ResolverUnavailable(f"upstream answered {RCODE.get(reply.header.rcode)} for {name}")
            addresses, chain, answer_ttl = _follow(reply, target, qtype)
            cnames += chain
            # NODATA (no such record, no alias): kept as long as the zone's SOA says
            ttl = min(ttl, answer_ttl if addresses or chain else self._negative_ttl(reply))
            if addresses or not chain:
                break
            target = chain[-1]  # the chain left the answer: ask for its end
        else:
            raise ResolverUnavailable(f"CNAME chain of {name} is longer than {MAX_CNAME_HOPS}")
        ttl = max(self.config.min_ttl, min(ttl, self.config.max_ttl))
        upstream_ms = (time.perf_counter() - started) * 1000
        answer = Answer(tuple(addresses), ttl, tuple(cnames), upstream_ms)
        self._store((name, qtype), answer, ttl)
        return answer

    def _negative_ttl(self, reply: DNSRecord) -> int:
        """How long a negative reply may be kept (RFC 2308 §5: the SOA record's TTL and its MINIMUM field,
        whichever is less), clamped to min_ttl..max_negative_ttl; min_ttl when the reply carries no SOA."""
        soa = next((rr for rr in reply.auth if rr.rtype == QTYPE.SOA), None)
        if soa is None:
            return self.config.min_ttl
        ttl: int = min(soa.ttl, soa.rdata.times[-1])
        return max(self.config.min_ttl, min(ttl, self.config.max_negative_ttl))

    def _store(self, key: tuple[str, int], answer: Answer | ResolveError, ttl: float) -> None:
        if ttl <= 0:
            return
        positive = isinstance(answer, Answer) and bool(answer.addresses)
        table, size = (
            (self._cache, self.config.cache_size) if positive else (self._negative, self.config.negative_cache_size)
        )
        (self._negative if positive else self._cache).pop(key, None)
        table.pop(key, None)  # re-inserted last: the oldest entry is evicted first
        if len(table) >= size:
            table.pop(next(iter(table)))
        table[key] = _Entry(time.monotonic() + ttl, answer)

    async def _exchange(self, name: str, qtype: int) -> DNSRecord:
        question = DNSRecord.question(name, QTYPE.get(qtype))
        question.header.id = secrets.randbits(16)  # unpredictable: an off-path spoofer has to guess it
        question.header.rd = 1
        problems: list[str] = []
        for _ in range(self.config.attempts):
            for server in self.config.servers:
                try:
                    reply = await asyncio.wait_for(_udp_exchange(question, server, self.stats), self.config.timeout)
                    if reply.header.tc:
                        reply = await asyncio.wait_for(_tcp_exchange(question, server, self.stats), self.config.timeout)
                    return reply
                except (TimeoutError, OSError, MalformedReply) as e:
                    problems.append(f"{server[0]}:{server[1]}: {type(e).__name__} {e}".strip())
        raise ResolverUnavailable(f"no upstream DNS answer for {name} ({'; '.join(problems[-2:])})")


def _follow(reply: DNSRecord, name: str, qtype: int) -> tuple[list[IPAddress], list[str], int]:
    """Addresses of `name` in the reply, following CNAMEs inside it; never trusts records for other names."""
    owner = name
    chain: list[str] = []
    ttl = 1 << 31
    by_owner: dict[str, list[RR]] = {}
    for rr in reply.rr:
        if rr.rclass == CLASS.IN:
            by_owner.setdefault(str(rr.rname).rstrip(".").lower(), []).append(rr)
    for _ in range(MAX_CNAME_HOPS + 1):
        records = by_owner.get(owner, [])
        addresses = [ipaddress.ip_address(str(rr.rdata)) for rr in records if rr.rtype == qtype]
        if addresses:
            ttl = min([ttl] + [rr.ttl for rr in records if rr.rtype == qtype])
            return addresses, chain, ttl
        cname = next((rr for rr in records if rr.rtype == QTYPE.CNAME), None)
        if cname is None:
            break
        ttl = min(ttl, cname.ttl)
        owner = str(cname.rdata).rstrip(".").lower()
        chain.append(owner)
    return [], chain, (ttl if chain else 0)


def _parse_reply(data: bytes, question: DNSRecord, stats: Counter[str]) -> DNSRecord:
    """The reply to `question` in `data`; MalformedReply (and counted) for anything else."""
    try:
        reply = DNSRecord.parse(data)
    except Exception as e:
        # Hostile bytes make dnslib raise more than DNSError: a long chain of compression pointers, RecursionError.
        stats["malformed_replies"] += 1
        raise MalformedReply(f"unparsable reply ({type(e).__name__})") from None
    if not _answers(reply, question):
        stats["mismatched_replies"] += 1
        raise MalformedReply("reply does not match the question")
    return reply


def _answers(reply: DNSRecord, question: DNSRecord) -> bool:
    """A response (QR set, opcode QUERY) with our ID and exactly our question: name (in any letter case), type
    and class (IN: the only class we ask)."""
    header = reply.header
    return bool(
        header.id == question.header.id
        and header.qr == 1
        and header.opcode == OPCODE.QUERY
        and reply.questions == question.questions
    )


async def _udp_exchange(question: DNSRecord, server: Server, stats: Counter[str]) -> DNSRecord:
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, server)  # connected UDP: the kernel drops datagrams from anyone else
        await loop.sock_sendall(sock, question.pack())
        while True:
            data = await loop.sock_recv(sock, 65535)
            with contextlib.suppress(MalformedReply):  # spoofed or broken: the real reply may still come
                return _parse_reply(data, question, stats)


async def _tcp_exchange(question: DNSRecord, server: Server, stats: Counter[str]) -> DNSRecord:
    reader, writer = await asyncio.open_connection(*server)
    try:
        packet = question.pack()
        writer.write(struct.pack("!H", len(packet)) + packet)
        await writer.drain()
        (length,) = struct.unpack("!H", await reader.readexactly(2))
        return _parse_reply(await reader.readexactly(length), question, stats)
    except asyncio.IncompleteReadError as e:
        raise OSError("TCP DNS reply cut short") from e
    finally:
        writer.close()
