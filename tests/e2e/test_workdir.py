"""Nothing the sandbox writes in its working directory runs later on the host.

Each test lets the sandbox plant, by one way of the class, git configuration that would run a command of its
choice (core.fsmonitor, core.pager, hooks, filters, diff.external) — then runs the user's plain git commands
in the folder, on the host, as the folder's owner, and checks that the command never ran (it would create a
marker file)."""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from airlock.sandbox.workdir import QUARANTINE_ROOT
from airlock.verify.topology import DNS_SERVER, Topology

from gateway_proc import AIRLOCK, E2E_POLICY

NOBODY = pwd.getpwnam("nobody")  # run as root without sudo, the sandboxed command runs as nobody
HOST_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/nonexistent", "LC_ALL": "C"}
_counter = itertools.count()


def host_git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """git on the host as the folder's owner, with that user's (empty) configuration: what the user runs next."""
    return subprocess.run(
        ["git", "-c", "user.name=owner", "-c", "user.email=owner@example.test", *args],
        cwd=cwd, env=HOST_ENV, capture_output=True, text=True, timeout=30, check=check,
        user=NOBODY.pw_uid, group=NOBODY.pw_gid, extra_groups=[],
    )  # fmt: skip


def chown_tree(top: Path) -> None:
    for path in [top, *top.rglob("*")]:
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid, follow_symlinks=False)


@pytest.fixture
def marker(topology: Topology) -> Iterator[Path]:
    path = Path("/var/tmp") / f"{topology.prefix}-ran-{next(_counter)}"
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture
def folder(topology: Topology) -> Iterator[Path]:
    """An empty folder of the command's user (not a repository yet)."""
    root = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-wd-", dir="/var/tmp"))
    os.chown(root, NOBODY.pw_uid, NOBODY.pw_gid)
    yield root
    shutil.rmtree(root, ignore_errors=True)
    for leftover in QUARANTINE_ROOT.glob(f"{topology.prefix}*"):
        shutil.rmtree(leftover, ignore_errors=True)


@pytest.fixture
def repo(folder: Path) -> Path:
    """A repository with one commit on `main`, owned by the command's user."""
    host_git(folder, "init", "-q", "-b", "main")
    (folder / "README").write_text("hello\n")
    chown_tree(folder)
    host_git(folder, "add", "README")
    host_git(folder, "commit", "-qm", "first")
    return folder


def plant(config: str, marker: Path, hooks: str = ".evil-hooks") -> str:
    """Shell that writes, into the config file `config`, every setting that makes a plain git command run
    something, and a hooks folder whose hooks do the same."""
    run = f"touch {marker}"
    settings = {
        "core.fsmonitor": run,
        "core.pager": f"{run}; cat",
        "core.hooksPath": f"$PWD/{hooks}",
        "diff.external": run,
        "filter.evil.clean": run,
        "filter.evil.smudge": run,
        "core.editor": run,
    }
    lines = [f"mkdir -p {hooks}"]
    for hook in ("pre-commit", "post-commit", "post-checkout", "reference-transaction"):
        lines.append(f"printf '#!/bin/sh\\n{run}\\n' > {hooks}/{hook} && chmod +x {hooks}/{hook}")
    lines += [f"git config --file {config} {key} '{value}'" for key, value in settings.items()]
    return "; ".join(lines)


def probe(*folders: Path) -> None:
    """The user's plain git commands in each folder (paged output on a terminal, a commit for the hooks)."""
    for where in folders:
        if not where.is_dir():
            continue
        for args in (["status"], ["diff"], ["log", "-1"], ["add", "-A"], ["commit", "-qm", "probe"]):
            host_git(where, *args, check=False)
        subprocess.run(
            ["script", "-qec", "git -p log -1; git -p branch -a", "/dev/null"],
            cwd=where, env=HOST_ENV | {"PAGER": "cat"}, capture_output=True, timeout=30, stdin=subprocess.DEVNULL,
            user=NOBODY.pw_uid, group=NOBODY.pw_gid, extra_groups=[],
        )  # fmt: skip


