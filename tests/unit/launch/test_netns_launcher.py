"""The netns launcher's checks before anything exists, and what `airlock run` hands it."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import pwd
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest

import airlock.configs
from airlock.cli import build_parser
from airlock.cli.common import default_policy_path
from airlock.cli.run import run_config
from airlock.gateway import GatewayError
from airlock.gateway.config import BrokerConfig, GatewayConfig
from airlock.inspection.trust import SYSTEM_BUNDLE
from airlock.launch import netns_launcher, preflight
from airlock.launch.preflight import airlock_code, gateway_inputs, unwritable_workdir
from airlock.policy import load_policy, parse_policy
from airlock.sandbox import netns
from airlock.sandbox.errors import SandboxError

POLICY = "version: 1\nprofiles:\n  default:\n    allow:\n      - host: pypi.org\n"


def _agent(tmp_path: Path) -> pwd.struct_passwd:
    return pwd.struct_passwd(("agent", "x", 4242, 4242, "", str(tmp_path / "home"), "/bin/sh"))


@pytest.mark.parametrize(
    ("owner", "mode", "named", "sudo", "told"),
    [
        (0, 0o755, False, None, "the command runs as agent (airlock run as root, not through sudo), who cannot"),
        (0, 0o755, True, None, "the command runs as agent, who cannot write"),  # --user named it: no reason to add
        (0, 0o755, False, "1000", "the command runs as agent, who cannot write"),
        (0, 0o777, False, None, None),
        (0, 0o1733, False, None, None),  # like /tmp: writable and searchable
        (4242, 0o755, False, None, None),
        (4242, 0o555, False, None, "cannot write the working directory"),
    ],
)
def test_a_user_who_cannot_write_the_working_directory_is_told_how_to_fix_it(
    privileged: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    owner: int, mode: int, named: bool, sudo: str | None, told: str | None,
) -> None:  # fmt: skip
    folder = tmp_path / "project"
    folder.mkdir()
    os.chown(folder, owner, owner)
    folder.chmod(mode)
    monkeypatch.chdir(folder)
    monkeypatch.delenv("SUDO_UID", raising=False)
    if sudo:
        monkeypatch.setenv("SUDO_UID", sudo)
    note = unwritable_workdir(_agent(tmp_path), named)
    if told is None:
        assert note is None
    else:
        assert note is not None and told in note and str(folder) in note, note
        assert note.endswith("pass --user with an account that may, or make the folder writable for agent")


def test_the_note_comes_before_anything_is_created(
    privileged: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    folder = tmp_path / "root-only"
    folder.mkdir(mode=0o755)
    monkeypatch.chdir(folder)
    monkeypatch.delenv("SUDO_UID", raising=False)
    events: list[str] = []

    def create(self: netns.NetnsSandbox) -> None:
        events.append("create")
        raise SandboxError("stop here")

    monkeypatch.setattr(netns.NetnsSandbox, "create", create)
    monkeypatch.setattr(preflight, "read_only_binds", lambda *args: [])
    config = GatewayConfig(parse_policy(POLICY), "0.0.0.0")

    async def launch() -> None:
        await netns_launcher.launch(["true"], config, isolation="none", report=events.append)

    with pytest.raises(SandboxError, match="stop here"):
        asyncio.run(launch())
    assert len(events) == 2 and "the command runs as nobody" in events[0] and events[1] == "create"


def test_the_gateways_inputs_come_from_its_config(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    config = GatewayConfig(
        load_policy(path), "0.0.0.0", upstream_ca="/ca.pem", audit_path=str(tmp_path / "a.log"), state_dir="/st",
        admin=str(tmp_path / "admin.sock"), policy_path=str(path), broker=BrokerConfig(port=8080, call_log="/calls"),
    )  # fmt: skip
    code = [("airlock's own code", str(p)) for p in airlock_code()]
    system = [("the system's CA bundle", str(SYSTEM_BUNDLE))] if SYSTEM_BUNDLE.exists() else []
    assert gateway_inputs(config) == [
        ("--policy", str(path)), ("--upstream-ca", "/ca.pem"), ("--audit", str(tmp_path / "a.log")),
        ("--state-dir", "/st"), ("--call-log", "/calls"), ("--admin", str(tmp_path / "admin.sock")),
        *system, *code,
    ]  # fmt: skip
    assert str(Path(str(airlock.configs.__file__)).parent) in [p for _, p in code]  # the packaged policies
    # Not read from a file; no broker, so no call log; the admin listener on loopback.
    bare = GatewayConfig(parse_policy(POLICY), "0.0.0.0", admin="127.0.0.1:9999", broker=BrokerConfig(port=0))
    assert gateway_inputs(bare) == [*system, *code]


@pytest.mark.parametrize(("grants", "port"), [((), 0), (("--grant", "create_pull_request:acme/app"), 8080)])
def test_without_a_grant_airlock_run_starts_no_broker(grants: tuple[str, ...], port: int) -> None:
    """The sandbox would hold no token: a broker could only refuse it, so none runs and the fence keeps its port."""
    args = build_parser(["run"]).parse_args(["run", *grants, "--", "true"])
    run = run_config(args, ["true"], load_policy(default_policy_path()))
    assert run.gateway.broker.port == port


def test_a_sandbox_whose_proxy_cannot_start_is_killed_and_the_error_is_raised(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The command starts while mitmproxy loads; should the proxy then fail, the command must not run on without
    one: wait() kills the sandbox and raises the gateway's error."""
    pidfile = tmp_path / "pid"
    events: list[str] = []

    def create(self: netns.NetnsSandbox) -> None:
        self.link = ipaddress.ip_network("10.231.0.0/30")

    def kill_all(self: netns.NetnsSandbox) -> None:
        events.append("killed")
        os.kill(int(pidfile.read_text()), signal.SIGKILL)

    def command(self: netns.NetnsSandbox, *args: object, **kwargs: object) -> list[str]:
        return ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 60"]

    class Failing:
        broker = inspector = None

        def __init__(self, listen: str) -> None:
            self.config = GatewayConfig(parse_policy(POLICY), listen)

        async def proxy_started(self) -> None:
            while not pidfile.exists() or not pidfile.read_text().strip():  # the command runs
                await asyncio.sleep(0.01)
            raise GatewayError("the proxy could not be loaded: ImportError: No module named 'mitmproxy'")

        async def stop(self) -> None:
            events.append("gateway stopped")

    async def start_gateway(config: GatewayConfig, listen: str, *args: object, **kwargs: object) -> Failing:
        assert kwargs == {"wait_for_proxy": False}
        return Failing(listen)

    for name, fake in (("create", create), ("kill_all", kill_all), ("command", command)):
        monkeypatch.setattr(netns.NetnsSandbox, name, fake)
    monkeypatch.setattr(netns.NetnsSandbox, "destroy", lambda self: events.append("destroyed"))
    monkeypatch.setattr(netns_launcher, "start_gateway", start_gateway)
    monkeypatch.setattr(preflight, "hidden_paths", lambda *args: [])
    monkeypatch.setattr(preflight, "read_only_binds", lambda *args: [])
    monkeypatch.chdir(tmp_path)

    async def run() -> int:
        handle = await netns_launcher.launch(["true"], GatewayConfig(parse_policy(POLICY), "0.0.0.0"), isolation="none")
        async with handle:
            with pytest.raises(GatewayError, match="the proxy could not be loaded: ImportError"):
                await handle.wait()
            assert handle.process.returncode is not None
            return handle.process.returncode

    assert asyncio.run(run()) == -signal.SIGKILL
    assert events == ["killed", "destroyed", "gateway stopped"]


