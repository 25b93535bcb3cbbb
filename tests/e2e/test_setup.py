"""README's two lines, typed by a user who is not root and may use sudo as Debian sets it up: secure_path holds no
pyenv (nor any Python of the user's own). `./scripts/setup` finds the user's Python (here the .venv already made);
`.venv/bin/airlock run` runs itself again through sudo, and the sandbox runs as that user and reaches the (fake)
internet through its gateway; `./scripts/test` runs pytest as root through sudo."""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from airlock.sandbox.netns import has_namespace
from airlock.verify.hostcgroups import with_host_cgroups
from airlock.verify.topology import DNS_SERVER, FakeNet, Topology

from gateway_proc import E2E_POLICY

ROOT = Path(__file__).resolve().parents[2]
SECURE_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


@pytest.fixture
def sudoer(topology: Topology) -> Iterator[pwd.struct_passwd]:
    """A user of this run's own (no password, no home) whom sudo lets be root, with secure_path set."""
    if shutil.which("sudo") is None:
        if os.environ.get("AIRLOCK_REQUIRE_PRIVILEGED") == "1":
            pytest.fail("sudo is not installed (.ci/run installs it)", pytrace=False)
        pytest.skip("needs sudo")
    name = f"{topology.prefix}su"
    rules = Path("/etc/sudoers.d") / name
    add = ["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", name]
    subprocess.run(add, check=True, capture_output=True)
    try:
        rules.write_text(f'Defaults:{name} secure_path="{SECURE_PATH}"\n{name} ALL=(root) NOPASSWD: ALL\n')
        rules.chmod(0o440)
        yield pwd.getpwnam(name)
    finally:
        rules.unlink(missing_ok=True)
        subprocess.run(["userdel", name], check=False, capture_output=True)


def open_the_way(targets: list[Path], hold: Path) -> str:
    """Shell for a private mount namespace in which everyone reaches `targets`: each folder on the way that others
    may not enter (root's home holds pyenv's Python on some hosts) is covered with a tmpfs holding only the entries
    on the way, bound from the real ones. A user's own Python would be reachable by that user anyway."""
    needed: dict[Path, set[str]] = {}
    for target in targets:
        for folder in reversed(target.parents):
            if not folder.stat().st_mode & 0o001:
                needed.setdefault(folder, set()).add(target.relative_to(folder).parts[0])
    lines = []
    for index, (folder, names) in enumerate(sorted(needed.items(), key=lambda item: len(item[0].parts))):
        kept = [(shlex.quote(str(folder / name)), shlex.quote(str(hold / f"{index}-{name}"))) for name in sorted(names)]
        lines += [f"mkdir {held} && mount --bind {entry} {held}" for entry, held in kept]
        lines.append(f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(str(folder))}")
        lines += [f"mkdir {entry} && mount --bind {held} {entry}" for entry, held in kept]
    return " && ".join([*lines, 'exec "$@"'])


def as_the_user(topology: Topology, user: pwd.struct_passwd, line: str, hold: Path) -> subprocess.CompletedProcess[str]:
    """`line` typed in the repository by `user`, whose PATH has its own Python (as pyenv's shims would give it), in
    the gateway's namespace (where airlock's traffic lands in the fake internet)."""
    python = Path(os.path.realpath(sys.executable))
    shell = [
        "setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--",
        "env", "-i", f"PATH={python.parent}:/usr/local/bin:/usr/bin:/bin", "HOME=/nonexistent", "LANG=C.UTF-8",
        "sh", "-c", line,
    ]  # fmt: skip
    hold.mkdir()
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", open_the_way([python, ROOT], hold), "sh"]
    return topology.run(topology.gw, with_host_cgroups([*argv, *shell]), timeout=90, cwd=ROOT)


@pytest.fixture
def set_up() -> None:
    """The repository as `.ci/run` (or a developer) left it: set up, nothing left to install."""
    subprocess.run([str(ROOT / "scripts" / "setup")], check=True, capture_output=True)


def test_readmes_first_line_as_a_sudoer(topology: Topology, fakenet: FakeNet, sudoer, set_up, tmp_path: Path):
    sandbox_id = f"{topology.prefix}su"
    line = (
        f"./scripts/setup && .venv/bin/airlock run --policy {E2E_POLICY} --upstream-dns {DNS_SERVER} "
        f"--sandbox-id {sandbox_id} -- sh -c 'id -un; curl -sS --max-time 10 http://allowed.test/from-a-sudoer'"
    )
    result = as_the_user(topology, sudoer, line, tmp_path / "hold")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{sudoer.pw_name}\nfakenet 192.0.2.10:80 host=allowed.test path=/from-a-sudoer\n"
    said = [line for line in result.stderr.splitlines() if "sudo" in line]
    assert len(said) == 1 and said[0].startswith("airlock: run needs root (") and "scripts/setup" not in result.stderr
    assert not has_namespace(sandbox_id)


def test_readmes_test_line_as_a_sudoer(topology: Topology, sudoer, set_up, tmp_path: Path):
    chosen = "tests/unit/test_setup_script.py::test_set_up_already_it_does_nothing_and_says_nothing"
    result = as_the_user(topology, sudoer, f"./scripts/setup && ./scripts/test -q -p no:xdist {chosen}", tmp_path / "h")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert result.stderr == "scripts/test: the end-to-end tests need root: running pytest with sudo\n"
