"""The sandbox-facing DNS server (airlock.dns.server) on 127.0.0.1, in front of the shared resolver and a raw UDP
upstream on 127.0.0.1 with a tiny zone. The sandbox is 127.0.0.0/8: the tests ask from 127.0.0.1.

Only 127.0.0.1 is ever contacted: the zone's 192.0.2.x answers are data, never dialled.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
from dnslib import QTYPE, RCODE, RR, DNSRecord

from airlock.audit import AuditRecord
from airlock.dns.admission import DnsSettings
from airlock.dns.server import DnsServer
from airlock.dns.upstream import Answer, Resolver, ResolverConfig
from airlock.policy import LivePolicy, ReasonCode, Sandbox, SandboxRegistry, parse_policy

from tasks import counting_tasks

LOCALHOST = "127.0.0.1"

POLICY = parse_policy(
    """
version: 1
profiles:
  default:
    allow:
      - host: "*.allowed.test"
    deny:
      - host: denied.allowed.test
      - host: "*.blocked.test"
      - host: ssh.cdn.test
        ports: [22]
"""
)

ZONE = """
www.allowed.test.     300 A     192.0.2.10
alias.allowed.test.   300 CNAME denied.allowed.test.
bare.allowed.test.    300 CNAME denied.allowed.test.
denied.allowed.test.  300 A     192.0.2.66
deep.allowed.test.    300 CNAME hop.cdn.test.
hop.cdn.test.         300 CNAME x.blocked.test.
x.blocked.test.       300 A     192.0.2.67
cdn.allowed.test.     300 CNAME edge.cdn.test.
edge.cdn.test.        300 A     192.0.2.7
ssh.allowed.test.     300 CNAME ssh.cdn.test.
ssh.cdn.test.         300 A     192.0.2.8
""" + "".join(f"many.allowed.test. 300 A 192.0.2.{i}\n" for i in range(1, 61))  # a reply of about 1 KB


class Upstream:
    """A raw UDP server on 127.0.0.1: answers from ZONE, chasing CNAMEs within the reply except for `bare.*`
    names; names starting with "silent" get no answer at all. Counts every question by name."""

    def __init__(self) -> None:
        self.records: dict[str, list[RR]] = {}
        for rr in RR.fromZone(ZONE):
            self.records.setdefault(str(rr.rname).rstrip(".").lower(), []).append(rr)
        self.asked: Counter[str] = Counter()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((LOCALHOST, 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]

    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                data, peer = self.sock.recvfrom(65535)
            except TimeoutError:
                continue
            question = DNSRecord.parse(data)
            name = str(question.q.qname).rstrip(".").lower()
            self.asked[name] += 1
            if not name.startswith("silent"):
                self.sock.sendto(self._reply(question, name).pack(), peer)

    def _reply(self, question: DNSRecord, name: str) -> DNSRecord:
        reply = question.reply()
        if name not in self.records:
            reply.header.rcode = RCODE.NXDOMAIN
        while name in self.records:
            records = self.records[name]
            reply.add_answer(*(rr for rr in records if rr.rtype in (question.q.qtype, QTYPE.CNAME)))
            cname = next((rr for rr in records if rr.rtype == QTYPE.CNAME), None)
            if cname is None or name.startswith("bare."):
                break
            name = str(cname.rdata).rstrip(".").lower()
        return reply


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join()
        server.sock.close()


@dataclass
class Gateway:
    server: DnsServer
    live: LivePolicy
    audit: list[AuditRecord]

    @property
    def port(self) -> int:
        return self.server.port


def make_resolver(upstream: Upstream) -> Resolver:
    return Resolver(ResolverConfig(servers=[(LOCALHOST, upstream.port)], timeout=2.0, attempts=1))


@contextlib.asynccontextmanager
async def running(resolver: Resolver, network: str = "127.0.0.0/8", **settings: object) -> AsyncIterator[Gateway]:
    """A DnsServer (UDP and TCP on one free port of 127.0.0.1) for the sandbox `network`."""
    audit: list[AuditRecord] = []
    registry = SandboxRegistry([Sandbox("sbx", "default", ipaddress.ip_network(network))])
    live = LivePolicy(POLICY, registry)
    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((LOCALHOST, 0))
            port = probe.getsockname()[1]
        server = DnsServer(live, resolver, audit.append, DnsSettings(**settings), LOCALHOST, port)  # type: ignore[arg-type]
        try:
            await server.start()
        except OSError:  # the TCP port was taken
            await server.stop()
            continue
        try:
            yield Gateway(server, live, audit)
        finally:
            await server.stop()
        return
    raise RuntimeError("no free port for UDP and TCP together")


@pytest.fixture
async def gateway(upstream: Upstream) -> AsyncIterator[Gateway]:
    async with running(make_resolver(upstream)) as gw:
        yield gw


async def ask(port: int, name: str, qtype: str = "A", tcp: bool = False, timeout: float = 3) -> DNSRecord:
    """One question from 127.0.0.1, in a thread: the server runs on this test's event loop."""
    question = DNSRecord.question(name, qtype)
    return DNSRecord.parse(await asyncio.to_thread(question.send, LOCALHOST, port, tcp=tcp, timeout=timeout))


