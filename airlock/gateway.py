"""The gateway process: the policy, the one resolver, mitmproxy with the airlock addon, the sandbox DNS server
and the broker, wired together."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import resource
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airlock.audit import AuditLog
from airlock.brokerconfig import BrokerConfig
from airlock.dns.admission import DnsSettings
from airlock.dns.answered import AnsweredAddresses
from airlock.dns.server import DnsServer
from airlock.dns.upstream import Resolver, ResolverConfig, Server, system_servers
from airlock.errors import AirlockError
from airlock.interfaces import interface_addresses
from airlock.live import GatewayAddresses
from airlock.mitm import Master, Proxyserver, TlsConfig, core, disable_h2c, next_layer, options
from airlock.policy import IPAddress, LivePolicy, Policy, Sandbox, SandboxRegistry
from airlock.proxy.addon import Airlock, build_addon
from airlock.proxy.shared import GatewaySettings
from airlock.sandbox.fence import mark_listeners

if TYPE_CHECKING:
    from airlock.broker.service import Broker
    from airlock.brokerd import BrokerRuntime

log = logging.getLogger("airlock.gateway")

# File descriptors kept apart from proxied connections: the process itself, listeners, audit log, broker store
# and broker calls; per sandbox, its DNS over TCP (16) and DNS queries waiting on upstream (32), with room left.
RESERVED_FILES = 256
RESERVED_FILES_PER_SANDBOX = 64
FILES_PER_CONNECTION = 2  # the sandbox's socket and the upstream one
# Per sandbox, when the open-file limit allows it: 1,000 idle tunnels with room to spare, at about 38 KiB of
# memory each (bench/tunnels.py). Tunnels get 7/8 of the connections, so that a client beyond the tunnel cap is
# told so (429) instead of finding its connection closed.
DEFAULT_CONNECTIONS_PER_SANDBOX = 4096
MIN_CONNECTIONS = 16
FD_REPORT_INTERVAL = 10.0
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class GatewayError(AirlockError):
    pass


@dataclass
class GatewayConfig:
    policy: Policy  # the policy to start with; the one in force is `Gateway.live.current.policy`
    listen: str
    proxy_port: int = 3128
    # Connections the fence redirects (clients that ignore the proxy variables); 0: explicit mode only.
    transparent_port: int = 3129
    sandboxes: list[Sandbox] = field(default_factory=list)
    upstream_dns: list[Server] = field(default_factory=list)
    upstream_ca: str | None = None
    audit_path: str | None = None
    audit_stdout: bool = False
    connect_timeout: float = 10.0
    idle_timeout: float = 300.0
    max_tunnels_per_sandbox: int | None = None  # None: derived from the open-file limit, like the next two
    max_connections_per_sandbox: int | None = None
    dns_min_ttl: int = 5
    dns_port: int = 53  # 0: no DNS server for sandboxes
    dns_rate: float = 100.0  # queries per second per sandbox
    state_dir: str | None = None
    broker: BrokerConfig = field(default_factory=BrokerConfig)


def _private_directory(path: Path) -> None:
    """Create `path` for the gateway's secrets, or tighten it to 0700 when this process owns it."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.stat().st_uid == os.geteuid():
            path.chmod(0o700)
    except OSError as e:
        raise GatewayError(f"state directory {path}: {e.strerror or e}") from e


def own_addresses() -> frozenset[IPAddress]:
    """Every address of this network namespace's interfaces: the gateway must never be its own upstream."""
    try:
        return frozenset(address.ip for address in interface_addresses())
    except OSError as e:
        log.warning("the gateway's own addresses could not be listed (%s): each is still found by binding to it", e)
        return frozenset()


@dataclass(frozen=True)
class ConnectionCaps:
    """What the open-file limit allows: proxied connections in all (client and upstream ones counted apart, each
    at most this many) and per sandbox; `notes` say where a requested cap had to be lowered."""

    open_files: int
    total: int
    per_sandbox: int
    tunnels: int
    notes: tuple[str, ...] = ()


def raise_open_file_limit() -> tuple[int, int, int]:
    """RLIMIT_NOFILE's soft limit raised to the hard one: (soft before, soft now, hard)."""
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = hard
    if hard == resource.RLIM_INFINITY:
        try:
            ceiling = int(Path("/proc/sys/fs/nr_open").read_text())  # the kernel's ceiling for any soft limit
        except (OSError, ValueError):
            ceiling = 1 << 20
    if before != resource.RLIM_INFINITY and before < ceiling:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return before, ceiling if now == resource.RLIM_INFINITY else now, hard


