"""The airlock mitmproxy addon: every way out of a sandbox passes these hooks.

Data flows one way: identify sandbox → canonicalize → decide → resolve → vet → connect → audit.
The early hooks (`http_connect`, `requestheaders`, `next_layer`) give the sandbox a clear answer;
`server_connect` is the one enforcement point that every upstream connection passes, whatever the mode or layer,
so it decides again from scratch and pins the vetted address. Each concern is its own module: `identity.py`,
`httppolicy.py`, `transparent.py` (with `tunnels.py`, and `spliced_tunnels.py` for what the kernel relays),
`inspection.py`, `connect.py`, `httpaudit.py`, over the state they share (`shared.py`); every hook fails closed
(`failclosed.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from mitmproxy.proxy import layer

from airlock.audit import AuditRecord
from airlock.dns.answered import AnsweredAddresses
from airlock.dns.upstream import Resolver
from airlock.policy import LivePolicy
from airlock.policy.held_requests import Asker

from .connect import PinnedConnect
from .httpaudit import HttpAudit
from .httppolicy import HttpPolicy
from .identity import SandboxIdentity
from .inspected_tunnels import Inspection
from .shared import Credentials, GatewaySettings, GitTokens, ProxyState
from .spliced_tunnels import Handlers, Splicing
from .transparent import TransparentPolicy
from .tunnels import TunnelPolicy


class Airlock:
    """The one addon mitmproxy dispatches to. Each hook is the fail-closed method of the object that owns its
    concern, found by name on this object: nothing sits between mitmproxy and the hook. The gateway's connection
    handler calls each hook's implementers directly (airlock/gateway/proxy_connections.py); mitmproxy's own addon
    manager, which the gateway still uses for its lifecycle events, walks the whole chain for every event, each
    addon in it costing every event about 2 µs (bench/dispatch.py)."""

    name = "airlock"

    def __init__(
        self, shared: ProxyState, handlers: Handlers, mitmproxy_layers: Callable[[layer.NextLayer], None] | None = None
    ) -> None:
        self.shared = shared
        self.identity = identity = SandboxIdentity(shared)
        self.splicing = splicing = Splicing(shared, handlers, then=identity.disconnected)
        self.audit = audit = HttpAudit(shared)
        self.inspection = inspection = Inspection(shared, then=audit.answered)
        self.http = http = HttpPolicy(shared, inspection)
        self.tunnels = tunnels = TunnelPolicy(shared, inspection.http_layer, splicing)
        self.transparent = transparent = TransparentPolicy(shared, tunnels, inspection.http_layer, mitmproxy_layers)
        self.pinned = pinned = PinnedConnect(shared)
        self.client_connected = identity.client_connected
        self.client_disconnected = splicing.client_disconnected  # a spliced tunnel's counts first
        self.http_connect = http.http_connect
        self.requestheaders = http.requestheaders
        self.next_layer = transparent.next_layer
        self.server_connect = pinned.server_connect
        self.server_connected = pinned.server_connected
        self.server_connect_error = pinned.server_connect_error
        self.server_disconnected = pinned.server_disconnected
        self.responseheaders = inspection.responseheaders
        self.response = inspection.response  # scrubbed, then audited
        self.websocket_message = inspection.websocket_message
        self.tls_failed_server = inspection.tls_failed_server
        self.error = audit.error

    @property
    def concerns(self) -> tuple[object, ...]:
        return self.identity, self.splicing, self.http, self.transparent, self.pinned, self.inspection, self.audit


def build_addon(
    live: LivePolicy,
    resolver: Resolver,
    emit: Callable[[AuditRecord], None],
    settings: GatewaySettings,
    answered: AnsweredAddresses | None = None,
    approvals: Asker | None = None,
    git_tokens: GitTokens | None = None,
    credentials: Credentials | None = None,
    handlers: Handlers | None = None,
    mitmproxy_layers: Callable[[layer.NextLayer], None] | None = None,
) -> Airlock:
    """The addon; `handlers` are mitmproxy's connection handlers by client id (its proxyserver's), whose sockets
    judged passthrough tunnels are spliced from (none given: no tunnel is spliced); `mitmproxy_layers` makes
    mitmproxy's choice of a layer where the addon keeps it (none: mitmproxy's next_layer addon has made it already,
    as a hook of its own)."""
    shared = ProxyState(live, resolver, emit, settings, answered, approvals, git_tokens, credentials)
    return Airlock(shared, handlers if handlers is not None else {}, mitmproxy_layers)