def rcode(reply: DNSRecord) -> str:
    return RCODE.get(reply.header.rcode)


def answers(reply: DNSRecord) -> list[str]:
    return [str(rr.rdata) for rr in reply.rr]


# --- every query is audited, even when something breaks ----------------------------------------------------------


class BrokenResolver(Resolver):
    async def query(self, name: str, qtype: int) -> Answer:
        raise RuntimeError("a bug")


@pytest.mark.parametrize("tcp", [False, True], ids=["udp", "tcp"])
async def test_an_unexpected_failure_is_servfail_and_still_audited(upstream: Upstream, tcp: bool) -> None:
    async with running(BrokenResolver(ResolverConfig(servers=[(LOCALHOST, upstream.port)]))) as gw:
        reply = await ask(gw.port, "www.allowed.test", tcp=tcp)
    assert rcode(reply) == "SERVFAIL" and answers(reply) == []
    [record] = gw.audit
    assert (record.host, record.decision, record.extra["rcode"]) == ("www.allowed.test", "error", "SERVFAIL")
    assert (record.code, record.reason) == (ReasonCode.INTERNAL_ERROR, "internal error: RuntimeError: a bug")


# --- CNAME chains through denied names ----------------------------------------------------------------------------

# (id, name, qtype, rcode, answers, the name the audit reason names or None)
CHAINS = [
    ("to-a-denied-name", "alias.allowed.test", "A", "REFUSED", [], "denied.allowed.test"),
    ("to-a-denied-name-no-data", "alias.allowed.test", "AAAA", "REFUSED", [], "denied.allowed.test"),
    ("to-a-denied-name-asked-separately", "bare.allowed.test", "A", "REFUSED", [], "denied.allowed.test"),
    ("through-a-cdn-to-a-denied-wildcard", "deep.allowed.test", "A", "REFUSED", [], "x.blocked.test"),
    ("to-an-unlisted-cdn", "cdn.allowed.test", "A", "NOERROR", ["192.0.2.7"], None),
    ("to-a-name-denied-on-one-port-only", "ssh.allowed.test", "A", "NOERROR", ["192.0.2.8"], None),
]


@pytest.mark.parametrize(
    ("name", "qtype", "code", "addresses", "denied"), [c[1:] for c in CHAINS], ids=[c[0] for c in CHAINS]
)
async def test_a_cname_chain_through_a_denied_name_is_refused(
    gateway: Gateway, name: str, qtype: str, code: str, addresses: list[str], denied: str | None
) -> None:
    reply = await ask(gateway.port, name, qtype)
    assert (rcode(reply), answers(reply)) == (code, addresses)
    [record] = gateway.audit
    assert record.extra["cnames"]
    if denied is None:
        assert (record.decision, record.code) == ("allow", ReasonCode.ALLOWED)
    else:
        assert (record.decision, record.code) == ("deny", ReasonCode.ALIAS_DENIED) and record.rule is not None
        assert record.reason.startswith(f"CNAME chain passes through {denied}, denied by rule deny ")
    again = await ask(gateway.port, name, qtype, tcp=True)  # from the shared cache: the same judgement
    assert (rcode(again), answers(again)) == (code, addresses)


# --- a reload while a query waits -----------------------------------------------------------------------------


class GatedResolver(Resolver):
    """The shared resolver, but each upstream question waits until the test lets it go."""

    def __init__(self, upstream: Upstream) -> None:
        super().__init__(ResolverConfig(servers=[(LOCALHOST, upstream.port)], attempts=1))
        self.asked, self.release = asyncio.Event(), asyncio.Event()

    async def query(self, name: str, qtype: int) -> Answer:
        self.asked.set()
        await self.release.wait()
        return await super().query(name, qtype)


async def test_a_reply_decided_before_a_reload_is_never_remembered_as_one_of_the_new_policy(
    upstream: Upstream,
) -> None:
    resolver = GatedResolver(upstream)
    closed = parse_policy("version: 1\nprofiles:\n  default:\n    allow:\n      - host: other.test\n", "closed.yaml")
    async with running(resolver) as gw:
        first = asyncio.create_task(ask(gw.port, "www.allowed.test"))
        await resolver.asked.wait()
        gw.live.replace(closed)  # SIGHUP while the query waits on upstream
        resolver.release.set()
        assert answers(await first) == ["192.0.2.10"]  # judged whole under the policy it started under
        again = await ask(gw.port, "www.allowed.test")  # within the second a reply is remembered for
    assert rcode(again) == "REFUSED" and gw.audit[-1].rule is None and "closed.yaml" not in gw.audit[-1].reason
    assert gw.audit[-1].code == ReasonCode.NOT_ALLOWLISTED


