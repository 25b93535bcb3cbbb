"""Running the proxy inside the gateway: its listening sockets (explicit, transparent), which are bound at start so
that early clients wait in their backlog, and mitmproxy with the airlock addon, which serves them once imported.

The addon gets every provider it reads (approvals, the broker's git tokens, the secrets the policy injects) when it
is built: the parts it needs are started before the proxy serves (`airlock.gateway.core`)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airlock.audit import REFUSAL_LINES, AuditRecord
from airlock.dns.answered import AnsweredAddresses
from airlock.dns.upstream import Resolver
from airlock.gateway.capacity import ConnectionCaps
from airlock.gateway.config import GatewayConfig
from airlock.gateway.errors import GatewayError
from airlock.gateway.metrics import GatewayMetrics
from airlock.inspection.inspector import Inspector
from airlock.inspection.trust import system_trust_store
from airlock.policy import LivePolicy
from airlock.policy.held_requests import Asker

if TYPE_CHECKING:
    from airlock.gateway.startup.mitm import Master, ServerInstance
    from airlock.proxy.addon import Airlock
    from airlock.proxy.shared import GitTokens, ProxyState, ScrubbedLog

MITMPROXY_LOG = logging.getLogger("mitmproxy.proxy.server")  # mitmproxy's lines about each connection
PROXY_BACKLOG = 100  # asyncio's default, which mitmproxy listened with
PROXY_START_TIMEOUT = 30.0  # seconds for mitmproxy to come up once imported


@dataclass(frozen=True)
class ProxyProviders:
    """What the addon reads from the rest of the gateway, each made before the proxy is built."""

    live: LivePolicy
    resolver: Resolver
    emit: Callable[[AuditRecord], None]
    audit_failure: Callable[[], str | None]
    metrics: GatewayMetrics
    approvals: Asker | None  # a proxy worker's asks its supervisor's desk (airlock/gateway/worker_approvals.py)
    inspector: Inspector
    answered: AnsweredAddresses  # what the DNS answered each sandbox: names for connections without one


class ProxyRuntime:
    def __init__(self, config: GatewayConfig, caps: ConnectionCaps, state_dir: Path, providers: ProxyProviders) -> None:
        self.config, self.caps, self.state_dir, self.providers = config, caps, state_dir, providers
        self.listeners: dict[str, socket.socket] = {}  # by mitmproxy mode spec, from listen() on
        self.servers: list[asyncio.Server] = []  # once mitmproxy serves them
        self.airlock: Airlock | None = None
        self._master: Master | None = None
        self._task: asyncio.Task[None] | None = None  # mitmproxy's master
        self._scrubbed_log: ScrubbedLog | None = None  # on mitmproxy's log while the proxy runs
        self._shared = False  # the listeners are another process's, accepted from by other workers too (`take`)

    @property
    def shared(self) -> ProxyState | None:
        return self.airlock.shared if self.airlock is not None else None

    def ports(self) -> dict[str, int]:
        """The proxy's listeners: mitmproxy's mode → port (explicit proxy; transparent, when configured)."""
        ports = {"regular": self.config.proxy_port}
        if self.config.transparent_port:
            ports["transparent"] = self.config.transparent_port
        return ports

    def take(self, listeners: Mapping[str, socket.socket]) -> None:
        """Serve listeners bound elsewhere (a proxy worker's, its supervisor's sockets), by mitmproxy mode spec."""
        self.listeners.update(listeners)
        self._shared = True

    def listen(self) -> None:
        """Bind every listener (GatewayError naming the one that cannot)."""
        listen = self.config.listen
        for mode, port in self.ports().items():
            try:
                self.listeners[f"{mode}@{port}"] = _listen(listen, port)
            except OSError as e:
                raise GatewayError(f"proxy could not listen on {listen}:{port}: {e.strerror}") from e

    @property
    def serving(self) -> bool:
        servers = self.servers
        return len(servers) == len(self.listeners) > 0 and all(server.is_serving() for server in servers)

    def counts(self, which: str) -> Mapping[str, int]:
        """The addon's open `tunnels`, `connections` or `upstreams` per sandbox (none before it exists)."""
        shared = self.shared
        return {k: n for k, n in getattr(shared, which).items() if n} if shared is not None else {}

    async def serve(self, git_tokens: GitTokens | None) -> None:
        """mitmproxy with the airlock addon, serving the listeners (mitmproxy and the addon imported by now)."""
        from airlock.gateway.startup.mitm import LayerChoice, Master, Proxyserver, ServerInstance, options
        from airlock.proxy.addon import build_addon
        from airlock.proxy.shared import Credentials, GatewaySettings, ScrubbedLog

        config, caps, given = self.config, self.caps, self.providers
        opts = options.Options(
            mode=list(self.listeners),
            listen_host=config.listen,
            confdir=str(self.state_dir / "mitmproxy"),
            server=False,  # the sockets are the gateway's own (`listeners`): mitmproxy handles their connections
        )
        self._master = master = Master(opts)
        settings = GatewaySettings(
            connect_timeout=config.connect_timeout,
            idle_timeout=config.idle_timeout,
            max_tunnels_per_sandbox=caps.tunnels,
            max_spliced=caps.spliced,
            max_connections_per_sandbox=caps.per_sandbox,
            max_connections=caps.total,
            cap_scope=f" in this proxy worker (its share of the cap: {config.workers} workers)" if self._shared else "",
            refusal_lines=max(1, REFUSAL_LINES // config.workers),
            audit_failure=given.audit_failure,
            timings=given.metrics,
        )
        credentials = Credentials.of(given.inspector.injected(given.live.current.policy))
        proxyserver = Proxyserver()  # type: ignore[no-untyped-call]
        choice = LayerChoice()  # mitmproxy's choice of layers, where the addon keeps it
        essentials = _essential_addons(given.inspector, proxyserver, choice)
        handlers = proxyserver.connections  # by client id: spliced tunnels are taken from their handlers' sockets
        self.airlock = build_addon(
            given.live,
            given.resolver,
            given.emit,
            settings,
            given.answered,
            given.approvals,
            git_tokens,
            credentials,
            handlers,
            choice.choose,
        )
        shared = self.airlock.shared
        self._scrubbed_log = ScrubbedLog(lambda: shared.credentials)
        MITMPROXY_LOG.addFilter(self._scrubbed_log)
        running = _Running()
        # mitmproxy's addon manager and options are untyped: the ignores below say no more than that.
        master.addons.add(*essentials, self.airlock, running)  # type: ignore[no-untyped-call]
        opts.update(**_proxy_options(config))  # type: ignore[no-untyped-call]
        self._task = asyncio.create_task(master.run())
        ports = " and ".join(str(port) for port in self.ports().values())
        if why := await _until_running(self._task, running.event):
            raise GatewayError(f"the proxy did not start on {config.listen} port {ports}: {why}")
        # Every addon has seen `running`: connections are theirs from now on, and the chain is complete.
        from airlock.gateway.proxy_connections import Hooks, Listener  # after mitm: it imports mitmproxy's master

        hooks = Hooks(master.addons)
        proxyserver = master.addons.get("proxyserver")  # type: ignore[no-untyped-call]
        for spec, listener in self.listeners.items():
            # SO_ORIGINAL_DST is read by the transparent one
            instance: ServerInstance[Any] = ServerInstance.make(spec, proxyserver)
            serve = Listener(instance, master, hooks).handle_stream
            # asyncio accepts up to `backlog` connections each time a listener is readable: on a listener other
            # workers share, one at a time, so that a burst is not all taken by whichever worker woke first
            # (bench/accept_balance.py); the kernel's queue stays PROXY_BACKLOG long.
            batch = 1 if self._shared else PROXY_BACKLOG
            server = await asyncio.start_server(serve, sock=listener, backlog=batch)
            if self._shared:
                listener.listen(PROXY_BACKLOG)
            self.servers.append(server)

    def close_denied_tunnels(self) -> int:
        """Close the open tunnels the policy in force denies; how many."""
        if self.shared is None or self._master is None:
            return 0
        from airlock.proxy.tunnels import denied_tunnels  # imported with the addon, which made `shared`

        denied = set(denied_tunnels(self.shared))
        proxyserver = self._master.addons.get("proxyserver")  # type: ignore[no-untyped-call]
        for handler in list(proxyserver.connections.values()):
            if handler.client.id in denied:
                handler.close_connection(handler.client)
        return len(denied)

    def close_listeners(self) -> None:
        for server in self.servers:
            server.close()  # connections still open end with the master
        for listener in self.listeners.values():
            listener.close()  # also when the proxy never served

    def flush_refusals(self) -> None:
        """The summaries of refusals that came in floods, written now (the gateway is stopping)."""
        if self.shared is not None:
            self.shared.refusals.flush()

    async def stop(self) -> None:
        self.close_listeners()
        if self.airlock is not None:
            await self.airlock.splicing.stop()  # the kernel relay's tunnels end with the gateway
        if self._master is not None:
            self._master.shutdown()  # type: ignore[no-untyped-call]
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)
        if self._scrubbed_log is not None:
            MITMPROXY_LOG.removeFilter(self._scrubbed_log)


