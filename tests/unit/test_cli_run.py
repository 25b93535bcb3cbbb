"""`airlock run` argument handling: the refusal without privileges, the clean environment, and keeping the
gateway's credentials (and the usual ones in a home directory) away from the command."""

from __future__ import annotations

import os
import pwd
import sys
from pathlib import Path

import pytest

from airlock import cli
from airlock.cli import run as run_command
from airlock.cli.common import UsageError
from airlock.cli.run import parse_mount, passed_env
from airlock.sandbox import netns
from airlock.sandbox.netns import SandboxError, accessible_by, credential_paths
from airlock.sandbox.netns_launch import choose_isolation, hidden_paths, host_environment, kept_from_writes


def test_run_without_root_says_what_is_needed(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(run_command.os, "geteuid", lambda: 1000)
    assert cli.main(["run", "--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs root" in err and "sudo" in err


def test_run_without_a_command_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["run", "--"]) == 2
    assert "nothing to run" in capsys.readouterr().err


def test_sandbox_environment_keeps_host_secrets_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_host_secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "host-secret")
    monkeypatch.setenv("PASSED_ON", "yes")
    env = host_environment(pwd.getpwnam("nobody")) | passed_env(["PASSED_ON", "SET_HERE=1"])
    assert "GITHUB_TOKEN" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["PASSED_ON"] == "yes" and env["SET_HERE"] == "1" and env["USER"] == "nobody"
    with pytest.raises(UsageError):
        passed_env(["BAD-NAME"])


def _user(tmp_path: Path, uid: int = 4242, gid: int = 4242) -> pwd.struct_passwd:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return pwd.struct_passwd(("agent", "x", uid, gid, "", str(home), "/bin/sh"))


def test_credential_paths_are_the_gateways_and_the_usual_home_places(tmp_path: Path) -> None:
    user = _user(tmp_path)
    home = Path(user.pw_dir)
    (home / ".ssh").mkdir()
    (home / ".config" / "gh").mkdir(parents=True)
    (home / ".netrc").write_text("machine x login y password z\n")
    (home / "project").mkdir()
    key = tmp_path / "app.pem"
    key.write_text("KEY")
    (tmp_path / "link.pem").symlink_to(key)
    found = credential_paths(user, [tmp_path / "link.pem", tmp_path / "missing.pem"])
    assert found == [key, home / ".ssh", home / ".config" / "gh", home / ".netrc"]  # resolved, existing, no project


@pytest.mark.parametrize(
    ("owner", "group", "mode", "accessible"),
    [
        ("user", "other", 0o600, True),
        ("user", "other", 0o200, True),  # writable is as bad: a signing key could be replaced
        ("user", "other", 0o000, False),
        ("root", "user", 0o640, True),
        ("root", "user", 0o600, False),
        ("root", "other", 0o604, True),
        ("root", "other", 0o600, False),
        ("root", "other", 0o660, False),
    ],
)
def test_accessible_by_follows_the_mode_bits(
    privileged: None, tmp_path: Path, owner: str, group: str, mode: int, accessible: bool
) -> None:
    user = _user(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("s")
    os.chown(secret, user.pw_uid if owner == "user" else 0, user.pw_gid if group == "user" else 4343)
    secret.chmod(mode)
    assert accessible_by(secret, user) == ([secret] if accessible else [])


def test_accessible_by_looks_inside_a_state_directory(tmp_path: Path) -> None:
    user = _user(tmp_path)
    state = tmp_path / "state"
    (state / "keys").mkdir(parents=True)
    (state / "keys" / "k1.pem").write_text("k")
    (state / "keys" / "k1.pem").chmod(0o600)
    (state / "broker.sqlite3").write_text("db")
    (state / "broker.sqlite3").chmod(0o644)
    assert accessible_by(state, user) == [state / "broker.sqlite3"]


def test_run_without_bubblewrap_refuses_while_a_credential_is_exposed(privileged: None, tmp_path: Path) -> None:
    user = _user(tmp_path)
    key = tmp_path / "app.pem"
    key.write_text("KEY")
    os.chown(key, user.pw_uid, user.pw_gid)
    key.chmod(0o600)
    with pytest.raises(SandboxError, match=r"app\.pem is readable or writable by agent"):
        hidden_paths(False, user, [str(key)])
    os.chown(key, 0, 0)
    assert hidden_paths(False, user, [str(key)]) == []  # root's alone: fine
    assert hidden_paths(True, user, [str(key)])[0] == key  # hidden by bubblewrap instead


def test_docker_mounts_never_show_a_gateway_credential(tmp_path: Path) -> None:
    key = tmp_path / "project" / "app.pem"
    key.parent.mkdir()
    key.write_text("KEY")
    for mount in (f"{tmp_path}:/src", f"{key.parent}:/src", f"{key}:/key.pem"):
        with pytest.raises(UsageError, match="gateway credential"):
            parse_mount(mount, [str(key)])
    (tmp_path / "data").mkdir()
    assert parse_mount(f"{tmp_path / 'data'}:/data:ro", [str(key)]) == (str(tmp_path / "data"), "/data")


def test_without_bubblewrap_a_user_with_a_session_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    user = _user(tmp_path)
    assert hidden_paths(False, user, []) == []
    monkeypatch.setattr(netns, "user_session", lambda u: Path(f"/run/user/{u.pw_uid}"))
    with pytest.raises(SandboxError, match=r"has a session \(/run/user/4242\)"):
        hidden_paths(False, user, [])


def test_host_services_are_hidden_where_they_exist(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "user").mkdir()
    (tmp_path / "docker.sock").write_text("")
    monkeypatch.setattr(netns, "HOST_SERVICES", (str(tmp_path / "user"), str(tmp_path / "docker.sock"), "/nope"))
    assert netns.host_service_paths() == [tmp_path / "user", tmp_path / "docker.sock"]


def test_the_command_runs_without_supplementary_groups_and_with_masks(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("secret")
    argv = netns.NetnsSandbox("t1").command(["id"], "nobody", True, [tmp_path / "dir", tmp_path / "file"])
    assert "--clear-groups" in argv and "--init-groups" not in argv
    joined = " ".join(argv)
    assert f"--tmpfs {tmp_path / 'dir'}" in joined and f"--ro-bind /dev/null {tmp_path / 'file'}" in joined
    assert joined.index(f"--bind {os.getcwd()}") < joined.index(f"--tmpfs {tmp_path / 'dir'}")  # masks win


@pytest.mark.parametrize(
    ("cwd", "problem"),
    [
        ("/", "system folders: run it from a folder of its own (mkdir -p HOME/work && cd HOME/work)"),
        ("/tmp", "system folders: run it from a folder of its own (mkdir -p /tmp/work && cd /tmp/work)"),
        ("/etc", "system folders: run it from a folder of its own (mkdir -p HOME/work && cd HOME/work)"),
        ("/var/tmp", "system folders: run it from a folder of its own (mkdir -p /var/tmp/work && cd /var/tmp/work)"),
        (
            "HOME",
            "home folder, whose dotfiles run outside the sandbox: run it from a folder of its own (mkdir -p HOME/",
        ),
        ("HOME/..", "home folder"),  # a parent of the home folder holds it
        ("HOME/project", None),
        ("/app", None),  # a container's project folder
    ],
)
def test_working_directories_the_command_may_not_write(tmp_path: Path, cwd: str, problem: str | None) -> None:
    user = _user(tmp_path)
    (Path(user.pw_dir) / "project").mkdir()
    found = netns.workdir_problem(Path(cwd.replace("HOME", user.pw_dir)), user)
    problem = problem and problem.replace("HOME", user.pw_dir)
    assert (found is None) if problem is None else (found is not None and problem in found), found


def test_gateway_inputs_and_airlocks_code_in_reach_are_kept_read_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    user = _user(tmp_path)
    project = Path(user.pw_dir) / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    inside = project / "policy.yaml"
    inside.write_text("version: 1\n")
    outside = tmp_path / "policy.yaml"
    outside.write_text("version: 1\n")
    assert kept_from_writes(True, user, [inside]) == [inside]
    assert kept_from_writes(True, user, [outside]) == []
    # airlock's own code and environment, when the working directory holds them (an editable install).
    monkeypatch.setattr(sys, "prefix", str(project / ".venv"))
    assert kept_from_writes(True, user, []) == [project / ".venv"]


def test_without_bubblewrap_a_gateway_input_the_user_may_change_is_refused(privileged: None, tmp_path: Path) -> None:
    user = _user(tmp_path)
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\n")
    os.chown(policy, user.pw_uid, user.pw_gid)
    with pytest.raises(SandboxError, match=r"policy\.yaml could be changed by agent"):
        kept_from_writes(False, user, [policy])


def test_without_bubblewrap_the_mode_bits_decide_who_may_change_an_input(privileged: None, tmp_path: Path) -> None:
    user = _user(tmp_path)
    folder = tmp_path / "etc"
    folder.mkdir()
    policy = folder / "policy.yaml"
    policy.write_text("version: 1\n")
    assert not netns.writable_in_sandbox(policy, user, False)  # root's file in root's folder
    os.chown(folder, user.pw_uid, 0)
    assert netns.writable_in_sandbox(policy, user, False)  # the folder is the user's: the file can be replaced
    os.chown(folder, 0, 0)
    os.chown(policy, user.pw_uid, 0)
    assert netns.writable_in_sandbox(policy, user, False)


def test_without_bubblewrap_auto_refuses_instead_of_falling_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "bubblewrap_available", lambda: False)
    for requested in ("auto", "bwrap"):
        with pytest.raises(SandboxError, match="bubblewrap is not installed"):
            choose_isolation(requested)
    assert choose_isolation("none") == "none"  # said knowingly
    monkeypatch.setattr(netns, "bubblewrap_available", lambda: True)
    assert choose_isolation("auto") == "bwrap"
