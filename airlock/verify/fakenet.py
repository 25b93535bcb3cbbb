"""The fake internet: HTTP/HTTPS/TCP upstreams, a UDP canary and an authoritative DNS server that count what reaches
them.

Run inside the `<prefix>-net` namespace (see airlock.verify.topology.FakeNet):

    python -P -m airlock.verify.fakenet --control /path/ctl.sock --cert leaf.crt --key leaf.key [--zone FILE]

Every TCP listener binds 0.0.0.0, so each fake-internet address answers on every port; a connection is
attributed to the address it was *sent to* (getsockname), which is what lets a denial check assert
"203.0.113.66:443 saw zero connections". `--zone` adds names to the DNS zone (JSON: {name: [[type, value]]}),
as `airlock verify` gives each host a policy allows a fake upstream (type REBIND, value "A1 A2": the first A
query answered A1, every later one A2). The control socket is a filesystem unix
socket, reachable from the host namespace, speaking one JSON object per line: {"cmd": "ping" | "stats" | "reset"}.
Prints READY on stdout once everything is bound.

One module past 500 lines on purpose: it is one server process (`python -m airlock.verify.fakenet`) with one
event loop and one record of what reached it (`Stats`); each listener is small, and they share that record."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gzip
import hashlib
import json
import resource
import ssl
import sys
import threading
import traceback
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import h2.config
import h2.connection
import h2.events
from dnslib import AAAA, CNAME, NS, QTYPE, RCODE, RR, SOA, TXT, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSLogger, DNSServer

from airlock.verify import registry
from airlock.verify.control import Commands, serve_until_signalled, start_control

HTTP_PORTS = (80, 8080)
HTTPS_PORTS = (443, 8443)
H2_PORT = 9443  # HTTPS that speaks HTTP/2 where the client offers it (ALPN), else HTTP/1.1
ECHO_PORT = 22
CANARY_PORT = 9999  # TCP, and the UDP canary's
DOT_PORT = 853  # DNS over TLS: a canary too (no fake upstream answers DNS there)
DNS_ADDR = "192.0.2.53"
IDLE_TIMEOUT = 60.0
MAX_LOG = 10_000  # per list; counters stay exact, only the detailed logs are capped
CHUNK = 64 * 1024
WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 §1.3

REBIND_NAME = "rebind.allowed.test"
REBIND_PUBLIC, REBIND_INTERNAL = "192.0.2.10", "10.1.2.3"
WILDCARD_PARENT = "allowed.test"
WILDCARD_IP = "192.0.2.10"

# name -> [(type, value)]; TTLs come from --zone-default-ttl. rebind.allowed.test is computed per query.
ZONE: dict[str, list[tuple[str, str]]] = {
    "test": [("NS", "ns.test")],
    "ns.test": [("A", DNS_ADDR)],
    "allowed.test": [("A", "192.0.2.10")],
    "www.allowed.test": [("A", "192.0.2.10")],
    "other.test": [("A", "198.51.100.10")],
    "evil.test": [("A", "203.0.113.66")],
    "internal.allowed.test": [("A", "10.1.2.3")],
    "loop.allowed.test": [("A", "127.0.0.1")],
    "meta.allowed.test": [("A", "169.254.169.254")],
    "mixed.allowed.test": [("A", "192.0.2.10"), ("A", "10.1.2.3")],
    "cname-internal.allowed.test": [("CNAME", "internal.allowed.test")],
    "cname-public.allowed.test": [("CNAME", "allowed.test")],
    "svc.internal.test": [("A", "10.1.2.4")],
    "v6.allowed.test": [("AAAA", "2001:db8::10"), ("A", "192.0.2.10")],
    "txt.allowed.test": [("TXT", "hello")],
    "api.github.test": [("A", "192.0.2.20")],  # airlock.verify.fakegithub
    "refused6.allowed.test": [("A", "192.0.2.10")],  # its AAAA questions are REFUSED (REFUSED_AAAA)
    "github.test": [("A", "192.0.2.20")],  # airlock.verify.fakegithub: git smart HTTP
    # the hosts of the docs' walk-throughs, under their real names: registries (registry.py), a model API
    **{host: [("A", "192.0.2.10")] for host in registry.REGISTRY_HOSTS},
    "api.model.example": [("A", "192.0.2.30")],  # airlock.verify.fakemodel
}
REFUSED_AAAA = {"refused6.allowed.test"}  # an upstream that refuses AAAA, as some do
RDATA = {"A": A, "AAAA": AAAA, "CNAME": CNAME, "NS": NS, "TXT": TXT}


def log(msg: str) -> None:
    print(f"fakenet: {msg}", file=sys.stderr, flush=True)


def _key(addr: tuple[Any, ...]) -> str:
    return f"{addr[0]}:{addr[1]}"


@dataclass
class Stats:
    """All counters, shared by the asyncio loop and dnslib's server threads (hence the lock)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    connections: Counter[str] = field(default_factory=Counter)
    bytes_in: Counter[str] = field(default_factory=Counter)
    dns: Counter[str] = field(default_factory=Counter)
    dns_typed: Counter[str] = field(default_factory=Counter)
    udp: Counter[str] = field(default_factory=Counter)  # datagrams by port
    rebind: Counter[str] = field(default_factory=Counter)
    logs: dict[str, list[Any]] = field(default_factory=dict)
    dropped: Counter[str] = field(default_factory=Counter)

    def _append(self, name: str, item: Any) -> None:
        entries = self.logs.setdefault(name, [])
        if len(entries) < MAX_LOG:
            entries.append(item)
        else:
            self.dropped[name] += 1

    def accepted(self, dst: str, client: str) -> None:
        with self.lock:
            self.connections[dst] += 1
            self._append("accepts", {"dst": dst, "client": client})

    def datagram(self, port: int) -> None:
        with self.lock:
            self.udp[str(port)] += 1

    def received(self, dst: str, n: int) -> None:
        with self.lock:
            self.bytes_in[dst] += n

    def record(self, name: str, item: Any) -> None:
        with self.lock:
            self._append(name, item)

    def dns_query(self, qname: str, qtype: str, proto: str, client: str) -> int:
        """Count one query; returns how many A/ANY queries this name has had (drives the rebinding answer)."""
        with self.lock:
            self.dns[qname] += 1
            self.dns_typed[f"{qname} {qtype}"] += 1
            self._append("dns_log", {"qname": qname, "qtype": qtype, "proto": proto, "client": client})
            if qtype in ("A", "ANY"):
                self.rebind[qname] += 1
            return self.rebind[qname]

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "connections": dict(self.connections),
                "bytes_in": dict(self.bytes_in),
                "dns": dict(self.dns),
                "dns_typed": dict(self.dns_typed),
                "udp": dict(self.udp),
                "dns_log": list(self.logs.get("dns_log", [])),
                "accepts": list(self.logs.get("accepts", [])),
                "sni": list(self.logs.get("sni", [])),
                "tls": list(self.logs.get("tls", [])),
                "http": list(self.logs.get("http", [])),
                "ws": list(self.logs.get("ws", [])),
                "dropped": dict(self.dropped),
            }

    def reset(self) -> None:
        with self.lock:
            for counter in (
                self.connections,
                self.bytes_in,
                self.dns,
                self.dns_typed,
                self.udp,
                self.rebind,
                self.dropped,
            ):
                counter.clear()
            self.logs.clear()