def connection_caps(
    open_files: int, sandboxes: int, per_sandbox: int | None = None, tunnels: int | None = None
) -> ConnectionCaps:
    """The caps an open-file limit allows, with `sandboxes` sandbox networks; a cap asked for (`per_sandbox`,
    `tunnels`) is kept when the limit allows it, else lowered. `notes` say what the limit held down; GatewayError
    when it leaves too little."""
    reserved = RESERVED_FILES + RESERVED_FILES_PER_SANDBOX * max(1, sandboxes)
    total = (open_files - reserved) // FILES_PER_CONNECTION
    if total < MIN_CONNECTIONS:
        need = reserved + MIN_CONNECTIONS * FILES_PER_CONNECTION
        raise GatewayError(f"the open-file limit ({open_files}) is too low for a gateway: it needs at least {need}")
    for option, value in (("--max-connections", per_sandbox), ("--max-tunnels", tunnels)):
        if value is not None and value < 1:
            raise GatewayError(f"{option} {value}: must be at least 1")
    notes: list[str] = []
    if per_sandbox is None:
        per_sandbox = min(DEFAULT_CONNECTIONS_PER_SANDBOX, total)
        if per_sandbox < DEFAULT_CONNECTIONS_PER_SANDBOX:
            notes.append(f"{per_sandbox} connections per sandbox instead of {DEFAULT_CONNECTIONS_PER_SANDBOX}")
    elif per_sandbox > total:
        notes.append(f"--max-connections {per_sandbox} lowered to {total}")
        per_sandbox = total
    if tunnels is None:
        tunnels = max(1, per_sandbox - per_sandbox // 8)
    elif tunnels > per_sandbox:
        notes.append(f"--max-tunnels {tunnels} lowered to {per_sandbox}")
        tunnels = per_sandbox
    return ConnectionCaps(open_files, total, per_sandbox, tunnels, tuple(notes))


def _sandbox_count(sandboxes: list[Sandbox]) -> int:
    return len({sandbox.id for sandbox in sandboxes})


def _announce(caps: ConnectionCaps, before: int, hard: int) -> None:
    raised = f", raised from {before}" if before != caps.open_files else ""
    summary = (
        f"open files {caps.open_files}{raised} (hard limit {hard}): at most {caps.total} proxied connections, "
        f"{caps.per_sandbox} per sandbox, of which {caps.tunnels} tunnels"
    )
    if caps.notes:
        why = "; ".join(caps.notes)
        log.warning("%s (%s: the open-file limit allows no more; raise it: ulimit -Hn, LimitNOFILE=)", summary, why)
    else:
        log.info("%s", summary)


class _DescriptorShortage:
    """The event loop's exception handler, but for accept() failing for lack of descriptors (asyncio then pauses
    that listener for a second, and reports each failure with a traceback): one line per interval instead, which
    says what it means."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.previous = loop.get_exception_handler()
        self.failures = 0
        self.reported = float("-inf")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        if context.get("message") != self.MESSAGE:
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.failures += 1
        now = time.monotonic()
        if now - self.reported >= FD_REPORT_INTERVAL:
            error = context.get("exception")
            why = getattr(error, "strerror", None) or error
            log.error(
                "out of file descriptors or memory (%s): new connections wait in the kernel until some close "
                "(%d accept failures since the last report)",
                why,
                self.failures,
            )
            self.failures, self.reported = 0, now


class _ListenerView:
    """A listening socket as asyncio's accept loop sees it: once accept() has failed for lack of descriptors (or
    memory), the next accept() of the same wakeup finds nothing waiting instead of failing again."""

    __slots__ = ("short", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.short = sock, False

    def accept(self) -> tuple[socket.socket, Any]:
        if self.short:
            raise BlockingIOError
        try:
            return self.sock.accept()
        except OSError as e:
            self.short = e.errno in RESOURCE_ERRNOS
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def _one_retry_per_shortage(loop: asyncio.AbstractEventLoop) -> None:
    """Python before 3.15 (gh-151615): when accept() fails for lack of file descriptors, asyncio's accept loop
    goes on calling it for the rest of its batch of 100, and every failure schedules its own retry of the listener
    a second later; the retries compound into a busy loop. Stop each batch at its first such failure, as the fix
    upstream does: then a listener short of descriptors tries once a second. Called before any listener starts,
    since a listener keeps the accept function it started with."""
    accept = getattr(loop, "_accept_connection", None)
    if accept is None or getattr(accept, "airlock", False):
        return  # not asyncio's selector loop, or done already

    def accept_connection(protocol_factory: Any, sock: Any, *args: Any, **kwargs: Any) -> None:
        listener = sock.sock if isinstance(sock, _ListenerView) else sock  # a retry passes the view back
        accept(protocol_factory, _ListenerView(listener), *args, **kwargs)

    accept_connection.airlock = True  # type: ignore[attr-defined]
    loop._accept_connection = accept_connection  # type: ignore[attr-defined]


def _all_listening(proxyserver: Proxyserver, modes: int) -> bool:
    """Has each of the proxy's modes (explicit, transparent) a listening socket?"""
    servers = list(proxyserver.servers)
    return len(servers) == modes and all(server.listen_addrs for server in servers)


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        try:  # before anything exists: a name would mean other addresses for proxy, DNS and the vetting
            ipaddress.ip_address(config.listen)
        except ValueError:
            raise GatewayError(f"listen address {config.listen!r}: give an IP address (127.0.0.1, ::1, ...)") from None
        before, open_files, hard = raise_open_file_limit()
        self.caps = connection_caps(
            open_files,
            _sandbox_count(config.sandboxes),
            config.max_connections_per_sandbox,
            config.max_tunnels_per_sandbox,
        )
        _announce(self.caps, before, hard)
        servers = config.upstream_dns or system_servers()
        if not servers:
            raise GatewayError("no upstream DNS server: pass --upstream-dns or configure /etc/resolv.conf")
        self.resolver = Resolver(ResolverConfig(servers, min_ttl=config.dns_min_ttl))
        self.registry = SandboxRegistry(config.sandboxes)
        self.live: LivePolicy | None = None  # from start(): policy, registry and own addresses, swapped whole
        self._own: GatewayAddresses | None = None
        try:
            self.audit = AuditLog(config.audit_path, config.audit_stdout)
        except OSError as e:
            raise GatewayError(f"audit log {config.audit_path}: {e.strerror or e}") from e
        # Signing keys, the broker's store and admin socket live here: root's alone. A temporary one goes at stop.
        self._own_state = config.state_dir is None
        self._state_dir = config.state_dir or tempfile.mkdtemp(prefix="airlock-gw-")
        _private_directory(Path(self._state_dir))
        self._master: Master | None = None
        self._task: asyncio.Task[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self.shared = None
        self.airlock: Airlock | None = None
        self.dns: DnsServer | None = None
        self.broker: Broker | None = None
        self._broker_runtime: BrokerRuntime | None = None

    async def start(self) -> None:
        config = self.config
        caps = self.caps
        _one_retry_per_shortage(asyncio.get_running_loop())
        modes = [f"regular@{config.proxy_port}"]
        if config.transparent_port:
            modes.append(f"transparent@{config.transparent_port}")
        opts = options.Options(
            mode=modes,
            listen_host=config.listen,
            confdir=str(Path(self._state_dir) / "mitmproxy"),
        )
        master = Master(opts)
        self._own = GatewayAddresses(own_addresses() | {ipaddress.ip_address(config.listen)})
        live = self.live = LivePolicy(config.policy, self.registry, self._own)
        settings = GatewaySettings(
            connect_timeout=config.connect_timeout,
            max_tunnels_per_sandbox=caps.tunnels,
            max_connections_per_sandbox=caps.per_sandbox,
            max_connections=caps.total,
            audit_failure=self._audit_failure,
        )
        answered = AnsweredAddresses()  # what the DNS answered each sandbox: names for connections without one
        self.airlock = build_addon(live, self.resolver, self.audit.emit, settings, answered)
        self.shared = self.airlock.shared
        # Only the addons a proxy needs: no script loader, replay, onboarding app (mitm.it), header or body
        # rewriting — less to dispatch on every event, and nothing a request could reach but airlock's hooks.
        essentials = (
            core.Core(),
            Proxyserver(),
            next_layer.NextLayer(),
            TlsConfig(),
            disable_h2c.DisableH2C(),
        )
        master.addons.add(*essentials, self.airlock)
        opts.update(
            # lazy: never connect upstream before the SNI and Host header have been checked
            connection_strategy="lazy",
            tcp_timeout=int(config.idle_timeout),
            stream_large_bodies="1m",
            # mitmproxy's default, pinned: ambiguous request framing (CL+TE, ...) is refused, never smuggled through
            validate_inbound_headers=True,
            ssl_verify_upstream_trusted_ca=config.upstream_ca,
        )
        self._master = master
        self._task = asyncio.create_task(master.run())
        self._flusher = asyncio.create_task(self._flush_audit())
        proxyserver = master.addons.get("proxyserver")
        for _ in range(1000):  # 5 s; looked at often, as the start of every `airlock run` waits for it
            if _all_listening(proxyserver, len(modes)) or self._task.done():
                break
            await asyncio.sleep(0.005)
        if not _all_listening(proxyserver, len(modes)):
            await self.stop()
            ports = " and ".join(spec.rsplit("@", 1)[1] for spec in modes)
            raise GatewayError(f"proxy could not listen on {config.listen} port {ports}")
        # mitmproxy has installed its handler by now; every listener of the gateway shares this loop.
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_DescriptorShortage(loop))
        log.info("airlock proxy listening on %s:%d", config.listen, config.proxy_port)
        if config.dns_port:
            dns_settings = DnsSettings(rate_per_second=config.dns_rate, audit_failure=self._audit_failure)
            self.dns = DnsServer(
                live, self.resolver, self.audit.emit, dns_settings, config.listen, config.dns_port, answered
            )
            try:
                await self.dns.start()
            except OSError as e:
                await self.stop()
                raise GatewayError(f"DNS server could not listen on {config.listen}:{config.dns_port}: {e}") from e
        if config.broker.port:
            # Only now: a gateway without a broker never imports one (aiohttp, the GitHub client, the token code).
            from airlock.broker.store import StoreError
            from airlock.broker.tokens import TokenError
            from airlock.brokerd import BrokerRuntime

            runtime = BrokerRuntime(
                config.broker, Path(self._state_dir), live, self.resolver, self.audit.emit, config.upstream_ca
            )
            self._broker_runtime = runtime
            try:
                self.broker = await runtime.start(config.listen)
            except (OSError, ValueError, StoreError, TokenError) as e:
                await self.stop()
                raise GatewayError(f"broker could not start: {e}") from e
        self._mark_listeners()

    def _mark_listeners(self) -> None:
        """The fence lets sandboxes reach only sockets with the gateway's mark, never another program that binds
        these ports; without the privilege to mark them, no airlock fence lets anything reach this gateway."""
        config = self.config
        try:
            ports = (config.proxy_port, config.transparent_port, config.dns_port, config.broker.port)
            mark_listeners(config.listen, [p for p in ports if p])
        except OSError as e:
            log.warning("listening sockets not marked (%s): an airlock fence keeps sandboxes from them", e)

    def _audit_failure(self) -> str | None:
        return self.audit.failure

    async def _flush_audit(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            self.audit.flush()

    def replace_policy(self, policy: Policy) -> None:
        """Swap in a new, already validated policy for proxy, DNS and broker at once (the one place it is swapped);
        connections already open keep the decision they had, replies the DNS server remembered are forgotten.

        A policy without a profile that a running sandbox uses would fail its every request and DNS query:
        PolicyError, and the running policy stays."""
        if self.live is None:
            raise GatewayError("the gateway has not started: no policy to replace")
        self.live.replace(policy)

    async def stop(self) -> None:
        if self._master is None:
            return
        master, self._master = self._master, None
        if self._flusher is not None:
            self._flusher.cancel()
        if self.dns is not None:
            await self.dns.stop()
        if self._broker_runtime is not None:
            await self._broker_runtime.stop()
        if self.shared is not None:
            self.shared.refusals.flush()
        # Master.shutdown() alone leaves the listening sockets open: close the servers first.
        with contextlib.suppress(Exception):
            await master.addons.get("proxyserver").servers.update([])
        master.shutdown()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)
        self.audit.close()
        if self._own is not None:
            self._own.close()
        if self._own_state:
            shutil.rmtree(self._state_dir, ignore_errors=True)
