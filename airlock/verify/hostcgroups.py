"""The host's cgroup hierarchies inside the fake internet's gateway namespace.

`ip netns exec` gives each command a private mount namespace with a fresh /sys, in which the host's cgroup mounts
(under /sys/fs/cgroup) are gone. A launcher run on a host sees them: `with_host_cgroups()` mounts the same
hierarchies again in that private mount namespace (mounting a v1 hierarchy with the controllers it already has
attaches the existing one, and the unified hierarchy is one per host), so `airlock run` in that namespace sees the
host's cgroups as it would outside. Nothing propagates back: `ip netns exec` makes the namespace a slave."""

from __future__ import annotations

import shlex
from pathlib import Path

CONTROLLERS = {"cpu", "cpuacct", "memory", "pids"}


def host_cgroup_mounts() -> list[tuple[str, str, str]]:
    """(type, options, mount point) of each cgroup2 mount and v1 mount with a controller airlock uses."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        tail = fields[fields.index("-") + 1 :]
        if tail[0] == "cgroup2":
            mounts.append(("cgroup2", "", fields[4]))
        elif tail[0] == "cgroup" and (wanted := [o for o in tail[2].split(",") if o in CONTROLLERS]):
            mounts.append(("cgroup", ",".join(wanted), fields[4]))
    return mounts


def with_host_cgroups(argv: list[str]) -> list[str]:
    """`argv` run after the host's cgroup hierarchies are mounted where the host has them (it execs: same PID)."""
    steps = []
    mounts = host_cgroup_mounts()
    if not any(point == "/sys/fs/cgroup" for _, _, point in mounts):
        steps.append("mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup")
    for fstype, options, point in mounts:
        option = f"-o {shlex.quote(options)} " if options else ""
        steps.append(f"mkdir -p {shlex.quote(point)} && mount -t {fstype} {option}{fstype} {shlex.quote(point)}")
    script = " && ".join([*steps, 'exec "$@"'])
    return ["sh", "-c", script, "sh", *[str(a) for a in argv]]
