"""Running the broker: its state (`--store`), its keys (`--signing-key`) and its GitHub credential, as
`airlock.gateway.broker_inputs` reads them, and its sandbox-facing listener — inside the gateway (`BrokerRuntime`,
its admin routes mounted on the gateway's admin listener, airlock/gateway/admin.py) or alone (`StandaloneBroker`,
`airlock broker`)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver

from airlock.broker.declared import DeclaredTools
from airlock.broker.declared_runtime import Runtime
from airlock.broker.github import GitHubClient
from airlock.broker.gitpush import GitTransport, Pusher, git_base_url
from airlock.broker.service import Broker, BrokerSettings
from airlock.broker.tokens import TokenAuthority
from airlock.broker.tool_schemas import TOOLS
from airlock.dns.upstream import ResolveError, Resolver
from airlock.gateway.broker_inputs import credential, open_state, signing_keys
from airlock.gateway.broker_listener import HTTP_LOG, CappedConnections
from airlock.gateway.config import BrokerConfig, BrokerConfigError, broker_url
from airlock.policy import (
    HostError,
    IPAddress,
    LivePolicy,
    Policy,
    ReasonCode,
    Rejection,
    SandboxRegistry,
    Vetted,
    canonical_host,
    parse_ip_literal,
    vet,
)

if TYPE_CHECKING:
    from airlock.gateway.approval_shared import SharedApprovals

log = logging.getLogger("airlock.broker")


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


class BrokerServer:
    """A broker with its state, keys, GitHub client and sandbox-facing listener; how it names sandboxes and whether
    it serves declared tools is its kind's (`BrokerRuntime` in a gateway, `StandaloneBroker` alone)."""

    def __init__(self, config: BrokerConfig, state_dir: Path, emit: Any, upstream_ca: str | None) -> None:
        self.config = config
        self.state_dir = state_dir
        self.emit = emit
        self.upstream_ca = upstream_ca
        self.broker: Broker | None = None
        self._runners: list[web.AppRunner] = []
        self._servers: list[asyncio.Server] = []
        self._session: aiohttp.ClientSession | None = None

    def declared_tools(self) -> DeclaredTools | None:
        return None

    def shared_approvals(self) -> SharedApprovals | None:
        """What gateways sharing this broker's store share of their approvals (a fleet's PostgreSQL store), once
        the store is open; None: the approvals are this gateway's own."""
        return self.broker.store.approvals if self.broker is not None else None

    def identify(self) -> Callable[[str], str | None] | None:
        """Client address → sandbox id; None: the broker binds tokens by their own networks."""
        return None

    def served(self) -> Callable[[], list[str]] | None:
        return None

    def resolver(self) -> SharedResolver | None:
        """How the GitHub client and git resolve names; None: the system's."""
        return None

    async def start(self, listen: str) -> Broker:
        config = self.config
        # Before anything is opened: a tool this broker cannot serve (a secret it was not given) stops the start.
        declared = self.declared_tools()
        keys = signing_keys(config, self.state_dir)
        store, call_log = await open_state(config, self.state_dir)
        try:
            github, pusher = self._github()
        except BaseException:
            await store.close()
            await call_log.close()
            raise
        settings = BrokerSettings(calls_per_minute=config.calls_per_minute)
        authority = TokenAuthority(keys, config.token_ttl, config.audience or broker_url(listen, config.port))
        self.broker = Broker(
            authority,
            store,
            self.identify(),
            github,
            self.emit,
            settings,
            pusher,
            serves=self.served(),
            call_log=call_log,
            declared=declared,
        )
        await self._serve(self.broker.sandbox_app(), listen, config.port, config.max_connections_per_client)
        return self.broker

    def _github(self) -> tuple[GitHubClient | None, Pusher | None]:
        config = self.config
        github_credential = credential(config)
        if github_credential is None:
            return None, None
        context = ssl.create_default_context(cafile=self.upstream_ca)
        resolver = self.resolver()
        connector = (
            aiohttp.TCPConnector(resolver=resolver, ssl=context) if resolver else aiohttp.TCPConnector(ssl=context)
        )
        self._session = aiohttp.ClientSession(connector=connector)
        github = GitHubClient(config.github_api, github_credential, self._session, config.github_timeout)
        transport = GitTransport(
            config.github_git or git_base_url(config.github_api), self.upstream_ca,
            resolver.addresses if resolver else None,
        )  # fmt: skip
        try:
            return github, Pusher(github, transport, workdir=self.state_dir / "push")
        except FileNotFoundError as e:
            log.warning("%s: push_branch answers 503", e)
            return github, None

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
        if self.broker is not None:  # after the listeners: no call is left to need the state
            await self.broker.store.close()
            if self.broker.calls is not None:
                await self.broker.calls.log.close()


class BrokerRuntime(BrokerServer):
    """The broker inside a gateway: sandboxes named by the live policy's registry, as the proxy and DNS name them,
    names resolved by the gateway's resolver, and the policy's declared tools served."""

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
        super().__init__(config, state_dir, emit, upstream_ca)
        self.secrets = secrets  # the --secret values, read once by the gateway
        self.live = live
        self.dns = resolver
        self.declared: DeclaredTools | None = None

    def declared_tools(self) -> DeclaredTools:
        runtime = Runtime(self.secrets, SharedResolver(self.dns).ip_addresses, self.vet, self.upstream_ca)
        self.declared = DeclaredTools(lambda: self.live.current.policy, runtime, TOOLS)
        if problems := self.declared.problems(self.live.current.policy):
            raise BrokerConfigError("\n".join(problems))
        return self.declared

    def identify(self) -> Callable[[str], str | None]:
        def identify(client: str) -> str | None:
            sandbox = self.live.current.registry.identify(client) if client else None
            return sandbox.id if sandbox else None

        return identify

    def served(self) -> Callable[[], list[str]]:
        return lambda: self.live.current.registry.ids()  # read at each call: a reload may add some

    def resolver(self) -> SharedResolver:
        return SharedResolver(self.dns)

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


class StandaloneBroker(BrokerServer):
    """`airlock broker`: the broker alone, no proxy, no DNS. With `registry` (`--sandbox ID=CIDR`) it names sandboxes
    by their network as a gateway does; without, it takes only tokens bound to a source network (`src`), the
    binding of pods on a cluster network whose addresses no registry here knows in advance. Declared tools are a
    gateway's: they are judged with a sandbox's profile, which belongs to the gateway that fences it."""

    def __init__(
        self, config: BrokerConfig, state_dir: Path, emit: Any, upstream_ca: str | None,
        registry: SandboxRegistry | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config, state_dir, emit, upstream_ca)
        self.registry = registry

    def identify(self) -> Callable[[str], str | None] | None:
        registry = self.registry
        if registry is None:
            return None

        def identify(client: str) -> str | None:
            sandbox = registry.identify(client) if client else None
            return sandbox.id if sandbox else None

        return identify

    def served(self) -> Callable[[], list[str]] | None:
        registry = self.registry
        return None if registry is None else registry.ids
