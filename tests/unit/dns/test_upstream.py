"""The upstream resolver against a real dnslib server (UDP and TCP) on 127.0.0.1 with a tiny test zone.

Only 127.0.0.1 is ever contacted: the zone's 192.0.2.x / 2001:db8:: answers are data, never dialled.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import ipaddress
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from dnslib import CLASS, QTYPE, RCODE, RR, SOA, DNSQuestion, DNSRecord
from dnslib.server import BaseResolver, DNSServer

from airlock.dns.servers import parse_server, system_servers
from airlock.dns.upstream import (
    MAX_CNAME_HOPS,
    NameNotFound,
    Resolver,
    ResolverConfig,
    ResolverUnavailable,
)

from tasks import counting_tasks

LOCALHOST = "127.0.0.1"

ZONE = """
a.test.          300   A      192.0.2.1
a.test.          300   A      192.0.2.2
a.test.          300   AAAA   2001:db8::1
v4only.test.     300   A      192.0.2.3
v6only.test.     300   AAAA   2001:db8::3
alias.test.      120   CNAME  a.test.
c1.test.         100   CNAME  c2.test.
c2.test.         50    CNAME  c3.test.
c3.test.         200   CNAME  a.test.
bare.test.       60    CNAME  v4only.test.
bare2.test.      60    CNAME  bare.test.
dangling.test.   60    CNAME  nx.test.
loop1.test.      60    CNAME  loop2.test.
loop2.test.      60    CNAME  loop1.test.
trunc.test.      300   A      192.0.2.11
trunc.test.      300   A      192.0.2.12
trunc.test.      300   A      192.0.2.13
ttl1.test.       1     A      192.0.2.21
ttl0.test.       0     A      192.0.2.22
ttlbig.test.     86400 A      192.0.2.23
slow.test.       300   A      192.0.2.31
slowfail.test.   300   A      192.0.2.32
servfail.test.   300   A      192.0.2.41
refused.test.    300   A      192.0.2.42
mixedcase.test.  300   A      192.0.2.51
v6refused.test.  300   A      192.0.2.61
nodata-soa.test. 300   A      192.0.2.62
"""


class Zone(BaseResolver):
    """A small authoritative-style resolver that counts every question it is asked, per protocol."""

    BARE = frozenset({"bare.test", "bare2.test", "dangling.test", "loop1.test", "loop2.test"})  # CNAME alone
    TRUNCATE = frozenset({"trunc.test"})  # over UDP: TC bit and only the first record
    SLOW: ClassVar[dict[str, float]] = {"slow.test": 0.3, "slowfail.test": 0.3}
    RCODES: ClassVar[dict[str, int]] = {
        "servfail.test": RCODE.SERVFAIL,
        "refused.test": RCODE.REFUSED,
        "slowfail.test": RCODE.SERVFAIL,
    }
    RCODES_AAAA: ClassVar[dict[str, int]] = {"v6refused.test": RCODE.REFUSED}  # A answered, AAAA refused
    # negative answers that carry the zone's SOA in the authority section: name → (SOA record TTL, MINIMUM)
    SOA: ClassVar[dict[str, tuple[int, int]]] = {
        "nx-soa.test": (600, 17),
        "nx-soa-ttl.test": (7, 40),
        "nx-soa-long.test": (86400, 86400),
        "nx-soa-short.test": (600, 1),
        "nodata-soa.test": (600, 20),
    }

    def __init__(self) -> None:
        self.records: dict[str, list[RR]] = collections.defaultdict(list)
        for rr in RR.fromZone(ZONE):
            self.records[str(rr.rname).rstrip(".").lower()].append(rr)
        self.lock = threading.Lock()
        self.asked: collections.Counter[tuple[str, str, str]] = collections.Counter()

    def count(self, name: str | None = None, qtype: str | None = None, protocol: str | None = None) -> int:
        with self.lock:
            return sum(
                n
                for (q_name, q_type, q_proto), n in self.asked.items()
                if name in (None, q_name) and qtype in (None, q_type) and protocol in (None, q_proto)
            )

    def resolve(self, request: DNSRecord, handler) -> DNSRecord:
        qname = str(request.q.qname).rstrip(".").lower()
        qtype = request.q.qtype
        with self.lock:
            self.asked[(qname, QTYPE[qtype], handler.protocol)] += 1
        time.sleep(self.SLOW.get(qname, 0))
        reply = request.reply()
        rcode = self.RCODES.get(qname) or (self.RCODES_AAAA.get(qname) if qtype == QTYPE.AAAA else None)
        if rcode is not None:
            reply.header.rcode = rcode
            return reply
        if qname in self.SOA:
            soa_ttl, minimum = self.SOA[qname]
            reply.add_auth(
                RR(
                    "test",
                    QTYPE.SOA,
                    rdata=SOA("ns.test", "hostmaster.test", (1, 3600, 600, 86400, minimum)),
                    ttl=soa_ttl,
                )
            )
        if qname not in self.records:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        answers = self._answers(qname, qtype)
        if qname in self.TRUNCATE and handler.protocol == "udp":
            reply.header.tc = 1
            answers = answers[:1]
        for rr in answers:
            reply.add_answer(rr)
        return reply

    def _answers(self, name: str, qtype: int) -> list[RR]:
        answers: list[RR] = []
        for _ in range(10):
            records = self.records.get(name, [])
            matching = [rr for rr in records if rr.rtype == qtype]
            if matching:
                return answers + matching
            cname = next((rr for rr in records if rr.rtype == QTYPE.CNAME), None)
            if cname is None:
                break
            answers.append(cname)
            if name in self.BARE:
                break  # leave the rest of the chain to a second question
            name = str(cname.rdata).rstrip(".").lower()
        return answers


class _Quiet:
    """dnslib's default logger prints every packet; the tests only need the counts."""

    def __getattr__(self, name: str):
        return lambda *args: None