# --------------------------------------------------------------------------------------------------- DNS


class ZoneResolver(BaseResolver):  # type: ignore[misc]  # dnslib's, untyped
    def __init__(self, stats: Stats, ttl: int, zone: dict[str, list[tuple[str, str]]]) -> None:
        self.stats = stats
        self.ttl = ttl
        self.zone = zone

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()  # authoritative answer, question echoed with the client's case
        qname = str(request.q.qname).rstrip(".").lower()
        qtype = QTYPE.get(request.q.qtype, str(request.q.qtype))
        nth = self.stats.dns_query(qname, qtype, handler.protocol, handler.client_address[0])
        if qtype == "AAAA" and qname in REFUSED_AAAA:
            reply.header.rcode = RCODE.REFUSED
            return reply
        records = self._records(qname, nth)
        if records is None:
            reply.header.rcode = RCODE.NXDOMAIN
        else:
            for rr in self._answer(request.q.qname, qtype, records):
                reply.add_answer(rr)
        if not reply.rr:
            reply.add_auth(self._soa())
        return reply

    def _records(self, name: str, nth: int) -> list[tuple[str, str, int]] | None:
        """The name's records as (type, value, ttl); [] = exists without data (NODATA); None = NXDOMAIN."""
        if name == REBIND_NAME:
            # Odd A queries get the public address, even ones the internal one; TTL 0 so nothing caches it.
            return [("A", REBIND_PUBLIC if nth % 2 == 1 else REBIND_INTERNAL, 0)]
        if name in self.zone and self.zone[name][:1] and self.zone[name][0][0] == "REBIND":
            # "REBIND first then": the first A query gets the first address, every later one the second; TTL 0.
            first, then = self.zone[name][0][1].split()
            return [("A", first if nth == 1 else then, 0)]
        if name in self.zone:
            return [(rtype, value, self.ttl) for rtype, value in self.zone[name]]
        if name.endswith("." + WILDCARD_PARENT):
            return [("A", WILDCARD_IP, self.ttl)]  # so exfil-style names resolve like a real wildcard zone
        if any(known.endswith("." + name) for known in self.zone):
            return []  # empty non-terminal, e.g. internal.test: NODATA, not NXDOMAIN
        return None

    def _answer(self, owner: Any, qtype: str, records: list[tuple[str, str, int]]) -> list[RR]:
        cname = next(((value, ttl) for rtype, value, ttl in records if rtype == "CNAME"), None)
        if cname is None or qtype in ("CNAME", "ANY"):
            return [self._rr(owner, t, v, ttl) for t, v, ttl in records if qtype in (t, "ANY")]
        # Chase the in-zone CNAME into the same answer, as an authoritative server does (one level suffices here).
        target, ttl = cname
        chased = [self._rr(target, t, v, t_ttl) for t, v, t_ttl in self._records(target, nth=1) or [] if t == qtype]
        return [self._rr(owner, "CNAME", target, ttl), *chased]

    @staticmethod
    def _rr(owner: Any, rtype: str, value: str, ttl: int) -> RR:
        return RR(owner, getattr(QTYPE, rtype), rdata=RDATA[rtype](value), ttl=ttl)

    def _soa(self) -> RR:
        return RR("test", QTYPE.SOA, rdata=SOA("ns.test", "hostmaster.test", (1, 3600, 600, 86400, 0)), ttl=self.ttl)


