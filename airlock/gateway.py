"""The gateway process: the policy, the one resolver, mitmproxy with the airlock addon, the sandbox DNS server
and the broker, wired together."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from airlock.audit import AuditLog
from airlock.brokerconfig import BrokerConfig
from airlock.dns.server import DnsServer, DnsSettings, PolicyResolver
from airlock.dns.upstream import Resolver, ResolverConfig, Server, system_servers
from airlock.errors import AirlockError
from airlock.mitm import Master, Proxyserver, TlsConfig, core, disable_h2c, next_layer, options
from airlock.policy import IPAddress, Policy, PolicyError, Sandbox, SandboxRegistry
from airlock.proxy.addon import GatewaySettings, build_addons
from airlock.sandbox.fence import mark_listeners

if TYPE_CHECKING:
    from airlock.broker.service import Broker
    from airlock.brokerd import BrokerRuntime

log = logging.getLogger("airlock.gateway")


class GatewayError(AirlockError):
    pass


@dataclass
class GatewayConfig:
    policy: Policy
    listen: str
    proxy_port: int = 3128
    sandboxes: list[Sandbox] = field(default_factory=list)
    upstream_dns: list[Server] = field(default_factory=list)
    upstream_ca: str | None = None
    audit_path: str | None = None
    audit_stdout: bool = False
    connect_timeout: float = 10.0
    idle_timeout: float = 300.0
    max_tunnels_per_sandbox: int = 256
    max_connections_per_sandbox: int = 1024
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
    found: set[IPAddress] = set()
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, timeout=5, check=True)
        for interface in json.loads(out.stdout):
            for info in interface.get("addr_info", []):
                with contextlib.suppress(ValueError, KeyError):
                    found.add(ipaddress.ip_address(info["local"]))
    return frozenset(found)


def _missing_profiles(policy: Policy, sandboxes: list[Sandbox]) -> list[str]:
    users: dict[str, set[str]] = {}
    for sandbox in sandboxes:
        if sandbox.profile not in policy.profiles:
            users.setdefault(sandbox.profile, set()).add(sandbox.id)
    known = ", ".join(sorted(policy.profiles))
    return [
        f"{policy.source}: no profile {name!r}, which sandbox {', '.join(sorted(ids))} uses (profiles: {known})"
        for name, ids in sorted(users.items())
    ]


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        try:  # before anything exists: a name would mean other addresses for proxy, DNS and the vetting
            ipaddress.ip_address(config.listen)
        except ValueError:
            raise GatewayError(f"listen address {config.listen!r}: give an IP address (127.0.0.1, ::1, ...)") from None
        servers = config.upstream_dns or system_servers()
        if not servers:
            raise GatewayError("no upstream DNS server: pass --upstream-dns or configure /etc/resolv.conf")
        self.resolver = Resolver(ResolverConfig(servers, min_ttl=config.dns_min_ttl))
        self.registry = SandboxRegistry(config.sandboxes)
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
        self.addons: list[object] = []
        self.dns: PolicyResolver | None = None
        self._dns_server: DnsServer | None = None
        self.broker: Broker | None = None
        self._broker_runtime: BrokerRuntime | None = None

    async def start(self) -> None:
        config = self.config
        opts = options.Options(
            mode=[f"regular@{config.proxy_port}"],
            listen_host=config.listen,
            confdir=str(Path(self._state_dir) / "mitmproxy"),
        )
        master = Master(opts)
        gateway_addresses = own_addresses() | {ipaddress.ip_address(config.listen)}
        settings = GatewaySettings(
            own_addresses=gateway_addresses,
            connect_timeout=config.connect_timeout,
            max_tunnels_per_sandbox=config.max_tunnels_per_sandbox,
            max_connections_per_sandbox=config.max_connections_per_sandbox,
        )
        self.shared, self.addons = build_addons(config.policy, self.registry, self.resolver, self.audit.emit, settings)
        # Only the addons a proxy needs: no script loader, replay, onboarding app (mitm.it), header or body
        # rewriting — less to dispatch on every event, and nothing a request could reach but airlock's hooks.
        essentials = (
            core.Core(),
            Proxyserver(),
            next_layer.NextLayer(),
            TlsConfig(),
            disable_h2c.DisableH2C(),
        )
        master.addons.add(*essentials, *self.addons)
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
            if proxyserver.listen_addrs() or self._task.done():
                break
            await asyncio.sleep(0.005)
        if not proxyserver.listen_addrs():
            await self.stop()
            raise GatewayError(f"proxy could not listen on {config.listen}:{config.proxy_port}")
        log.info("airlock proxy listening on %s:%d", config.listen, config.proxy_port)
        if config.dns_port:
            dns_settings = DnsSettings(own_addresses=gateway_addresses, rate_per_second=config.dns_rate)
            self.dns = PolicyResolver(config.policy, self.registry, self.resolver, self.audit.emit, dns_settings)
            self._dns_server = DnsServer(self.dns, config.listen, config.dns_port)
            try:
                await self._dns_server.start()
            except OSError as e:
                await self.stop()
                raise GatewayError(f"DNS server could not listen on {config.listen}:{config.dns_port}: {e}") from e
        if config.broker.port:
            # Only now: a gateway without a broker never imports one (aiohttp, the GitHub client, the token code).
            from airlock.broker.store import StoreError
            from airlock.broker.tokens import TokenError
            from airlock.brokerd import BrokerRuntime

            runtime = BrokerRuntime(
                config.broker, Path(self._state_dir), self.registry, self.resolver, self.audit.emit, config.upstream_ca
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
            mark_listeners(config.listen, [p for p in (config.proxy_port, config.dns_port, config.broker.port) if p])
        except OSError as e:
            log.warning("listening sockets not marked (%s): an airlock fence keeps sandboxes from them", e)

    async def _flush_audit(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            self.audit.flush()

    def replace_policy(self, policy: Policy) -> None:
        """Swap in a new, already validated policy; connections already open keep the decision they had.

        A policy without a profile that a running sandbox uses would fail its every request and DNS query:
        PolicyError, and the running policy stays."""
        assert self.shared is not None
        if errors := _missing_profiles(policy, self.config.sandboxes):
            raise PolicyError(errors)
        self.shared.policy = policy
        if self.dns is not None:
            self.dns.policy = policy

    async def stop(self) -> None:
        if self._master is None:
            return
        master, self._master = self._master, None
        if self._flusher is not None:
            self._flusher.cancel()
        if self._dns_server is not None:
            await self._dns_server.stop()
        if self._broker_runtime is not None:
            await self._broker_runtime.stop()
        # Master.shutdown() alone leaves the listening sockets open: close the servers first.
        with contextlib.suppress(Exception):
            await master.addons.get("proxyserver").servers.update([])
        master.shutdown()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)
        self.audit.close()
        if self._own_state:
            shutil.rmtree(self._state_dir, ignore_errors=True)
