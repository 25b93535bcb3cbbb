"""`launch()`: a hardened docker sandbox with its own embedded gateway, as one handle — for orchestrators, and
what `airlock run --backend docker` uses. Its netns twin is `airlock.launch.netns_launcher.launch()`."""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from typing import BinaryIO

import docker

from airlock.broker.grants import Grant
from airlock.gateway import Gateway
from airlock.gateway.config import GatewayConfig
from airlock.gateway.startup.preload import preload_proxy
from airlock.inspection.trust import SANDBOX_BUNDLE
from airlock.sandbox.docker import TOKEN_PATH, DockerSandbox, Limits

from .embedded_gateway import (
    fence_interception,
    fence_ports,
    gateway_environment,
    mint_token,
    release,
    start_gateway,
    state_directory,
)
from .watchdog import Watchdog

IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class DockerHandle:
    sandbox: DockerSandbox
    gateway: Gateway
    watchdog: Watchdog | None = None  # started by launch(): released once the sandbox is removed
    state: tempfile.TemporaryDirectory[str] | None = None  # made by launch(): removed with the sandbox

    async def wait(self, timeout: float | None = None) -> int | None:
        """The exit code; None when the (given or hard) timeout passed and the container was killed."""
        return await asyncio.to_thread(self.sandbox.wait, timeout)

    def logs(self) -> tuple[bytes, bytes]:
        return self.sandbox.output()

    async def stream(self, stdout: BinaryIO, stderr: BinaryIO) -> None:
        """Copy the container's output to these sinks as it comes, until it stops (each capped)."""
        seen = await asyncio.gather(
            asyncio.to_thread(self.sandbox.follow, False, stdout), asyncio.to_thread(self.sandbox.follow, True, stderr)
        )
        await self.wait()  # stopped: its logs are complete
        await asyncio.to_thread(self.sandbox.catch_up, False, stdout, seen[0])
        await asyncio.to_thread(self.sandbox.catch_up, True, stderr, seen[1])

    def kill(self) -> None:
        self.sandbox.kill()

    def oom_killed(self) -> bool:
        return bool(self.sandbox.state().get("OOMKilled"))

    async def close(self) -> None:
        """Remove the container, its network and its fence (in that order), then stop the gateway."""
        await _teardown(self.sandbox, self.gateway, self.watchdog, self.state)

    async def __aenter__(self) -> DockerHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def launch(
    client: docker.DockerClient,
    image: str,
    command: list[str],
    gateway: GatewayConfig,
    *,
    profile: str | None = None,
    sandbox_id: str | None = None,
    limits: Limits | None = None,
    mounts: list[tuple[str, str]] | None = None,
    env: dict[str, str] | None = None,
    grants: list[Grant] | None = None,
    token_ttl: int | None = None,
    watchdog: Watchdog | None = None,
) -> DockerHandle:
    """Network + fence, then the gateway on the network's gateway address, then the container.

    `gateway` gives the gateway's settings (policy, upstream DNS, ports, broker...); its `listen` and
    `sandboxes` are filled in here, and a temporary state directory when it names none. On any failure
    everything created so far is removed again. A watchdog process (started here unless one is given, which its
    giver releases) removes the sandbox and the temporary state if this process dies, or if it is still there
    `GRACE` seconds after its timeout."""
    limits = limits or Limits()
    limits.check()
    tcp_ports, udp_ports = fence_ports(gateway)
    gateway, state = state_directory(gateway)
    own = None
    try:
        if watchdog is None:
            own = await asyncio.to_thread(Watchdog.start, limits.timeout, [state.name] if state else [])
        sandbox = DockerSandbox(
            client, image, sandbox_id, tcp_ports, udp_ports, limits, mounts or [], watchdog or own,
            fence_interception(gateway),
        )  # fmt: skip
    except BaseException:
        await release(own, state)
        raise
    running: Gateway | None = None
    try:
        preload_proxy()  # aiohttp and mitmproxy import in a thread while docker makes the network and container
        # Docker API calls block: off the event loop, so other sandboxes' gateways on it keep answering.
        await asyncio.to_thread(sandbox.create)
        assert sandbox.sandbox_id is not None
        running = await start_gateway(gateway, sandbox.gateway_ip, sandbox.sandbox_id, sandbox.sandbox_ip, profile)
        environment = {"PATH": IMAGE_PATH, "HOME": "/tmp", **(env or {})}
        environment |= gateway_environment(running, sandbox.sandbox_id, bool(grants))
        bundle = None  # the system's CAs plus the gateway's (inspected hosts), bound where the image's clients look
        if (inspector := running.inspector) is not None and (bundle := inspector.bundle) is not None:
            environment |= inspector.environment(SANDBOX_BUNDLE)
        if token := await mint_token(running, sandbox.sandbox_id, grants or [], token_ttl):
            sandbox.place_token(token)
            environment["AIRLOCK_TOKEN_FILE"] = TOKEN_PATH
        await asyncio.to_thread(sandbox.start, command, environment, bundle)
    except BaseException:
        await _teardown(sandbox, running, own, state)
        raise
    return DockerHandle(sandbox, running, own, state)


async def _teardown(
    sandbox: DockerSandbox,
    gateway: Gateway | None,
    watchdog: Watchdog | None,
    state: tempfile.TemporaryDirectory[str] | None,
) -> None:
    """The gateway stops after the container is gone (until then the sandbox may still be talking to it); if
    removing fails it stops anyway: the fence stays, the sandbox is left with nothing to reach, and the watchdog
    is not released (it tries again when this process exits)."""
    try:
        await asyncio.to_thread(sandbox.destroy)
    finally:
        if gateway is not None:
            await gateway.stop()
    await release(watchdog, state)