def sandbox(run_in_gw, where: Path, script: str, *options: str) -> subprocess.CompletedProcess:
    result = run_in_gw("sh", "-c", script + "; true", cwd=where, options=options)
    assert result.returncode == 0, result.stderr
    return result


def test_the_probe_sees_a_plant_that_nothing_stopped(run_in_gw, repo: Path, marker: Path):
    # Without bubblewrap nothing protects the folder: the same plant runs, so the probe can see one.
    sandbox(run_in_gw, repo, plant(".git/config", marker), "--isolation", "none")
    probe(repo)
    assert marker.exists()


def test_renaming_git_away_and_building_a_new_one(run_in_gw, repo: Path, marker: Path):
    result = sandbox(run_in_gw, repo, f"mv .git .git-old; rm -rf .git; git init -q; {plant('.git/config', marker)}")
    probe(repo)
    assert not marker.exists(), result.stderr
    assert not (repo / ".git-old").exists()
    assert host_git(repo, "log", "--format=%s").stdout.split()[-1] == "first"


def test_commondir_pointing_at_a_folder_with_its_own_config(run_in_gw, repo: Path, marker: Path):
    script = f"git init -q --bare common; {plant('common/config', marker)}; echo $PWD/common > .git/commondir"
    sandbox(run_in_gw, repo, script)
    probe(repo, repo / "common")
    assert not marker.exists()
    assert not (repo / ".git" / "commondir").exists()


def test_a_git_file_in_place_of_the_folder(run_in_gw, repo: Path, marker: Path):
    script = f"git init -q --bare gd; {plant('gd/config', marker)}; rm -rf .git; printf 'gitdir: gd\\n' > .git"
    sandbox(run_in_gw, repo, script)
    probe(repo, repo / "gd")
    assert not marker.exists()
    assert (repo / ".git").is_dir()


def test_worktrees_and_worktree_config(run_in_gw, repo: Path, marker: Path):
    script = (
        f"git config extensions.worktreeConfig true; {plant('.git/config.worktree', marker)}; "
        "git worktree add -q ../wt-outside 2>/dev/null; git worktree add -q wt"
    )
    sandbox(run_in_gw, repo, script)
    probe(repo, repo / "wt")
    assert not marker.exists()
    assert not (repo / ".git" / "worktrees").exists() and not (repo / "wt" / ".git").exists()


def test_include_files_inside_the_folder(run_in_gw, repo: Path, marker: Path):
    (repo / "team.gitconfig").write_text("[user]\n\tname = team\n")
    chown_tree(repo)
    host_git(repo, "config", "include.path", "../team.gitconfig")
    host_git(repo, "config", "--add", "include.path", "../absent.gitconfig")
    host_git(repo, "config", "includeIf.gitdir:/.path", "../conditional.gitconfig")
    script = "; ".join(plant(name, marker) for name in ("team.gitconfig", "absent.gitconfig", "conditional.gitconfig"))
    sandbox(run_in_gw, repo, script)
    probe(repo)
    assert not marker.exists()
    assert (repo / "team.gitconfig").read_text() == "[user]\n\tname = team\n"
    assert not (repo / "absent.gitconfig").exists() and not (repo / "conditional.gitconfig").exists()


def test_attributes_filters_in_the_git_folder(run_in_gw, repo: Path, marker: Path):
    script = (
        f"mkdir -p .git/info; echo '* filter=evil diff=evil' > .git/info/attributes; {plant('.git/config', marker)}"
    )
    sandbox(run_in_gw, repo, script + "; echo changed >> README")
    probe(repo)
    assert not marker.exists()
    assert not (repo / ".git" / "info" / "attributes").exists()


def test_submodule_config_in_the_git_folder(run_in_gw, repo: Path, marker: Path):
    script = (
        f"git init -q --bare .git/modules/sub; {plant('.git/modules/sub/config', marker)}; mkdir -p sub; "
        "printf 'gitdir: ../.git/modules/sub\\n' > sub/.git; "
        "printf '[submodule \"sub\"]\\n\\tpath = sub\\n' > .gitmodules"
    )
    sandbox(run_in_gw, repo, script)
    probe(repo, repo / "sub")
    assert not marker.exists()
    assert not (repo / ".git" / "modules").exists() and not (repo / "sub" / ".git").exists()