def read_zone(path: Path | None) -> dict[str, list[tuple[str, str]]]:
    """The names `--zone` adds: {name: [[type, value]]} in JSON."""
    if path is None:
        return {}
    return {
        name.lower(): [(rtype, value) for rtype, value in rrs] for name, rrs in json.loads(path.read_text()).items()
    }


def start_dns(stats: Stats, address: str, ttl: int, zone: dict[str, list[tuple[str, str]]]) -> list[DNSServer]:
    resolver = ZoneResolver(stats, ttl, zone)
    logger = DNSLogger("error", prefix=False, logf=log)
    servers = [DNSServer(resolver, address=address, port=53, tcp=tcp, logger=logger) for tcp in (False, True)]
    for server in servers:
        server.start_thread()
    return servers


# --------------------------------------------------------------------------------------------------- TCP


@dataclass
class Conn:
    """One accepted connection; reads go through here so every received byte is counted against `dst`."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    stats: Stats
    dst: str
    client: str
    tls: bool = False
    sni: str | None = None

    def _count(self, data: bytes) -> bytes:
        if data:
            self.stats.received(self.dst, len(data))
        return data

    async def read(self, n: int = CHUNK) -> bytes:
        return self._count(await asyncio.wait_for(self.reader.read(n), IDLE_TIMEOUT))

    async def readuntil(self, sep: bytes) -> bytes:
        return self._count(await asyncio.wait_for(self.reader.readuntil(sep), IDLE_TIMEOUT))

    async def readexactly(self, n: int) -> bytes:
        return self._count(await asyncio.wait_for(self.reader.readexactly(n), IDLE_TIMEOUT))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


Handler = Any  # Callable[[Conn], Awaitable[None]]; kept loose to avoid typing noise in a test helper


async def guarded(handler: Handler, stats: Stats, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Count the connection, run the handler, and never let one bad client disturb the listener."""
    dst, client = _key(writer.get_extra_info("sockname")), writer.get_extra_info("peername")[0]
    stats.accepted(dst, client)
    conn = Conn(reader, writer, stats, dst, client)
    try:
        await handler(conn)
    except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError) as exc:
        log(f"{dst} from {client}: {type(exc).__name__}: {exc}")
    except Exception:
        log(f"{dst} from {client}: unexpected error\n{traceback.format_exc()}")
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def echo(conn: Conn) -> None:
    while data := await conn.read():
        await conn.send(data)