def test_the_reaper_knows_a_namespace_mounted_only_in_another_mount_namespace() -> None:
    # What a launcher in a private mount namespace (`ip netns exec`'s) shows in its mountinfo: its sandbox's
    # namespace, mounted there alone, next to the folder itself and a namespace docker keeps elsewhere.
    mountinfo = (
        "41 30 0:25 / /run/netns rw,nosuid shared:12 - tmpfs tmpfs rw\n"
        "52 41 0:4 net:[4026532801] /run/netns/airlock-ab12 rw master:14 - nsfs nsfs rw\n"
        "53 41 0:4 net:[4026532802] /run/docker/netns/1c2d3e rw - nsfs nsfs rw\n"
        "54 30 0:4 net:[4026532803] /run/netns/airlock-ab12/x rw - nsfs nsfs rw\n"
    )
    assert netns.netns_mounts(mountinfo) == {"airlock-ab12"}


def test_the_processes_of_a_namespace_are_those_ip_netns_pids_lists(privileged: None) -> None:
    """kill_all's reader: what runs in the namespace, and nothing of it once the namespace is gone."""
    name = f"alpids{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    inside = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while not (listed := subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout):
            assert time.monotonic() < deadline, "sleep never ran in the namespace"
            time.sleep(0.01)
        assert netns.pids_in(name) == [int(pid) for pid in listed.split()] == [inside.pid]
    finally:
        inside.kill()
        inside.wait()
        subprocess.run(["ip", "netns", "del", name], check=False)
    assert netns.pids_in(name) == []


@pytest.mark.parametrize(
    ("hostname", "own_line"),
    [
        ("vm", "127.0.1.1 vm"),
        ("Build-7.ci.example.com", "127.0.1.1 build-7.ci.example.com build-7"),
        ("localhost", None),
        ("bad name\n0.0.0.0 pypi.org", None),  # whatever the kernel holds: never a line of its own
        ("10.0.0.1", None),
    ],
)
def test_the_sandboxs_hosts_file_names_its_own_host(hostname: str, own_line: str | None) -> None:
    lines = netns.hosts_file(hostname).splitlines()
    assert lines == ["127.0.0.1 localhost", *([own_line] if own_line else []), "::1 localhost"]
