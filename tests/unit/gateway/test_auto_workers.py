"""How many workers `airlock gateway` runs when not told: `--workers auto` (the CPUs this process may use, its
cgroup's CPU limit included), and one for a pod's sidecar."""

from __future__ import annotations

from pathlib import Path

import pytest

from airlock.cli import build_parser
from airlock.cli.gateway import default_workers
from airlock.gateway import worker_terms
from airlock.gateway.worker_terms import MAX_AUTO_WORKERS, auto_workers, cgroup_cpu_limit

V2 = "0::/kubepods/pod1/sidecar\n"
HYBRID = "4:memory:/x\n2:cpu,cpuacct:/kubepods/pod1\n0::/kubepods/pod1\n"


def cgroups(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    ("proc_cgroup", "files", "limit"),
    [
        (V2, {}, None),  # no cgroup files to read: no limit known
        (V2, {"kubepods/pod1/sidecar/cpu.max": "max 100000\n"}, None),
        (V2, {"kubepods/pod1/sidecar/cpu.max": "150000 100000\n"}, 1.5),
        # a parent's limit binds its children: the smallest on the way up
        (V2, {"kubepods/pod1/sidecar/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "50000 100000\n"}, 0.5),
        (V2, {"kubepods/pod1/sidecar/cpu.max": "400000 100000\n", "kubepods/cpu.max": "200000 100000\n"}, 2.0),
        (V2, {"kubepods/pod1/sidecar/cpu.max": "garbage\n"}, None),
        ("0::/\n", {"cpu.max": "300000 100000\n"}, 3.0),
        # v2 beside v1 (a hybrid host): v2 at unified/, v1's cpu controller in its own folder
        (HYBRID, {"unified/kubepods/pod1/cpu.max": "250000 100000\n"}, 2.5),
        (
            HYBRID,
            {
                "cpu,cpuacct/kubepods/pod1/cpu.cfs_quota_us": "-1\n",
                "cpu,cpuacct/kubepods/pod1/cpu.cfs_period_us": "100000\n",
            },
            None,
        ),
        (
            HYBRID,
            {"cpu,cpuacct/kubepods/cpu.cfs_quota_us": "100000\n", "cpu,cpuacct/kubepods/cpu.cfs_period_us": "100000\n"},
            1.0,
        ),
        # a path that climbs out of the hierarchy reads nothing above it
        ("0::/../../etc\n", {"cpu.max": "100000 100000\n"}, None),
    ],
)
def test_the_cgroup_cpu_limit_is_the_smallest_on_the_way_up(
    tmp_path: Path, proc_cgroup: str, files: dict[str, str], limit: float | None
) -> None:
    assert cgroup_cpu_limit(proc_cgroup, cgroups(tmp_path, files)) == limit


def test_auto_is_the_cpus_within_the_cgroups_limit_and_at_most_eight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpus = len(__import__("os").sched_getaffinity(0))
    monkeypatch.setattr(worker_terms, "CGROUP_ROOT", tmp_path / "none")
    assert auto_workers() == min(cpus, MAX_AUTO_WORKERS)
    monkeypatch.setattr(worker_terms.os, "sched_getaffinity", lambda _pid: set(range(64)))
    assert auto_workers() == MAX_AUTO_WORKERS
    root = cgroups(tmp_path / "cg", {"cpu.max": "50000 100000\n", "unified/cpu.max": "50000 100000\n"})
    monkeypatch.setattr(worker_terms, "CGROUP_ROOT", root)
    monkeypatch.setattr(worker_terms, "own_cgroups", lambda: "0::/\n")
    assert auto_workers() == 1  # half a CPU: one worker, never none


def test_without_workers_a_shared_gateway_runs_auto_and_a_pods_sidecar_one() -> None:
    args = build_parser(["gateway"]).parse_args(["gateway", "--listen", "127.0.0.1"])
    assert args.workers is None
    assert default_workers(pod=False) == auto_workers()
    assert default_workers(pod=True) == 1
    given = build_parser(["gateway"]).parse_args(["gateway", "--listen", "127.0.0.1", "--workers", "3"])
    assert given.workers == 3