def test_a_hooks_folder_the_users_config_keeps_in_the_tree(run_in_gw, repo: Path, marker: Path):
    (repo / ".husky").mkdir()
    chown_tree(repo)
    host_git(repo, "config", "core.hooksPath", ".husky")
    hook = f"printf '#!/bin/sh\\ntouch {marker}\\n' > .husky/pre-commit; chmod +x .husky/pre-commit"
    sandbox(run_in_gw, repo, hook)
    probe(repo)
    assert not marker.exists()
    assert list((repo / ".husky").iterdir()) == []


def test_a_hooks_folder_the_users_config_names_but_that_does_not_exist_yet(run_in_gw, repo: Path, marker: Path):
    host_git(repo, "config", "core.hooksPath", ".githooks")
    hook = f"mkdir .githooks; printf '#!/bin/sh\\ntouch {marker}\\n' > .githooks/pre-commit; chmod +x .githooks/*"
    result = sandbox(run_in_gw, repo, hook)
    probe(repo)
    assert not marker.exists()
    assert not (repo / ".githooks").exists()
    assert "moved what the sandbox created" in result.stderr and ".githooks" in result.stderr


def test_a_new_repository_below_the_folder(run_in_gw, repo: Path, marker: Path):
    sandbox(run_in_gw, repo, f"mkdir -p deep/er && cd deep/er && git init -q && {plant('.git/config', marker)}")
    probe(repo / "deep" / "er", repo / "deep")
    assert not marker.exists()
    assert not (repo / "deep" / "er" / ".git").exists()


def test_a_bare_repository_below_the_folder(run_in_gw, repo: Path, marker: Path):
    sandbox(run_in_gw, repo, f"git init -q --bare fixture && {plant('fixture/config', marker)}")
    probe(repo / "fixture")
    assert not marker.exists()
    assert not (repo / "fixture" / "HEAD").exists()


def test_a_git_symlink_below_the_folder(run_in_gw, repo: Path, marker: Path):
    script = f"git init -q --bare elsewhere/r && {plant('elsewhere/r/config', marker)}; "
    script += "mkdir lnk; ln -s ../elsewhere/r lnk/.git"
    sandbox(run_in_gw, repo, script)
    probe(repo / "lnk")
    assert not marker.exists()
    assert not os.path.lexists(repo / "lnk" / ".git")


def test_a_folder_that_is_no_repository_yet(run_in_gw, folder: Path, marker: Path):
    (folder / "notes.txt").write_text("mine\n")
    chown_tree(folder)
    result = sandbox(run_in_gw, folder, f"git init -q && {plant('.git/config', marker)}")
    probe(folder)
    assert not marker.exists()
    assert not (folder / ".git").exists() and (folder / "notes.txt").exists()
    quarantined = list(QUARANTINE_ROOT.glob("*/.git"))
    assert any(str(q.parent) in result.stderr for q in quarantined), result.stderr  # kept, not lost


def test_a_folder_inside_a_parent_repository(run_in_gw, repo: Path, marker: Path):
    sub = repo / "pkg"
    sub.mkdir()
    chown_tree(repo)
    script = (
        "echo agent > work.txt && git add work.txt && "
        "git -c user.name=a -c user.email=a@example.test commit -qm agent; "
        f"git init -q && {plant('.git/config', marker)}"
    )
    result = sandbox(run_in_gw, sub, script)
    probe(sub, repo)
    assert not marker.exists()
    assert not (sub / ".git").exists()
    log = host_git(repo, "log", "--format=%s", f"refs/airlock/{_sandbox_id(result)}/heads/main").stdout
    assert log.split() == ["agent", "first"], result.stderr


