"""What a user can type never ends in a traceback: one `airlock: ...` line (or the policy's `file:line` lines) and
exit 2, Ctrl-C exit 130 — and the odd inputs that used to get further than that."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import docker
import pytest

from airlock import AirlockError, cli
from airlock.cli import common
from airlock.cli import policy as policy_command
from airlock.cli import run as run_command
from airlock.cli import token as token_command
from airlock.cli.common import UsageError
from airlock.gateway import GatewayError
from airlock.gateway.config import BrokerConfigError
from airlock.gateway.reload import PolicyReloader, log_reload
from airlock.inspection.ca import GatewayCA
from airlock.launch.watchdog import WatchdogError
from airlock.policy import PolicyError
from airlock.sandbox.docker import DockerSandboxError
from airlock.sandbox.errors import SandboxError
from airlock.sandbox.fence import FenceError
from airlock.sandbox.workdir import WorkdirError

GATEWAY = ["gateway", "--listen", "127.0.0.1", "--upstream-dns", "127.0.0.1"]
GRANT = "create_pull_request:acme/app"

# (id, argv with TMP for a fresh folder, what the one line on stderr says)
ODD_INPUTS = [
    ("policy-is-a-directory", ["policy", "check", "TMP"], "TMP:1: cannot read policy"),
    ("explain-policy-is-a-directory", ["policy", "explain", "--policy", "TMP", "pypi.org:443"], "cannot read policy"),
    ("policy-with-nul", ["policy", "check", "a\0b"], "cannot read policy"),
    ("gateway-policy-missing", [*GATEWAY, "--policy", "TMP/absent.yaml"], "TMP/absent.yaml:1: cannot read policy"),
    ("gateway-state-in-proc", [*GATEWAY, "--state-dir", "/proc/airlock-state"], "airlock: state directory /proc/"),
    ("gateway-state-is-a-file", [*GATEWAY, "--state-dir", "/etc/hostname"], "airlock: state directory /etc/hostname"),
    ("gateway-audit-in-missing-folder", [*GATEWAY, "--audit", "TMP/no/such/audit.log"], "airlock: audit log TMP/no"),
    ("gateway-bad-upstream-dns", ["gateway", "--listen", "::1", "--upstream-dns", "dns.example"], "--upstream-dns"),
    ("gateway-bad-sandbox-network", [*GATEWAY, "--sandbox", "a=10.0.0.1/8"], "--sandbox 'a=10.0.0.1/8'"),
    ("gateway-unknown-profile", [*GATEWAY, "--profile", "nope"], "no profile 'nope'"),
    ("gateway-bad-port", [*GATEWAY, "--proxy-port", "99999"], "--proxy-port 99999"),
    ("gateway-listen-not-here", ["gateway", "--listen", "192.0.2.77"], "--listen 192.0.2.77: Cannot assign requested"),
    ("gateway-ca-missing", [*GATEWAY, "--upstream-ca", "TMP/absent.pem"], "--upstream-ca TMP/absent.pem: no CA"),
    ("gateway-ca-not-pem", [*GATEWAY, "--upstream-ca", "/etc/hostname"], "--upstream-ca /etc/hostname: no CA"),
    ("explain-unclosed-bracket", ["policy", "explain", "http://[::1"], "airlock: 'http://[::1': Invalid IPv6 URL"),
    ("token-bad-grant", ["token", "issue", "--sandbox", "s", "--grant", "rm:-rf"], "airlock: --grant:"),
    ("token-no-listener", ["token", "revoke", "--state-dir", "TMP", "--jti", "x"], "cannot reach the gateway's admin"),
    ("token-admin-relative", ["token", "revoke", "--admin", "./admin.sock", "--jti", "x"], "cannot reach"),
    ("token-admin-not-loopback", ["token", "revoke", "--admin", "192.0.2.1:80", "--jti", "x"], "loopback"),
]


@pytest.mark.parametrize(("argv", "says"), [c[1:] for c in ODD_INPUTS], ids=[c[0] for c in ODD_INPUTS])
def test_odd_input_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main([a.replace("TMP", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert says.replace("TMP", str(tmp_path)) in err, err


RUN = ["run", "--upstream-dns", "127.0.0.1"]
# As root, up to where a sandbox would be built (both backends refuse first): (id, argv, what stderr says)
ODD_RUNS = [
    ("policy-missing", [*RUN, "--policy", "TMP/absent.yaml", "--", "true"], "TMP/absent.yaml:1: cannot read"),
    ("bad-grant", [*RUN, "--grant", "create_pull_request", "--", "true"], "airlock: --grant:"),
    ("bad-env", [*RUN, "--env", "A-B=1", "--", "true"], "airlock: --env 'A-B=1': not a variable name"),
    ("bad-mount", [*RUN, "--image", "i", "--mount", "rel:/x", "--", "true"], "airlock: --mount 'rel:/x'"),
    ("image-with-netns", [*RUN, "--backend", "netns", "--image", "i", "--", "true"], "--image needs --backend docker"),
    ("docker-without-image", [*RUN, "--backend", "docker", "--", "true"], "--backend docker needs --image"),
    ("unknown-profile", [*RUN, "--profile", "nope", "--", "true"], "no profile 'nope'"),
]


@pytest.mark.parametrize(("argv", "says"), [c[1:] for c in ODD_RUNS], ids=[c[0] for c in ODD_RUNS])
def test_odd_run_input_is_refused_before_anything_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    async def must_not_run(run: object) -> int:
        raise AssertionError("a sandbox would have been started")

    monkeypatch.setattr(run_command.os, "geteuid", lambda: 0)
    monkeypatch.setattr(run_command, "_run_netns", must_not_run)
    monkeypatch.setattr(run_command, "_run_docker", must_not_run)
    assert cli.main([a.replace("TMP", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert says.replace("TMP", str(tmp_path)) in err, err


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {"DOCKER_HOST": "unix:///nonexistent/docker.sock"},
            "airlock: no docker engine answers at unix:///nonexistent/docker.sock (No such file or directory): "
            "install and start one (apt-get install docker.io; systemctl start docker), or point DOCKER_HOST at one "
            "— or use --backend netns",
        ),
        (
            {"DOCKER_HOST": "tcp://127.0.0.1:9"},
            "airlock: no docker engine answers at tcp://127.0.0.1:9 (Connection refused): install and start one",
        ),
        (
            {"SUDO_USER": "dev"},  # sudo passed no DOCKER_HOST on: the default socket, where none listens
            "airlock: no docker engine answers at unix:///var/run/docker.sock (No such file or directory): sudo does "
            "not pass DOCKER_HOST on — if yours names the engine, keep it with sudo --preserve-env=DOCKER_HOST "
            "airlock run ...; else install and start one",
        ),
    ],
    ids=["socket-missing", "refused", "sudo-dropped-it"],
)
def test_without_a_docker_engine_the_error_says_why_and_how_to_get_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], env: dict[str, str], says: str
) -> None:
    if "DOCKER_HOST" not in env:  # the default socket, as on a host where none listens (whatever this one has)
        monkeypatch.setattr(docker, "from_env", lambda **kw: docker.DockerClient("unix:///nonexistent/docker.sock"))
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.delenv("SUDO_USER", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(run_command.os, "geteuid", lambda: 0)
    assert cli.main(["run", "--image", "debian", "--upstream-dns", "127.0.0.1", "--", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "airlock: backend docker, image debian" and len(err) == 2, err
    assert err[1].startswith(says) and "Error while fetching" not in err[1] and "(2, " not in err[1], err[1]


@pytest.mark.parametrize(
    "error",
    [
        GatewayError("x"), SandboxError("x"), FenceError("x"), DockerSandboxError("x"), BrokerConfigError("x"),
        UsageError("x"), WatchdogError("x"), WorkdirError("x"), PolicyError(["p.yaml:1: x"]),
    ],
    ids=lambda e: type(e).__name__,
)  # fmt: skip
def test_every_error_airlock_reports_shares_one_root(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error: AirlockError
) -> None:
    def fails(path: str | None) -> object:
        raise error

    monkeypatch.setattr(policy_command, "_load", fails)
    assert isinstance(error, AirlockError)
    assert cli.main(["policy", "check", "p.yaml"]) == 2
    assert capsys.readouterr().err == ("p.yaml:1: x\n" if isinstance(error, PolicyError) else "airlock: x\n")


def test_a_message_of_several_lines_is_said_in_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fails(path: str | None) -> object:
        raise SandboxError("ip netns add airlock-x: first line\n  second line\n")

    monkeypatch.setattr(policy_command, "_load", fails)
    assert cli.main(["policy", "check", "p.yaml"]) == 2
    assert capsys.readouterr().err == "airlock: ip netns add airlock-x: first line; second line\n"


@pytest.mark.parametrize(("raised", "code", "says"), [
    (KeyboardInterrupt(), 130, "airlock: interrupted\n"),
    (RuntimeError("boom"), 2, "airlock: unexpected error: RuntimeError: boom\n"),
])  # fmt: skip
def test_ctrl_c_and_the_unforeseen_are_one_line_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], raised: BaseException, code: int, says: str
) -> None:
    def fails(path: str | None) -> object:
        raise raised

    monkeypatch.setattr(policy_command, "_load", fails)
    assert cli.main(["policy", "check", "p.yaml"]) == code
    assert capsys.readouterr().err == says


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "airlock: the following arguments are required: command (see airlock --help)"),
        (["bogus"], "airlock: argument command: invalid choice: 'bogus' (choose from "),
        (["run", "--cpus", "x", "--", "true"], "airlock: argument --cpus: invalid float value: 'x' (see airlock run"),
        (["token", "issue", "--sandbox"], "airlock: argument --sandbox: expected one argument (see airlock token"),
        (["approvals", "approve"], "airlock: the following arguments are required: ID (see airlock approvals approve"),
        (["status", "--bogus"], "airlock: unrecognized arguments: --bogus (see airlock status --help)"),
        (
            ["token", "issue", "--sandbox", "s", "--grant", "g", "--bogus"],
            "airlock: unrecognized arguments: --bogus (see airlock token --help)",
        ),
    ],
    ids=[
        "no-command",
        "unknown-command",
        "bad-float",
        "missing-value",
        "missing-positional",
        "unknown-option",
        "unknown-option-deeper",
    ],
)
def test_a_usage_error_is_one_line_that_points_at_help(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(says) and err.endswith(" --help)\n"), err


@pytest.fixture
def not_root(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.setattr(common.os, "geteuid", lambda: 1000)
    monkeypatch.setenv("PATH", str(tmp_path_factory.mktemp("no-sudo")))  # no sudo to run it again with


@pytest.fixture
def sudo_started(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> list[list[str]]:
    """A user with sudo: what it would start (os.execv stands in for sudo taking over)."""
    monkeypatch.setattr(common.os, "geteuid", lambda: 1000)
    folder = tmp_path_factory.mktemp("sudo")
    (folder / "sudo").write_text("#!/bin/sh\n")
    (folder / "sudo").chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))
    started: list[list[str]] = []

    def execv(path: str, argv: list[str]) -> None:
        started.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(common.os, "execv", execv)
    return started


def _refused(path: object, *args: object, **kwargs: object) -> object:
    """What the system answers a user who is not root for a file of root's (root itself is never refused)."""
    raise PermissionError(13, "Permission denied", str(path))


