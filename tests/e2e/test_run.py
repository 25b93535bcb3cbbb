"""`airlock run` end to end. It runs *inside* the test's gateway namespace, so its embedded gateway, its
sandbox namespace and its fence live where everything it dials lands in the fake internet or nowhere."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from airlock.sandbox.cgroups import host_parents
from airlock.sandbox.fence import NETNS_TABLE_PREFIX
from airlock.sandbox.netns import NetnsSandbox
from airlock.verify.hostcgroups import with_host_cgroups
from airlock.verify.topology import DNS_SERVER, FakeNet, Topology

from gateway_proc import AIRLOCK, E2E_POLICY
from netclient import GATEWAY_PORTS, SENDER, ForeignListeners, in_netns

ALLOWED_IP = "192.0.2.10"
_counter = itertools.count()


def _netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


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
    # No new namespaces at all (the seccomp filter): not even a user namespace with an empty network of its own.
    escape = "curl -sS --max-time 3 --noproxy '*' http://192.0.2.10/ || echo NO-NETWORK"
    result = run_in_gw("unshare", "--net", "--map-root-user", "sh", "-c", escape)
    assert result.returncode == 1 and "unshare failed: Operation not permitted" in result.stderr, result
    assert fakenet.total_connections() == 0


def test_run_serves_clients_that_ignore_the_proxy_with_the_same_policy(run_in_gw, fakenet: FakeNet):
    script = (
        "ip route; curl -sS --noproxy '*' --max-time 5 http://allowed.test/direct; "
        "curl -sS --noproxy '*' --max-time 5 -o /dev/null -w 'literal %{http_code}\\n' http://192.0.2.10/"
    )
    result = run_in_gw("sh", "-c", script)
    assert "default via" in result.stdout, result.stdout  # to the gateway's side of the link, and only there
    assert "fakenet 192.0.2.10:80 host=allowed.test path=/direct" in result.stdout, result.stderr
    assert "literal 403" in result.stdout  # an IP literal no CIDR rule opens: judged, denied
    assert fakenet.connections("192.0.2.10", 80) == 1


# Back to back, QUIC to 50 ports, then the sandbox tries to turn the ICMP rate limit of its namespace back on.
UDP_BURST = """
import contextlib, socket, time
refused = 0
for port in range(20000, 20050):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(0.2)
        sock.connect(("192.0.2.10", port))
        started = time.perf_counter()
        with contextlib.suppress(PermissionError):
            sock.send(bytes(1200))
        try:
            sock.recv(1)
        except ConnectionRefusedError:
            refused += (time.perf_counter() - started) < 0.1
        except TimeoutError:
            pass
print("refused", refused)
for name in ("icmp_ratemask", "icmp_ratelimit"):
    try:
        with open(f"/proc/sys/net/ipv4/{name}", "w") as f:
            f.write("6168")
        print(name, "changed")
    except OSError as e:
        print(name, type(e).__name__)
