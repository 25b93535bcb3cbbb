"""The airlock mitmproxy addon: every way out of a sandbox passes these hooks.

Data flows one way: identify sandbox → canonicalize → decide → resolve → vet → connect → audit.
The early hooks (`http_connect`, `requestheaders`, `tls_clienthello`, `next_layer`) give the sandbox a clear
answer; `server_connect` is the one enforcement point that every upstream connection passes, whatever the
mode or layer, so it decides again from scratch and pins the vetted address.

mitmproxy logs and swallows exceptions raised by addons and lets the flow go on (fail open). Every hook here
therefore runs under `_fail_closed`, which turns any fault into a denial.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import connection, ctx, http
from mitmproxy.net.http.http1 import expected_http_body_size
from mitmproxy.proxy import events, layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.tcp import TcpMessageInjected
from mitmproxy.proxy.layers.tls import ClientHello, parse_client_hello
from mitmproxy.proxy.server_hooks import ServerConnectionHookData
from mitmproxy.proxy.utils import expect
from mitmproxy.utils import human

from airlock.audit import AuditRecord, AuditThrottle, Kind
from airlock.dns.upstream import ResolveError, Resolver
from airlock.policy import (
    Decision,
    HostError,
    IPAddress,
    LivePolicy,
    ReasonCode,
    Sandbox,
    canonical_host,
    decide,
    decide_alias,
    format_host_port,
    is_ip,
    vet,
)

from .tlsnames import ECH_EXTENSIONS, TlsNameError, hidden_name, server_name

log = logging.getLogger("airlock.proxy")

DECISION_HEADER = "X-Airlock-Decision"
REQUEST_ID_HEADER = "X-Airlock-Request-Id"
_UNKNOWN_SANDBOX = Decision(False, "connection from an address that belongs to no sandbox", ReasonCode.UNKNOWN_SANDBOX)


@dataclass
class GatewaySettings:
    connect_timeout: float = 10.0
    # A flood of idle connections must not starve the gateway. The gateway derives these from its open-file
    # limit (airlock/gateway.py): each proxied connection holds two descriptors, the sandbox's and the upstream.
    max_tunnels_per_sandbox: int = 3584
    max_connections_per_sandbox: int = 4096  # client connections; upstream connections are capped alike
    max_connections: int = 65536  # client connections of all sandboxes together; upstream ones alike
    # Why the audit log cannot be written, or None: while it cannot, every new request is denied (fail closed).
    audit_failure: Callable[[], str | None] = field(default=lambda: None)


@dataclass
class _ClientState:
    """What the gateway knows about one sandbox client connection."""

    sandbox: Sandbox | None
    tunnel: AuditRecord | None = None  # the CONNECT decision, once the sandbox asked for a tunnel
    tunnel_decision: Decision | None = None
    denied: str | None = None  # set once anything denied this connection: no upstream may be opened
    # Outcomes the early hooks vetted, by the (host, port) mitmproxy will ask to connect to: the connection
    # goes to exactly the address that was checked, and a rebinding name gets no second answer.
    vetted: dict[tuple[str, int], Outcome] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    counted: bool = False  # holds one of the sandbox's connection slots


@dataclass(frozen=True, slots=True)
class Outcome:
    decision: Decision
    host: str  # canonical when the host was valid
    resolved: list[str] = field(default_factory=list)
    chosen_ip: str | None = None

    def fill(self, record: AuditRecord) -> None:
        record.host, record.resolved, record.chosen_ip = self.host, self.resolved, self.chosen_ip
        record.decision = "allow" if self.decision.allow else "deny"
        record.reason, record.code, record.hint = self.decision.reason, self.decision.code, self.decision.hint
        record.decided_by(self.decision.rule)


class _Shared:
    """State all hook classes read: the live policy (policy, sandbox registry, the gateway's own addresses) and
    per-client connection state."""

    def __init__(
        self, live: LivePolicy, resolver: Resolver, emit: Callable[[AuditRecord], None], settings: GatewaySettings
    ) -> None:
        self.live = live
        self.resolver = resolver
        self.emit = emit
        self.settings = settings
        self.clients: dict[str, _ClientState] = {}
        self.tunnels: Counter[str] = Counter()
        self.connections: Counter[str] = Counter()  # open client connections per sandbox
        self.open_connections = 0  # of all sandboxes
        self.upstreams: Counter[str] = Counter()  # open upstream connections per sandbox
        self.upstream_of: dict[str, str] = {}  # server connection id → the sandbox whose upstream slot it holds
        self.refusals = AuditThrottle(emit)  # refusals that come in floods: a few lines each, then a summary
        self.resolved: dict[str, list[str]] = {}  # server connection id → addresses the name resolved to

    def client(self, client: connection.Client) -> _ClientState:
        state = self.clients.get(client.id)
        if state is None:
            state = self.clients[client.id] = _ClientState(self.live.current.registry.identify(client.peername[0]))
        return state

    def refuse(self, record: AuditRecord) -> None:
        """Audit a refusal that may come in a flood (unknown network, over a cap): a few lines, then a summary."""
        if self.refusals.admit(record.kind, record.sandbox, record.reason, record.code, record.client):
            self.emit(record)

    def connection_refusal(self, sandbox: str) -> str | None:
        """Why one more client connection of this sandbox must be refused, if it must."""
        settings = self.settings
        if self.connections[sandbox] >= settings.max_connections_per_sandbox:
            return f"sandbox already has {settings.max_connections_per_sandbox} connections open"
        if self.open_connections >= settings.max_connections:
            return f"the gateway already has {settings.max_connections} connections open"
        return None

    def take_upstream(self, server_id: str, sandbox: str) -> str | None:
        """Hold an upstream slot for this server connection; or why none is left. A client connection may open
        several upstream connections (one per host it sends plain HTTP to): they are capped like the clients."""
        settings = self.settings
        if self.upstreams[sandbox] >= settings.max_connections_per_sandbox:
            return f"sandbox already has {settings.max_connections_per_sandbox} upstream connections open"
        if len(self.upstream_of) >= settings.max_connections:
            return f"the gateway already has {settings.max_connections} upstream connections open"
        self.upstream_of[server_id] = sandbox
        self.upstreams[sandbox] += 1
        return None

    def release_upstream(self, server_id: str) -> None:
        sandbox = self.upstream_of.pop(server_id, None)
        if sandbox is not None:
            self.upstreams[sandbox] -= 1

    async def evaluate(self, sandbox: Sandbox | None, raw_host: str, port: int) -> Outcome:
        """The whole judgement of one upstream target: canonicalize, decide, resolve, vet, choose; under one
        snapshot of the live policy, however long the resolution takes."""
        if sandbox is None:
            return Outcome(_UNKNOWN_SANDBOX, raw_host)
        if (failure := self.settings.audit_failure()) is not None:
            reason = f"audit log unavailable ({failure}): no request is allowed until it can be written"
            return Outcome(Decision(False, reason, ReasonCode.AUDIT_UNAVAILABLE), raw_host)
        try:
            host = _target(raw_host, port)
        except HostError as e:
            return Outcome(Decision(False, f"invalid host: {e}", ReasonCode.INVALID_HOST), raw_host)
        live = self.live.current
        profile = live.profile(sandbox)
        decision = decide(profile, host, port)
        if not decision.allow:
            return Outcome(decision, host)
        if is_ip(host):
            addresses: tuple[IPAddress, ...] = (ipaddress.ip_address(host),)
        else:
            try:
                answer = await self.resolver.resolve(host)
            except ResolveError as e:
                failed = Decision(False, f"resolution failed: {e}", ReasonCode.RESOLVE_FAILED, decision.rule)
                return Outcome(failed, host)
            if denied := decide_alias(profile, answer.cnames, port):
                return Outcome(denied, host, [str(a) for a in answer.addresses])
            addresses = answer.addresses
        vetted = vet(profile, addresses, port, live.own.among(addresses))
        resolved = [str(a) for a in addresses]
        if not vetted.allowed:
            return Outcome(Decision(False, vetted.reason, vetted.code, None, decision.hint), host, resolved)
        chosen = min(vetted.allowed, key=lambda a: a.version)  # IPv4 first: the family most often routed
        return Outcome(decision, host, resolved, str(chosen))


def _fail_closed(on_error: Callable[..., None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a hook; on any exception log it and apply `on_error(self, *args)`, which denies."""

    def wrap(hook: Callable[..., Any]) -> Callable[..., Any]:
        if asyncio.iscoroutinefunction(hook):

            @functools.wraps(hook)
            async def run_async(self: Any, *args: Any) -> None:
                try:
                    await hook(self, *args)
                except Exception:
                    log.exception("airlock hook %s failed: denying", hook.__name__)
                    on_error(self, *args)

            return run_async

        @functools.wraps(hook)
        def run(self: Any, *args: Any) -> None:
            try:
                hook(self, *args)
            except Exception:
                log.exception("airlock hook %s failed: denying", hook.__name__)
                on_error(self, *args)

        return run

    return wrap


def _nothing_to_deny(self: Any, *args: Any) -> None:
    """For hooks that keep books after the decision was made and acted on (a client gone, an upstream connected,
    failed or closed, a flow that failed): nothing is left to deny, and the wrapper has logged the fault."""


def _answer(flow: http.HTTPFlow, response: http.Response) -> None:
    """Answer a refused request, or kill it where mitmproxy 12 cannot answer: a response set on a request whose
    body it streams, or starts streaming later, crashes its HTTP layer ("Can't set a response and enable
    streaming at the same time"). Nothing is forwarded either way."""
    if _body_is_buffered(flow.request):
        flow.response = response
    else:
        flow.kill()


def _body_is_buffered(request: http.Request) -> bool:
    """Will mitmproxy read this request's whole body before answering? Only when its length is known (no chunked
    HTTP/1, no HTTP/2 or 3 stream without Content-Length) and within stream_large_bodies."""
    if request.stream:
        return False
    if (request.is_http2 or request.is_http3) and "content-length" not in request.headers:
        return False  # a stream may carry DATA whatever its headers say
    try:
        size = expected_http_body_size(request)
    except ValueError:
        return False
    limit = human.parse_size(ctx.options.stream_large_bodies)
    return size is not None and size >= 0 and (limit is None or size <= limit)


def _deny_response(record: AuditRecord, hint: str | None, status: int = 403) -> http.Response:
    body = {
        "decision": "deny", "reason": record.reason, "code": record.code, "rule_hint": hint,
        "request_id": record.request_id,
    }  # fmt: skip
    return http.Response.make(
        status,
        json.dumps(body, indent=None).encode() + b"\n",
        {
            "Content-Type": "application/json",
            DECISION_HEADER: "deny",
            REQUEST_ID_HEADER: record.request_id,
            "Connection": "close",
        },
    )


def _target(raw_host: str, port: int) -> str:
    """Canonical host, or HostError. Bracketed IPv6 from URLs is accepted by canonical_host."""
    if not 1 <= port <= 65535:
        raise HostError(f"port {port} out of range")
    return canonical_host(raw_host)


UNKNOWN_NETWORK = "unknown sandbox network"


class SandboxIdentity:
    """Names the sandbox behind each client connection; connections from unknown networks are refused."""

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared

    def _refuse(self, client: connection.Client) -> None:
        client.error = "airlock: internal error identifying sandbox"

    @_fail_closed(_refuse)
    def client_connected(self, client: connection.Client) -> None:
        shared, state = self.shared, self.shared.client(client)
        if state.sandbox is None:
            client.error = "airlock: connection from an address that belongs to no sandbox"
            record = AuditRecord(
                "connect", "-", client.peername[0], "-", None, "deny", UNKNOWN_NETWORK, ReasonCode.UNKNOWN_SANDBOX
            )
            shared.refuse(record)
            return
        if refusal := shared.connection_refusal(state.sandbox.id):
            client.error = f"airlock: {refusal}"  # closed at once: it holds no descriptor of ours any longer
            record = AuditRecord(
                "connect", state.sandbox.id, client.peername[0], "-", None, "deny", refusal, ReasonCode.CONNECTION_LIMIT
            )
            shared.refuse(record)
            return
        shared.connections[state.sandbox.id] += 1
        shared.open_connections += 1
        state.counted = True

    @_fail_closed(_nothing_to_deny)
    def client_disconnected(self, client: connection.Client) -> None:
        state = self.shared.clients.pop(client.id, None)
        if state is not None and state.counted and state.sandbox is not None:
            self.shared.connections[state.sandbox.id] -= 1
            self.shared.open_connections -= 1
        if state is None or state.tunnel is None:
            return
        self.shared.tunnels[state.tunnel.sandbox] -= 1
        record = state.tunnel
        record.duration_ms = round((time.monotonic() - state.started) * 1000, 1)
        self.shared.emit(record)


class HttpPolicy:
    """Early answers to what the sandbox asks for (CONNECT targets, plain-HTTP requests): a denial here is a
    403 the agent can read, and no upstream connection is ever attempted."""

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared

    def _deny_flow(self, flow: http.HTTPFlow) -> None:
        self.shared.client(flow.client_conn).denied = "internal error"
        record = AuditRecord(
            "http", "-", flow.client_conn.peername[0], "-", None, "error", "airlock internal error",
            ReasonCode.INTERNAL_ERROR,
        )  # fmt: skip
        self.shared.emit(record)
        _answer(flow, _deny_response(record, None, 500))

    def _record(self, flow: http.HTTPFlow, kind: Kind, state: _ClientState) -> AuditRecord:
        request = flow.request
        path = None if kind == "connect" else request.path.split("?", 1)[0]
        sandbox = state.sandbox.id if state.sandbox else "-"
        return AuditRecord(
            kind, sandbox, flow.client_conn.peername[0], request.host, request.port, "deny", "",
            ReasonCode.INTERNAL_ERROR,  # every caller sets its own reason and code before the record is emitted
            method=request.method, path=path,
        )  # fmt: skip

    def _refuse(self, flow: http.HTTPFlow, record: AuditRecord, hint: str | None, status: int = 403) -> None:
        self.shared.emit(record)
        _answer(flow, _deny_response(record, hint, status))

    @_fail_closed(_deny_flow)
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        state = self.shared.client(flow.client_conn)
        record = self._record(flow, "connect", state)
        outcome = await self.shared.evaluate(state.sandbox, flow.request.host, flow.request.port)
        outcome.fill(record)
        if not outcome.decision.allow:
            return self._refuse(flow, record, outcome.decision.hint)
        state.vetted[(flow.request.host, flow.request.port)] = outcome
        assert state.sandbox is not None
        limit = self.shared.settings.max_tunnels_per_sandbox
        if self.shared.tunnels[state.sandbox.id] >= limit:
            record.decision, record.reason = "deny", f"sandbox already has {limit} open tunnels"
            record.code = ReasonCode.TUNNEL_LIMIT
            self.shared.refuse(record)  # a client retrying in a loop gets its 429s, the audit a summary
            return _answer(flow, _deny_response(record, None, 429))
        self.shared.tunnels[state.sandbox.id] += 1
        state.tunnel, state.tunnel_decision, state.started = record, outcome.decision, time.monotonic()

    @_fail_closed(_deny_flow)
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        state = self.shared.client(flow.client_conn)
        record = self._record(flow, "http", state)
        if state.tunnel is not None:
            # Requests inside a tunnel exist only if something intercepted it; airlock passes tunnels through.
            record.reason, record.code = "HTTP request inside a tunnel", ReasonCode.REQUEST_IN_TUNNEL
            return self._refuse(flow, record, None)
        request = flow.request
        if request.host_header is None and request.http_version != "HTTP/1.0":
            # mitmproxy forwards an absolute-form request without one: the upstream would pick its default site.
            record.reason = f"{request.http_version} request without a Host header"
            record.code = ReasonCode.MISSING_HOST_HEADER
            return self._refuse(flow, record, None, 400)
        outcome = await self.shared.evaluate(state.sandbox, request.host, request.port)
        outcome.fill(record)
        if outcome.decision.allow and (mismatch := _host_header_mismatch(flow, outcome.host)):
            record.decision, record.reason, record.code = "deny", mismatch, ReasonCode.HOST_MISMATCH
            record.decided_by(None)
        if record.decision != "allow":
            return self._refuse(flow, record, outcome.decision.hint)
        if request.host_header is None:  # HTTP/1.0 may omit it: the upstream gets the name that was judged
            request.host_header = _authority(outcome.host, request.port, _default_port(flow))
        state.vetted[(request.host, request.port)] = outcome
        flow.metadata["airlock"] = record
        flow.metadata["airlock_started"] = time.monotonic()


def _default_port(flow: http.HTTPFlow) -> int:
    return 443 if flow.request.scheme == "https" else 80


def _authority(host: str, port: int, default_port: int) -> str:
    """`host[:port]` as a Host header writes it: the port only when it is not the scheme's default."""
    text = format_host_port(host, port)
    return text if port != default_port else text.rsplit(":", 1)[0]


def _host_header_mismatch(flow: http.HTTPFlow, host: str) -> str | None:
    """The Host header must name exactly the target being judged: no domain fronting."""
    port = flow.request.port
    header = flow.request.host_header
    if header is not None and not _names_target(header, host, port, _default_port(flow)):
        return f"Host header {header!r} does not match the request target {format_host_port(host, port)}"
    return None


def _names_target(text: str, host: str, port: int, default_port: int) -> bool:
    """Does `host[:port]` text name this canonical host and port?"""
    text_host, text_port = text, ""
    if text.startswith("["):
        text_host, bracket, rest = text.partition("]")
        if not bracket or rest[:1] not in ("", ":"):
            return False  # `[v6`, `[v6]80`: the upstream's parser may read these otherwise than this one
        text_host, text_port = text_host + "]", rest[1:]
    elif text.count(":") > 1:
        return False  # an IPv6 literal in an authority is always bracketed (RFC 3986 §3.2.2)
    elif text.count(":") == 1:
        text_host, text_port = text.split(":")
    try:
        same_host = canonical_host(text_host) == host
    except HostError:
        return False
    return same_host and (text_port == str(port) or (text_port == "" and port == default_port))


class _MeteredTunnel(layers.TCPLayer):
    """A passed-through tunnel (no flow, no per-chunk hooks) that counts the bytes it relays for the audit."""

    def __init__(self, context: Context, record: AuditRecord) -> None:
        super().__init__(context, ignore=True)
        self.record = record

    @expect(events.DataReceived, events.ConnectionClosed, TcpMessageInjected)
    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.DataReceived):
            if event.connection == self.context.client:
                self.record.bytes_in = (self.record.bytes_in or 0) + len(event.data)
            else:
                self.record.bytes_out = (self.record.bytes_out or 0) + len(event.data)
        yield from super().relay_messages(event)


