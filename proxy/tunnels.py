"""What travels inside an allowed CONNECT tunnel: judged from its first bytes, then passed through and metered."""

from __future__ import annotations

from collections.abc import Callable

from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.layers.tcp import TcpMessageInjected
from mitmproxy.proxy.layers.tls import parse_client_hello
from mitmproxy.proxy.utils import expect
from mitmproxy.tls import ClientHello

from airlock.audit import AuditRecord
from airlock.policy import ReasonCode, decide, is_ip

from .failclosed import fail_closed
from .inspected_tunnels import inspected_rule, intercept
from .shared import ClientState, ProxyState
from .spliced_tunnels import SpliceTicket, Splicing
from .tlsnames import ECH_EXTENSIONS, TlsNameError, hidden_name, server_name


class MeteredTunnel(layers.TCPLayer):
    """A passed-through tunnel (no flow, no per-chunk hooks) that counts the bytes it relays for the audit. Once
    its first bytes have gone to the upstream, it asks `splicing` to relay the rest in the kernel; once spliced,
    mitmproxy has nothing more to relay, and any event that still comes closes both connections (fail closed)."""

    def __init__(self, context: Context, record: AuditRecord, splicing: Splicing) -> None:
        super().__init__(context, ignore=True)
        self.record, self.splicing = record, splicing
        self.ticket = SpliceTicket(record)

    @expect(  # type: ignore[no-untyped-call, untyped-decorator]  # mitmproxy's expect is unannotated
        events.DataReceived, events.ConnectionClosed, TcpMessageInjected
    )
    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self.ticket.taken:
            yield from self._close_both()
            return
        if isinstance(event, events.DataReceived):
            if event.connection == self.context.client:
                self.record.bytes_in = (self.record.bytes_in or 0) + len(event.data)
            else:
                self.record.bytes_out = (self.record.bytes_out or 0) + len(event.data)
        yield from super().relay_messages(event)
        if not self.ticket.requested and self.context.server.state is ConnectionState.OPEN:
            self.splicing.hand_over(self.context, self.ticket)

    def _close_both(self) -> layer.CommandGenerator[None]:
        self._handle_event = self.done
        for conn in (self.context.server, self.context.client):
            if conn.state is not ConnectionState.CLOSED:
                yield commands.CloseConnection(conn)


class TunnelPolicy:
    """What travels inside an allowed CONNECT tunnel: TLS whose SNI names the CONNECT host (and whose real name
    is not hidden by Encrypted Client Hello), or, where the rule says `tunnel: true`, bytes that are not TLS;
    either way passed through untouched (never intercepted) and metered.

    mitmproxy's own next-layer choice (TLS layers, HTTP, raw TCP) is replaced here, so that no TLS layer is
    ever built for a tunnel: the ClientHello is read from the first bytes, and until it is complete the
    decision waits (`nextlayer.layer = None`)."""

    def __init__(
        self, shared: ProxyState, http_layer: Callable[[Context, HTTPMode], layer.Layer], splicing: Splicing
    ) -> None:
        self.shared, self.http_layer, self.splicing = shared, http_layer, splicing

    def _deny_layer(self, nextlayer: layer.NextLayer) -> None:
        state = self.shared.client(nextlayer.context.client)
        self._deny(state, ReasonCode.INTERNAL_ERROR, "internal error")
        nextlayer.layer = layers.TCPLayer(nextlayer.context, ignore=True)

    def _deny(self, state: ClientState, code: ReasonCode, reason: str) -> None:
        state.denied = reason  # server_connect refuses to open anything for this connection
        if state.tunnel is not None:
            state.tunnel.decision, state.tunnel.reason, state.tunnel.code = "deny", reason, code

    def owns(self, nextlayer: layer.NextLayer) -> bool:
        """Is this the inside of one of our tunnels (not, say, a connection's first layer)? Its layer is chosen here."""
        state = self.shared.clients.get(nextlayer.context.client.id)
        return state is not None and state.tunnel is not None and bool(nextlayer.context.server.address)

    @fail_closed(_deny_layer)
    def inside_tunnel(self, nextlayer: layer.NextLayer) -> None:
        """The layer for what an allowed tunnel carries (transparent.py's `next_layer` hook asks here)."""
        state = self.shared.clients.get(nextlayer.context.client.id)
        if state is None or state.tunnel is None or not nextlayer.context.server.address:
            return  # not the inside of one of our tunnels (e.g. the connection's first layer)
        if state.inspected:  # both TLS sessions are up: HTTP/1 or 2 (by ALPN), each request judged on its own
            nextlayer.layer = self.http_layer(nextlayer.context, HTTPMode.transparent)
            return
        data: bytes = nextlayer.data_client()  # type: ignore[no-untyped-call]  # mitmproxy's data_client is unannotated
        if may_be_tls(data):
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
                elif inspected_rule(state.tunnel_decision) is not None:
                    return intercept(nextlayer, state)
        elif not (state.tunnel_decision and state.tunnel_decision.tunnel):
            reason = "tunnel carries something other than TLS and no rule allows a raw tunnel"
            self._deny(state, ReasonCode.NOT_TLS, reason)
        nextlayer.layer = MeteredTunnel(nextlayer.context, state.tunnel, self.splicing)


