"""The proxy addon without a network, for the unit tests of proxy/: the real addons on a fake resolver that
answers from a dict, a fixed set of the gateway's own addresses in place of the bind probe, and a list as the audit
sink. Flows and connections are mitmproxy's own test objects (`mitmproxy.test.tflow`)."""

from __future__ import annotations

import contextlib
import ipaddress
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

from mitmproxy import connection, http, options
from mitmproxy.proxy import events, layer
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.server_hooks import ServerConnectionHookData
from mitmproxy.test import taddons, tflow, tutils

from airlock.audit import AuditRecord
from airlock.dns.upstream import Answer, NameNotFound, Resolver, ResolverUnavailable
from airlock.policy import KnownAddresses, LivePolicy, Policy, Sandbox, SandboxRegistry, parse_policy
from airlock.policy.live import OwnAddresses
from airlock.proxy.addon import build_addon
from airlock.proxy.connect import PinnedConnect
from airlock.proxy.httpaudit import HttpAudit
from airlock.proxy.httppolicy import HttpPolicy
from airlock.proxy.identity import SandboxIdentity
from airlock.proxy.shared import ClientState, GatewaySettings, ProxyState
from airlock.proxy.transparent import TransparentPolicy
from airlock.proxy.tunnels import TunnelPolicy

POLICY = parse_policy(
    """\
version: 1
profiles:
  default:
    allow:
      - host: allowed.test
        ports: [80, 443]
      - host: "*.allowed.test"
        ports: [80, 443]
      - host: ssh.allowed.test
        ports: [22]
        tunnel: true
      - cidr: 10.1.2.4/32
        ports: [443]
        name: internal-svc
      - cidr: 198.51.100.10/32
        ports: [80, 443]
      - cidr: 2606:4700::/32
        ports: [443]
      # the gateway's own addresses (OWN, PROBED): no rule may open them
      - cidr: 203.0.113.248/29
    deny:
      - host: denied.allowed.test
      - host: tracker.test
  strict:
    allow:
      - host: other.test
""",
    "p.yaml",
)

SANDBOX_IP = "10.99.0.2"  # sandbox "sbx", profile default
STRICT_IP = "10.98.0.2"  # sandbox "tight", profile strict
STRANGER_IP = "192.0.2.50"  # no sandbox's network
OWN = "203.0.113.250"  # an own address the gateway knew at start (GatewaySettings.own_addresses)
PROBED = "203.0.113.251"  # an own address it gained later (the bind probe finds it)

SBX = Sandbox("sbx", "default", ipaddress.ip_network("10.99.0.0/24"))
TIGHT = Sandbox("tight", "strict", ipaddress.ip_network("10.98.0.0/24"))


def answer(*addresses: str, cnames: tuple[str, ...] = ()) -> Answer:
    return Answer(tuple(ipaddress.ip_address(a) for a in addresses), 60, cnames)


type Reply = Answer | list[Answer] | Exception

# The fake internet's DNS. 203.0.113/24, 198.51.100/24 and 2606:4700::/32 are public to the classifier.
ZONE: dict[str, Reply] = {
    "allowed.test": answer("203.0.113.10"),
    "www.allowed.test": answer("203.0.113.11"),
    "dual.allowed.test": answer("2606:4700::10", "203.0.113.12"),
    "v6.allowed.test": answer("2606:4700::11"),
    "internal.allowed.test": answer("10.0.0.5"),
    "mapped.allowed.test": answer("::ffff:10.0.0.5"),
    "loopback.allowed.test": answer("127.0.0.1", "::1"),
    "metadata.allowed.test": answer("169.254.169.254"),
    "metadata6.allowed.test": answer("fd00:ec2::254"),
    "mixed.allowed.test": answer("10.0.0.5", "169.254.169.254", "127.0.0.1", "203.0.113.13", "::1"),
    "svc.allowed.test": answer("10.1.2.4"),
    "link.allowed.test": answer("10.231.0.1"),
    "own.allowed.test": answer(OWN),
    "probed.allowed.test": answer(PROBED, "::ffff:203.0.113.250"),
    "alias.allowed.test": answer("203.0.113.14", cnames=("edge.cdn.test", "tracker.test")),
    "cdn.allowed.test": answer("203.0.113.15", cnames=("edge.cdn.test",)),
    "down.allowed.test": ResolverUnavailable("every upstream server timed out"),
    "ssh.allowed.test": answer("203.0.113.16"),
    "other.test": answer("203.0.113.20"),
}


class FakeResolver:
    """The interface of `airlock.dns.upstream.Resolver` the proxy uses (`resolve`), answering from a dict.

    A list of answers is handed out one per lookup, the last one repeating (a rebinding name); an exception is
    raised; a name not in the dict does not exist. Every lookup is counted in `asked`."""

    def __init__(self, zone: dict[str, Reply]) -> None:
        self.zone = {name: list(reply) if isinstance(reply, list) else reply for name, reply in zone.items()}
        self.asked: list[str] = []

    async def resolve(self, name: str) -> Answer:
        self.asked.append(name)
        reply = self.zone.get(name, NameNotFound(f"{name}: no such name"))
        if isinstance(reply, list):
            reply = reply.pop(0) if len(reply) > 1 else reply[0]
        if isinstance(reply, Exception):
            raise reply
        return reply


PUBLIC = ipaddress.ip_address("192.0.2.1")