class TunnelPolicy:
    """What travels inside an allowed CONNECT tunnel: TLS whose SNI names the CONNECT host (and whose real name
    is not hidden by Encrypted Client Hello), or, where the rule says `tunnel: true`, bytes that are not TLS;
    either way passed through untouched (never intercepted) and metered.

    mitmproxy's own next-layer choice (TLS layers, HTTP, raw TCP) is replaced here, so that no TLS layer is
    ever built for a tunnel: the ClientHello is read from the first bytes, and until it is complete the
    decision waits (`nextlayer.layer = None`)."""

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared

    def _deny_layer(self, nextlayer: layer.NextLayer) -> None:
        state = self.shared.client(nextlayer.context.client)
        self._deny(state, ReasonCode.INTERNAL_ERROR, "internal error")
        nextlayer.layer = layers.TCPLayer(nextlayer.context, ignore=True)

    def _deny(self, state: _ClientState, code: ReasonCode, reason: str) -> None:
        state.denied = reason  # server_connect refuses to open anything for this connection
        if state.tunnel is not None:
            state.tunnel.decision, state.tunnel.reason, state.tunnel.code = "deny", reason, code

    @_fail_closed(_deny_layer)
    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        state = self.shared.clients.get(nextlayer.context.client.id)
        if state is None or state.tunnel is None or not nextlayer.context.server.address:
            return  # not the inside of one of our tunnels (e.g. the connection's first layer)
        data = nextlayer.data_client()
        if _may_be_tls(data):
            try:
                hello = parse_client_hello(data)
            except ValueError:
                self._deny(state, ReasonCode.MALFORMED_CLIENT_HELLO, "malformed TLS ClientHello")
            else:
                if hello is None:
                    nextlayer.layer = None  # wait for the rest of the ClientHello
                    return
                ech_allowed = state.tunnel_decision is not None and state.tunnel_decision.ech
                if refusal := _hello_refusal(hello, state.tunnel.host, ech_allowed):
                    self._deny(state, *refusal)
        elif not (state.tunnel_decision and state.tunnel_decision.tunnel):
            reason = "tunnel carries something other than TLS and no rule allows a raw tunnel"
            self._deny(state, ReasonCode.NOT_TLS, reason)
        nextlayer.layer = _MeteredTunnel(nextlayer.context, state.tunnel)


