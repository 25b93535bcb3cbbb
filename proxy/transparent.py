"""Connections the fence redirected to the transparent listener: clients that ignore the proxy variables.

The sandbox dialled some address and port; the fence sent the connection here (SO_ORIGINAL_DST keeps what it
dialled). That address is a hint, never the connect target: the gateway judges the name the connection carries,
with explicit mode's every check, and connects to that name's own vetted, pinned address.

- TLS: the name is the ClientHello's SNI (read strictly, as for CONNECT); the tunnel is passed through, metered.
- HTTP: mitmproxy's transparent HTTP layer; every request is judged by its Host header (`HttpPolicy`), on the
  port the sandbox dialled.
- Anything else, and TLS without SNI, carries no name: it is judged as the IP literal it dialled (CIDR rules;
  bytes that are not TLS need `tunnel: true`), or else, if the gateway's DNS recently answered this sandbox that
  address for a name, as that name — whose rule must say `tunnel: true`, since the gateway cannot see what the
  bytes are for.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Callable
from typing import Literal

from mitmproxy.proxy import layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.layers.tls import parse_client_hello
from mitmproxy.tls import ClientHello

from airlock.audit import AuditRecord
from airlock.policy import Decision, ReasonCode, Sandbox, format_host_port

from .failclosed import fail_closed
from .httplayer import HttpLayer
from .inspected_tunnels import inspected_rule, intercept
from .shared import ClientState, ProxyState, TargetJudgement, is_transparent
from .tlsnames import TlsNameError, server_name
from .tunnels import MeteredTunnel, TunnelPolicy, ech_refusal, may_be_tls

MODE = "transparent"
# An HTTP/1 request line starts with its method, a token of capitals, then a space (RFC 9112 §3).
_METHOD = re.compile(rb"[A-Z]{1,20} ")

type Carried = Literal["tls", "http", "raw"]


class TransparentPolicy:
    """The `next_layer` hook: the first layer of a redirected connection is chosen here, from its first bytes;
    every other layer choice is `TunnelPolicy`'s, but that every HTTP layer is the gateway's (`http_layer`)."""

    def __init__(
        self,
        shared: ProxyState,
        tunnels: TunnelPolicy,
        http_layer: Callable[[Context, HTTPMode], layer.Layer],
        mitmproxy_layers: Callable[[layer.NextLayer], None] | None = None,
    ) -> None:
        self.shared, self.tunnels, self.http_layer = shared, tunnels, http_layer
        # mitmproxy's choice, asked for only where this hook keeps it (None: its own addon has made it already)
        self.mitmproxy_layers = mitmproxy_layers

    def _deny_layer(self, nextlayer: layer.NextLayer) -> None:
        self.shared.client(nextlayer.context.client).denied = "internal error"
        nextlayer.layer = layers.TCPLayer(nextlayer.context, ignore=True)  # server_connect opens nothing

    @fail_closed(_deny_layer)
    async def next_layer(self, nextlayer: layer.NextLayer) -> None:
        context = nextlayer.context
        state = self.shared.client(context.client)
        if not is_transparent(context.client) or state.original is not None or context.server.address is None:
            return self._inside(nextlayer)
        data: bytes = nextlayer.data_client()  # type: ignore[no-untyped-call]  # mitmproxy's data_client is unannotated
        carried = _carried(data)
        hello = None
        if carried == "tls":
            try:
                hello = parse_client_hello(data)
            except ValueError:
                return self._deny(nextlayer, state, ReasonCode.MALFORMED_CLIENT_HELLO, "malformed TLS ClientHello")
            carried = None if hello is None else carried
        if carried is None:
            nextlayer.layer = None  # wait for more bytes
            return
        address, port = context.server.address[0], context.server.address[1]
        state.original = (address, port)
        if carried == "http":
            nextlayer.layer = self.http_layer(context, HTTPMode.transparent)  # each request judged by its Host
            return
        sni = None
        if hello is not None:
            try:
                sni = server_name(hello.extensions)
            except TlsNameError as e:
                return self._deny(nextlayer, state, ReasonCode.INVALID_SNI, f"invalid TLS SNI: {e}")
        await self._tunnel(nextlayer, state, hello, sni)

    def _inside(self, nextlayer: layer.NextLayer) -> None:
        """A connection that is not a new transparent one: inside one of our tunnels, or the explicit proxy's."""
        if self.tunnels.owns(nextlayer):
            self.tunnels.inside_tunnel(nextlayer)  # TunnelPolicy's choice alone: mitmproxy's is not made
            return
        if self.mitmproxy_layers is not None:
            self.mitmproxy_layers(nextlayer)
        chosen = nextlayer.layer  # by mitmproxy (the explicit proxy's HTTP, say)
        if isinstance(chosen, layers.HttpLayer) and not isinstance(chosen, HttpLayer):
            nextlayer.layer = self.http_layer(nextlayer.context, chosen.mode)  # it answers refusals of any shape

    async def _tunnel(
        self, nextlayer: layer.NextLayer, state: ClientState, hello: ClientHello | None, sni: str | None
    ) -> None:
        """Judge a TLS (by its SNI, else as nameless) or raw connection, then open its tunnel or refuse it."""
        context = nextlayer.context
        assert state.original is not None
        address, port = state.original
        if sni is not None:
            judgement, named_by = await self.shared.evaluate(state.sandbox, sni, port), "sni"
        else:
            judgement, named_by = await self._nameless(state.sandbox, address, port, opaque=hello is None)
        record = _record(state, context.client.peername[0], judgement.host, port, named_by)
        judgement.fill(record)
        if judgement.decision.allow and hello is not None and (refusal := ech_refusal(hello, judgement.decision.ech)):
            record.decision, (record.code, record.reason) = "deny", refusal
        if record.decision == "allow" and (over_cap := self._over_tunnel_cap(state)):
            record.decision, record.reason, record.code = "deny", over_cap, ReasonCode.TUNNEL_LIMIT
        if record.decision != "allow":
            self.shared.emit(record)
            state.denied = record.reason
            nextlayer.layer = layers.TCPLayer(context, ignore=True)  # server_connect opens nothing: closed
            return
        assert state.sandbox is not None  # an allowed judgement has a sandbox
        # The upstream is the judged name (or literal), resolved and pinned already: never the dialled address.
        context.server.address = (judgement.host, port)
        state.vetted[(judgement.host, port)] = judgement
        self.shared.tunnels[state.sandbox.id] += 1
        state.tunnel, state.tunnel_decision, state.started = record, judgement.decision, time.monotonic()
        if hello is not None and sni is not None and inspected_rule(judgement.decision) is not None:
            return intercept(nextlayer, state)
        nextlayer.layer = MeteredTunnel(context, record, self.tunnels.splicing)

    def _deny(self, nextlayer: layer.NextLayer, state: ClientState, code: ReasonCode, reason: str) -> None:
        """Refuse a connection whose first bytes already say no (before any name is judged): audited, closed."""
        context = nextlayer.context
        assert context.server.address is not None
        address, port = context.server.address[0], context.server.address[1]
        state.original, state.denied = (address, port), reason
        record = _record(state, context.client.peername[0], address, port, "-")
        record.reason, record.code = reason, code
        self.shared.emit(record)
        nextlayer.layer = layers.TCPLayer(context, ignore=True)  # server_connect opens nothing: closed

    def _over_tunnel_cap(self, state: ClientState) -> str | None:
        limit = self.shared.settings.max_tunnels_per_sandbox
        if state.sandbox is not None and self.shared.tunnels[state.sandbox.id] >= limit:
            return f"sandbox already has {limit} open tunnels{self.shared.settings.cap_scope}"
        return None

    async def _nameless(
        self, sandbox: Sandbox | None, address: str, port: int, opaque: bool
    ) -> tuple[TargetJudgement, str]:
        """The judgement of a connection without a name: as the IP literal dialled, else as a name the gateway's
        DNS answered this sandbox with that address (newest first), whose rule must allow a raw tunnel."""
        literal = await self.shared.evaluate(sandbox, address, port)
        if literal.decision.allow and (literal.decision.tunnel or not opaque):
            return literal, "address"
        if sandbox is not None:
            names = self.shared.answered.names(sandbox.id, ipaddress.ip_address(address), time.monotonic())
            for name in names:
                named = await self.shared.evaluate(sandbox, name, port)
                if named.decision.tunnel:
                    return named, "dns"
            if names:
                reason = (
                    f"{address} was answered for {', '.join(names)}, but no rule lets that carry a connection "
                    f"without a name on port {port}: it needs `tunnel: true`"
                )
                refused = Decision(False, reason, ReasonCode.NOT_TLS)
                return TargetJudgement(refused, literal.host, literal.resolved), "dns"
        if literal.decision.allow:  # a CIDR rule opens the address, for TLS only
            reason = (
                f"connection to {format_host_port(literal.host, port)} carries something other than TLS and no rule "
                "allows a raw tunnel"
            )
            refused = Decision(False, reason, ReasonCode.NOT_TLS)
            return TargetJudgement(refused, literal.host, literal.resolved), "address"
        return literal, "address"


def _record(state: ClientState, client: str, host: str, port: int, named_by: str) -> AuditRecord:
    """A transparent connection's audit line; its decision, reason and code come from the judgement."""
    assert state.original is not None
    sandbox = state.sandbox.id if state.sandbox else "-"
    record = AuditRecord("connect", sandbox, client, host, port, "deny", "", ReasonCode.INTERNAL_ERROR)
    record.extra.update(audit_extra(state.original, named_by))
    return record


def audit_extra(original: tuple[str, int], named_by: str) -> dict[str, object]:
    """What a transparent connection's audit line says beyond explicit mode's: the mode, the address the sandbox
    dialled, and what named the target (sni, host, dns, address)."""
    return {"mode": MODE, "original_dst": format_host_port(*original), "named_by": named_by}


def _carried(data: bytes) -> Carried | None:
    """What the first bytes of a connection are; None while they could still become either."""
    if not data:
        return None
    if may_be_tls(data):
        return "tls"
    if _METHOD.match(data):
        return "http"
    if len(data) <= 20 and data.isalpha() and data.isupper():
        return None
    return "raw"
