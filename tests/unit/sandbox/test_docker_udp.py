"""The docker backend's refusal of other UDP inside the container (transparent mode), without an engine: the
container is created with its ICMP rate limit lifted, and the refusal's table goes into the namespace of the
container docker started — never into another process's, should the container have ended or its pid name another
process here. With real containers: tests/e2e/test_docker.py."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pytest

from airlock.sandbox import docker as docker_backend
from airlock.sandbox.docker import DockerSandbox, DockerSandboxError
from airlock.sandbox.fence import Fence, Interception, unlimited_unreachable

TRANSPARENT = Interception(3129, 53)
CONTAINER_ID = "c1" * 32  # docker's full ids are 64 hex digits


def _sandbox(intercept: Interception | None, pids: list[int]) -> tuple[DockerSandbox, MagicMock]:
    """A sandbox on a fake engine, its fence taken as installed; inspecting the container gives these pids."""
    client = MagicMock()
    client.api.inspect_image.return_value = {"Config": {}}
    client.api.create_container.return_value = {"Id": CONTAINER_ID}
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


@pytest.fixture
def ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process stands in for the container's first process: in its cgroup."""
    monkeypatch.setattr(docker_backend, "in_container", lambda pid, container_id: container_id == CONTAINER_ID)


@pytest.fixture
def exited() -> Iterator[int]:
    """A child that has exited and is not reaped yet (as docker-init is, for a moment, when its command ends)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.001)
    yield pid
    os.waitpid(pid, 0)


def test_a_transparent_container_refuses_udp_in_its_own_namespace(loaded: list[tuple[Any, ...]], ours: None) -> None:
    sandbox, client = _sandbox(TRANSPARENT, [os.getpid()])
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


def test_a_container_that_ended_gets_nothing_loaded_anywhere(
    loaded: list[tuple[Any, ...]], ours: None, exited: int
) -> None:
    # Docker says pid 0, or a pid no process has any more, or one that has exited while docker still says it
    # runs: nothing of it sends any more, and the start is not refused for it.
    for pid in (0, 2**22 + 1, exited):  # above any pid_max: no such process
        sandbox, _ = _sandbox(TRANSPARENT, [pid])
        sandbox.start(["true"], {})
    assert loaded == []


def test_a_pid_that_is_not_the_containers_here_fails_the_start(
    loaded: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As when airlock runs in another pid namespace than docker: the pid names some other process here (this one,
    # which does not exit: the grace it gets to be seen exiting need not be the full second).
    monkeypatch.setattr(docker_backend, "EXITING_GRACE", 0.05)
    sandbox, _ = _sandbox(TRANSPARENT, [os.getpid()])
    with pytest.raises(
        DockerSandboxError, match=rf"pid {os.getpid()}, the container's by docker, is not in its cgroup"
    ):
        sandbox.start(["true"], {})
    assert loaded == []


def test_a_container_caught_exiting_out_of_its_cgroup_is_taken_as_ended(loaded: list[tuple[Any, ...]]) -> None:
    # An exiting process leaves its cgroup before its pidfd says it has exited: a short command caught in that
    # moment is not "another process here" (which would fail the start), but one that has ended.
    child = subprocess.Popen(["sleep", "0.2"])
    try:
        sandbox, _ = _sandbox(TRANSPARENT, [child.pid])  # not in the container's cgroup, and it ends shortly
        sandbox.start(["true"], {})
    finally:
        child.wait()
    assert loaded == []


@pytest.mark.parametrize(
    ("proc_cgroup", "named"),
    [
        (f"0::/system.slice/docker-{CONTAINER_ID}.scope\n", True),  # systemd driver, cgroup v2
        (f"12:pids:/docker/{CONTAINER_ID}\n4:memory:/docker/{CONTAINER_ID}\n", True),  # cgroupfs driver, v1
        (f"4:memory:/docker/outer/docker/{CONTAINER_ID}\n", True),  # docker in docker
        (f"4:memory:/process_api/0f{CONTAINER_ID}8e\n0::/\n", False),  # the id only inside another one
        (f"4:memory:/docker/{CONTAINER_ID}0\n0::/docker-{CONTAINER_ID[:-1]}.scope\n", False),  # near misses
        ("", False),
    ],
)
def test_only_a_whole_cgroup_path_component_names_the_container(proc_cgroup: str, named: bool) -> None:
    assert docker_backend.cgroups_name_container(proc_cgroup, CONTAINER_ID) is named
