"""Running the broker inside the gateway: its state, its GitHub credential, and its two listeners."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver

from airlock.broker.github import AppCredential, Credential, GitHubClient, StaticCredential
from airlock.broker.service import Broker, BrokerSettings, _RateLimiter
from airlock.broker.shapes import CREDENTIAL
from airlock.broker.store import SqliteStore
from airlock.broker.tokens import KeyRing, TokenAuthority
from airlock.brokerconfig import BrokerConfig, BrokerConfigError, admin_endpoint
from airlock.dns.upstream import ResolveError, Resolver
from airlock.policy import HostError, SandboxRegistry, canonical_host, parse_ip_literal

log = logging.getLogger("airlock.broker")


class _ProtocolErrors(logging.Filter):
    """aiohttp logs each malformed request (before any handler runs) with its traceback: whoever reaches the port
    could fill the log. One line each instead, naming the error's type only (its text quotes the request, whose
    headers may hold a token); 20 at once, then one a second, with a count of those left out."""

    def __init__(self) -> None:
        super().__init__()
        self._budget = _RateLimiter(1.0, 20)
        self._left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._budget.take("-"):
            self._left_out += 1
            return False
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            message = f"{message}: {type(record.exc_info[1]).__name__}"
        if self._left_out:
            message, self._left_out = f"{message} ({self._left_out} more left out)", 0
        record.msg, record.args, record.exc_info, record.exc_text = message, None, None, None
        return True


HTTP_LOG = logging.getLogger("airlock.broker.http")  # the broker listeners' own aiohttp messages
HTTP_LOG.addFilter(_ProtocolErrors())


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


class SharedResolver(AbstractResolver):
    """aiohttp resolves through the gateway's one resolver (the gateway host may have no other)."""

    def __init__(self, resolver: Resolver) -> None:
        self.resolver = resolver

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[Any]:
        try:
            literal = parse_ip_literal(host)
            addresses = [literal] if literal else list((await self.resolver.resolve(canonical_host(host))).addresses)
        except (ResolveError, HostError) as e:
            log.warning("broker cannot resolve %s: %s", host, e)
            raise OSError(f"cannot resolve {host}: {e}") from None
        return [
            {
                "hostname": host, "host": str(a), "port": port, "proto": 0, "flags": socket.AI_NUMERICHOST,
                "family": socket.AF_INET if a.version == 4 else socket.AF_INET6,
            }
            for a in addresses
            if family == socket.AF_UNSPEC or (family == socket.AF_INET) == (a.version == 4)
        ]  # fmt: skip

    async def close(self) -> None:
        return None


class BrokerRuntime:
    def __init__(
        self,
        config: BrokerConfig,
        state_dir: Path,
        registry: SandboxRegistry,
        resolver: Resolver,
        emit: Any,
        upstream_ca: str | None,
    ) -> None:
        self.config = config
        self.state_dir = state_dir
        self.registry = registry
        self.resolver = resolver
        self.emit = emit
        self.upstream_ca = upstream_ca
        self.broker: Broker | None = None
        self._runners: list[web.AppRunner] = []
        self._session: aiohttp.ClientSession | None = None
        self.admin_address = config.admin or str(state_dir / "admin.sock")

    async def start(self, listen: str) -> Broker:
        config = self.config
        keys = KeyRing(self.state_dir / "keys", config.token_max_ttl)
        # Off the event loop, as every later store call: the proxy and DNS already serve, and the file may be locked.
        store = await asyncio.to_thread(SqliteStore, self.state_dir / "broker.sqlite3")
        github_credential = credential(config)
        github = None
        if github_credential is not None:
            context = ssl.create_default_context(cafile=self.upstream_ca)
            connector = aiohttp.TCPConnector(resolver=SharedResolver(self.resolver), ssl=context)
            self._session = aiohttp.ClientSession(connector=connector)
            github = GitHubClient(config.github_api, github_credential, self._session, config.github_timeout)

        def identify(client: str) -> str | None:
            sandbox = self.registry.identify(client) if client else None
            return sandbox.id if sandbox else None

        settings = BrokerSettings(calls_per_minute=config.calls_per_minute)
        authority = TokenAuthority(keys, config.token_ttl)
        self.broker = Broker(authority, store, identify, github, self.emit, settings, serves=self.registry.ids)
        await self._serve(self.broker.sandbox_app(), listen, config.port)
        await self._serve_admin(self.broker.admin_app())
        return self.broker

    async def _serve(self, app: web.Application, host: str, port: int) -> None:
        runner = web.AppRunner(app, access_log=None, logger=HTTP_LOG)
        await runner.setup()
        self._runners.append(runner)
        await web.TCPSite(runner, host, port, reuse_address=True).start()

    async def _serve_admin(self, app: web.Application) -> None:
        endpoint = admin_endpoint(self.admin_address)
        if isinstance(endpoint, tuple):
            await self._serve(app, *endpoint)
            return
        runner = web.AppRunner(app, access_log=None, logger=HTTP_LOG)
        await runner.setup()
        self._runners.append(runner)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(endpoint)
        old_umask = os.umask(0o177)  # the socket is the admin credential: owner only
        try:
            await web.UnixSite(runner, str(endpoint)).start()
        finally:
            os.umask(old_umask)

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        if self._session is not None:
            await self._session.close()
        if self.broker is not None:
            await asyncio.to_thread(self._close_state, self.broker)

    @staticmethod
    def _close_state(broker: Broker) -> None:
        broker.close()  # waits for a store call still running (a write waiting for a lock, at most its timeout)
        broker.store.close()  # type: ignore[attr-defined]
