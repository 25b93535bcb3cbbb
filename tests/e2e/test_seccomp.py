"""The seccomp filter in the netns backend (both isolations): every call of airlock's list refused — calls an
unprivileged process may make where nothing filters them included — while ordinary work runs as before. The docker
backend's twin is in test_docker.py."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from airlock.verify import registry
from airlock.verify.topology import FakeNet, Topology

from syscalls import expected_in_a_sandbox, probe_argv, results

# Calls an unprivileged process makes successfully on a host without the filter, whatever its sysctls say.
UNFILTERED_OK = {"ptrace", "clone3", "personality", "keyctl", "kcmp", "name_to_handle_at", "clock_adjtime"}


def test_without_the_filter_an_unprivileged_process_makes_these_calls():
    argv = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--no-new-privs",
        *probe_argv("/usr/bin/python3"),
    ]
    found = results(subprocess.run(argv, capture_output=True, text=True, cwd="/", timeout=60).stdout)
    assert {label for label, got in found.items() if got == "ok"} >= UNFILTERED_OK, found


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
def test_every_listed_call_is_refused_in_the_sandbox(run_in_gw, topology: Topology, isolation: str):
    folder = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-sc-", dir="/var/tmp"))
    try:
        folder.chmod(0o777)
        probe = run_in_gw(*probe_argv(), options=("--isolation", isolation), cwd=folder)
        status = run_in_gw("grep", "-E", "^Seccomp", "/proc/self/status", options=("--isolation", isolation))
    finally:
        shutil.rmtree(folder)
    found = results(probe.stdout)
    assert len(found) > 50 and found == expected_in_a_sandbox(found), probe.stderr
    assert status.stdout.split() == ["Seccomp:", "2", "Seccomp_filters:", "1"], status.stdout


def test_the_sandbox_holds_no_copy_of_the_filters_descriptor(run_in_gw):
    result = run_in_gw("sh", "-c", "ls -l /proc/self/fd/ | grep -c memfd; true")
    assert result.stdout.strip() == "0", result


def test_no_new_namespaces_from_the_command_line(run_in_gw, fakenet: FakeNet):
    script = (
        "unshare -U true; echo user=$?; unshare -n true; echo net=$?; unshare --net --map-root-user "
        "curl -s --noproxy '*' --max-time 3 http://192.0.2.10/; echo mapped=$?"
    )
    result = run_in_gw("sh", "-c", script)
    assert result.stdout.split() == ["user=1", "net=1", "mapped=1"], result
    assert result.stderr.count("unshare failed: Operation not permitted") == 3, result.stderr
    assert fakenet.total_connections() == 0


def test_no_raw_sockets_and_no_mounts(run_in_gw):
    script = (
        "ping -c1 -W1 10.9.9.9 >/dev/null 2>&1 || echo PING-FAILED; mount -t tmpfs none /tmp 2>/dev/null || "
        "echo MOUNT-FAILED; python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)' "
        "2>/dev/null || echo RAW-FAILED"
    )
    assert run_in_gw("sh", "-c", script).stdout.split() == ["PING-FAILED", "MOUNT-FAILED", "RAW-FAILED"]


def _wheel(folder: Path) -> Path:
    """The fake registry's hand-built wheel (module `airlockdemo`), as a file in `folder`."""
    path = folder / "airlockdemo-1.0-py3-none-any.whl"
    path.write_bytes(registry.wheel())
    return path


WORK = """
set -e
python3 -m venv /tmp/venv
/tmp/venv/bin/pip install -q --no-index --no-cache-dir ./airlockdemo-1.0-py3-none-any.whl
/tmp/venv/bin/python -c 'import airlockdemo; print("pip", airlockdemo.ANSWER)'
git init -q repo && cd repo && echo hi > f && git add f
git -c user.name=a -c user.email=a@example.test commit -qm first && echo git $(git rev-list --count HEAD) && cd ..
printf '#include <stdio.h>\\nint main(void){puts("gcc ok");return 0;}\\n' > /tmp/hello.c
gcc -o /tmp/hello /tmp/hello.c 2>&1 && /tmp/hello
node -e 'require("fs").writeFileSync("/tmp/n", "x"); console.log("node", require("fs").readFileSync("/tmp/n", "utf8"))'
curl -sS --max-time 10 http://allowed.test/work
"""


def test_ordinary_work_still_runs(run_in_gw, topology: Topology, fakenet: FakeNet):
    folder = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-work-", dir="/var/tmp"))
    try:
        folder.chmod(0o777)
        _wheel(folder).chmod(0o644)
        # /tmp is the sandbox's own, writable and executable (bubblewrap's tmpfs): gcc and the venv live there.
        result = run_in_gw("sh", "-c", WORK, cwd=folder, timeout=120, options=("--memory", "1g"))
    finally:
        shutil.rmtree(folder)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "pip 42",
        "git 1",
        "gcc ok",
        "node x",
        "fakenet 192.0.2.10:80 host=allowed.test path=/work",
    ], result.stderr