def _may_be_tls(data: bytes) -> bool:
    """Is this (or may it still become) a TLS handshake record? Any 0x16 0x03 start counts, also record versions
    mitmproxy's own check rejects: servers ignore that byte, so a raw tunnel must not let such a hello by."""
    return data[:2] == b"\x16\x03"[: len(data)]


def _hello_refusal(hello: ClientHello, host: str, ech_allowed: bool) -> tuple[ReasonCode, str] | None:
    """Why a tunnel with this ClientHello must not open, if it must not. ECH hides the name the client really
    connects to behind the outer SNI (fronting), unless the rule says `ech: true`; the (outer) SNI must be one
    valid host name, and it must be the CONNECT host."""
    extensions = hello.extensions
    if (hidden := hidden_name(extensions)) is not None and not ech_allowed:
        return ReasonCode.ECH, (
            f"TLS ClientHello carries Encrypted Client Hello extension 0x{hidden:04x} ({ECH_EXTENSIONS[hidden]}): "
            "the name it connects to is hidden (a rule with `ech: true` allows it for its hosts)"
        )
    try:
        sni = server_name(extensions)
    except TlsNameError as e:
        return ReasonCode.INVALID_SNI, f"invalid TLS SNI: {e}"
    mismatch = _sni_mismatch(sni, host)
    return None if mismatch is None else (ReasonCode.SNI_MISMATCH, mismatch)


