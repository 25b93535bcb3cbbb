"""What `airlock run` hands the command besides the gateway's variables: the invoker's git identity, the caches of
the package managers, the notice about CA bundles the clean environment drops; and the refusal of a program the
sandbox cannot start."""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

import pytest

from airlock import cli
from airlock.cli import build_parser
from airlock.cli.common import UsageError, default_policy_path
from airlock.cli.run import HOST_CA_VARS, git_identity, host_ca_note, run_config
from airlock.launch.git_identity import GitIdentityError, invoker_identity, parse_identity
from airlock.launch.preflight import cache_environment, command_problem, writable_cache
from airlock.policy import load_policy
from airlock.sandbox import netns
from airlock.sandbox.errors import SandboxError

ADA = {
    "GIT_AUTHOR_NAME": "Ada Lovelace",
    "GIT_COMMITTER_NAME": "Ada Lovelace",
    "GIT_AUTHOR_EMAIL": "ada@example.test",
    "GIT_COMMITTER_EMAIL": "ada@example.test",
}


def _home_with_identity(tmp_path: Path, name: str = "Ada Lovelace", email: str = "ada@example.test") -> Path:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    (home / ".gitconfig").write_text(f"[user]\n\tname = {name}\n\temail = {email}\n")
    return home


def test_the_invokers_git_configuration_is_the_sandboxs_identity(tmp_path: Path) -> None:
    home = _home_with_identity(tmp_path)
    environ = {"HOME": str(home), "PATH": os.environ["PATH"], "GIT_CONFIG_NOSYSTEM": "1"}
    assert invoker_identity(environ) == ADA


def test_git_identity_variables_of_the_invoker_win_over_the_configuration(tmp_path: Path) -> None:
    home = _home_with_identity(tmp_path, "Someone Else")
    environ = {"HOME": str(home), "PATH": os.environ["PATH"], "GIT_AUTHOR_NAME": "Ada", "GIT_AUTHOR_EMAIL": "a@x.test"}
    assert invoker_identity(environ) == {"GIT_AUTHOR_NAME": "Ada", "GIT_AUTHOR_EMAIL": "a@x.test"}


def test_without_any_identity_nothing_is_passed(tmp_path: Path) -> None:
    environ = {"HOME": str(tmp_path), "PATH": os.environ["PATH"], "GIT_CONFIG_NOSYSTEM": "1"}
    assert invoker_identity(environ) == {}
    assert invoker_identity({"HOME": str(tmp_path), "PATH": str(tmp_path)}) == {}  # no git at all: no identity


def test_under_sudo_the_callers_configuration_is_read_as_the_caller(privileged: None, tmp_path: Path) -> None:
    """Not root's: git runs as the sudo caller, with their home (here nobody, whose home holds no configuration:
    root's HOME, which names a configuration, is not read)."""
    home = _home_with_identity(tmp_path)
    environ = {"HOME": str(home), "PATH": os.environ["PATH"], "SUDO_UID": str(pwd.getpwnam("nobody").pw_uid)}
    assert invoker_identity(environ) == {}
    environ["SUDO_UID"] = "0"  # sudo from a root shell: root's own identity
    assert invoker_identity(environ) == ADA


@pytest.mark.parametrize(
    ("given", "expected"),
    [("Ada Lovelace <ada@example.test>", ADA), ("  Ada Lovelace<ada@example.test> ", ADA), ("none", {})],
)
def test_git_identity_flag(given: str, expected: dict[str, str]) -> None:
    assert parse_identity(given) == expected


@pytest.mark.parametrize("given", ["Ada", "<ada@example.test>", "Ada <a b@x>", "Ada <a@x>\nB <b@x>", "A <a@x> <b@y>"])
def test_a_git_identity_that_is_not_name_and_email_is_refused(given: str) -> None:
    with pytest.raises(GitIdentityError, match="expected 'Name <email>'"):
        parse_identity(given)
    with pytest.raises(UsageError):
        git_identity(given)


def test_run_passes_the_identity_and_env_overrides_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(_home_with_identity(tmp_path)))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.delenv("SUDO_UID", raising=False)
    for name in ADA:
        monkeypatch.delenv(name, raising=False)
    policy = load_policy(default_policy_path())

    def env(*options: str) -> dict[str, str]:
        args = build_parser(["run"]).parse_args(["run", *options, "--", "true"])
        return run_config(args, ["true"], policy).env

    assert env() == ADA
    assert env("--git-identity", "Bo <bo@x.test>")["GIT_AUTHOR_NAME"] == "Bo"
    assert env("--git-identity", "none") == {}
    assert env("--env", "GIT_AUTHOR_NAME=Cy")["GIT_AUTHOR_NAME"] == "Cy"


def test_a_git_identity_is_read_in_the_working_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A repository's own user.name is the one its commits get outside the sandbox: inside too."""
    environ = {"HOME": str(_home_with_identity(tmp_path)), "PATH": os.environ["PATH"], "GIT_CONFIG_NOSYSTEM": "1"}
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=environ)
    subprocess.run(["git", "-C", str(repo), "config", "user.name", "Ada at work"], check=True, env=environ)
    monkeypatch.chdir(repo)
    assert invoker_identity(environ)["GIT_AUTHOR_NAME"] == "Ada at work"


# --- what cannot start -----------------------------------------------------------------------------------------