def _start_servers(zone: BaseResolver) -> tuple[int, list[DNSServer]]:
    for _ in range(20):
        udp = DNSServer(zone, address=LOCALHOST, port=0, logger=_Quiet())
        port = udp.server.server_address[1]
        try:
            tcp = DNSServer(zone, address=LOCALHOST, port=port, tcp=True, logger=_Quiet())
        except OSError:
            udp.server.server_close()
            continue
        for server in (udp, tcp):
            # DNSServer.start_thread() but for the poll interval: stop() waits for it (0.5 s by default)
            server.thread = threading.Thread(target=server.server.serve_forever, args=(0.05,), daemon=True)
            server.thread.start()
        return port, [udp, tcp]
    raise RuntimeError("no free port for UDP and TCP together")


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Zone, int]]:
    zone = Zone()
    port, servers = _start_servers(zone)
    yield zone, port
    for s in servers:
        s.stop()
        s.server.server_close()


@pytest.fixture
def zone(server: tuple[Zone, int]) -> Zone:
    zone, _ = server
    with zone.lock:
        zone.asked.clear()
    return zone


def make_resolver(port: int, **options: float) -> Resolver:
    config = ResolverConfig(servers=[(LOCALHOST, port)], timeout=1.0, attempts=1)
    for key, value in options.items():
        setattr(config, key, value)
    return Resolver(config)


@pytest.fixture
def resolver(server: tuple[Zone, int], zone: Zone) -> Resolver:
    return make_resolver(server[1])


def ips(*texts: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]:
    return tuple(ipaddress.ip_address(t) for t in texts)


# --- answers ------------------------------------------------------------------------------------------------------

# (id, name, qtype, addresses, cname chain, TTL of the answer, upstream questions for this lookup)
QUERIES = [
    ("a", "a.test", QTYPE.A, ["192.0.2.1", "192.0.2.2"], [], 300, 1),
    ("aaaa", "a.test", QTYPE.AAAA, ["2001:db8::1"], [], 300, 1),
    ("no-data", "v4only.test", QTYPE.AAAA, [], [], 5, 1),
    ("cname-in-answer", "alias.test", QTYPE.A, ["192.0.2.1", "192.0.2.2"], ["a.test"], 120, 1),
    ("cname-in-answer-aaaa", "alias.test", QTYPE.AAAA, ["2001:db8::1"], ["a.test"], 120, 1),
    ("cname-chain-in-answer", "c1.test", QTYPE.A, ["192.0.2.1", "192.0.2.2"], ["c2.test", "c3.test", "a.test"], 50, 1),
    ("cname-second-query", "bare.test", QTYPE.A, ["192.0.2.3"], ["v4only.test"], 60, 2),
    ("cname-third-query", "bare2.test", QTYPE.A, ["192.0.2.3"], ["bare.test", "v4only.test"], 60, 3),
]