"""


def test_run_refuses_back_to_back_udp_at_once_and_the_sandbox_cannot_restore_the_icmp_rate_limit(run_in_gw):
    result = run_in_gw("python3", "-I", "-c", UDP_BURST)
    assert "refused 50" in result.stdout, result.stdout + result.stderr
    assert "icmp_ratemask PermissionError" in result.stdout and "icmp_ratelimit PermissionError" in result.stdout


@pytest.mark.parametrize("options", [(), ("--transparent-port", "0")], ids=["transparent", "explicit"])
def test_run_links_the_sandbox_by_ipv4_alone(run_in_gw, options: tuple[str, ...]):
    """IPv6 off on every interface of the sandbox's namespace (its link's end included): no address, no route the
    fence does not describe."""
    script = "cat /proc/net/if_inet6; cat /proc/sys/net/ipv6/conf/*/disable_ipv6 | sort -u"
    result = run_in_gw("sh", "-c", script, options=options)
    assert (result.returncode, result.stdout) == (0, "1\n"), result.stderr


def test_run_in_explicit_mode_only_has_no_direct_route_out(run_in_gw, fakenet: FakeNet):
    script = "ip route; curl -sS --noproxy '*' --max-time 3 http://192.0.2.10/ || echo BLOCKED"
    result = run_in_gw("sh", "-c", script, options=("--transparent-port", "0"))
    assert "default" not in result.stdout and "BLOCKED" in result.stdout
    assert fakenet.total_connections() == 0


def _run_argv(sandbox_id: str, *cmd: str) -> list[str]:
    options = ["--policy", E2E_POLICY, "--upstream-dns", DNS_SERVER, "--sandbox-id", sandbox_id]
    return with_host_cgroups([AIRLOCK, "run", *options, "--", *cmd])


def _start_run(topology: Topology, sandbox_id: str, *cmd: str) -> subprocess.Popen:
    """`airlock run` in the background, in the gateway namespace (stopped by PID when the topology goes)."""
    return topology.popen(topology.gw, _run_argv(sandbox_id, *cmd))


def test_run_tears_down_on_interrupt(topology: Topology, run_in_gw):
    sandbox_id = f"{topology.prefix}int"
    proc = topology.popen(topology.gw, _run_argv(sandbox_id, "sleep", "60"), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while f"airlock-{sandbox_id}" not in _netns_list():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 130, stderr
    assert stderr.splitlines()[-1] == "airlock: stopped by SIGINT; the sandbox is removed", stderr
    assert f"airlock-{sandbox_id}" not in _netns_list()
    assert f"{NETNS_TABLE_PREFIX}{sandbox_id}" not in topology.run(topology.gw, ["nft", "list", "tables"]).stdout


def test_run_sees_the_host_read_only_with_a_private_tmp(run_in_gw, tmp_path):
    marker = f"airlock-plant-{tmp_path.name}"
    result = run_in_gw("sh", "-c", f"touch /etc/planted; echo x > /tmp/{marker} && echo TMP-OK; echo pid=$$")
    assert "Read-only file system" in result.stderr and "TMP-OK" in result.stdout
    assert not (Path("/tmp") / marker).exists()  # the sandbox's /tmp is its own, gone with it
    assert int(result.stdout.split("pid=")[1]) < 10  # its own PID namespace: host processes are invisible
    assert "filesystem isolation bwrap" in result.stderr


def test_run_without_filesystem_isolation_when_asked(run_in_gw, topology: Topology):
    folder = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-host-", dir="/var/tmp"))
    try:
        folder.chmod(0o755)
        (folder / "from-the-host").write_text("host file")
        # The host's files as its user sees them; still its own processes: nothing of the host's to ptrace or read.
        script = f"cat {folder / 'from-the-host'}; echo pid=$$; ls /proc | grep -c '^[0-9]'"
        result = run_in_gw("sh", "-c", script, options=("--isolation", "none"))
    finally:
        shutil.rmtree(folder)
    assert result.returncode == 0 and "host file" in result.stdout, result.stderr
    assert int(result.stdout.split("pid=")[1].split()[0]) < 10
    assert int(result.stdout.split()[-1]) < 10  # processes it can see
    assert "filesystem isolation none" in result.stderr


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
def test_run_leaves_no_process_behind(run_in_gw, isolation: str):
    marker = "987654.25"  # a sleep nobody else runs
    result = run_in_gw("sh", "-c", f"sleep {marker} & echo started", options=("--isolation", isolation))
    assert result.returncode == 0 and "started" in result.stdout, result.stderr
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p) == ["sleep", marker]]
    assert left == [], "a background process of the sandbox outlived it"


def _cmdline(proc: Path) -> list[str]:
    try:
        return proc.joinpath("cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def test_files_in_the_working_directory_that_run_later_are_read_only(run_in_gw, topology: Topology):
    project = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-repo-", dir="/var/tmp"))
    try:
        (project / ".git" / "hooks").mkdir(parents=True)
        (project / ".git" / "config").write_text("[core]\n")
        (project / ".envrc").write_text("")
        (project / "src.py").write_text("")
        for path in (project, project / ".git", project / ".git" / "hooks"):
            path.chmod(0o777)  # the command's user may write all of it by the permissions
        for path in (project / ".git" / "config", project / ".envrc", project / "src.py"):
            path.chmod(0o666)
        script = (
            "echo x >> src.py && echo SRC-OK; echo fsmonitor >> .git/config && echo CONFIG-WRITTEN; "
            "touch .git/hooks/pre-commit && echo HOOK-WRITTEN; echo x >> .envrc && echo ENVRC-WRITTEN"
        )
        result = run_in_gw("sh", "-c", script, cwd=project)
        assert "SRC-OK" in result.stdout, result.stderr
        assert "ENVRC-WRITTEN" not in result.stdout, result.stdout
        # git's folder is the sandbox's to write, in a private layer of its own: the real one is as it was.
        assert "CONFIG-WRITTEN" in result.stdout and "HOOK-WRITTEN" in result.stdout, result.stdout
        assert (project / ".git" / "config").read_text() == "[core]\n"
        assert not (project / ".git/hooks/pre-commit").exists()
    finally:
        shutil.rmtree(project)


def test_run_refuses_a_system_folder_as_the_working_directory(run_in_gw):
    result = run_in_gw("true", cwd="/var/tmp")
    assert result.returncode == 2 and "system folders" in result.stderr, result.stderr
    assert "run it from a folder of its own (mkdir -p /var/tmp/work && cd /var/tmp/work)" in result.stderr


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


def test_a_policy_in_the_working_directory_is_refused(run_in_gw, topology: Topology):
    """Bound read-only, the file would still be the sandbox's once an editor saved it by renaming a new file over it
    (the bind stays with the old file) — and the folder around it is the sandbox's anyway: refused before anything
    runs (tests/e2e/test_run_inputs.py has the attacks)."""
    project = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-pol-", dir="/var/tmp"))
    try:
        project.chmod(0o777)
        policy = project / "policy.yaml"
        policy.write_text(E2E_POLICY.read_text())
        # This run's policy is the one in its working directory (the last --policy wins over run_in_gw's).
        result = run_in_gw("sh", "-c", "echo RAN", cwd=project, options=("--policy", str(policy)))
        assert result.returncode == 2 and "RAN" not in result.stdout, result
        assert f"airlock: --policy {policy}: the sandbox may write {project}, a folder on its way" in result.stderr
    finally:
        shutil.rmtree(project)


def test_a_second_run_with_a_taken_id_fails_and_leaves_the_first_alone(topology: Topology, run_in_gw):
    sandbox_id = f"{topology.prefix}dup"
    first = _start_run(topology, sandbox_id, "sleep", "60")
    try:
        deadline = time.monotonic() + 20
        table = f"{NETNS_TABLE_PREFIX}{sandbox_id}"
        while table not in topology.run(topology.gw, ["nft", "list", "tables"]).stdout:
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.1)
        second = topology.run(topology.gw, _run_argv(sandbox_id, "true"), timeout=60)
        assert second.returncode == 2, second.stderr
        # The first sandbox is whole: its namespace, its fence, its command.
        assert f"airlock-{sandbox_id}" in _netns_list()
        assert table in topology.run(topology.gw, ["nft", "list", "tables"]).stdout
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(20)
    assert f"airlock-{sandbox_id}" not in _netns_list()


def test_run_timeout_kills_the_whole_sandbox(run_in_gw):
    marker = "987653.5"
    started = time.monotonic()
    result = run_in_gw("sh", "-c", f"sleep {marker} & sleep {marker}", options=("--timeout", "2"))
    assert result.returncode == 124 and "timeout" in result.stderr, result.stderr
    assert time.monotonic() - started < 30
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p) == ["sleep", marker]]
    assert left == []


def test_docker_only_options_are_refused_for_the_netns_backend(run_in_gw):
    result = run_in_gw("true", options=("--mount", "/usr/share:/data"))
    assert result.returncode == 2 and "--mount: docker backend only" in result.stderr, result.stderr


def _pids_with(marker: str) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and marker in _cmdline(p)]


def _started(argv: tuple[str, ...]) -> bool:
    """Whether a process runs `argv` itself (not a launcher or wrapper whose command line holds it)."""
    return any(p.name.isdigit() and tuple(_cmdline(p)) == argv for p in Path("/proc").iterdir())


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
def test_a_killed_launcher_leaves_no_sandbox_and_no_way_to_another_program_on_its_ports(
    topology: Topology, run_in_gw, isolation: str, shared_gateway_stopped: None
):
    # bubblewrap's --die-with-parent ends only the command (and without bubblewrap nothing would): the watchdog
    # removes the rest, and until it has, the fence lets nothing reach a program that took the gateway's ports.
    sandbox_id = f"{topology.prefix}k{isolation[0]}"
    marker = f"airlock-sender-{sandbox_id}"
    argv = _run_argv(sandbox_id, "python3", "-c", SENDER, marker)
    argv[argv.index("--") : argv.index("--")] = ["--isolation", isolation, "--timeout", "120"]
    launcher = topology.popen(topology.gw, argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not _sending(launcher, marker):
            assert time.monotonic() < deadline and launcher.poll() is None, "the sandbox did not start"
            time.sleep(0.1)
        time.sleep(1)  # it is sending to the gateway
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        with ForeignListeners(topology.gw, GATEWAY_PORTS["tcp"], GATEWAY_PORTS["udp"]) as foreign:
            while left := _what_is_left(topology, sandbox_id, marker):
                assert time.monotonic() - killed < 5, f"the sandbox outlived its launcher: {left}"
                time.sleep(0.05)
            time.sleep(1)
            assert foreign.received == {}
        _, stderr = launcher.communicate(timeout=30)  # its stderr closes once the watchdog has exited
        assert f"netns sandbox {sandbox_id} removed: its launcher is gone" in stderr, stderr
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _pids_with(marker):  # only after a failure: the sandbox this test started
            os.kill(pid, signal.SIGKILL)
        leftover = NetnsSandbox(sandbox_id)
        leftover.owned = True
        in_netns(topology.gw, leftover.destroy)


def _sending(launcher: subprocess.Popen, marker: str) -> bool:
    """Whether the sandbox's command runs: a process naming the marker in another network namespace than the
    launcher's (which names it too, in its argv)."""
    with contextlib.suppress(OSError):
        outside = os.stat(f"/proc/{launcher.pid}/ns/net").st_ino
        others = [pid for pid in _pids_with(marker) if pid != launcher.pid]  # it enters the gateway's on its way
        return any(os.stat(f"/proc/{pid}/ns/net").st_ino != outside for pid in others)
    return False


