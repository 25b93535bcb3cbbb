"""What the gateway's broker is told to be: its port, where its GitHub credential comes from.

Apart from `airlock.brokerd` (which runs the broker, with the GitHub client and the token code) so that a gateway
without a broker imports none of that. The gateway's admin address is read here for the listener and its clients
alike."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from airlock.errors import AirlockError

LOOPBACK_NAMES = ("127.0.0.1", "::1", "localhost")
_PORT = re.compile(r"[0-9]{1,5}")
SECRET_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # policy.tools.SECRET_NAME, without importing the policy


class BrokerConfigError(AirlockError, ValueError):
    pass


@dataclass(frozen=True)
class SecretSource:
    """`--secret NAME=file:PATH|env:VAR`: where the gateway reads a secret that declared tools name."""

    name: str
    kind: Literal["file", "env"]
    where: str  # an absolute path, or a variable's name


def parse_secret(spec: str) -> SecretSource:
    name, _, source = spec.partition("=")
    kind, _, where = source.partition(":")
    if not SECRET_NAME.fullmatch(name) or kind not in ("file", "env") or not where:
        raise BrokerConfigError(f"--secret {spec!r}: expected NAME=file:PATH or NAME=env:VAR")
    return SecretSource(name, kind, str(Path(where).absolute()) if kind == "file" else where)  # type: ignore[arg-type]


@dataclass
class BrokerConfig:
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
