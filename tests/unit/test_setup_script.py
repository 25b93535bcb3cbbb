"""scripts/setup, run on a copy of itself beside a stand-in .venv, with a PATH of the tools it needs: which Python it
takes (the caller's, or .venv's again: never only sudo's secure_path), and who runs the apt step (root itself; a user
through sudo, which it says; without sudo, it says what to install)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SEARCH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What the script runs besides the Python, apt-get and sudo stand-ins; bwrap stands for a package it installs.
TOOLS = (
    "bash", "dirname", "cat", "cut", "sha256sum", "grep", "rm",
    "ip", "nft", "setpriv", "sysctl", "curl", "git", "bwrap",
)  # fmt: skip
NEW, OLD = "exit 0", "exit 1"  # a Python that is >= 3.12, and one that is older (the script asks it just that)


def script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """scripts/setup and pyproject.toml, and a .venv already installed from them (as a run before left it)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup", repo / "scripts" / "setup")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    script(repo / ".venv" / "bin" / "python", NEW)
    script(repo / ".venv" / "bin" / "airlock", "")
    stamp = hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest()
    (repo / ".venv" / ".airlock-setup").write_text(f"{stamp} {repo}\n")
    return repo


def tools(folder: Path, uid: int, without: tuple[str, ...] = ("bwrap",), sudo: bool = True) -> Path:
    """A PATH folder: the real tools (less `without`), `id -u` saying `uid`, and apt-get and sudo that only log."""
    folder.mkdir()
    for tool in TOOLS:
        if tool not in without:
            (folder / tool).symlink_to(shutil.which(tool, path=SEARCH) or f"/nonexistent/{tool}")
    script(folder / "id", f"echo {uid}")
    for name in ("apt-get", "sudo") if sudo else ("apt-get",):
        script(folder / name, f'echo "{name} $*" >>{folder.parent / "calls"}')
    return folder


def setup(repo: Path, path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(repo / "scripts" / "setup"), *args], env={"PATH": str(path), **env}, capture_output=True, text=True,
        timeout=30, check=False,
    )  # fmt: skip


def calls(folder: Path) -> list[str]:
    log = folder.parent / "calls"
    return log.read_text().splitlines() if log.exists() else []


def test_an_existing_venv_is_used_again_when_path_has_no_new_python(repo: Path, tmp_path: Path):
    path = tools(tmp_path / "bin", 1000)
    script(path / "python3", OLD)  # the system's older one
    result = setup(repo, path, "--print-python")
    assert (result.returncode, result.stdout) == (0, ".venv/bin/python\n"), result.stderr


def test_python_is_found_on_the_callers_path(repo: Path, tmp_path: Path):
    shutil.rmtree(repo / ".venv")
    path = tools(tmp_path / "bin", 1000)
    script(path / "python3", OLD)
    script(path / "python3.12", NEW)  # pyenv's, say: on the user's PATH, not on sudo's secure_path
    result = setup(repo, path, "--print-python")
    assert (result.returncode, result.stdout) == (0, f"{path / 'python3.12'}\n"), result.stderr


def test_a_venv_too_old_gives_way_to_a_new_python(repo: Path, tmp_path: Path):
    script(repo / ".venv" / "bin" / "python", OLD)
    path = tools(tmp_path / "bin", 1000)
    script(path / "python3.13", NEW)
    assert setup(repo, path, "--print-python").stdout == f"{path / 'python3.13'}\n"


def test_without_python_it_says_why_and_under_sudo_what_to_do(repo: Path, tmp_path: Path):
    shutil.rmtree(repo / ".venv")
    path = tools(tmp_path / "bin", 0)
    result = setup(repo, path, SUDO_USER="alice")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1
    assert "needs Python >= 3.12" in result.stderr and "run ./scripts/setup as yourself" in result.stderr


@pytest.mark.parametrize("sudo", [True, False])
def test_as_root_the_apt_step_never_calls_sudo(repo: Path, tmp_path: Path, sudo: bool):
    path = tools(tmp_path / "bin", 0, sudo=sudo)
    result = setup(repo, path)
    assert result.returncode == 0, result.stderr
    install = "apt-get install -y -qq --no-install-recommends bubblewrap"
    assert calls(path) == ["apt-get update -qq", install]
    assert result.stderr == "scripts/setup: installing bubblewrap (apt-get)\n"


def test_as_a_user_only_the_apt_step_asks_sudo_and_says_so(repo: Path, tmp_path: Path):
    path = tools(tmp_path / "bin", 1000)
    result = setup(repo, path)
    assert result.returncode == 0, result.stderr
    assert calls(path) == ["sudo apt-get update -qq", "sudo apt-get install -y -qq --no-install-recommends bubblewrap"]
    assert result.stderr == "scripts/setup: installing bubblewrap with sudo apt-get\n"


def test_a_user_without_sudo_hears_what_to_install(repo: Path, tmp_path: Path):
    path = tools(tmp_path / "bin", 1000, sudo=False)
    result = setup(repo, path)
    assert result.returncode == 0 and calls(path) == []
    assert "needs these system packages: bubblewrap (install them as root: no sudo here)" in result.stderr


def test_set_up_already_it_does_nothing_and_says_nothing(repo: Path, tmp_path: Path):
    path = tools(tmp_path / "bin", 1000, without=())
    result = setup(repo, path)
    assert (result.returncode, result.stdout, result.stderr, calls(path)) == (0, "", "", [])