def test_tools_log_as_a_user_says_it_needs_root(
    not_root: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(Path, "is_file", _refused)  # /var/lib/airlock/calls is root's, 0700
    assert cli.main(["tools", "log"]) == 2
    assert capsys.readouterr().err == (
        "airlock: /var/lib/airlock/calls/calls.sqlite3: permission denied: this needs root (run it with sudo)\n"
    )


def test_policy_suggest_on_the_root_owned_audit_log_says_to_use_sudo(
    not_root: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    audit.touch(0o640)
    monkeypatch.setattr(policy_command, "open", _refused, raising=False)
    assert cli.main(["policy", "suggest", str(audit)]) == 2
    assert capsys.readouterr().err == f"airlock: {audit}: permission denied: this needs root (run it with sudo)\n"


def test_any_other_error_of_the_system_is_one_line_naming_the_file(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fails(path: str | None) -> object:
        raise IsADirectoryError(21, "Is a directory", "/etc")

    monkeypatch.setattr(policy_command, "_load", fails)
    assert cli.main(["policy", "check", "p.yaml"]) == 2
    assert capsys.readouterr().err == "airlock: /etc: Is a directory\n"


def test_version_comes_from_the_package(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"airlock {version('airlock')}\n"


async def test_a_successful_reload_is_info_and_a_failed_one_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Gateway:
        def replace_policy(self, policy: object) -> None:
            pass

        def policy_refused(self, source: str, errors: list[str]) -> None:
            pass

    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("version: 1\nprofiles:\n  default:\n    allow:\n      - host: pypi.org\n")
    bad.write_text("version: 1\nprofiles: [\n")
    with caplog.at_level(logging.INFO, logger="airlock"):
        for path in (good, bad):
            log_reload(await PolicyReloader(Gateway(), str(path), lambda: None).reload())
    assert [(r.levelname, r.getMessage().split(" from ")[0][:20]) for r in caplog.records] == [
        ("INFO", "policy reloaded"),
        ("ERROR", "policy NOT reloaded,"),
    ]


def test_path_options_are_absolute_and_never_resolved(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link.log").symlink_to("/dev/null")
    args = cli.build_parser().parse_args(
        ["gateway", "--listen", "127.0.0.1", "--state-dir", "state", "--audit", "link.log", "--policy", "../p.yaml"]
    )
    assert args.state_dir == str(tmp_path / "state")
    assert args.audit == str(tmp_path / "link.log")  # the symlink itself: the gateway refuses to log through it
    assert args.policy == str(tmp_path / ".." / "p.yaml")


def test_help_loads_no_command_group() -> None:
    """`airlock --help` stays quick: it imports no policy, gateway or sandbox code."""
    probe = (
        "import sys\nfrom airlock.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith(('airlock.', 'yaml', 'mitmproxy', 'asyncio'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "['airlock.cli', 'airlock.cli.common', 'airlock.errors']"


def test_a_command_group_is_imported_with_the_cycle_collector_paused_and_what_it_made_is_out_of_its_sight() -> None:
    """`airlock run`'s import makes some thirty thousand objects that stay: no collection walks them meanwhile, nor
    afterwards (frozen), and the collector runs again."""
    probe = (
        "import gc, importlib\nfrom airlock import cli\nseen = []\nreal = importlib.import_module\n"
        "importlib.import_module = lambda name: seen.append(gc.isenabled()) or real(name)\n"
        "cli.build_parser(['run'])\nprint(seen, gc.isenabled(), gc.get_freeze_count() > 10000)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out == "[False] True True\n"


def test_the_gateway_imports_neither_mitmproxys_unused_addons_nor_the_broker() -> None:
    """(aiohttp it does import: every gateway has its admin listener.)"""
    probe = (
        "import sys\nimport airlock.gateway.core\nairlock.gateway.core.preload_proxy().result(60)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('mitmproxy.addons.', 'airlock.broker.'))\n"
        "             or m == 'airlock.gateway.broker_runtime'))\n"
        "from mitmproxy.addons import default_addons\nprint(len(default_addons()) > 20)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    loaded, whole_later = out.splitlines()
    assert loaded == str([
        "mitmproxy.addons.core", "mitmproxy.addons.disable_h2c", "mitmproxy.addons.next_layer",
        "mitmproxy.addons.proxyserver", "mitmproxy.addons.termlog", "mitmproxy.addons.tlsconfig",
    ])  # fmt: skip
    assert whole_later == "True"  # anyone else asking for mitmproxy's default set still gets it


def test_the_gateways_tls_addon_signs_only_with_the_gateway_ca_and_only_for_the_sni(tmp_path: Path) -> None:
    """mitmproxy makes no CA of its own (it could sign any name): without the gateway's there is no certificate at
    all, and with it the leaf names exactly the SNI the tunnel was judged by."""
    import pytest
    from cryptography import x509
    from mitmproxy.proxy.context import Context
    from mitmproxy.test import taddons, tflow

    from airlock.gateway.startup.mitm import TlsConfig

    issuer = Issuer()
    tls = TlsConfig(issuer)
    with taddons.context(tls) as tctx:
        tctx.configure(tls, confdir=str(tmp_path / "confdir"))
        tls.running()
        context = Context(tflow.tclient_conn(), tctx.options)
        context.client.sni = "api.example.com"
        with pytest.raises(RuntimeError, match="no certificate authority"):
            tls.get_cert(context)
        ca = issuer.make(tmp_path / "ca", "api.example.com")
        leaf = tls.get_cert(context).cert.to_cryptography()
        assert leaf.issuer == ca.cert.subject
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == ["api.example.com"]
        assert not (tmp_path / "confdir").exists() or list((tmp_path / "confdir").iterdir()) == []


class Issuer:
    """The gateway's CAs as the TLS addon sees them: none until `make`."""

    def __init__(self) -> None:
        self.ca: GatewayCA | None = None

    def make(self, directory: Path, host: str) -> GatewayCA:

        self.ca = GatewayCA.create(directory, [host])
        return self.ca

    @property
    def active(self) -> bool:
        return self.ca is not None

    @property
    def certstore(self) -> object:
        assert self.ca is not None
        return self.ca.certstore()

    def store_entry(self, host: str) -> object:
        assert self.ca is not None
        return self.ca.store_entry(host)


@pytest.mark.parametrize(
    "argv",
    [["policy", "suggest", "AUDIT"], ["tools", "log", "--call-log", "AUDIT"]],
    ids=["policy-suggest", "tools-log"],
)
def test_a_command_that_only_reads_runs_again_through_sudo_when_refused_a_file_of_roots(
    sudo_started: list[list[str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    argv: list[str],
) -> None:
    audit = tmp_path / "audit.jsonl"
    audit.touch(0o640)
    argv = [str(audit) if word == "AUDIT" else word for word in argv]
    monkeypatch.setattr(policy_command, "open", _refused, raising=False)
    monkeypatch.setattr(Path, "is_file", _refused)
    with pytest.raises(SystemExit):
        cli.main(argv)
    # Once, as the same airlock with the same command line, sudo its first word.
    assert len(sudo_started) == 1 and sudo_started[0][0].endswith("/sudo")
    assert sudo_started[0][1:] == ["--", sys.executable, "-I", "-m", "airlock", *argv]
    assert capsys.readouterr().err.endswith(": running it with sudo\n")


@pytest.mark.parametrize(
    "argv",
    [["status"], ["approvals", "approve", "3f9c", "--scope", "policy"], ["token", "revoke", "--sandbox", "s1"]],
    ids=["status", "approvals-approve", "token-revoke"],
)
def test_an_admin_command_refused_the_root_owned_socket_runs_again_through_sudo(
    sudo_started: list[list[str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    argv: list[str],
) -> None:
    async def refused(*args: object, **kwargs: object) -> object:  # the system's answer to a user (never to root)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(asyncio.SelectorEventLoop, "create_unix_connection", refused)
    argv = [*argv, "--admin", str(tmp_path / "admin.sock")]
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert len(sudo_started) == 1 and sudo_started[0][1:] == ["--", sys.executable, "-I", "-m", "airlock", *argv]
    assert capsys.readouterr().err.endswith(": running it with sudo\n")


def test_a_user_refused_the_list_of_running_gateways_asks_sudo(
    sudo_started: list[list[str]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(token_command, "running", lambda: _refused("/run/airlock/runs"))
    with pytest.raises(SystemExit):
        cli.main(["approvals", "list"])
    assert len(sudo_started) == 1 and sudo_started[0][-2:] == ["approvals", "list"]