def _what_is_left(topology: Topology, sandbox_id: str, marker: str) -> list[str]:
    tables = topology.run(topology.gw, ["nft", "list", "tables"]).stdout
    links = topology.run(topology.gw, ["ip", "-o", "link"]).stdout
    found = {
        "processes": bool(_pids_with(marker)),
        "namespace": f"airlock-{sandbox_id}" in _netns_list(),
        "fence": f"{NETNS_TABLE_PREFIX}{sandbox_id}" in tables,
        "link": f"alh{sandbox_id}" in links,
        "cgroup": any((parent / sandbox_id).exists() for parent, _ in host_parents().values()),
    }
    return [what for what, there in found.items() if there]


# `airlock reap` takes every empty sandbox namespace older than this on the host: runs of others still starting (a
# namespace without a process yet) are younger.
REAP_AGE = 10


def test_reap_removes_what_a_killed_launcher_and_watchdog_left_cgroup_included_and_nothing_of_a_live_sandbox(
    topology: Topology, fakenet: FakeNet
):
    # SIGKILL for both: nothing removes the sandbox; its command dies with its launcher (bubblewrap), so what is
    # left is empty (namespace, fence, cgroup) for `airlock reap` to find, beside a live sandbox it must not touch.
    dead, live = f"{topology.prefix}rd", f"{topology.prefix}rl"
    marker = f"airlock-reaped-{dead}"
    sleeper = ("python3", "-c", "import time; time.sleep(600)", marker)
    launchers = [_start_run(topology, dead, *sleeper), _start_run(topology, live, "sleep", "60")]
    try:
        deadline = time.monotonic() + 30
        # The command itself running, not only its cgroup holding a process: before bubblewrap has started it with
        # --die-with-parent, a launcher killed with its watchdog leaves a process that nothing else would end.
        while not (_started(sleeper) and all(_cgroup_processes(sandbox_id) for sandbox_id in (dead, live))):
            assert time.monotonic() < deadline and all(p.poll() is None for p in launchers), "no sandbox started"
            time.sleep(0.1)
        for pid in [*_watchdogs_of(launchers[0].pid), launchers[0].pid]:  # the watchdog first: it would act
            os.kill(pid, signal.SIGKILL)
        launchers[0].wait()
        deadline = time.monotonic() + 30  # its own: under load the starts above may have taken most of the first
        while _pids_with(marker) or _cgroup_processes(dead):
            assert time.monotonic() < deadline, "the command outlived its launcher"
            time.sleep(0.1)
        # (Here the namespace's mount lived in the launcher's mount namespace, `ip netns exec`'s: with it went the
        # namespace and its link; its name, fence and cgroup stay, as on a host.)
        assert {"namespace", "fence", "cgroup"} <= set(_what_is_left(topology, dead, marker))
        time.sleep(max(0.0, REAP_AGE + 1 - (time.time() - os.stat(f"/run/netns/airlock-{dead}").st_mtime)))
        reap = with_host_cgroups([AIRLOCK, "reap", "--older-than", f"{REAP_AGE}s"])
        result = topology.run(topology.gw, reap, timeout=60)
        assert f"removed netns {dead}" in result.stdout and f"removed cgroup {dead}" in result.stdout, result
        assert _what_is_left(topology, dead, marker) == []
        assert live not in result.stdout and _cgroup_processes(live)  # its groups hold its command, untouched
        assert f"airlock-{live}" in _netns_list() and launchers[1].poll() is None
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.send_signal(signal.SIGINT)
                launcher.wait(20)
        if _what_is_left(topology, dead, marker):  # only after a failure: the sandbox this test left
            for pid in _pids_with(marker):
                os.kill(pid, signal.SIGKILL)
            leftover = NetnsSandbox(dead)
            leftover.owned = True
            in_netns(topology.gw, leftover.destroy)
            for parent, _ in host_parents().values():
                with contextlib.suppress(OSError):
                    (parent / dead).rmdir()