def test_the_sandboxs_commits_reach_the_user_and_nothing_else_does(run_in_gw, repo: Path, marker: Path):
    script = (
        "echo more >> README && git -c user.name=agent -c user.email=a@example.test commit -qam 'agent work' && "
        f"git checkout -qb agent/fix && echo fix > fix.txt && git add fix.txt && git -c user.name=agent "
        f"-c user.email=a@example.test commit -qm fix; {plant('.git/config', marker)}"
    )
    result = sandbox(run_in_gw, repo, script)
    sandbox_id = _sandbox_id(result)
    assert f"refs/airlock/{sandbox_id}/heads/main" in result.stderr, result.stderr
    subjects = host_git(repo, "log", "--format=%s", f"refs/airlock/{sandbox_id}/heads/main").stdout.splitlines()
    assert subjects == ["agent work", "first"]
    fix = host_git(repo, "log", "--format=%s", f"refs/airlock/{sandbox_id}/heads/agent/fix").stdout.splitlines()
    assert fix == ["fix", "agent work", "first"]
    assert host_git(repo, "log", "--format=%s", "main").stdout.split() == ["first"]  # the user's branch as it was
    assert (repo / "README").read_text() == "hello\nmore\n"  # the working tree is the sandbox's, as edited
    probe(repo)
    assert not marker.exists()


def test_a_branch_made_without_a_commit_is_not_told_as_commits(run_in_gw, repo: Path, marker: Path):
    result = sandbox(run_in_gw, repo, "git checkout -qb topic")
    head = host_git(repo, "rev-parse", "main").stdout.strip()
    told = [line for line in result.stderr.splitlines() if "refs/airlock/" in line]
    assert told == [
        f"airlock: the sandbox made no commit; its branches are in {repo / '.git'}: "
        f"refs/airlock/{_sandbox_id(result)}/heads/topic ({head[:12]})"
    ], result.stderr


def test_tools_that_run_files_of_the_folder_cannot_gain_new_ones(run_in_gw, repo: Path, marker: Path):
    (repo / ".vscode").mkdir()
    chown_tree(repo)
    script = (
        "echo '{}' > .vscode/tasks.json; mkdir -p x/.vscode .devcontainer && echo '{}' > x/.vscode/tasks.json; "
        f"echo 'touch {marker}' > x/.envrc; echo 'touch {marker}' > .envrc; mkdir -p y/.idea; echo ok > y/file"
    )
    sandbox(run_in_gw, repo, script)
    assert list((repo / ".vscode").iterdir()) == []
    for planted in ("x/.vscode", "x/.envrc", ".envrc", ".devcontainer", "y/.idea"):
        assert not (repo / planted).exists(), planted
    assert (repo / "y" / "file").read_text() == "ok\n"  # ordinary files stay where the sandbox wrote them


def _sandbox_id(result: subprocess.CompletedProcess) -> str:
    for line in result.stderr.splitlines():
        if "refs/airlock/" in line:
            return line.split("refs/airlock/")[1].split("/")[0]
    raise AssertionError(f"no exported refs in: {result.stderr}")


def test_a_killed_launcher_still_leaves_nothing_that_runs(topology: Topology, repo: Path, marker: Path):
    # The watchdog that removes the sandbox checks its working directory too, and takes its commits out.
    sandbox_id = f"{topology.prefix}wk"
    script = (
        "echo more >> README && git -c user.name=a -c user.email=a@example.test commit -qam 'before the kill'; "
        f"mkdir -p deep && cd deep && git init -q && {plant('.git/config', marker)}; touch ../planted; sleep 120"
    )
    argv = [AIRLOCK, "run", "--policy", E2E_POLICY, "--upstream-dns", DNS_SERVER, "--sandbox-id", sandbox_id]
    launcher = topology.popen(topology.gw, [*argv, "--", "sh", "-c", script], cwd=repo, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not (repo / "planted").exists():
            assert time.monotonic() < deadline and launcher.poll() is None, "the sandbox did not start"
            time.sleep(0.1)
        launcher.kill()
        launcher.wait()
        ref = f"refs/airlock/{sandbox_id}/heads/main"
        deadline = time.monotonic() + 10
        while (repo / "deep" / ".git").exists() or host_git(
            repo, "rev-parse", "-q", "--verify", ref, check=False
        ).returncode:
            assert time.monotonic() < deadline, "the working directory was not checked after the launcher died"
            time.sleep(0.1)
        probe(repo / "deep", repo)
        assert not marker.exists()
        assert host_git(repo, "log", "-1", "--format=%s", ref).stdout.strip() == "before the kill"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate(timeout=30)
