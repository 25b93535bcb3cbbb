"""Running the broker inside the gateway: its state, its GitHub credential, and its sandbox-facing listener (its
admin routes are mounted on the gateway's admin listener, airlock/gateway/admin.py)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver

from airlock.broker.calllog import CallLog
from airlock.broker.declared import DeclaredTools
from airlock.broker.declared_runtime import Runtime
from airlock.broker.github import AppCredential, Credential, GitHubClient, StaticCredential
from airlock.broker.gitpush import GitTransport, Pusher, git_base_url
from airlock.broker.service import Broker, BrokerSettings
from airlock.broker.shapes import CREDENTIAL
from airlock.broker.store import SqliteStore
from airlock.broker.tokens import KeyRing, TokenAuthority
from airlock.broker.tool_schemas import TOOLS
from airlock.dns.upstream import ResolveError, Resolver
from airlock.gateway.broker_listener import HTTP_LOG, CappedConnections
from airlock.gateway.config import BrokerConfig, BrokerConfigError, broker_url
from airlock.policy import (
    HostError,
    IPAddress,
    LivePolicy,
    Policy,
    ReasonCode,
    Rejection,
    Vetted,
    canonical_host,
    parse_ip_literal,
    vet,
)

log = logging.getLogger("airlock.broker")


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

    async def addresses(self, host: str) -> list[str]:
        """`host`'s addresses through the gateway's resolver (git is handed these: it resolves nothing itself)."""
        return [str(a) for a in await self.ip_addresses(host)]

    async def ip_addresses(self, host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        try:
            literal = parse_ip_literal(host)
            return [literal] if literal else list((await self.resolver.resolve(canonical_host(host))).addresses)
        except (ResolveError, HostError) as e:
            log.warning("broker cannot resolve %s: %s", host, e)
            raise OSError(f"cannot resolve {host}: {e}") from None

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[Any]:
        addresses = await self.ip_addresses(host)
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
        live: LivePolicy,
        resolver: Resolver,
        emit: Any,
        upstream_ca: str | None,
        secrets: Mapping[str, str],
    ) -> None:
        self.config = config
        self.secrets = secrets  # the --secret values, read once by the gateway
        self.state_dir = state_dir
        self.live = live  # the broker names sandboxes by the live policy's registry, as the proxy and DNS do
        self.resolver = resolver
        self.emit = emit
        self.upstream_ca = upstream_ca
        self.broker: Broker | None = None
        self.declared: DeclaredTools | None = None
        self._runners: list[web.AppRunner] = []
        self._servers: list[asyncio.Server] = []
        self._session: aiohttp.ClientSession | None = None

    async def start(self, listen: str) -> Broker:
        config = self.config
        # Before anything is opened: a tool this broker cannot serve (a secret it was not given) stops the start.
        runtime = Runtime(self.secrets, SharedResolver(self.resolver).ip_addresses, self.vet, self.upstream_ca)
        self.declared = DeclaredTools(lambda: self.live.current.policy, runtime, TOOLS)
        if problems := self.declared.problems(self.live.current.policy):
            raise BrokerConfigError("\n".join(problems))
        keys = KeyRing(self.state_dir / "keys", config.token_max_ttl)
        # Off the event loop, as every later store call: the proxy and DNS already serve, and the file may be locked.
        store = await asyncio.to_thread(SqliteStore, self.state_dir / "broker.sqlite3")
        call_log = await asyncio.to_thread(CallLog.in_directory, Path(config.call_log or self.state_dir / "calls"))
        github_credential = credential(config)
        github = pusher = None
        if github_credential is not None:
            context = ssl.create_default_context(cafile=self.upstream_ca)
            resolver = SharedResolver(self.resolver)
            connector = aiohttp.TCPConnector(resolver=resolver, ssl=context)
            self._session = aiohttp.ClientSession(connector=connector)
            github = GitHubClient(config.github_api, github_credential, self._session, config.github_timeout)
            transport = GitTransport(
                config.github_git or git_base_url(config.github_api), self.upstream_ca, resolver.addresses
            )
            try:
                pusher = Pusher(github, transport, workdir=self.state_dir / "push")
            except FileNotFoundError as e:
                log.warning("%s: push_branch answers 503", e)

        def identify(client: str) -> str | None:
            sandbox = self.live.current.registry.identify(client) if client else None
            return sandbox.id if sandbox else None

        settings = BrokerSettings(calls_per_minute=config.calls_per_minute)
        authority = TokenAuthority(keys, config.token_ttl, broker_url(listen, config.port))
        served = lambda: self.live.current.registry.ids()  # noqa: E731 - read at each call: a reload may add some
        self.broker = Broker(
            authority,
            store,
            identify,
            github,
            self.emit,
            settings,
            pusher,
            serves=served,
            call_log=call_log,
            declared=self.declared,
        )
        await self._serve(self.broker.sandbox_app(), listen, config.port, config.max_connections_per_client)
        return self.broker

    def problems(self, policy: Policy) -> list[str]:
        """Why this broker could not serve `policy`'s declared tools (a reload to it is refused)."""
        return self.declared.problems(policy) if self.declared is not None else []

    def vet(self, sandbox_id: str, addresses: Sequence[IPAddress], port: int) -> Vetted:
        """A declared tool's upstream addresses judged as the proxy judges any upstream of this sandbox."""
        live = self.live.current
        sandbox = next((s for s in live.registry.sandboxes if s.id == sandbox_id), None)
        if sandbox is None:  # its token was bound to a sandbox the gateway no longer serves
            refused = tuple(Rejection(a, ReasonCode.UNKNOWN_SANDBOX, "no such sandbox") for a in addresses)
            return Vetted((), refused)
        return vet(live.profile(sandbox), addresses, port, live.own.among(addresses))

    async def _serve(self, app: web.Application, host: str, port: int, per_client: int | None = None) -> None:
        runner = web.AppRunner(app, access_log=None, logger=HTTP_LOG)
        await runner.setup()
        self._runners.append(runner)
        if per_client is None:
            await web.TCPSite(runner, host, port, reuse_address=True).start()
            return
        assert runner.server is not None
        # The server is made here rather than by a TCPSite, to count connections per client around aiohttp's own
        # protocol; runner.cleanup() closes it with the rest.
        factory = CappedConnections(runner.server, per_client)
        server = await asyncio.get_running_loop().create_server(factory, host, port, reuse_address=True)
        self._servers.append(server)

    async def stop(self) -> None:
        for server in self._servers:  # listening ends first; the runners then close the connections
            server.close()
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        for server in self._servers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 5)
        self._servers.clear()
        if self._session is not None:
            await self._session.close()
        if self.broker is not None:
            await asyncio.to_thread(self._close_state, self.broker)

    @staticmethod
    def _close_state(broker: Broker) -> None:
        broker.close()  # waits for a store call still running (a write waiting for a lock, at most its timeout)
        broker.store.close()  # type: ignore[attr-defined]
        if broker.calls is not None:
            broker.calls.log.close()