def _cgroup_processes(sandbox_id: str) -> list[str]:
    """The pids in the sandbox's groups (as `airlock run` in this test's own groups makes them)."""
    found = []
    for parent, _ in host_parents().values():
        with contextlib.suppress(OSError):
            found += (parent / sandbox_id / "cgroup.procs").read_text().split()
    return found


def _watchdogs_of(launcher: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher:
                children.append(int(entry.name))
    found = [pid for pid in children if "airlock.launch.watchdog" in _cmdline(Path(f"/proc/{pid}"))]
    assert len(found) == 1, children
    return found


def test_a_user_who_cannot_write_the_working_directory_hears_it_before_the_start(run_in_gw, topology: Topology):
    # Root without sudo runs the command as nobody: in a folder only root may write, it is told how to fix it,
    # and the run goes on (a command that only reads is fine).
    folder = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-ro-", dir="/var/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in ("SUDO_UID", "SUDO_USER", "SUDO_GID")}
    try:
        folder.chmod(0o755)
        result = run_in_gw("sh", "-c", "echo READ-OK; touch here || echo WRITE-FAILED", cwd=folder, env=env)
        assert "READ-OK" in result.stdout and "WRITE-FAILED" in result.stdout, result.stderr
        note = next(line for line in result.stderr.splitlines() if "cannot write the working directory" in line)
        assert note.startswith("airlock: the command runs as nobody (airlock run as root, not through sudo)")
        assert f"{folder}: to let it, pass --user" in note and "make the folder writable for nobody" in note
        assert (
            result.stderr.index(note) < result.stderr.index("WRITE-FAILED") if "WRITE-FAILED" in result.stderr else True
        )
        folder.chmod(0o777)
        quiet = run_in_gw("touch", "here", cwd=folder, env=env)
        assert quiet.returncode == 0 and "cannot write" not in quiet.stderr, quiet.stderr
    finally:
        shutil.rmtree(folder)


