"""The gateways running on this host, for the admin commands (`airlock status`, `token`, `approvals`, `policy
reload`) given neither --admin nor --state-dir; and how a person at this host's shell names this airlock.

Each `airlock gateway` and `airlock run` enters itself while it runs — its admin listener, pid, start and policy,
and a run the host folders that are its sandbox's (working directory, `--cache`, state and token folders: a netns
sandbox started later hides them, `airlock.launch.tenants`) — as one file in RUNS, a folder root's alone (0700;
bubblewrap hides it from every sandbox too), and removes the file at its end. An entry whose process is gone
(killed, crashed) is stale: whoever reads it removes it. A folder that is not its owner's alone, or whose owner is
neither root nor this user, is never read nor written: an entry names the socket the admin commands then send
tokens and answers to."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import stat
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from airlock.errors import AirlockError
from airlock.gateway.config import admin_address, admin_endpoint

RUNS = Path("/run/airlock/runs")
RUNS_ENV = "AIRLOCK_RUNS_DIR"  # another folder for them (the tests' own): checked as RUNS is

log = logging.getLogger("airlock")


class RunsError(AirlockError):
    pass


@dataclass(frozen=True)
class Running:
    """One running gateway's entry."""

    admin: str  # its admin listener: an absolute socket path, or 127.0.0.1:PORT
    pid: int
    ticks: int  # when the process started, in clock ticks since boot: a pid used again is another process
    started: float  # Unix time
    policy: str  # where its policy came from
    what: str  # `airlock gateway`, `airlock run, sandbox ab12`
    folders: tuple[str, ...] = ()  # a run's: the host folders of its sandbox, which no other sandbox may see

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"{self.what}, pid {self.pid}, since {since}, policy {self.policy}"


def runs_dir() -> Path:
    return Path(os.environ.get(RUNS_ENV) or RUNS)


@contextlib.contextmanager
def registered(admin: str, policy: str, what: str, folders: Sequence[str] = ()) -> Iterator[None]:
    """This process's gateway entered while the block runs (with the `folders` of its sandbox, absolute). One that
    cannot be entered (not root) runs all the same: the admin commands then find it only when told where (--admin,
    --state-dir), and a sandbox started later does not hide its folders (their modes keep another user out)."""
    try:
        path: Path | None = _register(admin, policy, what, tuple(folders))
    except (OSError, RunsError) as e:
        log.info("this gateway is not entered among the running ones: %s", e)
        path = None
    try:
        yield
    finally:
        if path is not None:
            path.unlink(missing_ok=True)


def _register(admin: str, policy: str, what: str, folders: tuple[str, ...]) -> Path:
    folder = runs_dir()
    folder.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    _check_private(folder)
    pid = os.getpid()
    entry = Running(admin_address(admin_endpoint(admin)), pid, _ticks(pid), time.time(), policy, what, folders)
    path, partial = folder / f"{pid}.json", folder / f".{pid}.json.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(asdict(entry), out)
    os.replace(partial, path)  # a reader sees the whole entry or none
    return path


def running() -> list[Running]:
    """The gateways running now, oldest first (stale entries removed); none when nothing was ever entered. A user
    who may not read the folder gets its PermissionError (the admin listeners are root's anyway)."""
    folder = runs_dir()
    if not folder.exists():
        return []
    _check_private(folder)
    found = []
    with os.scandir(folder) as entries:
        for item in entries:
            if not item.name.endswith(".json") or item.name.startswith("."):
                continue
            path = Path(item.path)
            try:
                entry = _entry(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, TypeError):
                continue  # not an entry of ours: left alone
            if _ticks(entry.pid) != entry.ticks:
                path.unlink(missing_ok=True)  # its gateway is gone
                continue
            found.append(entry)
    return sorted(found, key=lambda entry: entry.started)


def _entry(data: Any) -> Running:
    """An entry as read from its file (TypeError or ValueError: not one of ours)."""
    entry = Running(**data)
    if not isinstance(entry.folders, list | tuple) or not all(isinstance(f, str) for f in entry.folders):
        raise ValueError("folders: not a list of paths")
    return dataclasses.replace(entry, folders=tuple(entry.folders))


def _check_private(folder: Path) -> None:
    """RunsError unless `folder` is a real folder that only its owner — root, or this user — can read or write, in
    a folder nobody else may rename it out of."""
    owners = (0, os.geteuid())
    st, parent = os.lstat(folder), os.stat(folder.parent)
    private = stat.S_ISDIR(st.st_mode) and st.st_uid in owners and not st.st_mode & 0o077
    kept = parent.st_uid in owners and (not parent.st_mode & 0o022 or parent.st_mode & stat.S_ISVTX)
    if not (private and kept):
        raise RunsError(f"{folder} is not a folder of root's alone (0700): the running gateways are not read there")


def _ticks(pid: int) -> int:
    """When process `pid` started (field 22 of /proc/PID/stat, after the parenthesized name); -1 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return -1


def airlock_command() -> str:
    """How a person at this host's shell runs this airlock: `airlock` when that is what PATH finds, else its script's
    full path (typed by a user, it asks sudo itself for the admin listener, which is root's)."""
    script = Path(sys.executable).parent / "airlock"
    found = shutil.which("airlock")
    return "airlock" if not script.exists() or (found and Path(found).resolve() == script.resolve()) else str(script)