@pytest.mark.parametrize(
    ("name", "qtype", "addresses", "cnames", "ttl", "asked"), [q[1:] for q in QUERIES], ids=[q[0] for q in QUERIES]
)
async def test_query(
    resolver: Resolver,
    zone: Zone,
    name: str,
    qtype: int,
    addresses: list[str],
    cnames: list[str],
    ttl: int,
    asked: int,
) -> None:
    answer = await resolver.query(name, qtype)
    assert answer.addresses == ips(*addresses)
    assert list(answer.cnames) == cnames
    assert answer.ttl == ttl
    assert answer.upstream_ms > 0
    assert zone.count() == asked
    # Served from the cache the second time: the same answer, no new question.
    again = await resolver.query(name, qtype)
    assert (again.addresses, again.cnames, again.upstream_ms) == (answer.addresses, answer.cnames, 0.0)
    assert zone.count() == asked


@pytest.mark.parametrize(
    ("name", "addresses"),
    [
        ("a.test", ["192.0.2.1", "192.0.2.2", "2001:db8::1"]),
        ("v4only.test", ["192.0.2.3"]),
        ("v6only.test", ["2001:db8::3"]),
        ("alias.test", ["192.0.2.1", "192.0.2.2", "2001:db8::1"]),
    ],
    ids=["both", "v4-only", "v6-only", "via-cname"],
)
async def test_resolve_a_and_aaaa(resolver: Resolver, zone: Zone, name: str, addresses: list[str]) -> None:
    answer = await resolver.resolve(name)
    assert set(answer.addresses) == set(ips(*addresses))
    assert zone.count(name, "A") == 1
    assert zone.count(name, "AAAA") == 1


async def test_cname_loop_is_refused(resolver: Resolver, zone: Zone) -> None:
    with pytest.raises(ResolverUnavailable, match="CNAME chain"):
        await resolver.query("loop1.test", QTYPE.A)
    assert zone.count() == MAX_CNAME_HOPS


# --- failures -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["nx.test", "dangling.test"], ids=["nxdomain", "cname-to-nxdomain"])
async def test_nxdomain_and_negative_cache(resolver: Resolver, zone: Zone, name: str) -> None:
    with pytest.raises(NameNotFound):
        await resolver.query(name, QTYPE.A)
    asked = zone.count()
    assert asked >= 1
    with pytest.raises(NameNotFound):
        await resolver.query(name, QTYPE.A)
    assert zone.count() == asked  # the negative answer was cached


async def test_resolve_nxdomain(resolver: Resolver, zone: Zone) -> None:
    for _ in range(3):
        with pytest.raises(NameNotFound):
            await resolver.resolve("nothing.test")
    assert zone.count("nothing.test") == 2  # one A and one AAAA question, then the negative cache


async def test_negative_cache_expires(resolver: Resolver, zone: Zone) -> None:
    with pytest.raises(NameNotFound):
        await resolver.query("nx2.test", QTYPE.A)
    resolver._negative[("nx2.test", QTYPE.A)].expires = time.monotonic() - 1  # as if its TTL had passed
    with pytest.raises(NameNotFound):
        await resolver.query("nx2.test", QTYPE.A)
    assert zone.count() == 2