BROKER_PROBE = 'gw=${HTTP_PROXY#http://}; curl -s -o /dev/null -w "%{http_code} " --noproxy "*" --max-time 2 '
BROKER_PROBE += '"http://${gw%:*}:8080/"; echo rc=$?'


def test_without_a_grant_no_broker_listens(run_in_gw):
    without = run_in_gw("sh", "-c", BROKER_PROBE)
    assert without.stdout.split()[-1] in ("rc=7", "rc=28"), without  # nothing to reach: the fence drops it
    granted = run_in_gw("sh", "-c", BROKER_PROBE, options=("--grant", "create_pull_request:acme/app"))
    assert granted.stdout.split() == ["401", "rc=0"], granted  # its broker answers (and asks for the token)


LAUNCH = """
import asyncio, sys
from airlock.cli.common import load_policy_file
from airlock.gateway.config import GatewayConfig
from airlock.launch.netns_launcher import launch
from airlock.gateway.config import GatewayConfig
from airlock.launch.netns_launcher import launch

async def main():
    config = GatewayConfig(load_policy_file(sys.argv[1]), "0.0.0.0", upstream_dns=[(sys.argv[2], 53)])
    async with await launch(
        ["sh", "-c", "curl -sS http://allowed.test/api; echo to-stderr >&2; exit 3"], config,
        sandbox_id=sys.argv[3], capture_output=True,
    ) as handle:
        code = await handle.wait(30)
        out, err = handle.logs()
    print(code, out.decode().strip(), err.decode().strip(), sep="|")

asyncio.run(main())
"""


