"""Compute limits of the netns backend with real cgroups (the host's, v1 or v2, as `airlock run` sees them): each
limit holds inside the sandbox, from its first instruction, and goes with it."""

from __future__ import annotations

import concurrent.futures
import subprocess
import time
from pathlib import Path

from airlock.sandbox.cgroups import host_parents
from airlock.verify.topology import DNS_SERVER, Topology

from gateway_proc import AIRLOCK, E2E_POLICY


def test_fork_bomb_stops_at_the_pids_limit_and_the_host_stays_responsive(run_in_gw, topology: Topology):
    bomb = "bomb() { bomb | bomb & }; bomb; sleep 5; echo survived"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_in_gw, "sh", "-c", bomb, options=("--pids", "32", "--timeout", "15"))
        time.sleep(3)
        started = time.monotonic()
        assert topology.run(topology.gw, ["sh", "-c", "for i in 1 2 3 4 5; do true; done"]).returncode == 0
        assert time.monotonic() - started < 3  # forking on the host is unaffected
        result = running.result(timeout=60)
    assert "Cannot fork" in result.stderr or "Resource temporarily unavailable" in result.stderr, result.stderr[-2000:]


def test_memory_hog_is_killed_at_its_limit(run_in_gw):
    hog = "x = bytearray(512 * 1024 * 1024); print('allocated')"
    result = run_in_gw("python3", "-c", hog, options=("--memory", "64m"))
    assert result.returncode == 137 and "allocated" not in result.stdout, result
    assert result.stderr.splitlines()[-1] == "airlock: killed at the 64m memory limit", result.stderr


def test_an_exit_code_137_of_its_own_is_no_memory_kill(run_in_gw):
    result = run_in_gw("sh", "-c", "exit 137", options=("--memory", "64m"))
    assert result.returncode == 137 and "memory limit" not in result.stderr, result.stderr


CPU_TIME = """
import time
wall = time.monotonic()
while time.monotonic() - wall < 2:
    pass
print(round(time.process_time() / (time.monotonic() - wall), 2))
"""


def test_a_busy_loop_gets_no_more_than_its_cpus(run_in_gw):
    share = float(run_in_gw("python3", "-c", CPU_TIME, options=("--cpus", "0.2")).stdout)
    assert 0.05 < share < 0.35, share  # a fifth of one CPU (a whole one without the limit)


def test_every_process_is_in_the_sandboxs_groups_from_its_first_instruction(run_in_gw):
    result = run_in_gw("cat", "/proc/self/cgroup")
    groups = {line.split(":")[1]: line.split(":")[2] for line in result.stdout.splitlines()}
    for controller, (_, version) in host_parents().items():
        key = "" if version == 2 else next(k for k in groups if controller in k.split(","))
        assert groups[key].rsplit("/", 2)[-2] == "airlock", (controller, result.stdout)


def test_rlimits_have_defaults_and_follow_the_flags(run_in_gw):
    probe = "import resource as r; print(*(r.getrlimit(x) for x in (r.RLIMIT_NOFILE, r.RLIMIT_NPROC)))"
    assert run_in_gw("python3", "-c", probe).stdout.split() == ["(4096,", "4096)", "(8192,", "8192)"]
    given = run_in_gw("python3", "-c", probe, options=("--nofile", "64", "--nproc", "500"))
    assert given.stdout.split() == ["(64,", "64)", "(500,", "500)"], given.stderr
    opened = run_in_gw("python3", "-c", "fs = [open('/dev/null') for _ in range(100)]", options=("--nofile", "64"))
    assert opened.returncode == 1 and "Too many open files" in opened.stderr


def _run_without_cgroups(topology: Topology, tmp: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """`airlock run` where no cgroup hierarchy is mounted (as `ip netns exec` leaves it: a fresh /sys)."""
    argv = [AIRLOCK, "run", "--policy", E2E_POLICY, "--upstream-dns", DNS_SERVER, *options, "--", "echo", "ran"]
    return topology.run(topology.gw, argv, timeout=60, cwd=tmp)


def test_a_limit_the_host_cannot_enforce_is_refused_and_a_default_one_is_reported(topology: Topology, tmp_path):
    tmp_path.chmod(0o777)
    refused = _run_without_cgroups(topology, tmp_path, "--memory", "64m", "--pids", "10")
    assert refused.returncode == 2 and "ran" not in refused.stdout
    assert refused.stderr.splitlines()[-1] == (
        "airlock: --memory, --pids: this host has no memory, pids cgroup controller (neither cgroup v2 nor v1 "
        "offers it): the limit cannot be enforced"
    ), refused.stderr
    reported = _run_without_cgroups(topology, tmp_path)
    assert reported.returncode == 0 and reported.stdout == "ran\n", reported.stderr
    assert (
        "airlock: this host has no memory cgroup controller: the sandbox runs without the default --memory 512m "
        "(pass --memory to refuse to run without it)"
    ) in reported.stderr.splitlines()
