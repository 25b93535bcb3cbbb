"""The gateway's settings (`GatewayConfig`, its broker's `BrokerConfig`) and the addresses the gateway and its
clients name alike (the admin listener's, the broker's). What a command line or a launcher builds before a sandbox
exists imports none of the gateway's machinery (DNS server, audit, admin listener), which
`airlock.gateway.startup.preload` loads in a thread while the sandbox is built; a gateway without a broker imports
none of the broker (`airlock.gateway.broker_runtime` runs it)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from airlock.dns.servers import Server
from airlock.errors import AirlockError
from airlock.inspection.secrets import SECRET_NAME, SecretSource
from airlock.policy import Policy, Sandbox

if TYPE_CHECKING:
    from airlock.sandbox.reach import Reach

LOOPBACK_NAMES = ("127.0.0.1", "::1", "localhost")
_PORT = re.compile(r"[0-9]{1,5}")


class BrokerConfigError(AirlockError, ValueError):
    pass


def parse_secret(spec: str) -> SecretSource:
    name, _, source = spec.partition("=")
    kind, _, where = source.partition(":")
    if not SECRET_NAME.fullmatch(name) or kind not in ("file", "env") or not where:
        raise BrokerConfigError(f"--secret {spec!r}: expected NAME=file:PATH or NAME=env:VAR")
    return SecretSource(name, kind, str(Path(where).absolute()) if kind == "file" else where)  # type: ignore[arg-type]


@dataclass
class BrokerConfig:
    """What the gateway's broker is told to be: its port, where its GitHub credential comes from."""

    port: int = 8080  # sandbox-facing, on the gateway's sandbox address; 0: no broker
    call_log: str | None = None  # the directory of the record of brokered calls; default <state>/calls
    github_api: str = "https://api.github.com"
    github_git: str | None = None  # where git reaches the repositories; None: derived from github_api
    github_app_id: str | None = None
    github_app_key: str | None = None  # PEM file
    github_installation_id: int | None = None
    github_token_file: str | None = None
    github_token_env: str | None = None
    github_timeout: float = 10.0
    token_ttl: int = 900
    token_max_ttl: int = 3600
    calls_per_minute: int = 30
    max_connections_per_client: int = 32  # open connections to the sandbox-facing listener per source address
    secrets: list[SecretSource] = field(default_factory=list)  # what declared tools may name (policy tools:)
    store: str | None = None  # sqlite:///PATH or postgresql://…; None: STATE_DIR/broker.sqlite3
    store_password_file: str | None = None  # the database's password; None: libpq's (PGPASSWORD, PGPASSFILE)
    signing_keys: list[str] = field(default_factory=list)  # Ed25519 PEM files; none: keys made in STATE_DIR/keys
    active_kid: str | None = None  # which of them signs; None: the first
    audience: str | None = None  # the URL its clients reach it at (every replica's the same); None: from its listener


@dataclass(frozen=True)
class RelayConfig:
    """A pod's broker relay (`airlock gateway --pod --broker-url`): the sandbox surface of the central broker at `url`,
    served on the gateway's listen address, each request carrying the pod's token read from `token_file`."""

    url: str
    token_file: str
    port: int = 8080
    max_connections_per_client: int = 32


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
    relay: RelayConfig | None = None  # a pod's broker relay, in place of a broker of its own
    trust_dir: str | None = None  # where the trust bundle is published as ca-bundle.pem (a pod's shared volume)
    # Proxy processes (airlock/gateway/workers.py): 1, the proxy runs in the gateway process itself; N > 1, N
    # workers serve the gateway's listeners while this process keeps policy, DNS, broker, admin and the audit file.
    workers: int = 1


def broker_url(listen: str, port: int) -> str:
    """Where the sandboxes reach the broker ($AIRLOCK_BROKER_URL): also its resource, the audience of its tokens."""
    host = f"[{listen}]" if ":" in listen else listen
    return f"http://{host}:{port}"


def admin_address(endpoint: Path | tuple[str, int]) -> str:
    """An admin listener as --admin names it (absolute, whatever the working directory)."""
    if isinstance(endpoint, Path):
        return str(endpoint)
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def admin_endpoint(address: str) -> Path | tuple[str, int]:
    """The admin listener named by `address`: `HOST:PORT` (loopback only: the listener mints tokens for whoever
    reaches it) as (host, port), anything else a unix socket path, made absolute against the working directory —
    the same socket for the gateway that listens and the command that calls it."""
    host, sep, port = address.rpartition(":")
    if not sep or "/" in address or not _PORT.fullmatch(port):
        return Path(address).absolute()
    host = host.removeprefix("[").removesuffix("]")
    if host not in LOOPBACK_NAMES or not 1 <= int(port) <= 65535:
        raise BrokerConfigError(f"admin listener {address!r}: give a unix socket path or 127.0.0.1:PORT (loopback)")
    return host, int(port)