@pytest.mark.parametrize(("name", "rcode"), [("servfail.test", "SERVFAIL"), ("refused.test", "REFUSED")])
async def test_error_rcode_is_remembered_briefly(resolver: Resolver, zone: Zone, name: str, rcode: str) -> None:
    for _ in range(5):
        with pytest.raises(ResolverUnavailable, match=rcode):
            await resolver.query(name, QTYPE.A)
    assert zone.count() == 1  # one upstream question for five lookups
    entry = resolver._negative[(name, QTYPE.A)]
    assert 0 < entry.expires - time.monotonic() <= resolver.config.failure_ttl
    entry.expires = time.monotonic() - 0.001  # as if failure_ttl had passed: asked again
    with pytest.raises(ResolverUnavailable, match=rcode):
        await resolver.query(name, QTYPE.A)
    assert zone.count() == 2


async def test_a_refused_aaaa_costs_one_upstream_question_not_one_per_lookup(resolver: Resolver, zone: Zone) -> None:
    # An upstream that refuses AAAA (some do) must not be asked again on every connection to the name.
    for _ in range(50):
        answer = await resolver.resolve("v6refused.test")
        assert answer.addresses == ips("192.0.2.61")
    assert (zone.count("v6refused.test", "A"), zone.count("v6refused.test", "AAAA")) == (1, 1)


# (id, name, qtype, the time the negative answer is kept): RFC 2308 §5, min(SOA TTL, SOA MINIMUM), clamped to
# min_ttl (5) .. max_negative_ttl (60); without a SOA, min_ttl
NEGATIVE_TTLS = [
    ("nxdomain-soa-minimum", "nx-soa.test", QTYPE.A, 17),
    ("nxdomain-soa-ttl-lower", "nx-soa-ttl.test", QTYPE.A, 7),
    ("nxdomain-soa-clamped-down", "nx-soa-long.test", QTYPE.A, 60),
    ("nxdomain-soa-clamped-up", "nx-soa-short.test", QTYPE.A, 5),
    ("nxdomain-no-soa", "nx3.test", QTYPE.A, 5),
    ("nodata-soa-minimum", "nodata-soa.test", QTYPE.AAAA, 20),
    ("nodata-no-soa", "v4only.test", QTYPE.AAAA, 5),
]


@pytest.mark.parametrize(("name", "qtype", "ttl"), [t[1:] for t in NEGATIVE_TTLS], ids=[t[0] for t in NEGATIVE_TTLS])
async def test_negative_answers_are_kept_as_long_as_the_soa_says(
    resolver: Resolver, zone: Zone, name: str, qtype: int, ttl: int
) -> None:
    for _ in range(3):
        with contextlib.suppress(NameNotFound):
            answer = await resolver.query(name, qtype)
            assert answer.addresses == ()
    assert zone.count() == 1
    left = resolver._negative[(name, qtype)].expires - time.monotonic()
    assert ttl - 2 < left <= ttl


async def test_a_silent_upstream_is_not_asked_again_at_once() -> None:
    asked: list[DNSRecord] = []
    with udp_responder(lambda q: asked.append(q) or []) as port:
        resolver = make_resolver(port, timeout=0.2, attempts=1)
        for _ in range(3):
            with pytest.raises(ResolverUnavailable, match="TimeoutError"):
                await resolver.query("a.test", QTYPE.A)
    assert len(asked) == 1


async def test_names_that_do_not_exist_evict_no_answer(server: tuple[Zone, int], zone: Zone) -> None:
    resolver = make_resolver(server[1], cache_size=2, negative_cache_size=3)
    await resolver.query("a.test", QTYPE.A)
    for i in range(20):
        with pytest.raises(NameNotFound):
            await resolver.query(f"nx-flood-{i}.test", QTYPE.A)
    assert len(resolver._negative) == 3
    await resolver.query("a.test", QTYPE.A)
    assert zone.count("a.test") == 1  # still cached


async def test_resolving_a_cached_name_spawns_no_task(resolver: Resolver, zone: Zone) -> None:
    await resolver.resolve("a.test")
    with contextlib.suppress(NameNotFound):
        await resolver.resolve("nothing-cached.test")
    with counting_tasks() as spawned:
        for _ in range(10):
            assert (await resolver.resolve("a.test")).addresses
            with pytest.raises(NameNotFound):
                await resolver.resolve("nothing-cached.test")
    assert spawned == []


