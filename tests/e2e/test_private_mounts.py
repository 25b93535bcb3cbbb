"""A working directory below the sandbox's private mounts (/tmp, /dev/shm) at any depth: the folders on the way to
it are there as on the host — owner, group and mode — so the command's user reaches it and git works in it;
nothing else of the host's shows there."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from airlock.verify.topology import Topology

NOBODY = pwd.getpwnam("nobody")  # run as root without sudo, the sandboxed command runs as nobody
STAT = "%U:%G %a %n"


@pytest.fixture(params=["/tmp", "/dev/shm"])
def top(request: pytest.FixtureRequest, topology: Topology) -> Iterator[Path]:
    """A folder of root's (0755) below a private mount, with `a` (nobody's, setgid 2750) in it."""
    folder = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-deep-", dir=request.param))
    folder.chmod(0o755)
    (folder / "a").mkdir()
    os.chown(folder / "a", NOBODY.pw_uid, NOBODY.pw_gid)
    (folder / "a").chmod(0o2750)
    yield folder
    shutil.rmtree(folder)


def host_stat(*paths: Path) -> str:
    return subprocess.run(["stat", "-c", STAT, *paths], capture_output=True, text=True, check=True).stdout


def nobodys_folder(path: Path) -> Path:
    path.mkdir(mode=0o700)
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    return path


def test_a_working_directory_two_levels_below_a_private_mount(run_in_gw, top: Path):
    workdir = nobodys_folder(top / "a" / "b")
    on_the_way = [top, top / "a", workdir]
    script = f'stat -c "{STAT}" {" ".join(map(str, on_the_way))} && ls -ld "$PWD" >/dev/null && ls -A {top.parent}'
    script += " && git init -q && git status --short && echo GIT-OK"
    result = run_in_gw("sh", "-c", script, cwd=workdir)
    assert result.returncode == 0, result.stderr
    seen = result.stdout.splitlines()
    assert seen[:3] == host_stat(*on_the_way).splitlines()  # each folder's owner, group and mode, as on the host
    assert seen[3:] == [top.name, "GIT-OK"]  # nothing else of the host's private mount, not even an empty folder


def test_a_subfolder_of_a_repository_below_a_private_mount(run_in_gw, top: Path):
    repo = nobodys_folder(top / "a" / "repo")
    git = ["git", "-c", "user.name=owner", "-c", "user.email=owner@example.test"]
    as_nobody = {"user": NOBODY.pw_uid, "group": NOBODY.pw_gid, "extra_groups": [], "env": {"HOME": "/nonexistent"}}
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=repo, check=True, **as_nobody)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "first"], cwd=repo, check=True, **as_nobody)
    sub = nobodys_folder(repo / "sub")
    # git finds the repository in the folder above the working directory: the way there must be open.
    result = run_in_gw("sh", "-c", "git log --format=%s -1 && git status --short && echo GIT-OK", cwd=sub)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["first", "GIT-OK"]


def test_the_sandboxs_dev_shm_is_its_own_and_writable(run_in_gw, top: Path):
    marker = f"{top.name}-marker"
    lock = "import multiprocessing; multiprocessing.Lock(); print('LOCK-OK')"  # POSIX semaphores live in /dev/shm
    script = f"stat -c '%U:%G %a' /dev/shm && touch /dev/shm/{marker} && python3 -c \"{lock}\""
    result = run_in_gw("sh", "-c", script, cwd=nobodys_folder(top / "a" / "b"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["root:root 1777", "LOCK-OK"]
    assert not (Path("/dev/shm") / marker).exists()  # gone with the sandbox, never the host's


def test_nothing_of_the_hosts_private_mounts_shows(run_in_gw, topology: Topology):
    # Not even an empty folder where a gateway credential in the host's /tmp (a state directory kept from an
    # earlier run) is hidden.
    state = Path("/tmp") / f"{topology.prefix}-state"
    state.mkdir(mode=0o700)
    try:
        result = run_in_gw("sh", "-c", "ls -A /tmp /dev/shm", options=("--state-dir", str(state)))
    finally:
        shutil.rmtree(state, ignore_errors=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "/dev/shm:\n\n/tmp:\n"
