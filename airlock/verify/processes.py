"""The sandbox's processes as the host's kernel sees them (its cgroup's members, read from /proc while the probe's
children hold what their escalation steps got): IDs, capabilities, no-new-privileges, seccomp, tracer,
namespaces, descriptors, mounts — and the raw and packet sockets of its network namespace. What `airlock verify`
judges the privilege checks by: the kernel's record, not the probe's."""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from airlock.sandbox import cgroups

NAMESPACES = ("user", "pid", "net", "mnt", "uts", "ipc", "cgroup")
SOCKET_TABLES = ("raw", "raw6", "packet")


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    cmdline: tuple[str, ...]
    status: dict[str, str]  # /proc/PID/status: Uid, Gid, CapEff, CapPrm, NoNewPrivs, Seccomp, TracerPid, ...
    namespaces: dict[str, str]  # name -> e.g. "net:[4026532281]"
    descriptors: tuple[str, ...]  # what each open descriptor links to, e.g. "anon_inode:[io_uring]"
    mount_points: tuple[str, ...]

    def ids(self) -> list[int]:
        """Real, effective, saved and filesystem user and group IDs."""
        return [int(n) for key in ("Uid", "Gid") for n in self.status.get(key, "").split()]

    def marked(self, word: str) -> bool:
        """Whether one word of its command line is `word` (the probe's and its children's marks)."""
        return word in self.cmdline


def sandbox_processes(sandbox_id: str) -> list[Process]:
    """Every process in the sandbox's cgroup (each hierarchy's), read from /proc; one that ends meanwhile is left
    out."""
    pids: set[int] = set()
    for parent, _ in cgroups.host_parents().values():
        for members in (parent / sandbox_id).rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids |= {int(pid) for pid in members.read_text().split()}
    return [process for pid in sorted(pids) if (process := read_process(pid)) is not None]


def read_process(pid: int) -> Process | None:
    proc = Path(f"/proc/{pid}")
    try:
        status = dict(line.split(":\t", 1) for line in (proc / "status").read_text().splitlines() if ":\t" in line)
        cmdline = tuple((proc / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1])
        namespaces = {name: os.readlink(proc / "ns" / name) for name in NAMESPACES}
        descriptors = tuple(_links(proc / "fd"))
        mounts = tuple(line.split()[4] for line in (proc / "mountinfo").read_text().splitlines())
    except OSError:  # it ended
        return None
    return Process(pid, int(status.get("PPid", "0")), cmdline, status, namespaces, descriptors, mounts)


def _links(folder: Path) -> list[str]:
    links = []
    for entry in folder.iterdir():
        with contextlib.suppress(OSError):
            links.append(os.readlink(entry))
    return links


def descendants(processes: list[Process], root: Process) -> list[Process]:
    """`root` and every process below it."""
    found, frontier = [root], {root.pid}
    while frontier:
        children = [p for p in processes if p.ppid in frontier and p not in found]
        found += children
        frontier = {p.pid for p in children}
    return found


def raw_sockets(pid: int) -> int:
    """The raw (IPv4, IPv6) and packet sockets open in `pid`'s network namespace."""
    count = 0
    for table in SOCKET_TABLES:
        with contextlib.suppress(OSError):
            count += len(Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:])
    return count


def user_keys(uid: int) -> int | None:
    """How many keys the kernel counts for `uid` (/proc/key-users), None if it cannot be read."""
    try:
        lines = Path("/proc/key-users").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        owner, _, counts = line.partition(":")
        if owner.strip() == str(uid):
            return int(counts.split()[1].split("/")[0])
    return 0


def sockets_in_view(pid: int, paths: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `paths` that are a socket as `pid` sees them (through its root, its own symlinks followed there)."""
    found = []
    for path in paths:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.stat(in_root(pid, path)).st_mode):
                found.append(path)
    return tuple(found)


def in_root(pid: int, path: str, hops: int = 40) -> str:
    """`path` as the host reaches what `pid` sees there: /proc/PID/root followed by the path with each symlink
    resolved inside that root (an absolute link is relative to it, not to the host's /). OSError if too deep."""
    root, done, todo = f"/proc/{pid}/root", "", [part for part in path.split("/") if part]
    while todo:
        part = todo.pop(0)
        candidate = f"{done}/{part}"
        if os.path.islink(root + candidate):
            if (hops := hops - 1) < 0:
                raise OSError(f"too many symlinks in {path}")
            target = os.readlink(root + candidate)
            todo = [p for p in target.split("/") if p] + todo
            done = "" if target.startswith("/") else done
        elif part == "..":
            done = done.rsplit("/", 1)[0]
        else:
            done = candidate
    return root + done
