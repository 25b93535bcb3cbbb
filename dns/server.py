"""The sandbox DNS server's transports: UDP and TCP listeners on the gateway's sandbox-facing address.

Each query meets admission first (dns/admission.py: which sandbox, its rate, TCP caps), then, on UDP, the reply
memory (dns/memory.py: the same question within a second gets the same reply bytes, decided and audited as
before), and only then the resolver (dns/resolver.py), which judges it and writes its audit line. The listeners
are asyncio endpoints rather than dnslib's threaded `DNSServer`: the whole gateway is one asyncio loop, and a
thread per packet plus a cross-thread hop into that loop would cost more than the resolver itself. Malformed
input is dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from dnslib import DNSRecord

from airlock.audit import AuditRecord, RepeatedDecisions
from airlock.policy import LivePolicy, Sandbox
from airlock.policy.held_requests import Asker

from .admission import Admission, DnsSettings
from .answered import AnsweredAddresses
from .memory import ReplyMemory
from .resolver import Handler, PolicyResolver
from .upstream import Resolver

MAX_QUERY_BYTES = 1232  # a query is small; anything larger is not a query we want (EDNS's safe size)
UDP_BATCH = 64  # datagrams read per wakeup, with one clock reading


class DnsServer:
    def __init__(
        self,
        live: LivePolicy,
        resolver: Resolver,
        emit: Callable[[AuditRecord | RepeatedDecisions], None],
        settings: DnsSettings,
        host: str,
        port: int = 53,
        answered: AnsweredAddresses | None = None,
        approvals: Asker | None = None,
    ) -> None:
        self.live, self.emit, self.settings = live, emit, settings
        self.host, self.port = host, port
        self.stats: Counter[str] = Counter()
        self.admission = Admission(live, settings, emit, self.stats)
        self.resolver = PolicyResolver(live, resolver, emit, settings, self.admission, self.stats, answered, approvals)
        self.memory = ReplyMemory()
        self._udp: socket.socket | None = None
        self._tcp: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._tcp_writers: set[asyncio.StreamWriter] = set()

    @property
    def listening(self) -> bool:
        return self._udp is not None and self._tcp is not None and self._tcp.is_serving()

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
        self.admission.flush()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _readable(self) -> None:
        udp, admit, recall = self._udp, self.admission.admit, self.memory.recall
        assert udp is not None
        now, wall = time.monotonic(), time.time()
        repeated: list[tuple[str, str]] = []  # (audit template, client) of the remembered replies sent
        may_recall = self.settings.audit_failure() is None  # else every query goes where it is refused
        policy = self.live.current.policy  # remembered replies are of the policy in force: a reload forgets them
        try:
            for _ in range(UDP_BATCH):
                try:
                    data, address = udp.recvfrom(MAX_QUERY_BYTES + 1)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    return  # e.g. an ICMP error queued on the socket: nothing to answer
                if len(data) > MAX_QUERY_BYTES:
                    self.stats["dropped_oversize"] += 1
                    continue
                client = address[0]
                sandbox = admit(client, now)
                if sandbox is False:
                    continue
                remembered = recall(sandbox.id, data, policy, now) if sandbox and may_recall else None
                if remembered is None:
                    self._spawn(self._udp_query(data, address, sandbox))
                    continue
                repeated.append((remembered[1], client))
                try:
                    udp.sendto(remembered[0], address)
                except OSError:  # the sandbox went away: nothing to tell it
                    continue
        finally:
            if repeated:
                self.emit(RepeatedDecisions(wall, repeated))

    async def _udp_query(self, data: bytes, address: tuple[str, int], sandbox: Sandbox | None) -> None:
        request = self._parse(data)
        if request is None:
            return
        handler = Handler(address[0], "udp", sandbox)
        reply = await self.resolver.resolve(request, handler)
        packet = reply.pack()
        if len(packet) > 512:
            # Classic UDP limit: send the header and question with TC set; the client retries over TCP.
            packet = reply.truncate().pack()
        elif sandbox is not None and handler.record is not None and handler.policy is not None:
            rcode = reply.header.rcode
            self.memory.keep(sandbox.id, data, packet, rcode, handler.record, handler.policy, time.monotonic())
        self._send(packet, address)

    def _send(self, packet: bytes, address: tuple[str, int]) -> None:
        if self._udp is not None:
            with contextlib.suppress(OSError):
                self._udp.sendto(packet, address)

    def _parse(self, data: bytes) -> DNSRecord | None:
        try:
            request = DNSRecord.parse(data)
        except Exception:  # hostile bytes can make dnslib raise anything (e.g. RecursionError on pointer chains)
            self.stats["dropped_malformed"] += 1
            return None
        if request.header.qr or not request.questions:
            self.stats["dropped_malformed"] += 1  # a response, or nothing asked: not for us to answer
            return None
        return request

    async def _tcp_query(self, data: bytes, client: str) -> DNSRecord | None:
        """The reply to one TCP query of at most MAX_QUERY_BYTES, or None to send nothing (and close)."""
        request = self._parse(data)
        if request is None:
            return None
        sandbox = self.admission.admit(client)
        if sandbox is False:
            return None
        return await self.resolver.resolve(request, Handler(client, "tcp", sandbox or None))

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = writer.get_extra_info("peername")[0]
        owner = self.admission.open_tcp(client)
        if owner is None:
            writer.close()
            return
        self._tcp_writers.add(writer)
        timeout = self.settings.tcp_timeout
        try:
            while True:
                (length,) = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), timeout))
                if length > MAX_QUERY_BYTES:
                    self.stats["dropped_oversize"] += 1
                    break  # no query is that long: not worth reading
                data = await asyncio.wait_for(reader.readexactly(length), timeout)
                reply = await self._tcp_query(data, client)
                if reply is None:
                    break
                packet = reply.pack()
                writer.write(struct.pack("!H", len(packet)) + packet)
                await asyncio.wait_for(writer.drain(), timeout)  # a client that never reads must not hold on
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            self.admission.close_tcp(owner)
            self._tcp_writers.discard(writer)
            # Not close(): it keeps the socket until a client that never reads has taken the buffered replies.
            # What the kernel already holds is still delivered.
            writer.transport.abort()
