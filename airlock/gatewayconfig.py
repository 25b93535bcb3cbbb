"""The gateway's settings (`GatewayConfig`), apart from the gateway itself: what a command line or a launcher builds
before a sandbox exists imports none of the gateway's machinery (DNS server, audit, admin listener), which
`airlock.preload` loads in a thread while the sandbox is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from airlock.brokerconfig import BrokerConfig
from airlock.dns.upstream import Server
from airlock.policy import Policy, Sandbox

if TYPE_CHECKING:
    from airlock.sandbox.reach import Reach


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
    show_denials: bool = False  # each denial as one line on stderr, as it happens (`airlock run`; rate-limited)
    tell_reloads: bool = False  # an approval's reload as one line on stderr, as `airlock run` tells edits; else logged
    connect_timeout: float = 10.0
    idle_timeout: float = 300.0
    max_tunnels_per_sandbox: int | None = None  # None: derived from the open-file limit, like the next two
    max_connections_per_sandbox: int | None = None
    dns_min_ttl: int = 5
    dns_port: int = 53  # 0: no DNS server for sandboxes
    dns_rate: float = 100.0  # queries per second per sandbox
    close_denied_on_reload: bool = False  # a reload closes the open tunnels the new policy denies
    state_dir: str | None = None
    admin: str | None = None  # the admin listener: a unix socket path or 127.0.0.1:PORT; default STATE_DIR/admin.sock
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    policy_path: str | None = None  # the file `--scope policy` approvals write into; None: none may
    approval_webhook: str | None = None  # where each request held for approval is posted (JSON)
    # What the sandbox may change on the host (`airlock run`'s netns backend): a policy put in force later must
    # name no file there. None: nothing to judge (docker's sandboxes write no host path; `airlock gateway`'s are
    # its operator's).
    sandbox_reach: Reach | None = None
