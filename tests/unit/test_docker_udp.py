"""The docker backend's refusal of other UDP inside the container (transparent mode), without an engine: the
container is created with its ICMP rate limit lifted, and the refusal's table goes into the namespace of the
container docker started — never into another process's, should the container have ended. With real containers:
tests/e2e/test_docker.py."""

from __future__ import annotations

import os
from typing import Any
from unittest.mock import MagicMock

import pytest

from airlock.sandbox import docker as docker_backend
from airlock.sandbox.docker import DockerSandbox, DockerSandboxError
from airlock.sandbox.fence import Fence, Interception, unlimited_unreachable

TRANSPARENT = Interception(3129, 53)


def _sandbox(intercept: Interception | None, pids: list[int]) -> tuple[DockerSandbox, MagicMock]:
    """A sandbox on a fake engine, its fence taken as installed; inspecting the container gives `pids` in turn."""
    client = MagicMock()
    client.api.inspect_image.return_value = {"Config": {}}
    client.api.create_container.return_value = {"Id": "c1"}
    client.api.inspect_container.side_effect = [{"State": {"Pid": pid}} for pid in pids]
    sandbox = DockerSandbox(client, "image", "u1", (3128, 53), (53,), intercept=intercept)
    sandbox.subnet = docker_backend.ipaddress.ip_network("10.232.7.0/24")
    sandbox.fence = Fence("airlock_d_u1", "albu1", sandbox.gateway_ip, (3128, 53), (53,), intercept)
    return sandbox, client


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """What would be loaded, and where (never run here)."""
    calls: list[tuple[Any, ...]] = []

    def record(table: str, gateway_ip: str, udp_ports: tuple[int, ...], intercept: Interception, cmd: list[str]):
        netns = cmd[1].removeprefix("--net=")
        calls.append((table, gateway_ip, udp_ports, intercept, cmd, os.path.samefile(netns, "/proc/self/ns/net")))

    monkeypatch.setattr(docker_backend, "load_inner_refusal", record)
    return calls


def test_a_transparent_container_refuses_udp_in_its_own_namespace(loaded: list[tuple[Any, ...]]) -> None:
    sandbox, client = _sandbox(TRANSPARENT, [os.getpid(), os.getpid()])  # this process stands in for it
    sandbox.start(["true"], {})
    assert client.api.create_host_config.call_args.kwargs["sysctls"] == unlimited_unreachable()
    assert unlimited_unreachable()["net.ipv4.icmp_ratemask"] == "6160"  # the kernel's 6168 without type 3
    ((table, gateway_ip, udp_ports, intercept, cmd, same_namespace),) = loaded
    assert (table, gateway_ip, udp_ports, intercept) == ("airlock_d_u1", "10.232.7.1", (53,), TRANSPARENT)
    assert cmd[0] == "nsenter" and cmd[1].startswith(f"--net=/proc/{os.getpid()}/fd/") and same_namespace


def test_an_explicit_mode_container_has_neither(loaded: list[tuple[Any, ...]]) -> None:
    sandbox, client = _sandbox(None, [])
    sandbox.start(["true"], {})
    assert client.api.create_host_config.call_args.kwargs["sysctls"] is None
    assert loaded == [] and not client.api.inspect_container.called


@pytest.mark.parametrize("pids", [[0], [os.getpid(), 0], [os.getpid(), os.getpid() + 1]])
def test_a_container_that_ended_gets_nothing_loaded_anywhere(loaded: list[tuple[Any, ...]], pids: list[int]) -> None:
    # Ended before it was looked at, or while its namespace was opened (its pid may belong to another process
    # by then): it sends nothing any more, and the start is not refused for it.
    sandbox, _ = _sandbox(TRANSPARENT, pids)
    sandbox.start(["true"], {})
    assert loaded == []


def test_a_running_container_whose_namespace_cannot_be_entered_fails_the_start(loaded: list[tuple[Any, ...]]) -> None:
    missing = 2**22 + 1  # above any pid_max: no such process here (as from another pid namespace)
    sandbox, _ = _sandbox(TRANSPARENT, [missing, missing])
    with pytest.raises(DockerSandboxError, match=rf"cannot enter the container's network namespace \(pid {missing}\)"):
        sandbox.start(["true"], {})
    assert loaded == []
