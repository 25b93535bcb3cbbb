"""Compute limits for the netns backend: one cgroup per sandbox, holding every process of the sandbox from its
first instruction (the command's argv starts with a root shell that writes its own pid into the group, then execs
the rest), removed with the sandbox (by its launcher, else by the watchdog).

cgroup v2 where the host's unified hierarchy offers a controller; the v1 hierarchy of that controller (cpu, memory,
pids) where it does not. A limit the caller asked for that no controller can enforce is refused before anything is
created; a default one is reported, never silently dropped.

Where the groups go: under v1, inside the launcher's own group of each hierarchy (`<its group>/airlock/<id>`), so a
sandbox stays within whatever limits its launcher runs under; under v2 the no-internal-processes rule forbids
controllers below a group that has processes, so the parent is the top-level `airlock` group (as docker's cgroupfs
driver keeps `docker`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import SANDBOX_ID
from .errors import SandboxError
from .limits import Resources

PARENT = "airlock"
CPU_PERIOD_US = 100_000
LIMITED = ("cpus", "memory", "pids")  # each limit and the controller that enforces it
CONTROLLER = {"cpus": "cpu", "memory": "memory", "pids": "pids"}
FLAG = {"cpus": "--cpus", "memory": "--memory", "pids": "--pids"}
# The first thing that runs: the shell moves itself into each group (so does everything it execs and forks),
# then becomes the sandbox's command. A write that fails stops the run before the command starts.
_ENTER = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


class CgroupError(SandboxError):
    pass


@dataclass(frozen=True)
class Hierarchy:
    """A mounted cgroup hierarchy: its mount point, the group path at its root, its version, its controllers."""

    mount: Path
    root: str
    version: int
    controllers: frozenset[str]


def hierarchies(mountinfo: str, read: Callable[[Path], str] = Path.read_text) -> list[Hierarchy]:
    """The cgroup hierarchies in a /proc/PID/mountinfo text. A v2 hierarchy's controllers are those its root
    offers (`cgroup.controllers`); a v1 mount's are its mount options."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 10:
            continue
        tail = fields[fields.index("-") + 1 :]
        fstype, options = tail[0], tail[2].split(",") if len(tail) > 2 else []
        mount, root = Path(_unescape(fields[4])), _unescape(fields[3])
        if fstype == "cgroup2":
            with contextlib.suppress(OSError):
                offered = read(mount / "cgroup.controllers").split()
                found.append(Hierarchy(mount, root, 2, frozenset(offered)))
        elif fstype == "cgroup":
            found.append(Hierarchy(mount, root, 1, frozenset(o for o in options if o in CONTROLLER.values())))
    return found


