"""The netns backend's cgroups without a host: which hierarchy each controller comes from (v2 first, else v1),
where the sandbox's group goes, the files written for each limit in both versions (against a folder standing in
for the cgroup mounts), the refusal of a limit asked for that nothing can enforce, and the watchdog's checks."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from airlock.cli.run import netns_resources
from airlock.sandbox import cgroups
from airlock.sandbox.cgroups import CgroupError, SandboxCgroup, check, hierarchies, own_groups, parents
from airlock.sandbox.limits import Resources, rlimit_argv

# This machine's kind: v1 controllers, an empty unified hierarchy beside them (names escaped as the kernel does).
HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
38 31 0:35 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
39 31 0:36 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
40 31 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_SELF = "9:name=systemd:/\n8:pids:/\n4:memory:/jobs/j1\n1:cpu:/\n0::/\n"


def _unified(mount: Path) -> str:
    return f"30 23 0:27 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def _fake_read(offered: dict[str, str]):
    def read(path: Path) -> str:
        return offered[str(path)]

    return read


def test_on_a_v1_host_each_controller_is_its_v1_hierarchy_inside_the_launchers_own_group() -> None:
    found = hierarchies(HYBRID, _fake_read({"/sys/fs/cgroup/unified/cgroup.controllers": "\n"}))
    chosen = parents(found, own_groups(HYBRID_SELF))
    assert chosen == {
        "cpu": (Path("/sys/fs/cgroup/cpu/airlock"), 1),
        "memory": (Path("/sys/fs/cgroup/memory/jobs/j1/airlock"), 1),  # within the launcher's own memory limit
        "pids": (Path("/sys/fs/cgroup/pids/airlock"), 1),
    }


def test_a_controller_the_unified_hierarchy_offers_comes_from_v2() -> None:
    offered = {"/sys/fs/cgroup/unified/cgroup.controllers": "memory pids\n"}
    chosen = parents(hierarchies(HYBRID, _fake_read(offered)), own_groups(HYBRID_SELF))
    assert chosen["memory"] == chosen["pids"] == (Path("/sys/fs/cgroup/unified/airlock"), 2)
    assert chosen["cpu"] == (Path("/sys/fs/cgroup/cpu/airlock"), 1)


def test_on_a_v2_host_every_controller_shares_one_top_level_group() -> None:
    offered = {"/sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma misc\n"}
    found = hierarchies(_unified(Path("/sys/fs/cgroup")), _fake_read(offered))
    chosen = parents(found, own_groups("0::/user.slice/user-1000.slice/session-2.scope\n"))
    assert set(chosen.values()) == {(Path("/sys/fs/cgroup/airlock"), 2)}


def test_v1_hierarchies_with_two_controllers_and_escaped_mount_points() -> None:
    text = "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
    text += "33 31 0:30 / /mnt/my\\040groups rw - cgroup cgroup rw,pids\n"
    chosen = parents(hierarchies(text), {})
    assert chosen == {
        "cpu": (Path("/sys/fs/cgroup/cpu,cpuacct/airlock"), 1),
        "pids": (Path("/mnt/my groups/airlock"), 1),
    }


def test_a_group_outside_the_mounts_view_falls_back_to_its_top() -> None:
    text = "35 31 0:32 /jobs /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    inside = parents(hierarchies(text), {"memory": "/jobs/j1"})
    outside = parents(hierarchies(text), {"memory": "/other"})
    assert inside["memory"][0] == Path("/sys/fs/cgroup/memory/j1/airlock")
    assert outside["memory"][0] == Path("/sys/fs/cgroup/memory/airlock")


def _v2_root(tmp_path: Path) -> dict[str, tuple[Path, int]]:
    """A folder laid out as a cgroup2 root that offers every controller airlock uses."""
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("memory\n")
    (tmp_path / "airlock").mkdir()
    (tmp_path / "airlock" / "cgroup.subtree_control").write_text("")
    return parents(hierarchies(_unified(tmp_path)), {})


def test_v2_limits_are_written_where_the_kernel_reads_them(tmp_path: Path) -> None:
    group = SandboxCgroup("s1", Resources(cpus=0.5, memory="64m", pids=32), _v2_root(tmp_path))
    group.create()
    leaf = tmp_path / "airlock" / "s1"
    assert group.dirs == [leaf]
    assert (leaf / "cpu.max").read_text() == "50000 100000"
    assert (leaf / "memory.max").read_text() == str(64 * 2**20)
    assert (leaf / "pids.max").read_text() == "32"
    # The root hands the controllers it did not yet hand down to `airlock`, and `airlock` all three to each sandbox.
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu +pids"
    assert (tmp_path / "airlock" / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert group.enter_argv() == ["sh", "-c", cgroups._ENTER, "sh", str(leaf / "cgroup.procs"), "--"]


def test_v2_reports_an_oom_kill_only_when_the_groups_limit_was_hit(tmp_path: Path) -> None:
    group = SandboxCgroup("s1", Resources(), _v2_root(tmp_path))
    group.create()
    events = tmp_path / "airlock" / "s1" / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 10\noom 0\noom_kill 0\n")
    assert not group.oom_killed()
    events.write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    assert group.oom_killed()


def _v1_roots(tmp_path: Path) -> dict[str, tuple[Path, int]]:
    text = "".join(
        f"3{i} 31 0:2{i} / {tmp_path / c} rw - cgroup cgroup rw,{c}\n" for i, c in enumerate(("cpu", "memory", "pids"))
    )
    return parents(hierarchies(text), {})


def test_v1_limits_cap_memory_and_swap_alike(tmp_path: Path) -> None:
    group = SandboxCgroup("s2", Resources(cpus=2, memory="1g", pids=100), _v1_roots(tmp_path))
    (tmp_path / "cpu" / "airlock" / "s2").mkdir(parents=True)
    group.create()  # an empty leftover of a crashed run with this id is taken over
    assert (tmp_path / "cpu/airlock/s2/cpu.cfs_quota_us").read_text() == "200000"
    assert (tmp_path / "cpu/airlock/s2/cpu.cfs_period_us").read_text() == "100000"
    assert (tmp_path / "memory/airlock/s2/memory.limit_in_bytes").read_text() == str(2**30)
    assert (tmp_path / "pids/airlock/s2/pids.max").read_text() == "100"
    assert len(group.enter_argv()) == 4 + 3 + 1  # one cgroup.procs per hierarchy
    accounted = tmp_path / "accounted"  # a kernel with swap accounting shows memory.memsw.* in every group
    accounted.mkdir()
    (accounted / "memory.memsw.limit_in_bytes").write_text("")
    cgroups._limit_memory(accounted, 1, 2**30)
    assert (accounted / "memory.memsw.limit_in_bytes").read_text() == str(2**30)
    assert (accounted / "memory.limit_in_bytes").read_text() == str(2**30)


def test_v1_without_swap_accounting_the_group_does_not_swap(tmp_path: Path) -> None:
    group = SandboxCgroup("s3", Resources(), _v1_roots(tmp_path))
    group.create()
    assert (tmp_path / "memory/airlock/s3/memory.swappiness").read_text() == "0"


def test_a_group_of_the_same_id_still_in_use_is_refused_and_nothing_else_stays(tmp_path: Path) -> None:
    busy = tmp_path / "pids" / "airlock" / "s4"
    (busy / "inside").mkdir(parents=True)  # not empty: rmdir fails, as with processes in it
    group = SandboxCgroup("s4", Resources(), _v1_roots(tmp_path))
    with pytest.raises(CgroupError, match="s4 exists and is in use: another sandbox has this id"):
        group.create()
    assert busy.exists() and not (tmp_path / "cpu" / "airlock" / "s4").exists()


def test_a_limit_asked_for_without_a_controller_is_refused_a_default_one_reported(tmp_path: Path) -> None:
    only_cpu = {"cpu": (tmp_path / "airlock", 1)}
    asked = Resources(memory="64m", pids=10, required=frozenset({"memory", "pids"}))
    with pytest.raises(CgroupError) as refused:
        check(asked, only_cpu)
    assert str(refused.value) == (
        "--memory, --pids: this host has no memory, pids cgroup controller (neither cgroup v2 nor v1 offers it): "
        "the limit cannot be enforced"
    )
    notes = check(Resources(), only_cpu)
    assert notes == [
        "this host has no memory cgroup controller: the sandbox runs without the default --memory 512m "
        "(pass --memory to refuse to run without it)",
        "this host has no pids cgroup controller: the sandbox runs without the default --pids 256 "
        "(pass --pids to refuse to run without it)",
    ]
    with pytest.raises(CgroupError, match="memory: 'lots'"):
        check(Resources(memory="lots"), only_cpu)


def test_more_cpus_than_the_host_has_are_refused_with_the_hosts_count(tmp_path: Path) -> None:
    host = len(os.sched_getaffinity(0))
    every = {c: (tmp_path / "airlock", 2) for c in ("cpu", "memory", "pids")}
    with pytest.raises(CgroupError) as refused:
        check(Resources(cpus=host + 1, required=frozenset({"cpus"})), every)
    assert str(refused.value) == f"--cpus {host + 1}: this host has {host} CPU{'s' * (host != 1)}: give {host} or fewer"
    assert check(Resources(cpus=host, required=frozenset({"cpus"})), every) == []


def test_the_watchdog_removes_only_sandbox_groups_of_the_id_it_was_told(tmp_path: Path) -> None:
    group = tmp_path / "pids" / "airlock" / "s5"
    group.mkdir(parents=True)
    with pytest.raises(CgroupError, match="not a sandbox cgroup"):
        cgroups.remove_named(f'["{tmp_path / "pids"}"]', "s5")
    with pytest.raises(CgroupError, match="not a sandbox cgroup"):
        cgroups.remove_named(f'["{group}"]', "s6")
    cgroups.remove_named(f'["{group}"]', "s5")
    assert not group.exists() and group.parent.exists()


def test_the_command_line_marks_the_limits_it_names_as_required() -> None:
    names = ("cpus", "memory", "pids", "nofile", "nproc")
    given = argparse.Namespace(**{**dict.fromkeys(names), "memory": "64m", "nofile": 100})
    assert netns_resources(given) == Resources(memory="64m", nofile=100, required=frozenset({"memory", "nofile"}))
    assert netns_resources(argparse.Namespace(**dict.fromkeys(names))) == Resources()
    assert rlimit_argv(Resources()) == ["prlimit", "--nofile=4096:4096", "--nproc=8192:8192", "--"]


def test_reap_removes_old_empty_groups_of_gone_sandboxes_wherever_a_launcher_put_them(tmp_path: Path) -> None:
    mountinfo = "".join(
        f"3{i} 31 0:3{i} / {tmp_path / name} rw - {kind} {kind} rw{options}\n"
        for i, (name, kind, options) in enumerate(
            [("memory", "cgroup", ",memory"), ("pids", "cgroup", ",pids"), ("systemd", "cgroup", ",name=systemd"),
             ("unified", "cgroup2", "")]
        )
    )  # fmt: skip
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text("memory\n")
    groups = {
        "gone": ["memory/jobs/j1/airlock/gone", "pids/airlock/gone", "unified/airlock/gone"],  # launchers' own
        "stays": [
            "pids/airlock/busy/inside",  # not empty: rmdir fails, as with processes in it
            "pids/airlock/live",  # its namespace is there
            "pids/airlock/young",
            "memory/jobs/airlockish/gone",  # not below an `airlock` parent
            "memory/airlock/Not_An_Id",
            "systemd/airlock/gone",  # a hierarchy airlock makes no groups in
        ],
    }
    for path in groups["gone"] + groups["stays"]:
        (tmp_path / path).mkdir(parents=True)
    now = 1_000_000.0
    for group in tmp_path.rglob("*"):
        os.utime(group, (now - 100, now - 100))
    os.utime(tmp_path / "pids/airlock/young", (now - 5, now - 5))
    found = hierarchies(mountinfo)
    removed = cgroups.reap_groups(60, lambda sandbox_id: sandbox_id == "live", now, found)
    assert removed == ["gone"]
    assert [p for p in groups["gone"] if (tmp_path / p).exists()] == []
    assert [p for p in groups["stays"] if not (tmp_path / p).exists()] == []
