"""What both launchers share, in one place: the run's state directory (and its removal with the watchdog's
release), the gateway's credentials, the ports the fence opens, the sandbox's own gateway (on the gateway address
of the sandbox's link, serving that one sandbox), its broker token and the variables by which the command finds
the gateway."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import os
import tempfile
from typing import TYPE_CHECKING

from airlock.broker.grants import Grant
from airlock.gateway.config import GatewayConfig, broker_url
from airlock.policy import Sandbox
from airlock.runs import runs_dir
from airlock.sandbox.fence import Interception

from .watchdog import Watchdog

if TYPE_CHECKING:
    from airlock.gateway import Gateway


def state_directory(config: GatewayConfig) -> tuple[GatewayConfig, tempfile.TemporaryDirectory[str] | None]:
    """The config with its state directory: the one it names, else a temporary one (returned too) that the
    launcher removes at the end — and its watchdog, if the launcher dies."""
    if config.state_dir is not None:
        return config, None
    temporary = tempfile.TemporaryDirectory(prefix="airlock-run-")
    return dataclasses.replace(config, state_dir=temporary.name), temporary


async def release(watchdog: Watchdog | None, state: tempfile.TemporaryDirectory[str] | None) -> None:
    """The last of a teardown, once the sandbox is gone: the temporary state directory, then the watchdog."""
    if state is not None:
        state.cleanup()
    if watchdog is not None:
        await asyncio.to_thread(watchdog.release)


def gateway_credentials(config: GatewayConfig) -> list[str]:
    """What the gateway holds that the sandbox must never read: the GitHub key or token file, the files of its
    `--secret`s, a state directory it was given (signing keys, broker store, admin socket; a temporary one is 0700
    root), the call log (every sandbox's inputs: see `prepare_call_log`), and where the running gateways' admin
    sockets are listed (airlock.runs)."""
    broker = config.broker
    secrets = [s.where for s in broker.secrets if s.kind == "file"]
    named = (broker.github_app_key, broker.github_token_file, *secrets, config.state_dir, broker.call_log, runs_dir())
    return [str(p) for p in named if p]


def prepare_call_log(config: GatewayConfig) -> None:
    """Make the call log's folder (root's alone) before the sandbox's hidden paths are chosen, so that it is hidden
    as the folder the broker will write into."""
    if config.broker.port and config.broker.call_log:
        os.makedirs(config.broker.call_log, mode=0o700, exist_ok=True)


def fence_ports(config: GatewayConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The gateway's TCP and UDP ports the fence opens to the sandbox."""
    dns = (config.dns_port,) if config.dns_port else ()
    broker = (config.broker.port,) if config.broker.port else ()
    return (config.proxy_port, *dns, *broker), dns


def fence_interception(config: GatewayConfig) -> Interception | None:
    """Where the fence redirects what the sandbox dials elsewhere; None when the gateway has no transparent
    listener (explicit mode only: the sandbox then has no route but to the gateway's address)."""
    if not config.transparent_port:
        return None
    return Interception(config.transparent_port, config.dns_port or None)


async def start_gateway(
    config: GatewayConfig,
    listen: str,
    sandbox_id: str,
    sandbox_ip: str,
    profile: str | None,
    wait_for_proxy: bool = True,
) -> Gateway:
    """The sandbox's gateway, listening on `listen` and knowing exactly one client: the sandbox's address (see
    `Gateway.start` for `wait_for_proxy`)."""
    from airlock.gateway import Gateway  # only now: `preload_proxy()` imports it while the sandbox is built

    identity = Sandbox(sandbox_id, profile or config.policy.default_profile, ipaddress.ip_network(f"{sandbox_ip}/32"))
    gateway = Gateway(dataclasses.replace(config, listen=listen, sandboxes=[identity]))
    await gateway.start(wait_for_proxy=wait_for_proxy)
    return gateway


async def mint_token(gateway: Gateway, sandbox_id: str, grants: list[Grant], ttl: int | None) -> str | None:
    """The sandbox's broker token for these grants; None without grants or without a broker."""
    if not grants or gateway.broker is None:
        return None
    token, _ = await gateway.broker.issue(sandbox_id, grants, ttl)
    return token


def gateway_environment(gateway: Gateway, sandbox_id: str, with_broker: bool) -> dict[str, str]:
    """What a sandboxed command needs to find its gateway: the proxy variables, its sandbox id, and the broker's
    address when it holds a token for it."""
    config = gateway.config
    proxy = f"http://{config.listen}:{config.proxy_port}"
    env = {name: proxy for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    # The broker lives on the gateway's own address: talk to it directly (the fence allows its port).
    env["NO_PROXY"] = env["no_proxy"] = f"localhost,127.0.0.1,::1,{config.listen}"
    if with_broker and config.broker.port:
        env["AIRLOCK_BROKER_URL"] = broker_url(config.listen, config.broker.port)
    env["AIRLOCK_SANDBOX"] = sandbox_id
    return env
