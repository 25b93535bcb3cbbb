"""--mount checks of the docker backend: no host path that is, contains or (for host internals) lies inside what a
sandbox must never see."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import MagicMock

import pytest

from airlock.sandbox.docker import DockerSandbox, DockerSandboxError, check_mount

REFUSED = [
    # system folders, whole, and whatever contains them
    "/", "/boot", "/etc", "/home", "/root",
    # /run (every service socket, other sandboxes' tokens), the kernel, engine state: at, in or containing
    "/run", "/var/run", "/run/", "/run/user", "/run/user/1000", "/run/docker.sock", "/var/run/docker.sock",
    "/run/containerd/containerd.sock", "/run/podman/podman.sock", "/run/airlock-abc", "/run/airlock-d-abc/token",
    "/proc", "/proc/self/root", "/proc/1/environ", "/sys", "/sys/fs/cgroup", "/dev", "/dev/sda",
    "/var", "/var/lib", "/var/lib/docker", "/var/lib/docker/volumes", "/var/lib/containerd", "/var/lib/containers",
    "/tmp/../run", "/tmp/../etc",
]  # fmt: skip
ALLOWED = ["/usr/share", "/opt/data", "/etc/ssl/certs", "/home/someone/project", "/root/project", "/srv/x"]


@pytest.mark.parametrize("host", REFUSED)
def test_forbidden_paths_are_refused(host: str) -> None:
    with pytest.raises(DockerSandboxError, match="refusing to mount"):
        check_mount(host)


@pytest.mark.parametrize("host", ALLOWED)
def test_ordinary_paths_are_allowed(host: str) -> None:
    check_mount(host)


@pytest.mark.parametrize("target", ["/", "/run", "/var/run", "/etc", "/var/lib/docker"])
def test_symlinks_are_resolved(tmp_path: Path, target: str) -> None:
    link = tmp_path / "innocent"
    link.symlink_to(target)
    with pytest.raises(DockerSandboxError):
        check_mount(str(link))


def test_the_engine_socket_in_use_and_its_folders_are_refused(tmp_path: Path) -> None:
    socket = tmp_path / "engine" / "docker.sock"
    for host in (socket, socket.parent, tmp_path):
        with pytest.raises(DockerSandboxError):
            check_mount(str(host), str(socket))
    check_mount(str(tmp_path / "project"), str(socket))


@pytest.mark.parametrize("host", ["/", "/run", "/var/run"])
def test_a_sandbox_with_a_forbidden_mount_is_refused_before_anything_exists(host: str) -> None:
    client = MagicMock()
    with pytest.raises(DockerSandboxError):
        DockerSandbox(client, "image", "m1", mounts=[(host, "/src")])
    client.networks.create.assert_not_called()


def test_the_path_checked_is_the_path_mounted(tmp_path: Path) -> None:
    real = tmp_path / "project"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    sandbox = DockerSandbox(MagicMock(), "image", "m2", mounts=[(str(tmp_path / "link"), "/src")])
    assert sandbox.mounts == [(str(real), "/src")]  # not the symlink, which could be pointed elsewhere later