def _sni_mismatch(sni: str | None, expected: str) -> str | None:
    """A valid SNI (canonical) must name the CONNECT host. Only an IP-literal CONNECT may send none, since SNI
    cannot carry an address. An IP-literal CONNECT that does send a name is fronting: the CIDR rule judged the
    address, never that name, and a server there may pick its virtual host by it; so it is a mismatch like any."""
    if sni == expected or (sni is None and is_ip(expected)):
        return None
    return f"TLS SNI {sni!r} does not match CONNECT host {expected}"


class PinnedConnect:
    """The enforcement point: every upstream connection is judged again here and pinned to the vetted IP."""

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._names: dict[str, tuple[str, int]] = {}

    def _refuse(self, data: ServerConnectionHookData) -> None:
        data.server.error = "airlock: internal error while vetting the upstream"

    @_fail_closed(_refuse)
    async def server_connect(self, data: ServerConnectionHookData) -> None:
        server, state = data.server, self.shared.client(data.client)
        if state.denied is not None:
            server.error = f"airlock: {state.denied}"
            return
        if server.address is None:
            server.error = "airlock: no upstream address"
            return
        raw_host, port = server.address[0], server.address[1]
        outcome = state.vetted.pop((raw_host, port), None) or await self.shared.evaluate(state.sandbox, raw_host, port)
        if state.tunnel is not None:
            outcome.fill(state.tunnel)
        if not outcome.decision.allow or outcome.chosen_ip is None:
            server.error = f"airlock: {outcome.decision.reason}"
            return
        assert state.sandbox is not None  # an allowed outcome has a sandbox
        if refusal := self.shared.take_upstream(server.id, state.sandbox.id):
            server.error = f"airlock: {refusal}"
            if state.tunnel is not None:
                state.tunnel.decision, state.tunnel.reason = "deny", refusal
                state.tunnel.code = ReasonCode.CONNECTION_LIMIT
            return
        self.shared.resolved[server.id] = outcome.resolved
        self._names[server.id] = (raw_host, port)
        server.address = (outcome.chosen_ip, port)
        task = asyncio.current_task()
        if task is not None:
            # mitmproxy's own connect has no timeout; the hook runs in the connecting task, so cancel that.
            self._timers[server.id] = asyncio.get_running_loop().call_later(
                self.shared.settings.connect_timeout, self._time_out, server.id, task
            )

    def _time_out(self, server_id: str, task: asyncio.Task[Any]) -> None:
        # Forget the connection here too: a task cancelled while it waits for a connection slot gets no hook.
        self._forget(server_id)
        task.cancel()

    @_fail_closed(_nothing_to_deny)
    def server_connected(self, data: ServerConnectionHookData) -> None:
        self._cancel_timer(data.server.id)
        # Connection reuse compares `server.address`: give it back its logical name (the peer keeps the IP),
        # or every keep-alive request opens a new connection under mitmproxy's per-address semaphore.
        # mitmproxy guards `address` on open connections; this write is the one it is guarding against
        # on purpose, so go around the guard.
        name = self._names.pop(data.server.id, None)
        if name is not None:
            object.__setattr__(data.server, "address", name)

    @_fail_closed(_nothing_to_deny)
    def server_connect_error(self, data: ServerConnectionHookData) -> None:
        self._forget(data.server.id)

    @_fail_closed(_nothing_to_deny)
    def server_disconnected(self, data: ServerConnectionHookData) -> None:
        self._forget(data.server.id)

    def _forget(self, server_id: str) -> None:
        self._cancel_timer(server_id)
        self._names.pop(server_id, None)
        self.shared.resolved.pop(server_id, None)
        self.shared.release_upstream(server_id)

    def _cancel_timer(self, server_id: str) -> None:
        timer = self._timers.pop(server_id, None)
        if timer is not None:
            timer.cancel()