def test_a_name_not_in_the_sandboxs_path_is_refused_and_a_local_script_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    path = "/usr/local/bin:/usr/bin:/bin"
    assert command_problem("sh", path) is None
    assert command_problem("./agent.sh", path) == f"./agent.sh: no such file (the working directory is {tmp_path})"
    assert command_problem("agent.sh", path) == (
        "agent.sh: command not found in the sandbox's PATH (/usr/local/bin:/usr/bin:/bin)"
    )
    (tmp_path / "agent.sh").write_text("#!/bin/sh\n")
    assert command_problem("agent.sh", path) == (
        "agent.sh: command not found in the sandbox's PATH (/usr/local/bin:/usr/bin:/bin); to run the one in the "
        "working directory: ./agent.sh"
    )
    assert command_problem("./agent.sh", path) is None
    assert command_problem("agent.sh", f"{path}:") is None  # an empty entry is the working directory, for a shell too


def test_airlock_run_says_it_in_one_line(
    privileged: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "agent.sh").write_text("#!/bin/sh\n")
    assert cli.main(["run", "--isolation", "none", "--", "agent.sh"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "airlock: agent.sh: command not found in the sandbox's PATH (/usr/local/bin:/usr/bin:/bin); to run the one "
        "in the working directory: ./agent.sh"
    )


def test_workdir_is_where_the_command_is_looked_up_and_a_missing_one_is_refused(
    privileged: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "--workdir", "missing", "--", "true"]) == 2
    assert capsys.readouterr().err.strip() == f"airlock: --workdir {tmp_path / 'missing'}: No such file or directory"
    (tmp_path / "app").mkdir()
    assert cli.main(["run", "--isolation", "none", "--workdir", "app", "--", "./agent.sh"]) == 2
    assert f"./agent.sh: no such file (the working directory is {tmp_path / 'app'})" in capsys.readouterr().err


@pytest.mark.parametrize("option", [("--workdir", "/srv"), ("--cache", "/srv")])
def test_workdir_and_cache_are_the_netns_backends(option: tuple[str, str]) -> None:
    args = build_parser(["run"]).parse_args(["run", "--image", "img", *option, "--", "true"])
    with pytest.raises(UsageError, match="netns backend only"):
        run_config(args, ["true"], load_policy(default_policy_path()))


# --- caches ----------------------------------------------------------------------------------------------------


def test_npm_gets_a_cache_it_can_write() -> None:
    assert cache_environment(None, isolate_fs=True) == {"npm_config_cache": "/tmp/.npm"}  # the private /tmp
    assert cache_environment(None, isolate_fs=False) == {}  # the home is writable, /tmp the host's
    assert cache_environment(Path("/var/cache/agent"), isolate_fs=True) == {
        "XDG_CACHE_HOME": "/var/cache/agent",
        "npm_config_cache": "/var/cache/agent/npm",
    }


def _user(tmp_path: Path) -> pwd.struct_passwd:
    (tmp_path / "home").mkdir(exist_ok=True)
    return pwd.struct_passwd(("agent", "x", os.getuid(), os.getgid(), "", str(tmp_path / "home"), "/bin/sh"))


def test_a_cache_folder_is_one_of_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    user = _user(tmp_path)
    work, cache, policy = tmp_path / "work", tmp_path / "cache", tmp_path / "conf" / "policy.yaml"
    for folder in (work, cache, policy.parent, tmp_path / "home" / ".npm" / "x"):
        folder.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert writable_cache(cache, user, [policy]) == cache
    refused = {
        tmp_path / "missing": "no such folder (make it, writable for agent)",
        Path("/usr"): "it is / or one of the host's system folders",
        tmp_path / "home": "it is agent's home folder",
        tmp_path / "home" / ".npm" / "x": "it is agent's own cache, which the tools outside the sandbox read",
        tmp_path: "it holds the working directory",
        policy.parent: f"it holds {policy}, which the command must not change",
    }
    for folder, problem in refused.items():
        with pytest.raises(SandboxError, match="--cache ") as error:
            writable_cache(folder, user, [policy])
        assert problem in str(error.value), error.value


def test_a_cache_the_user_may_not_write_is_refused(privileged: None, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    nobody = pwd.getpwnam("nobody")
    with pytest.raises(SandboxError, match="nobody, who runs the command, may not write it"):
        writable_cache(cache, nobody, [])


def test_bubblewrap_binds_the_cache_writable_before_the_working_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = netns._bubblewrap([], [], None, writable=[Path("/var/cache/agent")])
    cache, work = argv.index("/var/cache/agent"), argv.index(str(tmp_path))
    assert argv[cache - 1 : cache + 2] == ["--bind", "/var/cache/agent", "/var/cache/agent"] and cache < work


# --- the host's CA bundles -------------------------------------------------------------------------------------


def test_ca_bundles_named_on_the_host_are_said_to_stay_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in HOST_CA_VARS:
        monkeypatch.delenv(name, raising=False)
    assert host_ca_note({}) is None
    monkeypatch.setenv("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt")  # the sandbox's own: nothing lost
    monkeypatch.setenv("SSL_CERT_DIR", "/etc/ssl/certs/")
    assert host_ca_note({}) is None
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/corp/ca.pem")
    monkeypatch.setenv("NODE_EXTRA_CA_CERTS", "/etc/corp/ca.pem")
    assert host_ca_note({}) == (
        "airlock: REQUESTS_CA_BUNDLE, NODE_EXTRA_CA_CERTS are set here but not passed into the sandbox (its "
        "environment is clean): to have its clients trust that CA, --env REQUESTS_CA_BUNDLE (the file must be "
        "readable there); for the upstreams the gateway itself verifies, --upstream-ca FILE"
    )
    note = host_ca_note({"REQUESTS_CA_BUNDLE": "/etc/corp/ca.pem"})  # passed with --env: only the other is told
    assert note is not None and note.startswith("airlock: NODE_EXTRA_CA_CERTS is set here but not passed")
