"""The gateway's parts, built once and in start order (`build_parts`): each is handed every part it uses when it is
made, so nothing is assigned into a part afterwards and the order below is the whole of the start-up contract.
None listens yet: `Gateway.start()` starts them, in this order too."""

from __future__ import annotations

import ipaddress
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from airlock.audit import AuditLog
from airlock.audit.notices import DenialNotices
from airlock.dns.admission import DnsSettings
from airlock.dns.answered import AnsweredAddresses
from airlock.dns.server import DnsServer
from airlock.dns.servers import system_servers
from airlock.dns.upstream import Resolver, ResolverConfig
from airlock.errors import AirlockError
from airlock.gateway.admin import AdminApp
from airlock.gateway.approval_desk import Approvals
from airlock.gateway.approval_writer import PolicyWriter
from airlock.gateway.auditing import GatewayAudit, tell
from airlock.gateway.capacity import ConnectionCaps, announce, connection_caps, raise_open_file_limit, sandbox_count
from airlock.gateway.config import GatewayConfig, admin_address
from airlock.gateway.errors import GatewayError
from airlock.gateway.metrics import GatewayMetrics
from airlock.gateway.own_addresses import GatewayAddresses, interface_own_addresses
from airlock.gateway.proxy_runtime import ProxyProviders, ProxyRuntime
from airlock.inspection.inspector import Inspector
from airlock.inspection.secrets import SecretValues
from airlock.policy import LivePolicy, Policy, SandboxRegistry

if TYPE_CHECKING:
    from airlock.gateway.broker_relay import BrokerRelay
    from airlock.gateway.broker_runtime import BrokerRuntime
    from airlock.gateway.metrics import MetricsSnapshot
    from airlock.gateway.worker_terms import WorkerChannels
    from airlock.gateway.workers import WorkerPool


@dataclass(frozen=True)
class StateDirectory:
    """Where signing keys, the broker's store and the admin socket live: root's alone. A temporary one goes at stop."""

    path: Path
    temporary: bool

    @classmethod
    def make(cls, given: str | None) -> StateDirectory:
        path = Path(given or tempfile.mkdtemp(prefix="airlock-gw-"))
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if path.stat().st_uid == os.geteuid():
                path.chmod(0o700)  # tightened when this process owns it
        except OSError as e:
            raise GatewayError(f"state directory {path}: {e.strerror or e}") from e
        return cls(path, given is None)

    def remove(self) -> None:
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)


@dataclass(frozen=True)
class GatewayParts:
    """Every part of one gateway, in the order they are built and started."""

    secrets: SecretValues  # the --secret values, read once, before any sandbox runs
    caps: ConnectionCaps
    metrics: GatewayMetrics
    resolver: Resolver
    audit: AuditLog
    notices: DenialNotices | None
    state: StateDirectory
    own: GatewayAddresses
    live: LivePolicy  # policy, registry and own addresses, swapped whole
    auditing: GatewayAudit  # what proxy, DNS and broker write their audit lines with (`emit`)
    admin: AdminApp
    broker: BrokerRuntime | None  # before the approvals: a fleet's store shares them
    relay: BrokerRelay | None  # a pod's relay to the central broker, in place of a broker of its own
    approvals: Approvals
    inspector: Inspector
    answered: AnsweredAddresses  # what the DNS answered each sandbox: names for connections without one
    dns: DnsServer | None
    proxy: ProxyRuntime  # with workers: the listeners only, bound here and served by the workers
    workers: WorkerPool | None  # `--workers N`, N > 1 (airlock/gateway/workers.py)


