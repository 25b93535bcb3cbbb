"""One sandbox cannot read another's working directory: a netns sandbox hides the folders of every `airlock run`
running when it starts (airlock/launch/tenants.py), as each entered them among the running gateways. Two real runs,
the first holding a file in its working directory (both run as the same user, nobody, so no file mode keeps the
second out); and a run whose working directory is inside the first's, which shares it and says so."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from airlock.runs import running
from airlock.verify.hostcgroups import with_host_cgroups
from airlock.verify.topology import DNS_SERVER, Topology

from gateway_proc import AIRLOCK, E2E_POLICY

NOBODY = pwd.getpwnam("nobody")  # run as root without sudo, the sandboxed command runs as nobody
SECRET = "tenant-a-secret-4f1c"
HOLD = "touch started; while [ ! -e release ]; do sleep 0.1; done"


@pytest.fixture
def folders(topology: Topology) -> Iterator[tuple[Path, Path]]:
    """Two working directories of nobody's, 0755, side by side in /var/tmp (a host folder every sandbox sees)."""
    root = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-tenants-", dir="/var/tmp"))
    made = (root / "a", root / "b")
    for folder in (root, *made):
        folder.mkdir(exist_ok=True)
        folder.chmod(0o755)
        os.chown(folder, NOBODY.pw_uid, NOBODY.pw_gid)
    yield made
    shutil.rmtree(root, ignore_errors=True)


def _run_argv(sandbox_id: str, workdir: Path, *cmd: str) -> list[str]:
    options = ["--policy", E2E_POLICY, "--upstream-dns", DNS_SERVER, "--sandbox-id", sandbox_id]
    return with_host_cgroups([AIRLOCK, "run", *options, "--workdir", str(workdir), "--timeout", "60", "--", *cmd])


def _start_holder(topology: Topology, sandbox_id: str, workdir: Path) -> subprocess.Popen:
    """A run whose command waits in `workdir` until released, once it is entered among the running gateways."""
    proc = topology.popen(topology.gw, _run_argv(sandbox_id, workdir, "sh", "-c", HOLD), stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not any(str(workdir) in entry.folders for entry in running()):
        assert proc.poll() is None and time.monotonic() < deadline, "the first run did not start"
        time.sleep(0.05)
    return proc


def _release(proc: subprocess.Popen, workdir: Path) -> None:
    (workdir / "release").touch()
    proc.wait(timeout=30)


def test_a_sandbox_cannot_read_the_working_directory_of_one_running_before_it(
    topology: Topology, folders: tuple[Path, Path]
):
    first, second = folders
    (first / "secret.txt").write_text(SECRET)
    holder = _start_holder(topology, f"{topology.prefix}ta", first)
    try:
        script = f"cat {first}/secret.txt; ls -A {first}; echo mine > {second}/mine.txt; cat {second}/mine.txt"
        seen = topology.run(topology.gw, _run_argv(f"{topology.prefix}tb", second, "sh", "-c", script), timeout=90)
    finally:
        _release(holder, first)
    assert SECRET not in seen.stdout, seen.stdout
    assert f"cat: {first}/secret.txt: No such file or directory" in seen.stderr, seen.stderr
    assert seen.stdout == "mine\n", seen.stdout  # an empty folder there; its own working directory as ever
    assert (first / "secret.txt").read_text() == SECRET and (second / "mine.txt").read_text() == "mine\n"
    # With the first gone, nothing is hidden: the folder is the host's, read-only, as before.
    after = topology.run(topology.gw, _run_argv(f"{topology.prefix}tc", second, "cat", f"{first}/secret.txt"))
    assert after.stdout == SECRET, after.stderr


def test_a_sandbox_whose_working_directory_is_inside_a_running_ones_shares_it_and_is_told(
    topology: Topology, folders: tuple[Path, Path]
):
    first, _ = folders
    inner = first / "inner"
    inner.mkdir()
    os.chown(inner, NOBODY.pw_uid, NOBODY.pw_gid)
    (first / "secret.txt").write_text(SECRET)
    holder = _start_holder(topology, f"{topology.prefix}td", first)
    try:
        argv = _run_argv(f"{topology.prefix}te", inner, "sh", "-c", f"cat {first}/secret.txt; echo x > made")
        seen = topology.run(topology.gw, argv, timeout=90)
    finally:
        _release(holder, first)
    assert seen.returncode == 0 and seen.stdout == SECRET, seen.stderr
    assert (inner / "made").read_text() == "x\n"
    assert (
        f"airlock: {inner} is within {first}, a folder of another running sandbox (airlock run, sandbox "
        f"{topology.prefix}td, pid {holder.pid}): the two share it"
    ) in seen.stderr, seen.stderr
