"""`airlock run` end to end. It runs *inside* the test's gateway namespace, so its embedded gateway, its
sandbox namespace and its fence live where everything it dials lands in the fake internet or nowhere."""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway_proc import AIRLOCK, E2E_POLICY
from topology import DNS_SERVER, FakeNet, Topology

ALLOWED_IP = "192.0.2.10"
_counter = itertools.count()


def _netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.fixture
def run_in_gw(topology: Topology, fakenet: FakeNet) -> Iterator:
    """`airlock run` inside the gateway namespace; checks afterwards that it left nothing behind."""
    ids: list[str] = []

    def run(*cmd: str, options: tuple[str, ...] = (), timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        sandbox_id = f"{topology.prefix}r{next(_counter)}"
        ids.append(sandbox_id)
        argv = [
            AIRLOCK, "run", "--policy", E2E_POLICY, "--upstream-dns", DNS_SERVER, "--sandbox-id", sandbox_id,
            *options, "--", *cmd,
        ]  # fmt: skip
        return topology.run(topology.gw, argv, timeout=timeout, **kw)

    yield run
    for sandbox_id in ids:
        assert (
            f"airlock-{sandbox_id}"
            not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        )
        tables = topology.run(topology.gw, ["nft", "list", "tables"]).stdout
        assert f"airlock_{sandbox_id}" not in tables
        links = topology.run(topology.gw, ["ip", "-o", "link"]).stdout
        assert f"alh{sandbox_id}" not in links


def test_run_fetches_an_allowed_url_through_the_gateway(run_in_gw, fakenet: FakeNet):
    result = run_in_gw("curl", "-sS", "--max-time", "10", "http://allowed.test/from-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/from-run\n"
    assert fakenet.connections(ALLOWED_IP, 80) == 1


def test_run_denies_an_unlisted_host(run_in_gw, fakenet: FakeNet):
    result = run_in_gw("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "http://evil.test/")
    assert result.stdout == "403"
    assert fakenet.total_connections() == 0


def test_run_passes_the_exit_code_through(run_in_gw):
    assert run_in_gw("sh", "-c", "exit 7").returncode == 7


def test_run_drops_root_and_capabilities(run_in_gw):
    result = run_in_gw("sh", "-c", "id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status")
    lines = result.stdout.split()
    assert lines[0] == "65534"  # nobody: run as root without sudo, no invoking user to return to
    assert "0000000000000000" in result.stdout and lines[-1] == "1"
    assert lines.count("0000000000000000") == 2


def test_run_cannot_enter_the_host_network_namespace(run_in_gw, fakenet: FakeNet):
    result = run_in_gw("nsenter", "--net=/proc/1/ns/net", "curl", "-s", "--noproxy", "*", "http://192.0.2.10/")
    assert result.returncode != 0
    assert "Permission denied" in result.stderr or "Operation not permitted" in result.stderr, result.stderr
    # A new user namespace gives capabilities only over namespaces it creates itself: an empty network.
    escape = "curl -sS --max-time 3 --noproxy '*' http://192.0.2.10/ || echo NO-NETWORK"
    result = run_in_gw("unshare", "--net", "--map-root-user", "sh", "-c", escape)
    assert "NO-NETWORK" in result.stdout, (result.stdout, result.stderr)
    assert fakenet.total_connections() == 0


def test_run_has_no_direct_route_out(run_in_gw, fakenet: FakeNet):
    result = run_in_gw("sh", "-c", "ip route; curl -sS --noproxy '*' --max-time 3 http://192.0.2.10/ || echo BLOCKED")
    assert "default" not in result.stdout and "BLOCKED" in result.stdout
    assert fakenet.total_connections() == 0


def test_run_tears_down_on_interrupt(topology: Topology, run_in_gw):
    sandbox_id = f"{topology.prefix}int"
    proc = topology.popen(
        topology.gw,
        [AIRLOCK, "run", "--policy", E2E_POLICY, "--upstream-dns", DNS_SERVER, "--sandbox-id", sandbox_id,
         "--", "sleep", "60"],
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while f"airlock-{sandbox_id}" not in _netns_list():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(20) != 0
    assert f"airlock-{sandbox_id}" not in _netns_list()
    assert f"airlock_{sandbox_id}" not in topology.run(topology.gw, ["nft", "list", "tables"]).stdout


def test_run_sees_the_host_read_only_with_a_private_tmp(run_in_gw, tmp_path):
    marker = f"airlock-plant-{tmp_path.name}"
    result = run_in_gw("sh", "-c", f"touch /etc/planted; echo x > /tmp/{marker} && echo TMP-OK; echo pid=$$")
    assert "Read-only file system" in result.stderr and "TMP-OK" in result.stdout
    assert not (Path("/tmp") / marker).exists()  # the sandbox's /tmp is its own, gone with it
    assert int(result.stdout.split("pid=")[1]) < 10  # its own PID namespace: host processes are invisible
    assert "filesystem isolation bwrap" in result.stderr


def test_run_without_filesystem_isolation_when_asked(run_in_gw):
    result = run_in_gw("sh", "-c", "echo pid=$$", options=("--isolation", "none"))
    assert result.returncode == 0 and int(result.stdout.split("pid=")[1]) > 10
    assert "filesystem isolation none" in result.stderr


def test_run_hides_the_gateways_credentials_even_from_their_owner(run_in_gw, broker_args, topology: Topology):
    # The command's user owns the key (as whoever ran sudo owns app.pem in their project), and the key sits in
    # the working directory, which the command may write: still, it reads nothing.
    project = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-project-", dir="/var/tmp"))
    try:
        project.chmod(0o755)
        key = project / "app.pem"
        original = Path(broker_args[broker_args.index("--github-app-key") + 1])
        key.write_bytes(original.read_bytes())
        nobody = pwd.getpwnam("nobody")
        os.chown(key, nobody.pw_uid, nobody.pw_gid)
        key.chmod(0o600)
        args = list(broker_args)
        args[args.index("--github-app-key") + 1] = str(key)
        secret_line = original.read_text().splitlines()[1]

        hidden = run_in_gw("sh", "-c", "cat app.pem; echo rc=$?; ls", options=tuple(args), cwd=project)
        assert "rc=1" in hidden.stdout and "app.pem: Permission denied" in hidden.stderr, hidden.stderr
        assert "app.pem" in hidden.stdout  # still listed: only its content is gone
        assert secret_line not in hidden.stdout + hidden.stderr

        exposed = run_in_gw("cat", "app.pem", options=(*args, "--isolation", "none"), cwd=project)
        assert exposed.returncode == 2 and secret_line not in exposed.stdout
        assert "app.pem is readable or writable by nobody" in exposed.stderr
    finally:
        shutil.rmtree(project)


def test_run_hides_the_users_session_services(run_in_gw, topology: Topology):
    # Whoever has a session has services at /run/user/UID (systemd --user, dbus, rootless docker) that would start
    # processes in the host's network namespace: the sandbox must not reach them.
    session = Path("/run/user") / str(pwd.getpwnam("nobody").pw_uid)
    created = not session.exists()
    session.mkdir(parents=True, exist_ok=True)
    marker = session / f"{topology.prefix}-bus"
    try:
        marker.write_text("a session service")
        seen = run_in_gw("sh", "-c", f"ls /run/user; cat {marker}; echo done")
        assert "done" in seen.stdout and "a session service" not in seen.stdout, seen
        assert str(session.name) not in seen.stdout.split()

        refused = run_in_gw("true", options=("--isolation", "none"))
        assert refused.returncode == 2 and "has a session" in refused.stderr, refused.stderr
    finally:
        marker.unlink(missing_ok=True)
        if created:
            session.rmdir()