def build_parts(config: GatewayConfig, put_approved: Callable[[Policy], Awaitable[None] | None]) -> GatewayParts:
    """The parts of a gateway for `config`; GatewayError for a setting that cannot work. `put_approved` puts in force
    a policy that an approval wrote into the policy file."""
    try:  # before anything exists: a name would mean other addresses for proxy, DNS and the vetting
        listen = ipaddress.ip_address(config.listen)
    except ValueError:
        raise GatewayError(f"listen address {config.listen!r}: give an IP address (127.0.0.1, ::1, ...)") from None
    # Read once, before any sandbox runs, for the broker and the inspection alike: a file is never read again
    # (a sandbox that replaced it, or a folder on its way, changes nothing).
    try:
        secrets = SecretValues.read(config.broker.secrets)
    except AirlockError as e:
        raise GatewayError(str(e)) from e
    caps = _caps(config)
    servers = config.upstream_dns or system_servers()
    if not servers:
        raise GatewayError("no upstream DNS server: pass --upstream-dns or configure /etc/resolv.conf")
    channels = _worker_channels(config)
    pool: WorkerPool | None = None

    def worker_metrics() -> list[MetricsSnapshot]:
        return pool.metrics() if pool is not None else []  # the pool, made below, once it is

    metrics = GatewayMetrics(worker_metrics)
    resolver = Resolver(ResolverConfig(servers, min_ttl=config.dns_min_ttl), timed=metrics.resolved)
    try:
        audit = AuditLog(config.audit_path, config.audit_stdout)
    except OSError as e:
        raise GatewayError(f"audit log {config.audit_path}: {e.strerror or e}") from e
    notices = DenialNotices(tell) if config.show_denials else None
    state = StateDirectory.make(config.state_dir)
    own = GatewayAddresses(interface_own_addresses() | {listen})
    live = LivePolicy(config.policy, SandboxRegistry(config.sandboxes), own)
    auditing = GatewayAudit(audit.emit, config.sandboxes, notices, metrics.observe, live)
    # The admin listener: routes are made once aiohttp is in (others: `gateway.admin.add_routes(...)`).
    admin = AdminApp(config.admin or str(state.path / "admin.sock"))
    writer = PolicyWriter(config.policy_path, put_approved) if config.policy_path else None
    # Before the desk: gateways on one PostgreSQL store share their approvals through it (opened when the broker
    # starts, so the desk asks for them each time).
    broker = _broker(config, state.path, live, resolver, auditing, secrets)
    relay = _relay(config, live, auditing)
    approvals = Approvals(
        auditing.emit, config.approval_webhook, writer, admin=admin_address(admin.endpoint),
        shared=broker.shared_approvals if broker is not None else lambda: None,
    )  # fmt: skip
    inspector = Inspector(state.path, secrets, Path(config.trust_dir) if config.trust_dir else None)
    answered = AnsweredAddresses() if channels is None else _broadcast_answers(channels)
    dns = None
    if config.dns_port:
        dns_settings = DnsSettings(rate_per_second=config.dns_rate, audit_failure=lambda: audit.failure)
        dns = DnsServer(
            live, resolver, auditing.emit, dns_settings, config.listen, config.dns_port, answered, approvals
        )
    providers = ProxyProviders(
        live, resolver, auditing.emit, lambda: audit.failure, metrics, approvals, inspector, answered
    )  # fmt: skip
    proxy = ProxyRuntime(config, caps, state.path, providers)
    if channels is not None:
        pool = _worker_pool(config, caps, secrets, state.path, channels, live, answered, audit, approvals, inspector)
    return GatewayParts(
        secrets, caps, metrics, resolver, audit, notices, state, own, live, auditing, admin, broker, relay,
        approvals, inspector, answered, dns, proxy, pool,
    )  # fmt: skip


def _worker_channels(config: GatewayConfig) -> WorkerChannels | None:
    """With N > 1 workers, their channels (none yet)."""
    if config.workers <= 1:
        return None
    from airlock.gateway.worker_terms import WorkerChannels

    return WorkerChannels()


def _broadcast_answers(channels: WorkerChannels) -> AnsweredAddresses:
    from airlock.gateway.worker_terms import BroadcastAnswers

    return BroadcastAnswers(channels)


def _worker_pool(
    config: GatewayConfig,
    caps: ConnectionCaps,
    secrets: SecretValues,
    state: Path,
    channels: WorkerChannels,
    live: LivePolicy,
    answered: AnsweredAddresses,
    audit: AuditLog,
    approvals: Approvals,
    inspector: Inspector,
) -> WorkerPool:
    from airlock.gateway.worker_approvals import WorkerApprovals
    from airlock.gateway.worker_terms import WorkerSettings, worker_share
    from airlock.gateway.workers import WorkerPool

    settings = WorkerSettings(config, config.workers, worker_share(caps, config.workers), secrets, str(state))
    return WorkerPool(settings, channels, live, answered, audit, inspector, WorkerApprovals(approvals, live))


def _caps(config: GatewayConfig) -> ConnectionCaps:
    before, open_files, hard = raise_open_file_limit()
    caps = connection_caps(
        open_files, sandbox_count(config.sandboxes), config.max_connections_per_sandbox, config.max_tunnels_per_sandbox
    )
    announce(caps, before, hard)
    return caps


def _broker(
    config: GatewayConfig,
    state_dir: Path,
    live: LivePolicy,
    resolver: Resolver,
    auditing: GatewayAudit,
    secrets: SecretValues,
) -> BrokerRuntime | None:
    if not config.broker.port:
        return None
    # Only then: a gateway without a broker never imports one (aiohttp, the GitHub client, the token code).
    from airlock.gateway.broker_runtime import BrokerRuntime

    return BrokerRuntime(config.broker, state_dir, live, resolver, auditing.emit, config.upstream_ca, secrets)


def _relay(config: GatewayConfig, live: LivePolicy, auditing: GatewayAudit) -> BrokerRelay | None:
    if config.relay is None:
        return None
    from airlock.gateway.broker_relay import BrokerRelay  # aiohttp's client: with a relay only

    def identify(client: str) -> str:
        try:
            sandbox = live.current.registry.identify(client)
        except ValueError:  # no peer address
            sandbox = None
        return sandbox.id if sandbox is not None else "-"

    timeouts = (config.connect_timeout, config.idle_timeout)
    return BrokerRelay(config.relay, auditing.emit, identify, config.upstream_ca, timeouts)