def _unescape(text: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for escaped, plain in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        text = text.replace(escaped, plain)
    return text


def own_groups(proc_cgroup: str) -> dict[str, str]:
    """This process's group in each hierarchy of a /proc/PID/cgroup text: controller (v1) or "" (v2) → path."""
    groups = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            groups[controller] = path
    return groups


def parents(found: list[Hierarchy], own: dict[str, str]) -> dict[str, tuple[Path, int]]:
    """Each controller's `airlock` parent group and its version: v2 where the unified hierarchy offers the
    controller, else the v1 hierarchy mounting it; a controller in neither is absent."""
    chosen: dict[str, tuple[Path, int]] = {}
    for controller in CONTROLLER.values():
        unified = [h for h in found if h.version == 2 and controller in h.controllers]
        legacy = [h for h in found if h.version == 1 and controller in h.controllers]
        if unified:
            chosen[controller] = (unified[0].mount / PARENT, 2)
        elif legacy:
            h = legacy[0]
            group = own.get(controller, "/")
            inside = group.removeprefix(h.root) if group.startswith(h.root) else "/"  # beyond its view: its top
            chosen[controller] = (h.mount / inside.lstrip("/") / PARENT, 1)
    return chosen


def host_parents() -> dict[str, tuple[Path, int]]:
    """This host's parents, as this process sees its mounts and groups."""
    found = hierarchies(Path("/proc/self/mountinfo").read_text())
    return parents(found, own_groups(Path("/proc/self/cgroup").read_text()))


def check(resources: Resources, available: dict[str, tuple[Path, int]]) -> list[str]:
    """Before anything is created: CgroupError (one line) if a limit is invalid or one asked for has no controller
    here to enforce it; the notes to tell the user of default limits the host cannot enforce."""
    if problems := resources.problems():
        raise CgroupError("; ".join(problems))
    if resources.cpus > (host := len(os.sched_getaffinity(0))):  # a quota above the host's would limit nothing
        raise CgroupError(
            f"--cpus {resources.cpus:g}: this host has {host} CPU{'s' * (host != 1)}: give {host} or fewer"
        )
    missing = [name for name in LIMITED if CONTROLLER[name] not in available]
    if refused := [name for name in missing if name in resources.required]:
        flags = ", ".join(FLAG[n] for n in refused)
        controllers = ", ".join(CONTROLLER[n] for n in refused)
        raise CgroupError(
            f"{flags}: this host has no {controllers} cgroup controller (neither cgroup v2 nor v1 offers it): "
            "the limit cannot be enforced"
        )
    return [
        f"this host has no {CONTROLLER[n]} cgroup controller: the sandbox runs without the default "
        f"{FLAG[n]} {getattr(resources, n)} (pass {FLAG[n]} to refuse to run without it)"
        for n in missing
    ]


class SandboxCgroup:
    """One sandbox's groups: `create()`, `enter_argv()` before the command, `oom_killed()`, `remove()` always."""

    def __init__(self, sandbox_id: str, resources: Resources, available: dict[str, tuple[Path, int]]) -> None:
        if not SANDBOX_ID.fullmatch(sandbox_id):
            raise CgroupError(f"not a sandbox id: {sandbox_id!r}")
        self.resources = resources
        # controller → the sandbox's group; v2 controllers share one group
        self.groups = {c: parent / sandbox_id for c, (parent, _) in available.items()}
        self.versions = {c: version for c, (_, version) in available.items()}
        self.created: list[Path] = []

    @property
    def dirs(self) -> list[Path]:
        return list(dict.fromkeys(self.groups.values()))

    def create(self) -> None:
        """Every group with its limits set, before any process is in it. A group left by a crashed run of the
        same id is taken over if empty; one that still holds processes is refused."""
        try:
            for group in self.dirs:
                self._make(group)
            self._limit()
        except BaseException as e:
            self.remove()
            if isinstance(e, OSError):
                raise CgroupError(f"cannot set up the sandbox's cgroup: {e}") from None
            raise

    def _make(self, group: Path) -> None:
        if self.versions[self._controller_of(group)] == 2:
            wanted = [c for c, g in self.groups.items() if g == group]
            _enable(group.parent.parent, wanted)  # the hierarchy's root hands them to `airlock`...
            group.parent.mkdir(exist_ok=True)
            _enable(group.parent, wanted)  # ...which hands them to each sandbox
        else:
            group.parent.mkdir(parents=True, exist_ok=True)
        try:
            group.mkdir()
        except FileExistsError:
            try:
                group.rmdir()  # only an empty leftover goes
            except OSError:
                raise CgroupError(f"{group} exists and is in use: another sandbox has this id") from None
            group.mkdir()
        self.created.append(group)

    def _controller_of(self, group: Path) -> str:
        return next(c for c, g in self.groups.items() if g == group)

    def _limit(self) -> None:
        r = self.resources
        if (group := self.groups.get("cpu")) is not None:
            quota = max(1000, round(r.cpus * CPU_PERIOD_US))
            if self.versions["cpu"] == 2:
                _write(group / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                _write(group / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(group / "cpu.cfs_quota_us", str(quota))
        if (group := self.groups.get("memory")) is not None:
            _limit_memory(group, self.versions["memory"], r.memory_bytes)
        if (group := self.groups.get("pids")) is not None:
            _write(group / "pids.max", str(r.pids))

    def enter_argv(self) -> list[str]:
        """The argv prefix that puts the command into the groups before it runs anything of its own."""
        if not self.created:
            return []
        return ["sh", "-c", _ENTER, "sh", *[str(g / "cgroup.procs") for g in self.created], "--"]

    def watchdog_words(self) -> str:
        """The groups, as the watchdog is told of them (one line, no newline)."""
        return json.dumps([str(g) for g in self.created])

    def oom_killed(self) -> bool:
        """Whether the memory limit made the kernel kill a process of the sandbox (v2 also tells that the group's
        own limit was hit; v1 counts only the kills, which a host out of memory could also have caused)."""
        group = self.groups.get("memory")
        if group is None or group not in self.created:
            return False
        try:
            if self.versions["memory"] == 2:
                events = _counters((group / "memory.events").read_text())
                return events.get("oom_kill", 0) > 0 and events.get("oom", 0) > 0
            return _counters((group / "memory.oom_control").read_text()).get("oom_kill", 0) > 0
        except OSError:
            return False

    def remove(self) -> None:
        """Kill whatever is still in the groups and remove them; CgroupError if one cannot be removed."""
        failed = []
        for group in reversed(self.created):
            if not remove_group(group):
                failed.append(group)
        self.created = failed
        if failed:
            raise CgroupError(f"cannot remove {failed[0]}: processes are still in it")


def _limit_memory(group: Path, version: int, size: int) -> None:
    """The memory limit, swap capped to the same: v2 gives no swap at all (memory.swap.max 0); v1 caps memory+swap
    at the memory limit. Without swap accounting, the group is told not to swap (v1 swappiness 0)."""
    if version == 2:
        _write(group / "memory.max", str(size))
        if (group / "memory.swap.max").exists():
            _write(group / "memory.swap.max", "0")
        return
    _write(group / "memory.limit_in_bytes", str(size))  # before memsw: memory+swap may never be below memory
    if (group / "memory.memsw.limit_in_bytes").exists():
        _write(group / "memory.memsw.limit_in_bytes", str(size))
    else:
        _write(group / "memory.swappiness", "0")


def remove_group(group: Path, patience: float = 5.0) -> bool:
    """SIGKILL everything in one group until it is empty, then remove it. Whether it is gone."""
    deadline = time.monotonic() + patience
    while True:
        try:
            group.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
        kill_all(group)
        time.sleep(0.01)


def kill_all(group: Path) -> None:
    """SIGKILL every process in the group (cgroup.kill where v2 has it: no pid can be reused in between)."""
    with contextlib.suppress(OSError):
        if (group / "cgroup.kill").exists():
            _write(group / "cgroup.kill", "1")
            return
    with contextlib.suppress(OSError):
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)


def remove_named(words: str, sandbox_id: str) -> None:
    """The watchdog's end: remove the groups a launcher named (`watchdog_words()`), each only if it is a sandbox
    group of this id under an `airlock` parent."""
    groups = [Path(g) for g in json.loads(words)]
    for group in groups:
        if group.name != sandbox_id or group.parent.name != PARENT or not group.is_absolute():
            raise CgroupError(f"not a sandbox cgroup: {group}")
    left = [g for g in reversed(groups) if not remove_group(g)]
    if left:
        raise CgroupError(f"cannot remove {left[0]}: processes are still in it")


def reap_groups(
    older_than: float, in_use: Callable[[str], bool], now: float | None = None, found: list[Hierarchy] | None = None
) -> list[str]:
    """Remove the sandbox groups a crashed run left (its launcher and its watchdog both killed): older than
    `older_than` seconds, empty, of a sandbox `in_use` does not claim (its namespace is gone). A group that still
    holds a process is left alone, as `reap_netns` leaves a namespace: something of that sandbox still runs. The
    ids of the sandboxes whose groups were removed."""
    now = time.time() if now is None else now
    removed = set()
    for group in sandbox_groups(found if found is not None else hierarchies(Path("/proc/self/mountinfo").read_text())):
        if in_use(group.name):
            continue
        try:
            if group.stat().st_mtime > now - older_than:
                continue
            group.rmdir()  # refused (EBUSY) while a process is in it: never killed here
        except OSError:
            continue
        removed.add(group.name)
    return sorted(removed)


def sandbox_groups(found: list[Hierarchy]) -> list[Path]:
    """Every sandbox group where `parents()` puts them, whoever launched it: in a v2 hierarchy below its top-level
    `airlock`, in a v1 one below an `airlock` inside any group (the launcher's own)."""
    groups = []
    for h in found:
        if not h.controllers & set(CONTROLLER.values()):
            continue  # airlock makes no groups there
        if h.version == 2:
            airlock_parents = [h.mount / PARENT]
        else:
            airlock_parents = [Path(top) / PARENT for top, subdirs, _ in os.walk(h.mount) if PARENT in subdirs]
        for parent in airlock_parents:
            with contextlib.suppress(OSError):  # absent, or removed meanwhile
                groups += [g for g in parent.iterdir() if SANDBOX_ID.fullmatch(g.name) and g.is_dir()]
    return groups


def _enable(group: Path, controllers: list[str]) -> None:
    """Let `group`'s children use these controllers (v2 subtree_control), unless they may already."""
    control = group / "cgroup.subtree_control"
    enabled = control.read_text().split()
    if wanted := [c for c in controllers if c not in enabled]:
        _write(control, " ".join(f"+{c}" for c in wanted))


def _write(path: Path, value: str) -> None:
    with path.open("w") as f:  # one write(2): a cgroup file takes or refuses it whole
        f.write(value)


def _counters(text: str) -> dict[str, int]:
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            counters[name] = int(value)
    return counters