def test_the_python_api_launches_a_netns_sandbox_as_a_handle(topology: Topology, fakenet: FakeNet):
    sandbox_id = f"{topology.prefix}api"
    argv = [sys.executable, "-c", LAUNCH, E2E_POLICY, DNS_SERVER, sandbox_id]
    result = topology.run(topology.gw, argv, timeout=60, cwd="/var/tmp/")
    assert "SandboxError: the working directory /var/tmp would be" in result.stderr  # the library refuses it too
    folder = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-api-", dir="/var/tmp"))
    try:
        folder.chmod(0o777)
        result = topology.run(topology.gw, argv, timeout=60, cwd=folder)
    finally:
        shutil.rmtree(folder)
    assert result.stdout.strip() == f"3|fakenet {ALLOWED_IP}:80 host=allowed.test path=/api|to-stderr", result.stderr
    assert f"airlock-{sandbox_id}" not in _netns_list()
    assert f"{NETNS_TABLE_PREFIX}{sandbox_id}" not in topology.run(topology.gw, ["nft", "list", "tables"]).stdout


def test_status_token_and_approvals_find_a_run_started_without_a_state_dir(topology: Topology, tmp_path: Path):
    """Its admin socket is in a temporary folder nobody is told of: the admin commands find it among the running
    gateways — one running, that one; two, each named; none, where they looked."""
    env = {**os.environ, "AIRLOCK_RUNS_DIR": str(tmp_path / "runs")}

    def admin(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([AIRLOCK, *args], capture_output=True, text=True, timeout=30, env=env)

    first, second = f"{topology.prefix}st1", f"{topology.prefix}st2"
    runs = [topology.popen(topology.gw, _run_argv(first, "sleep", "60"), stderr=subprocess.PIPE, env=env)]
    try:
        deadline = time.monotonic() + 20
        while f"sandbox   {first} " not in (status := admin("status")).stdout:
            assert runs[0].poll() is None and time.monotonic() < deadline, status
            time.sleep(0.2)
        assert f"from {E2E_POLICY}" in status.stdout.splitlines()[0], status.stdout
        [entry] = [json.loads(path.read_text()) for path in (tmp_path / "runs").glob("*.json")]
        assert entry["admin"].startswith("/tmp/airlock-run-") and entry["admin"].endswith("/admin.sock")
        assert admin("approvals", "list").stdout == "no request waits for approval\n"
        revoked = admin("token", "revoke", "--sandbox", first)  # no broker runs: the run was given no --grant
        assert revoked.stderr == (
            f"airlock: the gateway at {entry['admin']} runs no broker (airlock run starts one only with --grant)\n"
        )
        runs.append(topology.popen(topology.gw, _run_argv(second, "sleep", "60"), env=env))
        while (both := admin("status")).returncode == 0:
            assert time.monotonic() < deadline, both
            time.sleep(0.2)
        told = both.stderr.strip()
        assert told.startswith("airlock: 2 gateways run here, say which: --admin /tmp/airlock-run-"), told
        assert f"--admin {entry['admin']} for airlock run, sandbox {first}, pid {runs[0].pid}, since " in told, told
        assert f"airlock run, sandbox {second}, pid {runs[1].pid}" in told, told
        assert f"sandbox   {first} " in admin("status", "--admin", entry["admin"]).stdout
    finally:
        for proc in runs:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    gone = admin("status")
    assert gone.returncode == 2 and gone.stderr.startswith(
        f"airlock: no gateway runs here: none is entered in {tmp_path / 'runs'}, and none answers at "
    ), gone.stderr