# --- queries waiting on upstream, per sandbox ---------------------------------------------------------------------


def _burst(port: int, names: list[str], wait: float) -> list[DNSRecord]:
    """Send every question at once from one socket; the replies that arrive within `wait` seconds."""
    replies = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            sock.sendto(DNSRecord.question(name).pack(), (LOCALHOST, port))
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                replies.append(DNSRecord.parse(sock.recv(4096)))
            except TimeoutError:
                break
    return replies


async def test_queries_waiting_on_upstream_are_capped_per_sandbox(upstream: Upstream) -> None:
    async with running(make_resolver(upstream), answer_timeout=1.0) as gw:
        assert answers(await ask(gw.port, "www.allowed.test", tcp=True)) == ["192.0.2.10"]  # now cached
        names = [f"silent{i}.allowed.test" for i in range(40)]
        burst = asyncio.create_task(asyncio.to_thread(_burst, gw.port, names, 0.6))
        await asyncio.sleep(0.3)
        # At the cap, a cached name is still answered: it waits on nothing.
        assert answers(await ask(gw.port, "www.allowed.test", tcp=True)) == ["192.0.2.10"]
        early = await burst
        assert len(early) == 8 and {rcode(r) for r in early} == {"SERVFAIL"}  # at once, never asked upstream
        assert sum(upstream.asked[n] for n in names) == 32
        over = [r for r in gw.audit if r.code == ReasonCode.INFLIGHT_LIMIT]
        assert len(over) == 8 and {r.decision for r in over} == {"error"}
        assert "32 queries of this sandbox" in over[0].reason
        await asyncio.sleep(0.6)  # the 32 time out (answer_timeout): the sandbox may ask again
        assert rcode(await ask(gw.port, "silent-again.allowed.test", timeout=3)) == "SERVFAIL"
        assert upstream.asked["silent-again.allowed.test"] == 1


# --- addresses of no sandbox, an audit log that cannot be written -----------------------------------------------


async def test_a_flood_from_an_address_of_no_sandbox_costs_a_few_lines_and_no_task_per_query(
    upstream: Upstream,
) -> None:
    async with running(make_resolver(upstream), network="127.0.0.2/32") as gw:  # 127.0.0.1 is no sandbox
        gw.server.admission.strangers.interval = 0.5
        with counting_tasks() as spawned:
            replies = await asyncio.to_thread(_burst, gw.port, [f"q{i}.allowed.test" for i in range(300)], 0.5)
        await asyncio.sleep(0.3)  # the interval ends: its summary line
    assert len(replies) == 10 and {rcode(r) for r in replies} == {"REFUSED"}
    assert len(spawned) <= 10  # one task per answered query; the dropped ones cost none
    one_by_one = [r for r in gw.audit if r.reason == "query from an address that belongs to no sandbox"]
    summaries = [r for r in gw.audit if "not audited one by one" in r.reason]
    assert len(one_by_one) == 10 and len(summaries) == 1 and len(gw.audit) == 11
    # A burst this size may overflow the socket's receive buffer: what arrived beyond the first 10 is counted.
    dropped = gw.server.stats["dropped_unknown_source"]
    assert 100 <= dropped <= 290 and summaries[0].extra == {"suppressed": dropped, "clients": {LOCALHOST: dropped}}
    assert (summaries[0].kind, summaries[0].sandbox, summaries[0].decision) == ("dns", "-", "deny")
    assert sum(upstream.asked.values()) == 0


async def test_nothing_is_answered_while_the_audit_log_cannot_be_written(upstream: Upstream) -> None:
    failure: list[str] = []
    audit_failure = lambda: failure[0] if failure else None  # noqa: E731
    async with running(make_resolver(upstream), audit_failure=audit_failure) as gw:
        assert answers(await ask(gw.port, "www.allowed.test")) == ["192.0.2.10"]
        assert answers(await ask(gw.port, "www.allowed.test")) == ["192.0.2.10"]  # remembered now
        failure.append("audit.jsonl: No space left on device")
        for tcp in (False, True):  # the remembered reply too: nothing is answered that cannot be audited
            assert rcode(await ask(gw.port, "www.allowed.test", tcp=tcp)) == "SERVFAIL"
        failure.clear()
        assert answers(await ask(gw.port, "www.allowed.test")) == ["192.0.2.10"]
    refused = [r for r in gw.audit if isinstance(r, AuditRecord) and r.decision == "error"]
    assert len(refused) == 2 and "audit log unavailable (audit.jsonl: No space left on device)" in refused[0].reason
    assert upstream.asked["www.allowed.test"] == 1


