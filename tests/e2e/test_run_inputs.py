"""`airlock run` and the gateway's inputs: nothing the gateway reads or writes by path while the sandbox runs can be
swapped by the sandbox through a folder on its way. Each attack is typed in the sandbox as an agent would; the fake
internet counts what reached it."""

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

from airlock.verify.fakeca import FakeCA
from airlock.verify.hostcgroups import with_host_cgroups
from airlock.verify.topology import DNS_SERVER, FakeNet, Topology

from gateway_proc import AIRLOCK, E2E_POLICY

EVIL = ("203.0.113.66", 80)  # evil.test: in no policy of these tests
ALLOW_EVIL = "version: 1\\nprofiles:\\n  default:\\n    allow:\\n      - host: evil.test\\n        ports: [80]\\n"
NOBODY = pwd.getpwnam("nobody")  # the sandbox's user: the tests run as root without sudo


@pytest.fixture
def project(topology: Topology) -> Iterator[Path]:
    """A working directory the sandbox's user owns, as a project of its own."""
    folder = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-inputs-", dir="/var/tmp"))
    os.chown(folder, NOBODY.pw_uid, NOBODY.pw_gid)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def _users_folder(path: Path) -> Path:
    path.mkdir()
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    return path


# The sandbox moves the policy's folder away, puts one of its own in its place, and tries the unlisted host for
# three seconds (the file watch reloads within half a second).
SWAP_POLICY = (
    f"mv conf conf.old && mkdir conf && printf '{ALLOW_EVIL}' > conf/policy.yaml && echo SWAPPED; i=0; "
    "until curl -s -o /dev/null -f --max-time 2 http://evil.test/; do i=$((i+1)); [ $i -ge 30 ] && break; "
    "sleep 0.1; done; echo DONE"
)


def test_the_sandbox_cannot_swap_its_policy_through_the_policys_folder(run_in_gw, fakenet: FakeNet, project: Path):
    policy = _users_folder(project / "conf") / "policy.yaml"
    policy.write_text(E2E_POLICY.read_text())
    result = run_in_gw("sh", "-c", SWAP_POLICY, cwd=project, options=("--policy", str(policy)))
    assert fakenet.connections(*EVIL) == 0, result.stderr
    assert "policy reloaded" not in result.stderr
    assert result.returncode == 2 and "SWAPPED" not in result.stdout, result
    assert result.stderr.splitlines()[-1] == (
        f"airlock: --policy {policy}: the sandbox may write {project}, a folder on its way, and could put something "
        f"else in its place: keep the gateway's files outside the working directory {project}"
    ), result.stderr


# The sandbox moves the audit log's folder away and puts a symlink to a folder of root's in its place, then makes
# the gateway write audit lines (denials) for a second.
SWAP_AUDIT = (
    "mv logs logs.old && ln -s {target} logs && echo SWAPPED; "
    "for i in 1 2 3 4 5; do curl -s -o /dev/null --max-time 2 http://evil.test/sandbox-chosen-$i; sleep 0.2; done"
)


def test_the_sandbox_cannot_send_the_audit_log_into_a_folder_of_its_choice(
    run_in_gw, fakenet: FakeNet, project: Path, topology: Topology
):
    audit = _users_folder(project / "logs") / "audit.jsonl"
    root_only = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-rootonly-", dir="/var/tmp"))
    try:
        root_only.chmod(0o700)
        script = SWAP_AUDIT.format(target=root_only)
        result = run_in_gw("sh", "-c", script, cwd=project, options=("--audit", str(audit)))
        assert list(root_only.iterdir()) == [], result.stderr
    finally:
        shutil.rmtree(root_only)
    assert fakenet.connections(*EVIL) == 0
    assert result.returncode == 2 and "SWAPPED" not in result.stdout, result
    assert result.stderr.splitlines()[-1].startswith(
        f"airlock: --audit {audit}: the sandbox may write {project}, a folder on its way"
    ), result.stderr


@pytest.mark.parametrize("option", ["--state-dir", "--call-log", "--upstream-ca"])
def test_every_input_the_gateway_uses_while_the_sandbox_runs_is_refused_where_the_sandbox_could_swap_it(
    run_in_gw, project: Path, test_ca: FakeCA, option: str
):
    folder = _users_folder(project / "gateway")
    if option == "--upstream-ca":
        path = folder / "ca.pem"
        shutil.copyfile(test_ca.ca_cert, path)
    else:
        path = folder / "state"
    grant = ("--grant", "create_pull_request:acme/app") if option == "--call-log" else ()  # a broker writes it
    result = run_in_gw("sh", "-c", "echo RAN", cwd=project, options=(option, str(path), *grant))
    assert result.returncode == 2 and "RAN" not in result.stdout, result
    assert result.stderr.splitlines()[-1].startswith(
        f"airlock: {option} {path}: the sandbox may write {project}, a folder on its way"
    ), result.stderr


def test_inputs_outside_the_sandboxs_reach_are_used(run_in_gw, project: Path, tmp_path: Path):
    state, audit = tmp_path / "state", tmp_path / "audit.jsonl"
    options = ("--state-dir", str(state), "--audit", str(audit))
    result = run_in_gw("sh", "-c", "curl -s -o /dev/null http://evil.test/; echo RAN", cwd=project, options=options)
    assert result.returncode == 0 and result.stdout == "RAN\n", result.stderr
    assert state.is_dir() and '"host":"evil.test"' in audit.read_text()


