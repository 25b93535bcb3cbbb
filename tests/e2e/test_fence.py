"""The nftables fence with real nft, in a throwaway network namespace: a fence is never replaced or removed by
another sandbox that happens to share its id, nor by another backend's teardown or reaper."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
from collections.abc import Callable, Iterator
from typing import Any
from unittest.mock import MagicMock

import pytest

from airlock.sandbox.docker import DockerSandbox, fence_table
from airlock.sandbox.docker_reaper import remove_sandbox
from airlock.sandbox.fence import (
    DOCKER_TABLE_PREFIX,
    NETNS_TABLE_PREFIX,
    Fence,
    FenceError,
    in_network_namespace,
    read_sysctl,
    write_sysctl,
)
from airlock.sandbox.netns import NETNS_DIR

from netclient import in_netns


class Namespace:
    def __init__(self, name: str) -> None:
        self.name = name
        self.cmd = ["ip", "netns", "exec", name]

    def tables(self) -> str:
        return subprocess.run([*self.cmd, "nft", "list", "tables"], capture_output=True, text=True, check=True).stdout

    def table(self, name: str) -> str:
        argv = [*self.cmd, "nft", "list", "table", "inet", name]
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout

    def call(self, fn: Callable[[], Any]) -> Any:
        """fn() inside the namespace (nft and ip act on their caller's namespace)."""
        return in_netns(self.name, fn)


@pytest.fixture
def ns(privileged: None) -> Iterator[Namespace]:
    name = f"alfence{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        yield Namespace(name)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def test_a_second_install_of_a_table_fails_and_leaves_the_first_whole(ns: Namespace) -> None:
    first = Fence("airlock_d_same", "alb1", "10.232.1.1", (3128,))
    first.install(ns.cmd)
    second = Fence("airlock_d_same", "alb2", "10.232.2.1", (4444,), (53,))
    with pytest.raises(FenceError, match="exists already"):
        second.install(ns.cmd)
    table = ns.table("airlock_d_same")
    assert '"alb1"' in table and "3128" in table
    assert "alb2" not in table and "4444" not in table and "udp" not in table  # the batch was refused whole
    first.remove(ns.cmd)
    assert "airlock_d_same" not in ns.tables()


def test_backends_have_their_own_table_names() -> None:
    assert NETNS_TABLE_PREFIX != DOCKER_TABLE_PREFIX
    assert not NETNS_TABLE_PREFIX.startswith(DOCKER_TABLE_PREFIX)
    assert not DOCKER_TABLE_PREFIX.startswith(NETNS_TABLE_PREFIX)
    assert fence_table("abc") == f"{DOCKER_TABLE_PREFIX}abc"


def test_docker_reaper_removes_only_its_own_backends_table(ns: Namespace) -> None:
    netns_fence = Fence(f"{NETNS_TABLE_PREFIX}same", "alhsame", "10.231.0.1", (3128,))
    docker_fence = Fence(fence_table("same"), "albsame", "10.232.7.1", (3128,))
    netns_fence.install(ns.cmd)
    docker_fence.install(ns.cmd)
    client = MagicMock()
    client.containers.list.return_value = []
    client.networks.list.return_value = []
    ns.call(lambda: remove_sandbox(client, "same"))
    tables = ns.tables()
    assert f"{NETNS_TABLE_PREFIX}same" in tables and fence_table("same") not in tables


def test_a_docker_sandbox_whose_id_is_taken_leaves_the_other_ones_fence(ns: Namespace) -> None:
    theirs = Fence(fence_table("taken"), "albtaken", "10.232.9.1", (3128,))
    theirs.install(ns.cmd)
    client = MagicMock()
    client.networks.list.return_value = []
    sandbox = DockerSandbox(client, "image", "taken")
    with pytest.raises(FenceError, match="exists already"):
        ns.call(sandbox.create)
    ns.call(sandbox.destroy)  # what launch() does on a failure
    assert '"albtaken"' in ns.table(fence_table("taken"))
    client.networks.create.assert_not_called()
    client.api.remove_network.assert_not_called()
    client.api.remove_container.assert_not_called()


def _namespace_of_this_thread() -> int:
    return os.stat("/proc/thread-self/ns/net").st_ino


def test_work_in_a_network_namespace_is_done_there_and_its_sysctls_are_that_namespaces(ns: Namespace) -> None:
    before = read_sysctl("net.ipv4.icmp_ratemask")

    def inside() -> tuple[int, str]:
        write_sysctl("net.ipv4.icmp_ratemask", "6144")
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        return _namespace_of_this_thread(), links

    namespace, links = in_network_namespace(NETNS_DIR / ns.name, inside).result(10)
    assert namespace == os.stat(NETNS_DIR / ns.name).st_ino != _namespace_of_this_thread()
    assert [line.split()[1] for line in links.splitlines()] == ["lo:"]  # what it starts runs there too
    seen = subprocess.run([*ns.cmd, "sysctl", "-n", "net.ipv4.icmp_ratemask"], capture_output=True, text=True)
    assert seen.stdout.strip() == "6144"
    assert read_sysctl("net.ipv4.icmp_ratemask") == before  # this namespace's is untouched


def test_a_network_namespace_that_cannot_be_entered_is_one_fence_error_and_nothing_is_done(tmp_path) -> None:
    done: list[str] = []
    not_a_namespace = tmp_path / "file"
    not_a_namespace.write_text("")
    for path, problem in ((tmp_path / "absent", "No such file or directory"), (not_a_namespace, "Invalid argument")):
        with pytest.raises(FenceError, match=f"^{re.escape(f'cannot enter the network namespace {path}: {problem}')}$"):
            in_network_namespace(path, lambda: done.append("worked")).result(10)
    assert done == []


def test_work_that_fails_in_a_network_namespace_raises_its_error_to_the_caller(ns: Namespace) -> None:
    with pytest.raises(FenceError, match=r"^cannot set net\.ipv4\.no_such_setting=1: No such file or directory$"):
        in_network_namespace(NETNS_DIR / ns.name, lambda: write_sysctl("net.ipv4.no_such_setting", "1")).result(10)