def _proxy_options(config: GatewayConfig) -> dict[str, object]:
    return {
        # lazy: never connect upstream before the SNI and Host header have been checked
        "connection_strategy": "lazy",
        "tcp_timeout": int(config.idle_timeout),
        "stream_large_bodies": "1m",
        # mitmproxy's default, pinned: ambiguous request framing (CL+TE, ...) is refused, never smuggled through
        "validate_inbound_headers": True,
        # Inspected hosts only (all else passes through): their upstreams are verified against the system's
        # store, or --upstream-ca alone; the leaf the sandbox sees is the gateway CA's, never a copy of theirs.
        "ssl_verify_upstream_trusted_ca": config.upstream_ca or system_trust_store(),
        "upstream_cert": False,
    }


def _listen(host: str, port: int) -> socket.socket:
    """The proxy's listening socket, as asyncio would make it (SO_REUSEADDR; IPv6 only on an IPv6 address; Nagle
    off). create_server's sockets say proto 0, so asyncio leaves Nagle on for what they accept, and a response
    mitmproxy writes as head then body would wait for the client's delayed ACK (40 ms); Linux passes the option on
    to every accepted socket."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=PROXY_BACKLOG)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _essential_addons(issuer: Inspector, proxyserver: object, choice: object) -> tuple[object, ...]:
    """Only the addons a proxy needs: no script loader, replay, onboarding app (mitm.it), header or body rewriting —
    less to dispatch on every event, and nothing a request could reach but airlock's hooks."""
    from airlock.gateway.startup.mitm import TlsConfig, core, disable_h2c

    return core.Core(), proxyserver, choice, TlsConfig(issuer), disable_h2c.DisableH2C()


class _Running:
    """The last addon: its `running` hook comes after every other addon's."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def running(self) -> None:
        self.event.set()


async def _until_running(master: asyncio.Task[None], running: asyncio.Event) -> str | None:
    """None once the master runs; else why not (it ended, or took longer than PROXY_START_TIMEOUT)."""
    waiter = asyncio.ensure_future(running.wait())
    try:
        await asyncio.wait({master, waiter}, timeout=PROXY_START_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if running.is_set():
        return None
    if not master.done():
        return f"not running after {PROXY_START_TIMEOUT:g}s"
    error = master.exception()
    return f"{type(error).__name__}: {error}" if error else "it stopped"
