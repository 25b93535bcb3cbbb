"""What a broker is started with, read before it serves: its GitHub credential (`--github-app-*`,
`--github-token-*`), its state and call log (`--store`, `--store-password-file`) and its signing keys
(`--signing-key`, else STATE_DIR's). Shared by the broker inside the gateway, `airlock broker` and
`airlock tools replay` (`airlock.gateway.broker_runtime`, `airlock.cli.tools`)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from airlock.broker.calllog import CallLog, CallStore
from airlock.broker.github import AppCredential, Credential, StaticCredential
from airlock.broker.shapes import CREDENTIAL
from airlock.broker.store import BrokerStore, SqliteStore
from airlock.broker.tokens import FileKeys, KeyRing, KeySet
from airlock.gateway.config import BrokerConfig, BrokerConfigError


def credential(config: BrokerConfig) -> Credential | None:
    """The GitHub credential the broker acts with: an App's key, a static token from a file or a variable, or none."""
    if config.github_app_id or config.github_app_key:
        if not (config.github_app_id and config.github_app_key):
            raise BrokerConfigError("GitHub App mode needs both --github-app-id and --github-app-key")
        try:
            key = Path(config.github_app_key).read_text()
        except (OSError, ValueError) as e:  # ValueError: undecodable bytes
            raise BrokerConfigError(f"cannot read the GitHub App key: {e}") from None
        return AppCredential(config.github_app_id, key, config.github_installation_id)
    if config.github_token_file:
        try:
            return _static(Path(config.github_token_file).read_text().strip(), "the GitHub token file")
        except (OSError, ValueError) as e:
            raise BrokerConfigError(f"cannot read the GitHub token file: {e}") from None
    if config.github_token_env:
        token = os.environ.get(config.github_token_env, "").strip()
        if not token:
            raise BrokerConfigError(f"environment variable {config.github_token_env} is empty")
        return _static(token, f"environment variable {config.github_token_env}")
    return None


def _static(token: str, where: str) -> StaticCredential:
    # It is sent in an Authorization header, and the redactor relies on a credential holding no whitespace.
    if not CREDENTIAL.test(token):
        raise BrokerConfigError(f"{where} must hold one token: visible ASCII characters, no spaces")
    return StaticCredential(token)


async def open_state(config: BrokerConfig, state_dir: Path) -> tuple[BrokerStore, CallStore]:
    """The broker's state and its call log, where `--store` says: a SQLite file (the default: STATE_DIR's, and the
    call log in a file of its own) or a PostgreSQL database (both in it). Off the event loop for SQLite: the proxy
    and DNS may already serve, and a file may be locked."""
    url = config.store or f"sqlite://{state_dir / 'broker.sqlite3'}"
    scheme = url.partition("://")[0]
    if scheme in ("postgresql", "postgres"):
        from airlock.broker.pgstore import PostgresStore

        store = await PostgresStore.open(url, read_password(config.store_password_file))
        return store, store
    if scheme != "sqlite" or not url.startswith("sqlite:///"):
        raise BrokerConfigError(f"--store {url!r}: give sqlite:///PATH or postgresql://USER@HOST/DB")
    sqlite = await asyncio.to_thread(SqliteStore, Path(url.removeprefix("sqlite://")))
    call_log = await asyncio.to_thread(CallLog.in_directory, Path(config.call_log or state_dir / "calls"))
    return sqlite, call_log


def read_password(path: str | None) -> str | None:
    """The database password from `--store-password-file` (its first line); None: libpq's own (PGPASSWORD,
    PGPASSFILE, ~/.pgpass)."""
    if path is None:
        return None
    try:
        return Path(path).read_text().splitlines()[0]
    except (OSError, ValueError, IndexError) as e:
        raise BrokerConfigError(f"--store-password-file {path}: {getattr(e, 'strerror', None) or 'empty'}") from None


def signing_keys(config: BrokerConfig, state_dir: Path) -> KeySet:
    """`--signing-key` files (the same for every replica), else keys the broker makes in STATE_DIR/keys."""
    if config.signing_keys:
        return FileKeys([Path(p) for p in config.signing_keys], config.token_max_ttl, config.active_kid)
    return KeyRing(state_dir / "keys", config.token_max_ttl)