def may_be_tls(data: bytes) -> bool:
    """Is this (or may it still become) a TLS handshake record? Any 0x16 0x03 start counts, also record versions
    mitmproxy's own check rejects: servers ignore that byte, so a raw tunnel must not let such a hello by."""
    return data[:2] == b"\x16\x03"[: len(data)]


def _hello_refusal(hello: ClientHello, host: str, ech_allowed: bool) -> tuple[ReasonCode, str] | None:
    """Why a tunnel with this ClientHello must not open, if it must not. ECH hides the name the client really
    connects to behind the outer SNI (fronting), unless the rule says `ech: true`; the (outer) SNI must be one
    valid host name, and it must be the CONNECT host."""
    if refusal := ech_refusal(hello, ech_allowed):
        return refusal
    try:
        sni = server_name(hello.extensions)
    except TlsNameError as e:
        return ReasonCode.INVALID_SNI, f"invalid TLS SNI: {e}"
    mismatch = _sni_mismatch(sni, host)
    return None if mismatch is None else (ReasonCode.SNI_MISMATCH, mismatch)


def ech_refusal(hello: ClientHello, ech_allowed: bool) -> tuple[ReasonCode, str] | None:
    """Why this ClientHello must not pass for hiding the name it connects to (fronting), if it must not."""
    if (hidden := hidden_name(hello.extensions)) is None or ech_allowed:
        return None
    return ReasonCode.ECH, (
        f"TLS ClientHello carries Encrypted Client Hello extension 0x{hidden:04x} ({ECH_EXTENSIONS[hidden]}): "
        "the name it connects to is hidden (a rule with `ech: true` allows it for its hosts)"
    )


def _sni_mismatch(sni: str | None, expected: str) -> str | None:
    """A valid SNI (canonical) must name the CONNECT host. Only an IP-literal CONNECT may send none, since SNI
    cannot carry an address. An IP-literal CONNECT that does send a name is fronting: the CIDR rule judged the
    address, never that name, and a server there may pick its virtual host by it; so it is a mismatch like any."""
    if sni == expected or (sni is None and is_ip(expected)):
        return None
    return f"TLS SNI {sni!r} does not match CONNECT host {expected}"


def denied_tunnels(shared: ProxyState) -> list[str]:
    """The client connections of open tunnels that the policy in force now denies (after a reload), each tunnel's
    audit line (written when it closes) saying why it was closed."""
    snapshot = shared.live.current
    denied = []
    for client_id, state in shared.clients.items():
        record = state.tunnel
        if record is None or state.sandbox is None or state.denied or record.port is None:
            continue
        decision = decide(snapshot.profile(state.sandbox), record.host, record.port)
        if not decision.allow:
            state.denied = decision.reason
            record.extra["closed"] = f"closed at a policy reload, which denies it: {decision.reason}"
            denied.append(client_id)
    return denied
