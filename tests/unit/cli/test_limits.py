"""Command-line input that would switch a limit off or crash: refused with one usage line (exit 2) before anything
is created — no traceback, no sandbox, no state directory."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import time
from pathlib import Path

import pytest

from airlock import cli
from airlock.cli import run as run_command
from airlock.cli.common import default_policy_path
from airlock.cli.run import RunConfig
from airlock.gateway import Gateway, GatewayError
from airlock.gateway.config import GatewayConfig
from airlock.launch import netns_launcher, preflight
from airlock.policy import load_policy
from airlock.sandbox import netns


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """As root, with both backends replaced by a failure: a refused limit must never get that far."""

    async def must_not_run(run: RunConfig) -> int:
        raise AssertionError(f"a sandbox would have been started with {run}")

    monkeypatch.setattr(run_command.os, "geteuid", lambda: 0)
    monkeypatch.setattr(run_command, "_run_netns", must_not_run)
    monkeypatch.setattr(run_command, "_run_docker", must_not_run)


DOCKER = ("--backend", "docker", "--image", "img")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--timeout", "inf"), "--timeout inf"),
        (("--timeout", "nan"), "--timeout nan"),
        (("--timeout", "-1"), "--timeout -1"),
        (("--timeout", "0"), "--timeout 0"),
        (("--timeout", "1e9"), "--timeout 1"),
        ((*DOCKER, "--memory", "0"), "--memory: '0'"),  # docker reads 0 as unlimited
        ((*DOCKER, "--memory=-1g"), "--memory: '-1g'"),
        ((*DOCKER, "--memory", "1m"), "--memory: '1m' is outside"),  # below docker's own minimum
        ((*DOCKER, "--memory", "lots"), "--memory: 'lots'"),
        ((*DOCKER, "--cpus", "0"), "--cpus 0"),
        ((*DOCKER, "--cpus", "nan"), "--cpus nan"),
        ((*DOCKER, "--cpus", "-2"), "--cpus -2"),
        ((*DOCKER, "--pids", "0"), "--pids 0"),
        ((*DOCKER, "--pids", "-1"), "--pids -1"),
        ((*DOCKER, "--output-limit", "0"), "--output-limit 0"),
        (("--memory", "0"), "--memory: '0'"),  # the netns backend takes the same limits
        (("--cpus", "inf"), "--cpus inf"),
        (("--pids", "0"), "--pids 0"),
        (("--nofile", "0"), "--nofile 0"),
        ((*DOCKER, "--nofile", "2000000"), "--nofile 2000000"),
        (("--nproc", "-1"), "--nproc -1"),
        (("--max-tunnels", "0"), "--max-tunnels 0"),
        (("--max-connections", "-5"), "--max-connections -5"),
        (("--connect-timeout", "inf"), "--connect-timeout inf"),
        (("--connect-timeout", "0"), "--connect-timeout 0"),
        (("--idle-timeout", "nan"), "--idle-timeout nan"),
        (("--github-timeout", "-1"), "--github-timeout -1"),
        (("--dns-rate", "0"), "--dns-rate 0"),
        (("--dns-rate", "inf"), "--dns-rate inf"),
        (("--dns-min-ttl", "-1"), "--dns-min-ttl -1"),
        (("--proxy-port", "0"), "--proxy-port 0"),
        (("--dns-port", "70000"), "--dns-port 70000"),
        (("--broker-port", "-1"), "--broker-port -1"),
        (("--token-ttl", "200h"), "--token-ttl 720000"),
    ],
)
def test_a_limit_that_is_off_infinite_or_absurd_is_a_usage_error(
    nothing_runs: None, capsys: pytest.CaptureFixture, options: tuple[str, ...], message: str
) -> None:
    assert cli.main(["run", *options, "--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"airlock: {message}"), err


@pytest.mark.parametrize(
    "options",
    [
        ("--timeout", "0.5"),
        ("--timeout", "604800"),
        (*DOCKER, "--memory", "6m", "--cpus", "0.01", "--pids", "1", "--output-limit", "1"),
        (*DOCKER, "--memory", "2G"),
        (*DOCKER, "--nofile", "16", "--nproc", "1"),
        ("--memory", "6m", "--cpus", "0.01", "--pids", "1", "--nofile", "1048576", "--nproc", "4194304"),
        ("--dns-port", "0", "--broker-port", "0"),  # 0 turns these services off, as documented
        ("--dns-min-ttl", "0"),
    ],
)
def test_limits_within_their_bounds_are_accepted(
    nothing_runs: None, monkeypatch: pytest.MonkeyPatch, options: tuple[str, ...]
) -> None:
    reached: list[RunConfig] = []

    async def runs(run: RunConfig) -> int:
        reached.append(run)
        return 0

    monkeypatch.setattr(run_command, "_run_netns", runs)
    monkeypatch.setattr(run_command, "_run_docker", runs)
    monkeypatch.setattr(netns, "bubblewrap_available", lambda: True)
    assert cli.main(["run", *options, "--", "true"]) == 0 and len(reached) == 1


def test_the_gateway_checks_its_limits_too(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    argv = ["gateway", "--listen", "127.0.0.1", "--state-dir", str(tmp_path / "state"), "--connect-timeout", "inf"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith("airlock: --connect-timeout inf")
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("listen", ["localhost", "gateway.example", "127.1", " 127.0.0.1", ""])
def test_listen_must_be_an_ip_address_and_nothing_is_left_behind(
    capsys: pytest.CaptureFixture, tmp_path: Path, listen: str
) -> None:
    state = tmp_path / "state"
    argv = ["gateway", "--listen", listen, "--state-dir", str(state), "--upstream-dns", "127.0.0.1"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--listen" in err and "IP address" in err, err
    assert not state.exists()


def test_a_gateway_object_refuses_a_name_before_making_its_state_directory(tmp_path: Path) -> None:
    config = GatewayConfig(load_policy(default_policy_path()), "localhost", upstream_dns=[("127.0.0.1", 53)])
    config.state_dir = str(tmp_path / "state")
    with pytest.raises(GatewayError, match="give an IP address"):
        Gateway(config)
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("spec", ["foo", "=10.0.0.0/8", "foo10.0.0.0/8"])
def test_a_sandbox_spec_without_id_and_network_is_a_usage_error(
    capsys: pytest.CaptureFixture, tmp_path: Path, spec: str
) -> None:
    argv = ["gateway", "--listen", "127.0.0.1", "--state-dir", str(tmp_path / "s"), "--sandbox", spec]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"airlock: --sandbox {spec!r}: expected ID=CIDR[:PROFILE]"


def test_the_launcher_kills_and_removes_the_sandbox_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """kill_all() and destroy() sleep and wait for `ip` and `nft`: on the event loop they would stall the
    embedded gateway (its proxy, DNS and broker) for as long."""
    calls: dict[str, bool] = {}

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    pidfile = tmp_path / "pid"

    def recorder(name: str):
        def record(self: netns.NetnsSandbox, *args: object, **kwargs: object) -> object:
            calls[name] = on_loop()
            if name == "create":
                self.link = ipaddress.ip_network("10.231.0.0/30")
            if name == "kill_all":  # as the real one does: the command ends now, not when it would have
                while not pidfile.exists() or not pidfile.read_text().strip():  # it has started
                    time.sleep(0.01)
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            return ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 60"] if name == "command" else None

        return record

    for name in ("create", "kill_all", "destroy", "command"):
        monkeypatch.setattr(netns.NetnsSandbox, name, recorder(name))
    config = GatewayConfig(load_policy(default_policy_path()), "0.0.0.0")

    class Stopped:
        broker = inspector = None

        def __init__(self, listen: str) -> None:
            self.config = GatewayConfig(config.policy, listen)

        async def proxy_started(self) -> None:
            pass

        async def stop(self) -> None:
            calls["gateway stopped"] = True

    async def start_gateway(config: GatewayConfig, listen: str, *args: object, **kwargs: object) -> Stopped:
        return Stopped(listen)

    monkeypatch.setattr(netns_launcher, "start_gateway", start_gateway)
    monkeypatch.setattr(preflight, "hidden_paths", lambda *args: [])
    monkeypatch.setattr(preflight, "read_only_binds", lambda *args: [])
    monkeypatch.setattr(netns, "bubblewrap_available", lambda: True)
    monkeypatch.chdir(tmp_path)

    async def run() -> int | None:
        handle = await netns_launcher.launch(["true"], config, user="nobody", isolation="bwrap", timeout=0.2)
        async with handle:
            return await handle.wait()

    assert asyncio.run(run()) is None  # the timeout passed
    assert calls == {
        "create": False, "command": True, "kill_all": False, "destroy": False, "gateway stopped": True,
    }  # fmt: skip