async def canary(conn: Conn) -> None:
    await conn.send(b"canary\n")


class UdpCanary(asyncio.DatagramProtocol):
    """Counts every datagram that reaches its port (on any fake address): nothing of a sandbox's may."""

    def __init__(self, stats: Stats, port: int) -> None:
        self.stats, self.port = stats, port

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self.stats.datagram(self.port)


# --------------------------------------------------------------------------------------------------- HTTP


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    @property
    def keep_alive(self) -> bool:
        connection = (self.header("connection") or "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in connection
        return "close" not in connection


def parse_head(head: bytes) -> Request | None:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return None
    headers = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            return None
        headers.append((name.strip(), value.strip()))
    return Request(parts[0], parts[1], parts[2], headers)


async def read_body(conn: Conn, req: Request) -> int:
    """Consume the request body (Content-Length or chunked); returns its size."""
    if "chunked" in (req.header("transfer-encoding") or "").lower():
        total = 0
        while True:
            size = int((await conn.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while (await conn.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return total
            await conn.readexactly(size + 2)
            total += size
    remaining = int(req.header("content-length") or 0)
    total = remaining
    while remaining:
        remaining -= len(await conn.readexactly(min(remaining, CHUNK)))
    return total


def response_head(status: str, length: int, keep_alive: bool, content_type: str = "text/plain") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    ).encode()


async def respond(conn: Conn, req: Request) -> None:
    url = urlsplit(req.target)
    query = parse_qs(url.query)
    send_body = req.method != "HEAD"
    if url.path == "/slow":
        await asyncio.sleep(min(float(query.get("s", ["1"])[0]), 300.0))
    if url.path == "/big":
        size = int(query.get("n", ["0"])[0])
        await conn.send(response_head("200 OK", size, req.keep_alive, "application/octet-stream"))
        block = b"x" * CHUNK
        while send_body and size > 0:
            await conn.send(block[: min(size, CHUNK)])
            size -= CHUNK
        return
    if url.path == "/reflect":  # the request's headers, reflected into the response's own
        reflected = "".join(f"X-Reflected-{name}: {value}\r\n" for name, value in req.headers)
        head = response_head("200 OK", 3, req.keep_alive).replace(b"\r\n\r\n", f"\r\n{reflected}\r\n".encode())
        await conn.send(head + (b"ok\n" if send_body else b""))
        return
    if url.path == "/gzip":  # the headers echoed, compressed whatever the request accepts
        body = gzip.compress(json.dumps(req.headers).encode())
        head = response_head("200 OK", len(body), req.keep_alive, "application/json")
        await conn.send(head.replace(b"\r\n\r\n", b"\r\nContent-Encoding: gzip\r\n\r\n") + body)
        return
    if url.path.startswith("/leak/"):
        return await leak(conn, req, url.path.removeprefix("/leak/"))
    if served := registry.answer(req.header("host"), url.path):
        content_type, body = served
    elif url.path == "/headers":
        body = json.dumps(req.headers).encode()
        content_type = "application/json"
    else:
        body = f"fakenet {conn.dst} host={req.header('host') or ''} path={req.target}\n".encode()
        content_type = "text/plain"
    await conn.send(response_head("200 OK", len(body), req.keep_alive, content_type) + (body if send_body else b""))


async def leak(conn: Conn, req: Request, part: str) -> None:
    """/leak/<part>: the request's Authorization header reflected into one part of the answer, as a careless
    upstream's error or echo would write it (the gateway must scrub or withhold each part it delivers)."""
    auth = req.header("authorization") or ""
    token = auth.rpartition(" ")[2] or "none"
    close = "Connection: close\r\n"
    answers = {
        "reason": f"HTTP/1.1 401 Invalid credentials {auth}\r\nContent-Length: 7\r\n{close}\r\ndenied\n",
        "header": f"HTTP/1.1 200 OK\r\nX-Echo: {auth}\r\nX-{token}: name\r\nContent-Length: 3\r\n{close}\r\nok\n",
        "early-hints": f"HTTP/1.1 103 Early Hints\r\nLink: </s.css?k={quote(auth)}>; rel=preload\r\n"
        f"X-Echo: {auth}\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n{close}\r\nok\n",
        "trailer": f"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Echo\r\n{close}\r\n"
        f"3\r\nok\n\r\n0\r\nX-Echo: {auth}\r\n\r\n",
        "status-line": f"HTTP/1.1 2xx {auth}\r\nContent-Length: 3\r\n{close}\r\nok\n",
        "truncated": f"HTTP/1.1 200 OK\r\nX-Echo: {auth}\r\n",
        "bad-length": f"HTTP/1.1 200 OK\r\nContent-Length: {token}\r\n{close}\r\nok\n",
    }
    if part in ("te", "te-forced"):  # the body by a transfer-coding: gzip where the request's TE asks (or always)
        body = f"{auth}\n".encode()
        gzipped = part == "te-forced" or "gzip" in (req.header("te") or "").lower()
        coded = gzip.compress(body) if gzipped else body
        coding = "gzip, chunked" if gzipped else "chunked"
        head = f"HTTP/1.1 200 OK\r\nTransfer-Encoding: {coding}\r\n{close}\r\n".encode()
        return await conn.send(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(coded), coded))
    await conn.send(answers[part].encode())


async def http(conn: Conn) -> None:
    while True:
        try:
            head = await conn.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                log(f"{conn.dst}: client closed mid-request ({len(exc.partial)} bytes)")
            return
        except asyncio.LimitOverrunError:
            await conn.send(response_head("431 Request Header Fields Too Large", 0, False))
            return
        req = parse_head(head)
        if req is None:
            await conn.send(response_head("400 Bad Request", 0, False))
            return
        if (req.header("expect") or "").lower() == "100-continue":
            await conn.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            body_bytes = await read_body(conn, req)
        except ValueError:  # malformed Content-Length or chunk size
            await conn.send(response_head("400 Bad Request", 0, False))
            return
        conn.stats.record(
            "http",
            {
                "dst": conn.dst,
                "client": conn.client,
                "tls": conn.tls,
                "sni": conn.sni,
                "method": req.method,
                "target": req.target,
                "line": f"{req.method} {req.target} {req.version}",
                "host": req.header("host"),
                "headers": req.headers,
                "body_bytes": body_bytes,
            },
        )
        if urlsplit(req.target).path in UPGRADES:
            return await UPGRADES[urlsplit(req.target).path](conn, req)
        await respond(conn, req)
        if not req.keep_alive:
            return


async def websocket(conn: Conn, req: Request) -> None:
    """A websocket (RFC 6455) on any request to /ws, upgrade header or not (a lenient server): its first message is
    the handshake's headers as JSON, then it echoes each text or binary frame it gets (recorded as "ws")."""
    accept = base64.b64encode(hashlib.sha1((req.header("sec-websocket-key") or "").encode() + WS_GUID).digest())
    await conn.send(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
    )
    await conn.send(ws_frame(0x1, json.dumps(req.headers).encode()))
    while True:
        head = await conn.readexactly(2)
        opcode, length = head[0] & 0x0F, head[1] & 0x7F
        if length >= 126:
            length = int.from_bytes(await conn.readexactly(2 if length == 126 else 8))
        mask = await conn.readexactly(4) if head[1] & 0x80 else bytes(4)
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(await conn.readexactly(length)))
        if opcode == 0x8:
            await conn.send(ws_frame(0x8, payload[:2]))
            return
        if opcode == 0x9:
            await conn.send(ws_frame(0xA, payload))
            continue
        conn.stats.record("ws", {"dst": conn.dst, "opcode": opcode, "payload": payload.decode("latin-1")})
        await conn.send(ws_frame(opcode, payload))


async def leak_websocket(conn: Conn, req: Request) -> None:
    """/leak/ws: a websocket whose server reflects the upgrade's Authorization header in every frame it can send:
    a text and a binary message, a ping, an unasked pong, and the close frame's reason."""
    accept = base64.b64encode(hashlib.sha1((req.header("sec-websocket-key") or "").encode() + WS_GUID).digest())
    auth = (req.header("authorization") or "").encode()
    await conn.send(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
    )
    for opcode, payload in ((0x1, auth), (0x2, auth), (0x9, auth), (0xA, auth), (0x8, b"\x03\xf0" + auth)):
        await conn.send(ws_frame(opcode, payload))
    while await conn.read():  # until the client closes
        pass


def ws_frame(opcode: int, payload: bytes) -> bytes:
    """One final, unmasked frame (what a server sends)."""
    length = len(payload)
    size = (
        bytes([length])
        if length < 126
        else bytes([126]) + length.to_bytes(2)
        if length < 65536
        else bytes([127]) + length.to_bytes(8)
    )
    return bytes([0x80 | opcode]) + size + payload


async def raw_upgrade(conn: Conn, req: Request) -> None:
    """/raw-upgrade switches to whatever protocol the request names (or "raw"), then echoes bytes: a tunnel."""
    protocol = (req.header("upgrade") or "raw").encode()
    await conn.send(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: " + protocol + b"\r\nConnection: Upgrade\r\n\r\n")
    await echo(conn)


UPGRADES = {"/ws": websocket, "/raw-upgrade": raw_upgrade, "/leak/ws": leak_websocket}


def make_tls_context(cert: Path, key: Path, stats: Stats, alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(list(alpn))  # HTTP/1.1 only, but on H2_PORT

    def on_sni(sslobj: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        # Recorded at handshake time so a handshake that later fails still shows what the client asked for.
        stats.record("sni", name)
        sslobj.fakenet_sni = name  # type: ignore[attr-defined]

    ctx.sni_callback = on_sni
    return ctx


def https(ctx: ssl.SSLContext) -> Handler:
    async def handler(conn: Conn) -> None:
        # Plain accept, then start_tls (not start_server(ssl=...)): failed handshakes still get counted.
        await conn.writer.start_tls(ctx, ssl_handshake_timeout=10)
        conn.tls = True
        conn.sni = getattr(conn.writer.get_extra_info("ssl_object"), "fakenet_sni", None)
        conn.stats.record("tls", {"dst": conn.dst, "client": conn.client, "sni": conn.sni})
        alpn = conn.writer.get_extra_info("ssl_object").selected_alpn_protocol()
        await (http2(conn) if alpn == "h2" else http(conn))

    return handler


async def http2(conn: Conn) -> None:
    """HTTP/2 (h2's state machine): every request is answered as a gRPC error would be, in trailers that reflect
    its Authorization header; /leak/goaway ends the connection with that header as GOAWAY's debug data."""
    h2conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    h2conn.initiate_connection()
    await conn.send(h2conn.data_to_send())
    while data := await conn.read():
        for event in h2conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                h2conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if not isinstance(event, h2.events.RequestReceived):
                continue
            fields = [(k.decode(), v.decode()) for k, v in event.headers]
            pseudo = dict(f for f in fields if f[0].startswith(":"))
            headers = [f for f in fields if not f[0].startswith(":")]
            conn.stats.record("http", {
                "dst": conn.dst, "client": conn.client, "tls": True, "sni": conn.sni, "method": pseudo[":method"],
                "target": pseudo[":path"], "line": f"{pseudo[':method']} {pseudo[':path']} HTTP/2",
                "host": pseudo.get(":authority"), "headers": headers, "body_bytes": 0,
            })  # fmt: skip
            auth = next((v for k, v in headers if k == "authorization"), "")
            if pseudo[":path"] == "/leak/goaway":
                h2conn.close_connection(additional_data=auth.encode())
                return await conn.send(h2conn.data_to_send())
            h2conn.send_headers(event.stream_id, [(":status", "200"), ("content-type", "application/grpc")])
            h2conn.send_data(event.stream_id, b"ok\n")
            h2conn.send_headers(event.stream_id, [("grpc-status", "16"), ("grpc-message", f"invalid token {auth}")],
                                end_stream=True)  # fmt: skip
        await conn.send(h2conn.data_to_send())


# --------------------------------------------------------------------------------------------------- control


def commands(stats: Stats) -> Commands:
    """The control commands besides ping: {"cmd": "stats" | "reset"}."""

    def answer(cmd: Any, request: dict[str, Any]) -> dict[str, Any] | None:
        if cmd == "stats":
            return stats.snapshot()
        if cmd == "reset":
            stats.reset()
            return {"ok": True}
        return None

    return answer


# --------------------------------------------------------------------------------------------------- main


def internet(args: argparse.Namespace, stats: Stats) -> list[tuple[int, Handler]]:
    """The fake internet's TCP listeners: HTTP, HTTPS (HTTP/2 on H2_PORT), echo, the canaries."""
    tls = https(make_tls_context(args.cert, args.key, stats))
    handlers: list[tuple[int, Handler]] = [(p, http) for p in HTTP_PORTS] + [(p, tls) for p in HTTPS_PORTS]
    handlers.append((H2_PORT, https(make_tls_context(args.cert, args.key, stats, ("h2", "http/1.1")))))
    return [*handlers, (ECHO_PORT, echo), (CANARY_PORT, canary), (DOT_PORT, canary)]


async def serve(args: argparse.Namespace) -> None:
    """The fake internet; with --canaries only TCP and UDP canaries on those ports (no DNS, no TLS)."""
    stats = Stats()
    handlers = [(port, canary) for port in args.canaries] if args.canaries else internet(args, stats)
    servers = []
    for port, handler in handlers:

        async def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter, h: Handler = handler) -> None:
            await guarded(h, stats, r, w)

        # reuse_port lets the fake GitHub bind one fake address's :443 too; the kernel prefers its specific bind.
        servers.append(await asyncio.start_server(on_client, args.bind, port, reuse_address=True, reuse_port=True))
    loop = asyncio.get_running_loop()
    udp = []
    for port in args.canaries or (CANARY_PORT,):
        endpoint, _ = await loop.create_datagram_endpoint(partial(UdpCanary, stats, port), (args.bind, port))
        udp.append(endpoint)
    zone = ZONE | read_zone(args.zone)
    dns_servers = [] if args.canaries else start_dns(stats, args.dns_addr, args.zone_default_ttl, zone)
    servers.append(await start_control(args.control, commands(stats), log))

    await serve_until_signalled()

    for server in servers:
        server.close()
    for endpoint in udp:
        endpoint.close()
    for dns_server in dns_servers:
        dns_server.stop()
        dns_server.server.server_close()
    args.control.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", type=Path, required=True, help="unix socket path for the JSON control API")
    parser.add_argument("--cert", type=Path, required=True, help="leaf certificate (PEM) for the TLS ports")
    parser.add_argument("--key", type=Path, required=True, help="leaf private key (PEM)")
    parser.add_argument("--zone-default-ttl", type=int, default=0, help="TTL of zone records (rebind is always 0)")
    parser.add_argument("--zone", type=Path, help="JSON {name: [[type, value]]}: names added to the zone")
    parser.add_argument(
        "--canaries", type=lambda text: tuple(int(port) for port in text.split(",")), default=(),
        help="PORT,...: only TCP and UDP canaries on these ports (a namespace beside the fake internet's)",
    )  # fmt: skip
    parser.add_argument("--bind", default="0.0.0.0", help="address of the TCP listeners")
    parser.add_argument("--dns-addr", default=DNS_ADDR, help="address of the authoritative DNS server")
    # Tests hold a thousand tunnels and more through the gateway: each is a connection here too.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