async def test_resolve_servfail(resolver: Resolver) -> None:
    with pytest.raises(ResolverUnavailable):
        await resolver.resolve("servfail.test")


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((LOCALHOST, 0))
        return sock.getsockname()[1]


async def test_nobody_listening() -> None:
    resolver = make_resolver(_free_udp_port(), timeout=0.3, attempts=2)
    started = time.monotonic()
    with pytest.raises(ResolverUnavailable, match="no upstream DNS answer"):
        await resolver.query("a.test", QTYPE.A)
    assert time.monotonic() - started < 2 * 0.3 + 1


@contextlib.contextmanager
def udp_responder(respond) -> Iterator[int]:
    """A raw UDP server on 127.0.0.1: `respond(question) -> list of reply bytes` for every datagram."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((LOCALHOST, 0))
    sock.settimeout(0.05)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, peer = sock.recvfrom(65535)
            except TimeoutError:
                continue
            for packet in respond(DNSRecord.parse(data)):
                sock.sendto(packet, peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        sock.close()


async def test_silent_server_times_out() -> None:
    asked: list[DNSRecord] = []
    with udp_responder(lambda q: asked.append(q) or []) as port:
        resolver = make_resolver(port, timeout=0.2, attempts=2)
        started = time.monotonic()
        with pytest.raises(ResolverUnavailable, match="TimeoutError"):
            await resolver.query("a.test", QTYPE.A)
        elapsed = time.monotonic() - started
    assert 0.35 < elapsed < 2
    assert len(asked) == 2  # one question per attempt
    assert len({q.header.id for q in asked}) >= 1


def _reply(
    question: DNSRecord,
    address: str,
    *,
    id_delta: int = 0,
    qr: int = 1,
    opcode: int = 0,
    questions: list[DNSQuestion] | None = None,
) -> bytes:
    reply = question.reply()
    reply.header.id = (question.header.id + id_delta) % 65536
    reply.header.qr, reply.header.opcode = qr, opcode
    if questions is not None:  # fresh questions: reply() shares the DNSQuestion object with the request
        reply.questions = questions
    reply.add_answer(*RR.fromZone(f"{question.q.qname} 300 A {address}"))
    return reply.pack()


def pointer_chain_reply(question: DNSRecord, pointers: int = 8000) -> bytes:
    """A reply whose second answer's name ends a chain of compression pointers, each pointing at the one before
    (a first record's data holds them): dnslib follows them recursively, past Python's recursion limit."""
    head = bytearray(question.reply().pack())  # header and question
    head[6:8] = struct.pack("!H", 2)  # two answers
    chain_start = len(head) + 12  # after the first record's name pointer, type, class, TTL and length
    chain = struct.pack("!H", 0xC000 | 12)  # the first one points at the question's name
    chain += b"".join(struct.pack("!H", 0xC000 | (chain_start + 2 * i)) for i in range(pointers - 1))
    last = chain_start + 2 * (pointers - 1)
    assert last < 0x4000, "a pointer has 14 bits"
    null = b"\xc0\x0c" + struct.pack("!HHIH", QTYPE.NULL, CLASS.IN, 60, len(chain)) + chain
    a = struct.pack("!HHHIH", 0xC000 | last, QTYPE.A, CLASS.IN, 60, 4) + bytes([192, 0, 2, 66])
    return bytes(head) + null + a


def _wrong_then_right(**wrong):
    """A reply to `a.test` that is wrong in one way (192.0.2.66), then the right one (192.0.2.1)."""
    return lambda q: [_reply(q, "192.0.2.66", **wrong), _reply(q, "192.0.2.1")]


# (id, replies sent for each question, expected address or None when every reply must be ignored)
SPOOFS = [
    ("wrong-id-then-right", _wrong_then_right(id_delta=1), "192.0.2.1"),
    ("wrong-name-then-right", _wrong_then_right(questions=[DNSQuestion("evil.test")]), "192.0.2.1"),
    ("other-type-then-right", _wrong_then_right(questions=[DNSQuestion("a.test", QTYPE.AAAA)]), "192.0.2.1"),
    ("class-chaos-then-right", _wrong_then_right(questions=[DNSQuestion("a.test", QTYPE.A, CLASS.CH)]), "192.0.2.1"),
    (
        "extra-question-then-right",
        _wrong_then_right(questions=[DNSQuestion("a.test"), DNSQuestion("b.test")]),
        "192.0.2.1",
    ),
    ("no-question-then-right", _wrong_then_right(questions=[]), "192.0.2.1"),
    ("query-then-right", _wrong_then_right(qr=0), "192.0.2.1"),
    ("opcode-notify-then-right", _wrong_then_right(opcode=4), "192.0.2.1"),
    ("garbage-then-right", lambda q: [b"\x00\x01garbage", _reply(q, "192.0.2.1")], "192.0.2.1"),
    ("pointer-chain-then-right", lambda q: [pointer_chain_reply(q), _reply(q, "192.0.2.1")], "192.0.2.1"),
    ("only-wrong-id", lambda q: [_reply(q, "192.0.2.66", id_delta=1)], None),
    ("only-pointer-chain", lambda q: [pointer_chain_reply(q)], None),
]


@pytest.mark.parametrize(("respond", "expected"), [s[1:] for s in SPOOFS], ids=[s[0] for s in SPOOFS])
async def test_mismatched_replies_ignored(respond, expected: str | None) -> None:
    with udp_responder(respond) as port:
        resolver = make_resolver(port, timeout=0.3, attempts=1)
        if expected is None:
            with pytest.raises(ResolverUnavailable):
                await resolver.query("a.test", QTYPE.A)
        else:
            answer = await resolver.query("a.test", QTYPE.A)
            assert answer.addresses == ips(expected)
    assert resolver.stats["malformed_replies"] + resolver.stats["mismatched_replies"] == 1  # each one counted


async def test_query_ids_do_not_follow_the_random_module() -> None:
    asked: list[DNSRecord] = []
    with udp_responder(lambda q: asked.append(q) or [_reply(q, "192.0.2.1")]) as port:
        resolver = make_resolver(port)
        for run in range(2):
            random.seed(1234)  # the same state twice: IDs drawn from `random` would repeat
            for i in range(3):
                await resolver.query(f"id{run}{i}.test", QTYPE.A)
    ids = [q.header.id for q in asked]
    assert len(ids) == 6 and ids[:3] != ids[3:]


def _aliased_per_family(question: DNSRecord) -> list[bytes]:
    """A through cdn-a.test, AAAA through cdn-b.test."""
    reply = question.reply()
    target, rtype, address = (
        ("cdn-a", "A", "192.0.2.1") if question.q.qtype == QTYPE.A else ("cdn-b", "AAAA", "2001:db8::1")
    )
    reply.add_answer(*RR.fromZone(f"{question.q.qname} 60 CNAME {target}.test.\n{target}.test. 60 {rtype} {address}"))
    return [reply.pack()]


async def test_resolve_reports_the_cname_chains_of_both_families() -> None:
    with udp_responder(_aliased_per_family) as port:
        answer = await make_resolver(port).resolve("split.test")
    assert set(answer.addresses) == set(ips("192.0.2.1", "2001:db8::1"))
    assert set(answer.cnames) == {"cdn-a.test", "cdn-b.test"}


# --- TCP fallback -------------------------------------------------------------------------------------------------


async def test_truncated_udp_falls_back_to_tcp(resolver: Resolver, zone: Zone) -> None:
    answer = await resolver.query("trunc.test", QTYPE.A)
    assert answer.addresses == ips("192.0.2.11", "192.0.2.12", "192.0.2.13")
    assert zone.count("trunc.test", "A", "udp") == 1
    assert zone.count("trunc.test", "A", "tcp") == 1


def truncated(question: DNSRecord) -> list[bytes]:
    reply = question.reply()
    reply.header.tc = 1
    reply.add_answer(*RR.fromZone(f"{question.q.qname} 300 A 192.0.2.1"))
    return [reply.pack()]


async def test_truncated_without_tcp_is_unavailable() -> None:
    with udp_responder(truncated) as port:  # nobody listens on TCP at this port
        resolver = make_resolver(port, timeout=0.3, attempts=1)
        with pytest.raises(ResolverUnavailable):
            await resolver.query("a.test", QTYPE.A)


@contextlib.contextmanager
def tcp_responder(respond, port: int) -> Iterator[None]:
    """A raw TCP server on 127.0.0.1:`port`: one question per connection, answered with `respond(question)`."""
    listener = socket.create_server((LOCALHOST, port))
    listener.settimeout(0.05)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1)
                packet = respond(DNSRecord.parse(conn.recv(65535)[2:]))  # a small question arrives in one piece
                conn.sendall(struct.pack("!H", len(packet)) + packet)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        listener.close()


@contextlib.contextmanager
def udp_and_tcp_responders(udp_respond, tcp_respond) -> Iterator[int]:
    """Both on one port number. The kernel picks the UDP port; a TCP socket of another test may hold that number
    already, so a few numbers are tried."""
    for _ in range(50):
        with contextlib.ExitStack() as stack:
            port = stack.enter_context(udp_responder(udp_respond))
            try:
                stack.enter_context(tcp_responder(tcp_respond, port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                continue
            yield port
            return
    raise RuntimeError("no port number free for both UDP and TCP on 127.0.0.1")


async def test_unparsable_tcp_reply_is_malformed_and_the_next_server_is_asked(server: tuple[Zone, int]) -> None:
    with udp_and_tcp_responders(truncated, pointer_chain_reply) as port:
        hostile_only = make_resolver(port)
        with pytest.raises(ResolverUnavailable, match=r"unparsable reply \(RecursionError\)"):
            await hostile_only.query("a.test", QTYPE.A)
        assert hostile_only.stats["malformed_replies"] == 1
        config = ResolverConfig(servers=[(LOCALHOST, port), (LOCALHOST, server[1])], timeout=1.0, attempts=1)
        answer = await Resolver(config).query("a.test", QTYPE.A)
    assert answer.addresses == ips("192.0.2.1", "192.0.2.2")  # from the second server


# --- cache --------------------------------------------------------------------------------------------------------

# (id, name, min_ttl, max_ttl, expected TTL; 0: not cached)
TTLS = [
    ("min-ttl-raises", "ttl1.test", 5, 3600, 5),
    ("max-ttl-lowers", "ttlbig.test", 5, 60, 60),
    ("within-bounds", "a.test", 5, 3600, 300),
    ("max-ttl-below-record", "a.test", 5, 100, 100),
    ("zero-ttl-not-cached", "ttl0.test", 0, 3600, 0),
    ("zero-ttl-raised", "ttl0.test", 10, 3600, 10),
]


@pytest.mark.parametrize(("name", "min_ttl", "max_ttl", "ttl"), [t[1:] for t in TTLS], ids=[t[0] for t in TTLS])
async def test_cache_ttl_clamps(
    server: tuple[Zone, int], zone: Zone, name: str, min_ttl: int, max_ttl: int, ttl: int
) -> None:
    resolver = make_resolver(server[1], min_ttl=min_ttl, max_ttl=max_ttl)
    answer = await resolver.query(name, QTYPE.A)
    assert answer.ttl == ttl
    await resolver.query(name, QTYPE.A)
    assert zone.count() == (2 if ttl == 0 else 1)
    entry = resolver._cache.get((name, QTYPE.A))
    if ttl == 0:
        assert entry is None
    else:
        assert ttl - 2 < entry.expires - time.monotonic() <= ttl


async def test_cache_expiry_asks_again(resolver: Resolver, zone: Zone) -> None:
    await resolver.query("a.test", QTYPE.A)
    resolver._cache[("a.test", QTYPE.A)].expires = time.monotonic() - 0.001
    await resolver.query("a.test", QTYPE.A)
    assert zone.count() == 2


async def test_cache_size_bounded(server: tuple[Zone, int], zone: Zone) -> None:
    resolver = make_resolver(server[1], cache_size=2)
    for name in ("a.test", "v4only.test", "ttlbig.test", "alias.test"):
        await resolver.query(name, QTYPE.A)
    assert len(resolver._cache) <= 2


async def test_concurrent_identical_queries_share_one_exchange(resolver: Resolver, zone: Zone) -> None:
    answers = await asyncio.gather(*(resolver.query("slow.test", QTYPE.A) for _ in range(20)))
    assert {a.addresses for a in answers} == {ips("192.0.2.31")}
    assert zone.count() == 1


async def test_concurrent_identical_failures_share_one_exchange(resolver: Resolver, zone: Zone) -> None:
    results = await asyncio.gather(
        *(resolver.query("slowfail.test", QTYPE.A) for _ in range(10)), return_exceptions=True
    )
    assert all(isinstance(r, ResolverUnavailable) for r in results)
    assert zone.count() == 1
    assert not resolver._inflight


async def test_concurrent_resolve_calls(resolver: Resolver, zone: Zone) -> None:
    await asyncio.gather(*(resolver.resolve("slow.test") for _ in range(10)), return_exceptions=True)
    assert zone.count("slow.test", "A") == 1
    assert zone.count("slow.test", "AAAA") == 1


async def test_cancelled_caller_does_not_strand_the_others(resolver: Resolver, zone: Zone) -> None:
    first = asyncio.create_task(resolver.query("slow.test", QTYPE.A))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(resolver.query("slow.test", QTYPE.A))
    await asyncio.sleep(0.05)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    with pytest.raises(ResolverUnavailable):  # fails closed, promptly, instead of waiting forever
        await asyncio.wait_for(second, 2)
    assert not resolver._inflight
    answer = await resolver.query("slow.test", QTYPE.A)  # the next lookup starts afresh
    assert answer.addresses == ips("192.0.2.31")


async def test_lone_caller_cancelled_by_timeout(resolver: Resolver) -> None:
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(resolver.query("slow.test", QTYPE.A), 0.05)
    assert not resolver._inflight


# --- configuration ------------------------------------------------------------------------------------------------

SERVERS = [
    ("v4", "192.0.2.53", ("192.0.2.53", 53)),
    ("v4-port", "127.0.0.1:5353", ("127.0.0.1", 5353)),
    ("v6", "2001:db8::53", ("2001:db8::53", 53)),
    ("v6-bracketed-port", "[2001:db8::53]:5353", ("2001:db8::53", 5353)),
    ("v6-bracketed", "[::1]", ("::1", 53)),
]


@pytest.mark.parametrize(("text", "expected"), [s[1:] for s in SERVERS], ids=[s[0] for s in SERVERS])
def test_parse_server(text: str, expected: tuple[str, int]) -> None:
    assert parse_server(text) == expected


@pytest.mark.parametrize(
    "text",
    ["dns.example", "127.0.0.1:0", "127.0.0.1:70000", "127.0.0.1:dns", "[::1]:99999", "1.2.3"],
    ids=["name", "port-0", "port-too-big", "port-word", "v6-port-too-big", "short-ipv4"],
)
def test_parse_server_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_server(text)


def test_system_servers(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text(
        "# comment\nsearch example\nnameserver 192.0.2.53\nnameserver bogus\nnameserver 2001:db8::53\noptions x\n",
        encoding="utf-8",
    )
    assert system_servers(str(conf)) == [("192.0.2.53", 53), ("2001:db8::53", 53)]
    assert system_servers(str(tmp_path / "absent")) == []


def test_no_servers_refused() -> None:
    with pytest.raises(ValueError):
        Resolver(ResolverConfig(servers=[]))


async def test_each_upstream_resolution_is_timed_with_its_result(resolver: Resolver, zone: Zone) -> None:
    timed: list[tuple[str, float]] = []
    resolver = Resolver(resolver.config, timed=lambda result, seconds: timed.append((result, seconds)))
    await resolver.query("a.test", QTYPE.A)
    await resolver.query("a.test", QTYPE.A)  # cached: nothing asked, nothing timed
    with pytest.raises(NameNotFound):
        await resolver.query("nothing-timed.test", QTYPE.A)
    assert [result for result, _ in timed] == ["ok", "nxdomain"]
    assert all(0 < seconds < 1 for _, seconds in timed)