class HttpAudit:
    """One audit line per plain-HTTP request that was allowed (denials are written where they happen)."""

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared

    def _withhold(self, flow: http.HTTPFlow) -> None:
        """A response whose audit line could not be made is not delivered."""
        if flow.killable:
            flow.kill()

    def _finish(self, flow: http.HTTPFlow, error: str | None = None) -> None:
        record: AuditRecord | None = flow.metadata.pop("airlock", None)
        if record is None or record.decision != "allow":
            return
        started = flow.metadata.get("airlock_started", time.monotonic())
        record.duration_ms = round((time.monotonic() - started) * 1000, 1)
        record.bytes_in = len(flow.request.raw_content or b"")
        if flow.response is not None:
            record.bytes_out = len(flow.response.raw_content or b"")
        peer = flow.server_conn.peername
        record.chosen_ip = peer[0] if peer else None
        # What the connection in use resolved to; a failed connect has been forgotten: keep the early answer.
        record.resolved = self.shared.resolved.get(flow.server_conn.id, record.resolved)
        if error is not None:
            record.decision, record.reason, record.code = "error", error, ReasonCode.REQUEST_FAILED
        self.shared.emit(record)

    @_fail_closed(_withhold)
    def response(self, flow: http.HTTPFlow) -> None:
        self._finish(flow)

    @_fail_closed(_nothing_to_deny)
    def error(self, flow: http.HTTPFlow) -> None:
        self._finish(flow, flow.error.msg if flow.error else "error")


