"""`airlock run` argument handling: the refusal without privileges, the clean environment, and keeping the
gateway's credentials (and the usual ones in a home directory) away from the command."""

from __future__ import annotations

import os
import pwd
import sys
from pathlib import Path

import pytest

from airlock import cli
from airlock.cli.common import UsageError
from airlock.cli.run import HOST_CA_VARS, parse_mount, passed_env
from airlock.gateway.config import GatewayConfig
from airlock.launch import preflight
from airlock.launch.git_identity import IDENTITY_VARS
from airlock.launch.preflight import (
    choose_isolation,
    hidden_paths,
    host_environment,
    read_only_binds,
    refuse_inputs_in_reach,
    sandbox_reach,
)
from airlock.policy import load_policy
from airlock.sandbox import host_paths, netns
from airlock.sandbox.errors import SandboxError
from airlock.sandbox.host_paths import accessible_by, credential_paths
from airlock.sandbox.workdir import WorkdirGuard


def test_run_without_root_nor_sudo_says_what_is_needed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sudo on it
    assert cli.main(["run", "--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs root" in err and "no sudo here: run it as root" in err


def test_run_without_root_runs_itself_again_through_sudo(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    sudo = tmp_path / "sudo"
    sudo.write_text("#!/bin/sh\n")
    sudo.chmod(0o755)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("PATH", str(tmp_path))
    for name, value in {"PASSED": "1", "MODEL_KEY": "k", "DOCKER_HOST": "unix:///d.sock", "OTHER": "x"}.items():
        monkeypatch.setenv(name, value)
    for name in ("DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH", *IDENTITY_VARS, *HOST_CA_VARS):
        monkeypatch.delenv(name, raising=False)
    started: list[list[str]] = []

    def execv(path: str, argv: list[str]) -> None:  # this process would be sudo's from here on
        started.append([path, *argv])
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", execv)
    argv = ["run", "--env", "PASSED", "--env", "SET=1", "--secret", "model=env:MODEL_KEY", "--", "id"]
    with pytest.raises(SystemExit):
        cli.main(argv)
    # The same interpreter and command line as root; what the run reads from the environment goes along.
    preserve = "--preserve-env=DOCKER_HOST,MODEL_KEY,PASSED"
    assert started == [[str(sudo), str(sudo), preserve, "--", sys.executable, "-I", "-m", "airlock", *argv]]
    err = capsys.readouterr().err
    assert err.startswith("airlock: run needs root (") and err.endswith("): running it with sudo\n")


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
    monkeypatch.setattr(host_paths, "user_session", lambda u: Path(f"/run/user/{u.pw_uid}"))
    with pytest.raises(SandboxError, match=r"has a session \(/run/user/4242\)"):
        hidden_paths(False, user, [])


def test_host_services_are_hidden_where_they_exist(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "user").mkdir()
    (tmp_path / "docker.sock").write_text("")
    monkeypatch.setattr(host_paths, "HOST_SERVICES", (str(tmp_path / "user"), str(tmp_path / "docker.sock"), "/nope"))
    assert host_paths.host_service_paths() == [tmp_path / "user", tmp_path / "docker.sock"]


def test_a_pods_service_account_token_is_hidden_where_it_exists(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    (tmp_path / "kubernetes.io" / "serviceaccount").mkdir(parents=True)
    monkeypatch.setattr(host_paths, "HOST_SECRETS", (str(tmp_path / "kubernetes.io"), "/nope"))
    assert tmp_path / "kubernetes.io" in hidden_paths(True, _user(tmp_path), [])


def test_the_command_runs_without_supplementary_groups_and_with_masks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # the masks inside the working directory, as the credentials a project holds
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("secret")
    argv = netns.NetnsSandbox("t1").command(["id"], "nobody", True, [tmp_path / "dir", tmp_path / "file"])
    assert "--clear-groups" in argv and "--init-groups" not in argv
    joined = " ".join(argv)
    assert f"--tmpfs {tmp_path / 'dir'}" in joined and f"--ro-bind /dev/null {tmp_path / 'file'}" in joined
    assert joined.index(f"--bind {os.getcwd()}") < joined.index(f"--tmpfs {tmp_path / 'dir'}")  # masks win


def test_below_a_private_mount_the_folders_on_the_way_are_the_hosts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(netns, "PRIVATE_MOUNTS", (tmp_path,))
    nobody = pwd.getpwnam("nobody")
    outer, inner = tmp_path / "a", tmp_path / "a" / "b"
    (inner / "work" / ".ssh").mkdir(parents=True)
    (tmp_path / "elsewhere" / ".ssh").mkdir(parents=True)
    os.chown(outer, nobody.pw_uid, nobody.pw_gid)
    outer.chmod(0o2750)
    inner.chmod(0o711)
    monkeypatch.chdir(inner / "work")
    argv = netns._bubblewrap([inner / "work" / ".ssh", tmp_path / "elsewhere" / ".ssh"], [], None)
    joined = " ".join(argv)
    # Each folder as on the host, before the working directory's bind (bubblewrap would make them root's 0700).
    assert f"--dir {outer} --chmod 2750 {outer} --dir {inner} --chmod 711 {inner} --bind {inner / 'work'}" in joined
    # Its owner given after bubblewrap, before the command; root's stays root's.
    assert argv[-3:] == [f"{nobody.pw_uid}:{nobody.pw_gid}", str(outer), "--"]
    # A credential inside the working directory is hidden; one elsewhere below the private mount never shows.
    assert f"--tmpfs {inner / 'work' / '.ssh'}" in joined and "elsewhere" not in joined


@pytest.mark.parametrize(("work_tree", "bound"), [("private/repo", True), ("private", False), ("plain", False)])
def test_the_work_tree_above_the_working_directory_shows_below_a_private_mount_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, work_tree: str, bound: bool
) -> None:
    monkeypatch.setattr(netns, "PRIVATE_MOUNTS", (tmp_path / "private",))
    cwd = tmp_path / work_tree / "sub"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    guard = WorkdirGuard(cwd, pwd.getpwnam("nobody"), "t1", tmp_path / "scratch", work_tree=tmp_path / work_tree)
    joined = " ".join(netns._bubblewrap([], [], guard))
    top = tmp_path / work_tree
    # A private mount bound again would show the host's own (its sockets), `/` the host's /tmp and /dev.
    assert (f"--ro-bind {top} " in joined) is bound
    assert (f"--ro-bind {top} {top} --bind {cwd}" in joined) is bound  # before the working directory


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
    user = _user(tmp_path, os.getuid(), os.getgid())  # its home its own
    (Path(user.pw_dir) / "project").mkdir()
    found = host_paths.workdir_problem(Path(cwd.replace("HOME", user.pw_dir)), user)
    problem = problem and problem.replace("HOME", user.pw_dir)
    assert (found is None) if problem is None else (found is not None and problem in found), found


@pytest.mark.parametrize("cwd", ["/", "/root", "HOME"])
def test_a_home_the_user_may_not_write_is_never_the_folder_to_use(tmp_path: Path, cwd: str) -> None:
    """As nobody's /nonexistent, where something made the folder (a root shell's command runs as nobody)."""
    user = _user(tmp_path)  # its home root's (or the test runner's), 0755
    found = host_paths.workdir_problem(Path(cwd.replace("HOME", user.pw_dir)), user)
    assert found is not None and found.endswith(
        "run it from a folder of its own (mkdir -p /var/tmp/work && cd /var/tmp/work)"
    ), found


def test_airlocks_own_code_in_the_working_directory_is_kept_read_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    user = _user(tmp_path)
    project = Path(user.pw_dir) / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    # airlock's own code and environment, when the working directory holds them (an editable install).
    monkeypatch.setattr(sys, "prefix", str(project / ".venv"))
    assert read_only_binds(True, user) == [project / ".venv"]
    assert read_only_binds(False, user) == []  # nothing can be bound: its inputs are judged instead


def test_a_gateway_input_the_command_could_change_is_refused(privileged: None, tmp_path: Path) -> None:
    user = _user(tmp_path)
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nprofiles:\n  default: {}\n")
    config = GatewayConfig(load_policy(policy), "0.0.0.0", policy_path=str(policy))
    refuse_inputs_in_reach(sandbox_reach(False, user, []), config)  # root's file in root's folders
    os.chown(policy, user.pw_uid, user.pw_gid)
    with pytest.raises(SandboxError, match=r"--policy .*/policy\.yaml: agent, who runs the sandboxed command, may "):
        refuse_inputs_in_reach(sandbox_reach(False, user, []), config)


def test_the_packaged_policy_of_a_checkout_run_from_itself_is_not_refused(
    privileged: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`sudo .venv/bin/airlock run -- CMD` in a checkout its user owns: the default policy lies in configs/, which
    is bound read-only with airlock's own code (a mount point: it cannot be renamed); a file beside it is refused."""
    user = _user(tmp_path)
    checkout = Path(user.pw_dir) / "airlock"
    for folder in (checkout, checkout / "configs", checkout / ".venv", checkout / "notes"):
        folder.mkdir()
        os.chown(folder, user.pw_uid, user.pw_gid)
    (checkout / "configs" / "default.yaml").write_text("version: 1\nprofiles:\n  default: {}\n")
    (checkout / "notes" / "policy.yaml").write_text("version: 1\nprofiles:\n  default: {}\n")
    monkeypatch.chdir(checkout)
    monkeypatch.setattr(preflight, "airlock_code", lambda: [checkout / ".venv", checkout / "configs"])
    reach = sandbox_reach(True, user, read_only_binds(True, user))
    packaged = GatewayConfig(
        load_policy(checkout / "configs" / "default.yaml"), "0.0.0.0", state_dir=str(tmp_path / "state")
    )
    refuse_inputs_in_reach(reach, packaged)
    beside = GatewayConfig(
        load_policy(checkout / "notes" / "policy.yaml"), "0.0.0.0", state_dir=str(tmp_path / "state")
    )
    with pytest.raises(SandboxError, match=f"the default policy {checkout}/notes/policy.yaml: the sandbox may write "):
        refuse_inputs_in_reach(reach, beside)


def test_without_bubblewrap_auto_refuses_instead_of_falling_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "bubblewrap_available", lambda: False)
    for requested in ("auto", "bwrap"):
        with pytest.raises(SandboxError, match="bubblewrap is not installed"):
            choose_isolation(requested)
    assert choose_isolation("none") == "none"  # said knowingly
    monkeypatch.setattr(netns, "bubblewrap_available", lambda: True)
    assert choose_isolation("auto") == "bwrap"