class PublicResolver:
    """The shared resolver's interface (proxy: resolve; DNS: cached and query): every name answers PUBLIC, but those
    in `answers` (an answer, or an exception raised)."""

    def __init__(self, answers: dict[str, Answer | Exception] | None = None) -> None:
        self.answers = answers or {}

    async def resolve(self, name: str) -> Answer:
        answer = self.answers.get(name, Answer((PUBLIC,), 60))
        if isinstance(answer, Exception):
            raise answer
        return answer

    def cached(self, name: str, qtype: int) -> Answer | None:
        return None

    async def query(self, name: str, qtype: int) -> Answer:
        return await self.resolve(name)


@dataclass
class Gateway:
    shared: ProxyState
    resolver: FakeResolver
    records: list[AuditRecord]
    addons: list[object]

    def addon[T](self, kind: type[T]) -> T:
        return next(a for a in self.addons if isinstance(a, kind))

    @property
    def identity(self) -> SandboxIdentity:
        return self.addon(SandboxIdentity)

    @property
    def http(self) -> HttpPolicy:
        return self.addon(HttpPolicy)

    @property
    def tunnels(self) -> TunnelPolicy:
        return self.addon(TransparentPolicy).tunnels

    @property
    def transparent(self) -> TransparentPolicy:
        return self.addon(TransparentPolicy)

    @property
    def pinned(self) -> PinnedConnect:
        return self.addon(PinnedConnect)

    @property
    def audit(self) -> HttpAudit:
        return self.addon(HttpAudit)

    def addon_named(self, name: str) -> Any:
        return next(a for a in self.addons if type(a).__name__ == name)

    def state(self, client: connection.Client) -> ClientState:
        return self.shared.client(client)


def gateway(
    zone: dict[str, Reply] | None = None, policy: Policy = POLICY, own: OwnAddresses | None = None, **settings: Any
) -> Gateway:
    resolver = FakeResolver(ZONE if zone is None else zone)
    records: list[AuditRecord] = []
    registry = SandboxRegistry([SBX, TIGHT])
    config = GatewaySettings(**settings)
    # The gateway's own addresses, as its probe would find them (no sockets here): the listen one and one more.
    own = own or KnownAddresses(frozenset({ipaddress.ip_address(OWN), ipaddress.ip_address(PROBED)}))
    airlock = build_addon(LivePolicy(policy, registry, own), cast(Resolver, resolver), records.append, config)
    return Gateway(airlock.shared, resolver, records, list(airlock.concerns))


@contextlib.contextmanager
def mitmproxy_options() -> Iterator[taddons.context]:
    """mitmproxy's `ctx` as the gateway configures it (the deny path reads `stream_large_bodies`)."""
    with taddons.context() as tctx:
        tctx.options.add_option("stream_large_bodies", str | None, "1m", "")
        yield tctx


def client(ip: str = SANDBOX_IP) -> connection.Client:
    conn = tflow.tclient_conn()
    conn.peername = (ip, 40000)
    return conn


def connect_flow(host: str, port: int, conn: connection.Client | None = None) -> http.HTTPFlow:
    """The CONNECT request of a regular-mode client, as mitmproxy's HTTP/1 layer reads it."""
    request = tutils.treq(
        method=b"CONNECT", scheme=b"", host=host, port=port, authority=f"{host}:{port}".encode(), path=b"",
        headers=http.Headers(), content=b"",
    )  # fmt: skip
    return tflow.tflow(client_conn=conn or client(), req=request)


def request_flow(
    host: str,
    port: int = 80,
    host_header: str | None = "",
    *,
    scheme: str = "http",
    http_version: str = "HTTP/1.1",
    conn: connection.Client | None = None,
    headers: dict[str, str] | None = None,
) -> http.HTTPFlow:
    """An absolute-form request `GET scheme://host:port/path?q` through the proxy. `host_header` "" writes the
    authority as a browser would, None writes no Host header."""
    fields = http.Headers(**(headers or {}))
    if host_header == "":
        host_header = host if port == (443 if scheme == "https" else 80) else f"{host}:{port}"
    if host_header is not None:
        fields["Host"] = host_header
    request = tutils.treq(
        scheme=scheme.encode(), host=host, port=port, path=b"/path?secret=1", http_version=http_version.encode(),
        headers=fields, content=b"",
    )  # fmt: skip
    return tflow.tflow(client_conn=conn or client(), req=request)


def upstream(conn: connection.Client, host: str, port: int, sni: str | None = None) -> ServerConnectionHookData:
    """What mitmproxy hands `server_connect`: the server connection it is about to open, addressed by name."""
    server = tflow.tserver_conn()
    server.address, server.sni, server.peername, server.sockname = (host, port), sni, None, None
    return ServerConnectionHookData(server, conn)


def next_layer(conn: connection.Client, host: str, port: int, data: bytes) -> layer.NextLayer:
    """The layer decision inside a CONNECT tunnel to host:port once the client has sent `data`."""
    context = Context(conn, options.Options())
    context.server.address = (host, port)
    nextlayer = layer.NextLayer(context)
    if data:
        nextlayer.events.append(events.DataReceived(conn, data))
    return nextlayer


def client_hello(*extensions: tuple[int, bytes]) -> bytes:
    """A TLS record holding a ClientHello with exactly these extensions."""
    block = b"".join(struct.pack("!HH", kind, len(body)) + body for kind, body in extensions)
    body = b"\x03\x03" + bytes(32) + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00" + struct.pack("!H", len(block)) + block
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack("!H", len(handshake)) + handshake


def sni(*names: bytes) -> tuple[int, bytes]:
    """A server_name extension listing `names` (one, as a client sends, or several, as none may)."""
    entries = b"".join(struct.pack("!BH", 0, len(name)) + name for name in names)
    return (0, struct.pack("!H", len(entries)) + entries)