INSPECTED = """\
version: 1
profiles:
  default:
    allow:
      - host: allowed.test
        ports: [443]
        inspect: true
        inject:
          - {header: Authorization, value: "Bearer {secret:model_api}"}
"""
NOT_YET = "version: 1\nprofiles:\n  default:\n    allow:\n      - host: other.test\n        ports: [443]\n"
SECRET = "sk-airlock-inputs-5b1d9e3f7a2c4680"
# The sandbox replaces the folder of the secret's file with one holding a value of its choice, says so, then asks
# the inspected host until a reload inspects it.
SWAP_SECRET = (
    "mv keys keys.old && mkdir keys && echo sk-chosen-by-the-sandbox > keys/model_api && touch swapped; i=0; "
    "until curl -sk -o /dev/null -f --max-time 2 https://allowed.test/headers; do i=$((i+1)); "
    "[ $i -ge 100 ] && exit 3; sleep 0.1; done; echo INSPECTED"
)


def test_a_secret_is_read_once_at_start_never_again_from_a_folder_the_sandbox_replaced(
    topology: Topology, fakenet: FakeNet, test_ca: FakeCA, project: Path, tmp_path: Path
):
    secret = _users_folder(project / "keys") / "model_api"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)  # root's: the sandbox reads nothing of it (and it is hidden there anyway)
    policy = tmp_path / "policy.yaml"
    policy.write_text(NOT_YET)  # allowed.test not allowed yet: no request reaches it before the reload
    argv = [
        AIRLOCK, "run", "--policy", str(policy), "--upstream-dns", DNS_SERVER, "--upstream-ca", str(test_ca.ca_cert),
        "--sandbox-id", f"{topology.prefix}sec", "--secret", f"model_api=file:{secret}", "--",
        "sh", "-c", SWAP_SECRET,
    ]  # fmt: skip
    launcher = topology.popen(
        topology.gw, with_host_cgroups(argv), cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not (project / "swapped").exists():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.05)
    edit = tmp_path / "policy.yaml.new"
    edit.write_text(INSPECTED)
    edit.replace(policy)  # the operator's edit, whole at once: the reload makes the gateway inject the secret
    stdout, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 0 and "INSPECTED" in stdout, stderr
    seen = [r for r in fakenet.http_requests() if r["target"] == "/headers"]
    assert seen and all(
        [v for k, v in r["headers"] if k.lower() == "authorization"] == [f"Bearer {SECRET}"] for r in seen
    ), seen


# The sandbox says it runs, then waits (at most 10 s) for the test to let it end.
WAIT = "touch started; i=0; while [ ! -e finish ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; echo ENDED"


def test_a_reload_naming_a_file_the_sandbox_could_swap_is_refused_and_the_running_policy_stays(
    topology: Topology, project: Path, tmp_path: Path
):
    tool = _users_folder(project / "tools") / "lookup"
    policy = tmp_path / "policy.yaml"
    policy.write_text(E2E_POLICY.read_text())
    argv = [
        AIRLOCK, "run", "--policy", str(policy), "--upstream-dns", DNS_SERVER, "--sandbox-id", f"{topology.prefix}tl",
        "--", "sh", "-c", WAIT,
    ]  # fmt: skip
    launcher = topology.popen(
        topology.gw, with_host_cgroups(argv), cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not (project / "started").exists():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.05)
    # The operator's edit declares a tool whose program lies in the sandbox's working directory.
    policy.write_text(E2E_POLICY.read_text() + f"tools:\n  - name: lookup\n    description: d\n    argv: [{tool}]\n")
    time.sleep(1.5)  # the file watch looks every 0.1 s and reads a file that stayed unchanged for 0.2 s
    (project / "finish").touch()
    stdout, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 0 and "ENDED" in stdout, stderr
    told = [line for line in stderr.splitlines() if line.startswith("airlock: policy")]
    line = len(E2E_POLICY.read_text().splitlines()) + 2
    assert told == [
        f"airlock: policy NOT reloaded, the running policy stays: tool lookup ({policy}:{line}): its command {tool}: "
        f"the sandbox may write {project}, a folder on its way, and could put something else in its place: keep the "
        f"gateway's files outside the working directory {project}"
    ], stderr


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
def test_a_folder_of_the_sandboxs_user_outside_the_working_directory_counts_only_without_bubblewrap(
    run_in_gw, topology: Topology, project: Path, isolation: str
):
    """The policy's own folder and file are root's, the folder above them the sandbox's user's: with bubblewrap the
    host outside the working directory is read-only to the command, without it that user may rename its folder in
    /var/tmp (sticky, but the folder is that user's) and put another in its place."""
    host = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-host-", dir="/var/tmp"))
    try:
        os.chown(host, NOBODY.pw_uid, NOBODY.pw_gid)
        (host / "conf").mkdir(mode=0o755)
        policy = host / "conf" / "policy.yaml"
        policy.write_text(E2E_POLICY.read_text())
        options = ("--policy", str(policy), "--isolation", isolation)
        result = run_in_gw("sh", "-c", "echo RAN", cwd=project, options=options)
    finally:
        shutil.rmtree(host)
    if isolation == "bwrap":
        assert result.returncode == 0 and result.stdout == "RAN\n", result.stderr
    else:
        assert result.returncode == 2 and "RAN" not in result.stdout, result
        assert result.stderr.splitlines()[-1] == (
            f"airlock: --policy {policy}: nobody, who runs the sandboxed command, may write /var/tmp, a folder on its "
            "way, and could put something else in its place: keep the gateway's files in folders only root may "
            "change, or use bubblewrap"
        ), result.stderr