# --- TCP from the sandbox ------------------------------------------------------------------------------------------


def _declare_and_wait(port: int, declared: int) -> tuple[bytes, float]:
    """Announce a message of `declared` bytes, send none of it: what comes back, and how soon."""
    with socket.create_connection((LOCALHOST, port), timeout=3) as sock:
        started = time.monotonic()
        sock.sendall(struct.pack("!H", declared))
        return sock.recv(4096), time.monotonic() - started


async def test_tcp_query_declared_too_long_is_refused_at_once(gateway: Gateway) -> None:
    data, elapsed = await asyncio.to_thread(_declare_and_wait, gateway.port, 1233)
    assert data == b"" and elapsed < 1  # closed without waiting for 1233 bytes that will never come
    assert gateway.server.stats["dropped_oversize"] == 1
    assert answers(await ask(gateway.port, "www.allowed.test", tcp=True)) == ["192.0.2.10"]


class NeverReads:
    """A TCP client (in a thread) that pipelines questions without reading a single reply until the server stops
    taking them; then, told to, reads what it was sent until the server's end of the connection."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stalled, self.read_now = threading.Event(), threading.Event()

    def run(self) -> bool:
        query = DNSRecord.question("many.allowed.test").pack()  # a reply of about 1 KB
        framed = struct.pack("!H", len(query)) + query
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
            sock.connect((LOCALHOST, self.port))
            sock.settimeout(0.5)
            with contextlib.suppress(TimeoutError, ConnectionError):  # no more room, or the server has let go
                while True:
                    sock.sendall(framed)
            self.stalled.set()
            self.read_now.wait(10)
            sock.settimeout(3)
            with contextlib.suppress(ConnectionError):
                while sock.recv(65536):
                    pass
            return True


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_tcp_client_that_never_reads_is_dropped(upstream: Upstream) -> None:
    async with running(make_resolver(upstream), tcp_timeout=0.5, rate_per_second=1e6) as gw:
        assert len(answers(await ask(gw.port, "many.allowed.test", tcp=True))) == 60  # now cached
        while gw.server.admission.tcp_connections("sbx"):  # that connection's end, seen by the server
            await asyncio.sleep(0.01)
        assert gw.server._tcp is not None
        for listener in gw.server._tcp.sockets:  # small kernel buffers (inherited on accept): the server stalls soon
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        before = open_fds()
        client = NeverReads(gw.port)
        reading = asyncio.create_task(asyncio.to_thread(client.run))
        assert await asyncio.to_thread(client.stalled.wait, 10), "the server stopped taking questions"
        # Within a second the server's reply has waited on the client for longer than tcp_timeout.
        deadline = asyncio.get_running_loop().time() + 1.0
        while gw.server.admission.tcp_connections("sbx") or open_fds() != before + 1:
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.01)
        try:
            assert gw.server.admission.tcp_connections("sbx") == 0
            assert open_fds() == before + 1  # only the client's socket: the server's is closed, not lingering
        finally:
            client.read_now.set()
        assert await reading  # what the kernel held is delivered, then the end of the connection


async def test_stop_closes_idle_tcp_clients_instead_of_waiting_for_them(upstream: Upstream) -> None:
    async with running(make_resolver(upstream), tcp_timeout=60) as gw:
        idle = await asyncio.to_thread(socket.create_connection, (LOCALHOST, gw.port), 3)
        while not gw.server.admission.tcp_connections("sbx"):
            await asyncio.sleep(0.01)
        # Well below tcp_timeout: stop() must not wait for the idle client to time out.
        await asyncio.wait_for(gw.server.stop(), 5)
        idle.settimeout(3)
        assert await asyncio.to_thread(idle.recv, 1) == b""  # the gateway's end is gone
        idle.close()


# --- refusals are timed like every other answer --------------------------------------------------------------


async def test_a_refusal_is_audited_with_the_time_it_took(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    from airlock.dns import resolver as dns_resolver

    judge = dns_resolver.decide_name

    def slow_judge(*args: object):
        time.sleep(0.03)  # a slow policy decision, as a big policy on a loaded host makes it
        return judge(*args)

    monkeypatch.setattr(dns_resolver, "decide_name", slow_judge)
    assert rcode(await ask(gateway.port, "x.blocked.test")) == "REFUSED"
    [record] = gateway.audit
    assert record.decision == "deny" and record.duration_ms >= 30, record
