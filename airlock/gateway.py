"""The gateway process: the policy, the one resolver, mitmproxy with the airlock addon, the sandbox DNS server,
the broker and the admin listener, wired together.

mitmproxy and the addon are most of a gateway's start-up (proxy layers, QUIC, pyOpenSSL, pyparsing: about 300 ms),
and aiohttp (the admin listener) a quarter of a second more, so they are imported in a thread (`airlock.preload`)
while the rest starts: what a launcher builds meanwhile (the sandbox's namespace, link, fence and DNS) waits on
subprocesses and the kernel, not on this process. The proxy's sockets (explicit and transparent) and the admin
listener's listen from the start, once the policy is in force: a client that comes before they are served waits in
their backlog, and is served like any other (the proxy's by the addon) once aiohttp, then mitmproxy, are in."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import gc
import ipaddress
import logging
import os
import resource
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airlock.admin import AdminApp, gateway_routes
from airlock.approvals import Approvals, PolicyWriter, approval_routes
from airlock.audit import AuditLog
from airlock.audit.notices import DenialNotices
from airlock.auditing import GatewayAudit, tell
from airlock.brokerconfig import admin_address
from airlock.dns.admission import DnsSettings
from airlock.dns.answered import AnsweredAddresses
from airlock.dns.server import DnsServer
from airlock.dns.upstream import Resolver, ResolverConfig, system_servers
from airlock.errors import AirlockError
from airlock.gatewayconfig import GatewayConfig
from airlock.inspection.secrets import SecretValues
from airlock.inspection.trust import system_trust_store
from airlock.interfaces import interface_addresses
from airlock.live import GatewayAddresses
from airlock.metrics import GatewayMetrics
from airlock.policy import IPAddress, LivePolicy, Policy, PolicyError, Sandbox, SandboxRegistry
from airlock.preload import preload_admin, preload_proxy
from airlock.reload import PolicyReloader, Reloaded, log_reload
from airlock.sandbox.fence import mark_listeners
from airlock.sandbox.reach import policy_files

if TYPE_CHECKING:
    from airlock.broker.service import Broker
    from airlock.brokerd import BrokerRuntime
    from airlock.inspector import Inspector
    from airlock.mitm import Master
    from airlock.proxy.addon import Airlock

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
PROXY_BACKLOG = 100  # asyncio's default, which mitmproxy listened with
PROXY_START_TIMEOUT = 30.0  # seconds for mitmproxy to come up once imported


class GatewayError(AirlockError):
    pass


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


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        try:  # before anything exists: a name would mean other addresses for proxy, DNS and the vetting
            ipaddress.ip_address(config.listen)
        except ValueError:
            raise GatewayError(f"listen address {config.listen!r}: give an IP address (127.0.0.1, ::1, ...)") from None
        # Read once, before any sandbox runs, for the broker and the inspection alike: a file is never read again
        # (a sandbox that replaced it, or a folder on its way, changes nothing).
        try:
            self.secrets = SecretValues.read(config.broker.secrets)
        except AirlockError as e:
            raise GatewayError(str(e)) from e
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
        self.metrics = GatewayMetrics()
        self.metrics.readiness = self.readiness
        self.resolver = Resolver(ResolverConfig(servers, min_ttl=config.dns_min_ttl))
        self.resolver.timed = self.metrics.resolved
        self.registry = SandboxRegistry(config.sandboxes)
        self.live: LivePolicy | None = None  # from start(): policy, registry and own addresses, swapped whole
        self._own: GatewayAddresses | None = None
        try:
            self.audit = AuditLog(config.audit_path, config.audit_stdout)
        except OSError as e:
            raise GatewayError(f"audit log {config.audit_path}: {e.strerror or e}") from e
        self.notices = DenialNotices(tell) if config.show_denials else None
        self.auditing = GatewayAudit(self.audit.emit, config.sandboxes, self.notices, self.metrics.observe)
        self.emit = self.auditing.emit  # what proxy, DNS and broker write their audit lines with
        # Signing keys, the broker's store and admin socket live here: root's alone. A temporary one goes at stop.
        self._own_state = config.state_dir is None
        self._state_dir = config.state_dir or tempfile.mkdtemp(prefix="airlock-gw-")
        _private_directory(Path(self._state_dir))
        self._started = False
        self._master: Master | None = None
        self._task: asyncio.Task[None] | None = None  # mitmproxy's master
        self._proxy: asyncio.Future[None] | None = None  # until the admin listener, then the proxy, serve
        self._listeners: dict[str, socket.socket] = {}  # the proxy's, by mitmproxy mode spec, from start() on
        self._proxy_servers: list[asyncio.Server] = []  # once mitmproxy serves them
        self._flusher: asyncio.Task[None] | None = None
        self.shared = None
        self.airlock: Airlock | None = None
        self.dns: DnsServer | None = None
        self.broker: Broker | None = None
        self._broker_runtime: BrokerRuntime | None = None
        self.inspector: Inspector | None = None  # once a policy in force inspects (`inspect: true`)
        # The admin listener: routes are made once aiohttp is in (others: `gateway.admin.add_routes(...)`).
        self.admin = AdminApp(config.admin or str(Path(self._state_dir) / "admin.sock"))
        self._approved: str | None = None  # the hash of the policy an approval wrote, until its file is read again
        writer = PolicyWriter(config.policy_path, self._put_approved) if config.policy_path else None
        self.approvals = Approvals(
            self.emit, config.approval_webhook, writer, admin=admin_address(self.admin.endpoint),
            shared=lambda: self.broker.store.approvals if self.broker is not None else None,  # a fleet's store
        )  # fmt: skip
        # Reloads read the file the first policy came from, off the event loop (airlock/reload.py).
        self.reloader = PolicyReloader(self, config.policy.source, self._policy)
        if config.close_denied_on_reload:
            self.reloader.after.append(lambda policy: self.close_denied_tunnels())
        self.started_at = time.time()
        # The broker's routes are added when it starts.
        self.admin.add_routes(lambda: gateway_routes(self.reload_policy, self.status))
        self.admin.add_routes(self.metrics.routes)
        self.admin.add_routes(lambda: approval_routes(self.approvals))

    async def start(self, *, wait_for_proxy: bool = True) -> None:
        """Put the policy in force, then listen: the proxy's sockets (explicit, transparent), the DNS server, the
        broker, the admin listener; all but the last marked for the fence. Returns once the admin listener and the
        proxy serve too — or, without `wait_for_proxy`, while aiohttp and mitmproxy may still be loading (their
        clients wait in the backlog meanwhile): then `proxy_started()` says when both serve, or why they cannot.
        GatewayError for anything that cannot start (the gateway is stopped again)."""
        config = self.config
        loading = preload_proxy()
        admin_loading = preload_admin()
        _one_retry_per_shortage(asyncio.get_running_loop())
        self._own = GatewayAddresses(own_addresses() | {ipaddress.ip_address(config.listen)})
        live = self.live = self.auditing.live = LivePolicy(config.policy, self.registry, self._own)
        self._started = True
        try:
            self._follow_inspection(config.policy)
        except PolicyError as e:
            await self.stop()
            raise GatewayError("; ".join(e.errors)) from e
        except AirlockError as e:  # a CA that cannot be written
            await self.stop()
            raise GatewayError(str(e)) from e
        try:
            for mode, port in self._proxy_ports().items():
                self._listeners[f"{mode}@{port}"] = _listen(config.listen, port)
        except OSError as e:
            await self.stop()
            raise GatewayError(f"proxy could not listen on {config.listen}:{port}: {e.strerror}") from e
        answered = AnsweredAddresses()  # what the DNS answered each sandbox: names for connections without one
        self._flusher = asyncio.create_task(self._flush_audit())
        if config.dns_port:
            dns_settings = DnsSettings(rate_per_second=config.dns_rate, audit_failure=self._audit_failure)
            self.dns = DnsServer(live, self.resolver, self.emit, dns_settings, config.listen, config.dns_port, answered)
            self.dns.resolver.approvals = self.approvals
            try:
                await self.dns.start()
            except OSError as e:
                await self.stop()
                raise GatewayError(f"DNS server could not listen on {config.listen}:{config.dns_port}: {e}") from e
        self._watch_metrics()
        if config.broker.port:
            # Only now: a gateway without a broker never imports one (aiohttp, the GitHub client, the token code).
            from airlock.broker.store import StoreError
            from airlock.broker.tokens import TokenError
            from airlock.brokerd import BrokerRuntime

            runtime = BrokerRuntime(
                config.broker, Path(self._state_dir), live, self.resolver, self.emit, config.upstream_ca, self.secrets
            )  # fmt: skip
            self._broker_runtime = runtime
            try:
                self.broker = await runtime.start(config.listen)
            except (OSError, ValueError, StoreError, TokenError) as e:
                await self.stop()
                raise GatewayError(f"broker could not start: {e}") from e
            self.admin.mount(self.broker.admin_app())
            if self.shared is not None:  # else the proxy, when it starts, finds the broker's git tokens
                self.shared.git_tokens = self.broker.git_read
        try:
            self.admin.listen()
        except OSError as e:
            await self.stop()
            raise GatewayError(f"admin listener could not listen on {self.admin.address}: {e.strerror or e}") from e
        # Every route is added and every app mounted by now: the admin listener can be served as it is.
        self._proxy = asyncio.ensure_future(self._serve_loaded(admin_loading, loading, answered))
        self._mark_listeners()
        if wait_for_proxy:
            try:
                await self.proxy_started()
            except GatewayError:
                await self.stop()
                raise

    async def proxy_started(self) -> None:
        """Once the admin listener and the proxy serve; GatewayError if they cannot (then the gateway should be
        stopped)."""
        if self._proxy is None:
            raise GatewayError("the gateway has not started: no proxy")
        await asyncio.shield(self._proxy)

    def _proxy_ports(self) -> dict[str, int]:
        """The proxy's listeners: mitmproxy's mode → port (explicit proxy; transparent, when configured)."""
        config = self.config
        ports = {"regular": config.proxy_port}
        if config.transparent_port:
            ports["transparent"] = config.transparent_port
        return ports

    def _watch_metrics(self) -> None:
        """What a scrape reads: the proxy's counters once its addon exists (before, it has proxied nothing)."""
        assert self.live is not None
        live, shared, nothing = self.live, self.shared, dict[str, int]()
        self.metrics.watch(
            lambda: live.current.registry.ids(),
            shared.tunnels if shared is not None else nothing,
            shared.connections if shared is not None else nothing,
            shared.upstreams if shared is not None else nothing,
            self.audit,
            self.dns.stats if self.dns is not None else None,
        )

    async def _serve_loaded(
        self,
        admin_loading: concurrent.futures.Future[None],
        loading: concurrent.futures.Future[None],
        answered: AnsweredAddresses,
    ) -> None:
        """The admin listener once aiohttp is imported, then mitmproxy with the airlock addon once that is, each
        serving the clients that have waited in their backlog until now. If either cannot, every listener of
        theirs closes at once: clients are refused, not kept, and none is served by a gateway half up."""
        try:
            await _loaded(admin_loading, "the admin listener")
            try:
                await self.admin.serve()
            except Exception as e:
                raise GatewayError(f"the admin listener could not start: {type(e).__name__}: {e}") from e
            await _loaded(loading, "the proxy")
            await self._start_proxy(answered)
        except BaseException as e:
            await self.admin.stop()
            for server in self._proxy_servers:
                server.close()
            for listener in self._listeners.values():
                listener.close()
            if isinstance(e, Exception) and not isinstance(e, GatewayError):
                raise GatewayError(f"the proxy could not start: {type(e).__name__}: {e}") from e
            raise

    async def _start_proxy(self, answered: AnsweredAddresses) -> None:
        from airlock.mitm import Master, ServerInstance, options
        from airlock.proxy.addon import build_addon
        from airlock.proxy.shared import Credentials, GatewaySettings

        config, caps = self.config, self.caps
        opts = options.Options(
            mode=list(self._listeners),
            listen_host=config.listen,
            confdir=str(Path(self._state_dir) / "mitmproxy"),
            server=False,  # the sockets are the gateway's own (`_listeners`): mitmproxy handles their connections
        )
        self._master = master = Master(opts)
        settings = GatewaySettings(
            connect_timeout=config.connect_timeout,
            max_tunnels_per_sandbox=caps.tunnels,
            max_connections_per_sandbox=caps.per_sandbox,
            max_connections=caps.total,
            audit_failure=self._audit_failure,
            timings=self.metrics,
        )
        assert self.live is not None
        self.airlock = build_addon(self.live, self.resolver, self.emit, settings, answered)
        self.shared = shared = self.airlock.shared
        shared.approvals = self.approvals
        self._watch_metrics()
        running = _Running()
        master.addons.add(*_essential_addons(), self.airlock, running)
        master.addons.get("tlsconfig").issuer = self.inspector
        shared.git_tokens = self.broker.git_read if self.broker is not None else None
        if self.inspector is not None:
            shared.credentials = Credentials.of(self.inspector.injected(self.live.current.policy))
        opts.update(
            # lazy: never connect upstream before the SNI and Host header have been checked
            connection_strategy="lazy",
            tcp_timeout=int(config.idle_timeout),
            stream_large_bodies="1m",
            # mitmproxy's default, pinned: ambiguous request framing (CL+TE, ...) is refused, never smuggled through
            validate_inbound_headers=True,
            # Inspected hosts only (all else passes through): their upstreams are verified against the system's
            # store, or --upstream-ca alone; the leaf the sandbox sees is the gateway CA's, never a copy of theirs.
            ssl_verify_upstream_trusted_ca=config.upstream_ca or system_trust_store(),
            upstream_cert=False,
        )
        self._task = asyncio.create_task(master.run())
        ports = " and ".join(str(port) for port in self._proxy_ports().values())
        if why := await _until_running(self._task, running.event):
            raise GatewayError(f"the proxy did not start on {config.listen} port {ports}: {why}")
        # Every addon has seen `running`: connections are theirs from now on.
        proxyserver = master.addons.get("proxyserver")
        for spec, listener in self._listeners.items():
            instance = ServerInstance.make(spec, proxyserver)  # SO_ORIGINAL_DST is read by the transparent one
            server = await asyncio.start_server(instance.handle_stream, sock=listener, backlog=PROXY_BACKLOG)
            self._proxy_servers.append(server)
        # mitmproxy has installed its handler by now; every listener of the gateway shares this loop.
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_DescriptorShortage(loop))
        # What exists now (mitmproxy's modules, the policy) is mostly what the gateway keeps: out of the cycle
        # collector's sight, or each full collection would walk a policy of 100,000 rules on the event loop. A
        # reload's policy is frozen too (airlock/reload.py); a replaced one, which holds no reference cycles, is
        # freed by reference counting all the same.
        gc.freeze()
        log.info("airlock proxy listening on %s port %s", config.listen, ports)

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

    def readiness(self) -> dict[str, str | None]:
        """What /readyz checks, each with what is wrong (None: fine): a policy in force, every listener this
        gateway was told to open still open, and an audit log that can be written (without one, every request is
        denied)."""
        config, servers = self.config, self._proxy_servers
        proxy_up = len(servers) == len(self._listeners) > 0 and all(server.is_serving() for server in servers)
        failure = self.audit.failure
        checks: dict[str, str | None] = {
            "policy": None if self.live is not None else "no policy in force",
            "proxy": None if proxy_up else f"the proxy is not listening on {config.listen}:{config.proxy_port}",
            "audit": None if failure is None else f"the audit log cannot be written: {failure}",
        }
        if config.dns_port:
            dns_up = self.dns is not None and self.dns.listening
            checks["dns"] = None if dns_up else f"the DNS server is not listening on {config.listen}:{config.dns_port}"
        if config.broker.port:
            checks["broker"] = None if self.broker is not None else "the broker is not running"
        return checks

    def reopen_audit(self) -> None:
        """SIGUSR1: the audit file opened anew at its path (after log rotation moved it away)."""
        self.audit.reopen()

    async def _flush_audit(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            self.audit.flush()

    def replace_policy(self, policy: Policy) -> None:
        """Swap in a new, already validated policy for proxy, DNS and broker at once (the one place it is swapped);
        connections already open keep the decision they had, replies the DNS server remembered are forgotten.

        A policy without a profile that a running sandbox uses would fail its every request and DNS query, and
        one whose declared tools the broker cannot serve (a secret it was not given) would fail their calls:
        PolicyError, and the running policy stays. The declared tools follow the policy in force."""
        if self.live is None:
            raise GatewayError("the gateway has not started: no policy to replace")
        running = self.live.current.policy.hash
        reach = self.config.sandbox_reach
        try:
            if reach is not None and (problems := reach.problems(policy_files(policy))):
                raise PolicyError(problems)  # a file it names could be the sandbox's (airlock/sandbox/reach.py)
            if self._broker_runtime is not None and (problems := self._broker_runtime.problems(policy)):
                raise PolicyError(problems)  # e.g. a declared tool naming a secret the gateway was not given
            if problems := self.live.refusals(policy):  # before the inspection follows it: nothing of it then
                raise PolicyError(problems)
            self._follow_inspection(policy)
            self.live.replace(policy)
        except PolicyError as e:
            self.auditing.policy_refused(policy.source, e.errors, refused_hash=policy.hash)
            raise
        self.auditing.policy_loaded(policy, running)

    def _follow_inspection(self, policy: Policy) -> None:
        """Ready what the policy's inspected rules need before it is in force: a CA that permits their hosts, the
        secrets they inject (PolicyError: one the gateway was not given). A policy that inspects nothing needs
        nothing, and imports nothing of it."""
        if self.inspector is None:
            if not policy.inspected_hosts():
                return
            from airlock.inspector import Inspector

            self.inspector = Inspector(Path(self._state_dir), self.secrets)
            if self._master is not None:
                self._master.addons.get("tlsconfig").issuer = self.inspector
        if problems := self.inspector.problems(policy):
            raise PolicyError(problems)
        self.inspector.apply(policy)
        if self.shared is not None:
            from airlock.proxy.shared import Credentials

            self.shared.credentials = Credentials.of(self.inspector.injected(policy), self.shared.credentials.minted)

    def policy_refused(self, source: str, errors: list[str]) -> None:
        """Audit a policy file that did not load (the running policy stays)."""
        self.auditing.policy_refused(source, errors)

    def _put_approved(self, policy: Policy) -> None:
        """A policy an approval wrote (`--scope policy`) put in force, and told as a reload of its file is."""
        previous = self._policy()
        self.replace_policy(policy)
        self.tell_reload(Reloaded(policy.source, policy.hash, previous.hash if previous is not None else None))
        self._approved = policy.hash

    def tell_reload(self, outcome: Reloaded) -> None:
        """A reload as the gateway tells them: one line on stderr (`airlock run`), else in its log — once only for
        the file an approval wrote (a file watch that reads it again finds the policy in force)."""
        approved, self._approved = self._approved, None
        if outcome.ok and outcome.policy_hash == outcome.previous_hash == approved:
            return
        if self.config.tell_reloads:
            tell(outcome.one_line())
        else:
            log_reload(outcome)

    async def reload_policy(self) -> Reloaded:
        """Load the policy file again, off the event loop, and put it in force; a file that does not load (or lacks
        a running sandbox's profile) is audited as refused and the running policy stays."""
        return await self.reloader.reload()

    def close_denied_tunnels(self) -> int:
        """Close the open tunnels the policy in force denies; how many."""
        if self.shared is None or self._master is None:
            return 0
        from airlock.proxy.tunnels import denied_tunnels  # imported with the addon, which made `shared`

        denied = set(denied_tunnels(self.shared))
        for handler in list(self._master.addons.get("proxyserver").connections.values()):
            if handler.client.id in denied:
                handler.close_connection(handler.client)
        return len(denied)

    def _policy(self) -> Policy | None:
        return self.live.current.policy if self.live is not None else None

    def status(self) -> dict[str, Any]:
        """What `GET /v1/status` answers: the policy in force, the sandboxes, open tunnels and connections, counts."""
        policy = self.live.current.policy if self.live is not None else self.config.policy
        shared = self.shared
        return {
            "policy_hash": policy.hash,
            "policy_source": policy.source,
            "default_profile": policy.default_profile,
            "profiles": {
                name: {"allow_rules": len(p.allow), "deny_rules": len(p.deny)}
                for name, p in sorted(policy.profiles.items())
            },
            "sandboxes": [
                {"id": s.id, "profile": s.profile, "network": str(s.network)} for s in self.registry.sandboxes
            ],
            "open_tunnels": {k: n for k, n in shared.tunnels.items() if n} if shared is not None else {},
            "open_connections": {k: n for k, n in shared.connections.items() if n} if shared is not None else {},
            "counters": self.auditing.counters(),
            "started_at": self.started_at,
            "inspection": self._inspection_status(policy),
        }

    def _inspection_status(self, policy: Policy) -> dict[str, Any] | None:
        """The inspected hosts, and the certificates a sandbox must trust for them (each CA generation's, and the
        bundle with the system's CAs); None while nothing is inspected."""
        inspector = self.inspector
        if inspector is None or not inspector.active:
            return None
        return {
            "hosts": sorted(policy.inspected_hosts()),
            "ca_certificates": [str(ca.cert_path) for ca in inspector.generations],
            "trust_bundle": str(inspector.bundle),
        }

    async def stop(self) -> None:
        """Close every listener and stop; a proxy still loading is not waited for (it will not serve)."""
        if not self._started:
            return
        self._started = False
        if self._proxy is not None and not self._proxy.done():
            self._proxy.cancel()
        if self._proxy is not None:
            with contextlib.suppress(asyncio.CancelledError, GatewayError):
                await self._proxy  # its failure was told by start() or proxy_started(), if anyone asked
        if self._flusher is not None:
            self._flusher.cancel()
        if self.dns is not None:
            await self.dns.stop()
        await self.admin.stop()
        if self._broker_runtime is not None:
            await self._broker_runtime.stop()
        await self.approvals.close()
        if self.shared is not None:
            self.shared.refusals.flush()
        if self.notices is not None:
            self.notices.flush()
        for server in self._proxy_servers:
            server.close()  # connections still open end with the master
        for listener in self._listeners.values():
            listener.close()  # also when the proxy never served
        if self._master is not None:
            self._master.shutdown()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)
        self.audit.close()
        if self._own is not None:
            self._own.close()
        if self._own_state:
            shutil.rmtree(self._state_dir, ignore_errors=True)


async def _loaded(loading: concurrent.futures.Future[None], what: str) -> None:
    """Once preload_proxy()'s `loading` is done; GatewayError naming `what` if its import failed."""
    try:
        await asyncio.wrap_future(loading)
    except Exception as e:
        raise GatewayError(f"{what} could not be loaded: {type(e).__name__}: {e}") from e


def _listen(host: str, port: int) -> socket.socket:
    """The proxy's listening socket, as asyncio would make it (SO_REUSEADDR; IPv6 only on an IPv6 address; Nagle
    off). create_server's sockets say proto 0, so asyncio leaves Nagle on for what they accept, and a response
    mitmproxy writes as head then body would wait for the client's delayed ACK (40 ms); Linux passes the option on
    to every accepted socket."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=PROXY_BACKLOG)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _essential_addons() -> tuple[object, ...]:
    """Only the addons a proxy needs: no script loader, replay, onboarding app (mitm.it), header or body rewriting —
    less to dispatch on every event, and nothing a request could reach but airlock's hooks."""
    from airlock.mitm import Proxyserver, TlsConfig, core, disable_h2c, next_layer

    return core.Core(), Proxyserver(), next_layer.NextLayer(), TlsConfig(), disable_h2c.DisableH2C()


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