class Airlock:
    """The one addon mitmproxy dispatches to. Each hook is the fail-closed method of the object that owns its
    concern, found by name on this object: mitmproxy walks its whole addon chain for every event (and for the
    `update` event after each flow event), and each addon in the chain costs every event about 2 µs
    (bench/dispatch.py); nothing sits between mitmproxy and the hook."""

    name = "airlock"

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared
        self.identity = identity = SandboxIdentity(shared)
        self.http = http = HttpPolicy(shared)
        self.tunnels = tunnels = TunnelPolicy(shared)
        self.pinned = pinned = PinnedConnect(shared)
        self.audit = audit = HttpAudit(shared)
        self.client_connected = identity.client_connected
        self.client_disconnected = identity.client_disconnected
        self.http_connect = http.http_connect
        self.requestheaders = http.requestheaders
        self.next_layer = tunnels.next_layer
        self.server_connect = pinned.server_connect
        self.server_connected = pinned.server_connected
        self.server_connect_error = pinned.server_connect_error
        self.server_disconnected = pinned.server_disconnected
        self.response = audit.response
        self.error = audit.error

    @property
    def concerns(self) -> tuple[object, ...]:
        return self.identity, self.http, self.tunnels, self.pinned, self.audit


def build_addon(
    live: LivePolicy, resolver: Resolver, emit: Callable[[AuditRecord], None], settings: GatewaySettings
) -> Airlock:
    return Airlock(_Shared(live, resolver, emit, settings))
