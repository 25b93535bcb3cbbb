"""The tools an agent uses, in `airlock run`, as its user's shell has them: `git commit` with the invoker's identity,
`npm install` from the registry (the starter policy's `npm` profile; a cache npm can write, per run or kept with
`--cache`), and a command the sandbox cannot find refused before anything starts. Real git, node and npm against
the fake internet's registry (airlock/verify/registry.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from airlock.cli.common import default_policy_path
from airlock.verify.fakeca import FakeCA
from airlock.verify.registry import NPM_PACKAGE
from airlock.verify.topology import FakeNet, Topology

NOBODY = 65534


@pytest.fixture
def folder(topology: Topology) -> Iterator[Path]:
    """A working directory anyone may write (the command runs as nobody, root without sudo, or as --user)."""
    path = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-tools-", dir="/var/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _without_sudo(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUDO_", "GIT_"))}
    return env | extra


def test_git_commits_in_the_sandbox_as_the_invoker(run_in_gw, folder: Path, tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[user]\n\tname = Ada Lovelace\n\temail = ada@example.test\n")
    repo = folder / "repo"
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    os.chown(repo, NOBODY, NOBODY)
    for path in repo.rglob("*"):
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    script = "echo hi > f && git add f && git commit -qm first && git log -1 --format='%an <%ae> / %cn <%ce>'"
    env = _without_sudo(HOME=str(home), GIT_CONFIG_NOSYSTEM="1")
    result = run_in_gw("sh", "-c", script, cwd=repo, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "Ada Lovelace <ada@example.test> / Ada Lovelace <ada@example.test>"
    named = run_in_gw(
        "sh", "-c", "git commit -q --allow-empty -m second && git log -1 --format=%an", cwd=repo, env=env,
        options=("--git-identity", "Agent Smith <agent@example.test>"),
    )  # fmt: skip
    assert (named.returncode, named.stdout.strip()) == (0, "Agent Smith"), named.stderr
    bare = run_in_gw("git", "commit", "-q", "--allow-empty", "-m", "third", cwd=repo, env=env,
                     options=("--git-identity", "none"))  # fmt: skip
    assert bare.returncode != 0 and "Author identity unknown" in bare.stderr


def test_a_bare_script_name_is_refused_before_the_start_and_the_fix_named(run_in_gw, folder: Path):
    (folder / "agent.sh").write_text("#!/bin/sh\necho agent ran\n")
    (folder / "agent.sh").chmod(0o755)
    result = run_in_gw("agent.sh", cwd=folder)
    assert result.returncode == 2 and "agent ran" not in result.stdout, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "airlock: agent.sh: command not found in the sandbox's PATH (/usr/local/bin:/usr/bin:/bin); to run the one "
        "in the working directory: ./agent.sh"
    )
    ran = run_in_gw("./agent.sh", cwd=folder)
    assert (ran.returncode, ran.stdout) == (0, "agent ran\n"), ran.stderr


NPM_INSTALL = f"npm install --no-audit --no-fund --no-update-notifier {NPM_PACKAGE} >/dev/null && "
NPM_INSTALL += f'node -e \'console.log("answer", require("{NPM_PACKAGE}"))\''


def _npm_options(topology: Topology, test_ca: FakeCA, folder: Path, *extra: str) -> tuple[str, ...]:
    """The starter policy's npm profile, and the fake internet's CA for npm (npm 11 reads no NODE_EXTRA_CA_CERTS:
    its own `cafile`); the command runs as `daemon`, whose home exists and is read-only in the sandbox, as a real
    user's is."""
    ca = folder / "fake-internet-ca.pem"
    shutil.copy(test_ca.ca_cert, ca)
    ca.chmod(0o644)
    return (
        "--policy", str(default_policy_path()), "--profile", "npm", "--user", "daemon",
        "--env", f"npm_config_cafile={ca}", *extra,
    )  # fmt: skip


def test_npm_installs_from_the_registry_with_the_npm_profile(
    run_in_gw, topology: Topology, fakenet: FakeNet, test_ca: FakeCA, folder: Path
):
    result = run_in_gw("sh", "-c", NPM_INSTALL, cwd=folder, timeout=120,
                       options=_npm_options(topology, test_ca, folder))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "answer 42"
    assert (folder / "node_modules" / NPM_PACKAGE / "index.js").is_file()
    assert not (folder / ".npm").exists()  # the run's own cache was in its private /tmp


def test_npm_keeps_its_cache_across_runs_in_the_cache_folder(
    run_in_gw, topology: Topology, fakenet: FakeNet, test_ca: FakeCA, folder: Path, tmp_path: Path
):
    work, cache = folder / "work", Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-cache-", dir="/var/tmp"))
    work.mkdir(mode=0o777)
    work.chmod(0o777)
    try:
        os.chown(cache, 1, 1)  # daemon's
        options = _npm_options(topology, test_ca, folder, "--cache", str(cache))
        first = run_in_gw("sh", "-c", NPM_INSTALL, cwd=work, timeout=120, options=options)
        assert first.returncode == 0, first.stderr
        assert list((cache / "npm").iterdir()), "npm wrote nothing into --cache"
        shutil.rmtree(work / "node_modules")
        fetched = fakenet.connections("192.0.2.10", 443)
        offline = NPM_INSTALL.replace("npm install", "npm install --offline")
        second = run_in_gw("sh", "-c", offline, cwd=work, timeout=120, options=options)
        assert (second.returncode, second.stdout.strip()) == (0, "answer 42"), second.stderr
        assert fakenet.connections("192.0.2.10", 443) == fetched  # from the kept cache alone
    finally:
        shutil.rmtree(cache, ignore_errors=True)
