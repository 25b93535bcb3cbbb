"""What the sandbox's resource limits did, as the host's kernel counts it: its cgroup's counters (CPU throttling,
out-of-memory kills and peak memory, forks refused at the pids limit) and its /tmp as the host sees it, read while
the probe is held at its end (the cgroup goes with the sandbox). What `airlock verify` judges the resource checks
by: the kernel's accounts, not the probe's."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from airlock.sandbox import cgroups

# counter -> the file and the line of it under cgroup v2, then v1 (a number alone in its file when the line is "",
# the second number of its one line when "#1"; "max" is -1)
_V2 = {
    "nr_throttled": ("cpu.stat", "nr_throttled"), "throttled_usec": ("cpu.stat", "throttled_usec"),
    "cpu_quota": ("cpu.max", ""), "cpu_period": ("cpu.max", "#1"),
    "oom_kill": ("memory.events", "oom_kill"), "memory_peak": ("memory.peak", ""), "memory_max": ("memory.max", ""),
    "memory_now": ("memory.current", ""), "pids_refused": ("pids.events", "max"), "pids_now": ("pids.current", ""),
    "pids_max": ("pids.max", ""),
}  # fmt: skip
_V1 = _V2 | {
    "throttled_usec": ("cpu.stat", "throttled_time"),  # nanoseconds: made microseconds below
    "cpu_quota": ("cpu.cfs_quota_us", ""), "cpu_period": ("cpu.cfs_period_us", ""),
    "oom_kill": ("memory.oom_control", "oom_kill"), "memory_peak": ("memory.max_usage_in_bytes", ""),
    "memory_max": ("memory.limit_in_bytes", ""), "memory_now": ("memory.usage_in_bytes", ""),
}  # fmt: skip
_CONTROLLER = {name: name.split("_")[0] for name in _V2} | {
    "nr_throttled": "cpu",
    "throttled_usec": "cpu",
    "oom_kill": "memory",
}


@dataclass(frozen=True)
class Usage:
    """The sandbox's cgroup counters (a counter the host does not keep is absent) and its /tmp as the host saw it."""

    counters: dict[str, int] = field(default_factory=dict)
    tmp_own: bool | None = None  # whether the sandbox's /tmp is another filesystem than the host's (None: unseen)
    tmp_fill: int | None = None  # bytes of the probe's fill file there (None: no such file)


def cgroup_counters(sandbox_id: str) -> dict[str, int]:
    """Each counter of the sandbox's groups the host keeps."""
    found: dict[str, int] = {}
    for controller, (parent, version) in cgroups.host_parents().items():
        found |= group_counters(parent / sandbox_id, version, controller)
    return found


def group_counters(group: Path, version: int, controller: str) -> dict[str, int]:
    """The counters of one controller's group that its files hold, in v2's units."""
    found = {}
    for name, (file, line) in (_V2 if version == 2 else _V1).items():
        if _CONTROLLER[name] == controller and (value := _read(group / file, line)) is not None:
            found[name] = value // 1000 if version == 1 and name == "throttled_usec" else value
    return found


def _read(path: Path, line: str) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    if line in ("", "#1"):
        words = text.split()
        with contextlib.suppress(ValueError, IndexError):
            word = words[1 if line else 0]
            return -1 if word == "max" else int(word)
        return None
    for row in text.splitlines():
        name, _, value = row.partition(" ")
        if name == line:
            with contextlib.suppress(ValueError):
                return int(value)
    return None


def sandbox_tmp(pid: int, fill_name: str) -> tuple[bool | None, int | None]:
    """Whether `pid`'s /tmp is a filesystem of its own (not the host's /tmp), and the size of `fill_name` in it."""
    root_tmp = Path(f"/proc/{pid}/root/tmp")
    try:
        own = os.stat(root_tmp).st_dev != os.stat("/tmp").st_dev
    except OSError:
        return None, None
    try:
        return own, (root_tmp / fill_name).stat().st_size
    except OSError:
        return own, None
