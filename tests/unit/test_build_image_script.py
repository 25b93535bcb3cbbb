"""scripts/build-image, run on a copy of itself in a stand-in checkout: what it refuses before it builds anything
(the build itself: the docker pod tests import its image, tests/e2e/test_docker_pod.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts" / "lib").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "build-image", repo / "scripts" / "build-image")
    shutil.copy(ROOT / "scripts" / "lib" / "rootfs.sh", repo / "scripts" / "lib" / "rootfs.sh")
    (repo / "pyproject.toml").write_text('[project]\nname = "airlock"\nversion = "9.8.7"\n')
    return repo


def build(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cache = repo.parent / "cache"
    # GIT_CEILING_DIRECTORIES: the stand-in checkout is no git repository, even inside one.
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "AIRLOCK_IMAGE_CACHE": str(cache),
        "GIT_CEILING_DIRECTORIES": str(repo.parent),
    }
    return subprocess.run(
        [str(repo / "scripts" / "build-image"), *args], capture_output=True, text=True, env=env, timeout=30
    )


@pytest.mark.parametrize("args", [("--bogus",), ("--import", "extra"), ("-f",)])
def test_an_unknown_argument_is_a_usage_error(repo: Path, args: tuple[str, ...]) -> None:
    result = build(repo, *args)
    assert result.returncode == 2 and result.stderr.startswith("usage: ") and "[--force] [--import]" in result.stderr
    assert result.stdout == "" and not (repo.parent / "cache").exists()


def test_a_checkout_without_its_venv_is_told_to_run_setup(repo: Path) -> None:
    result = build(repo, "--import")
    assert result.returncode == 1
    assert result.stderr == f"build-image: {repo}/.venv/bin/pip not found: run scripts/setup first\n"


def test_a_pyproject_without_a_version_is_refused(repo: Path) -> None:
    (repo / "pyproject.toml").write_text('[project]\nname = "airlock"\n')
    result = build(repo)
    assert result.returncode == 1
    assert result.stderr == f'build-image: no version = "..." line in {repo}/pyproject.toml\n'


def stand_in_venv(repo: Path, base_prefix: Path | str) -> None:
    """A .venv whose python names `base_prefix` as the Python it was made from."""
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = f'case "$2" in *base_prefix*) echo {base_prefix};; *) echo python3.12;; esac'
    for name, body in [("pip", "exit 0"), ("python", python)]:
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)


def test_a_venv_made_from_a_distributions_python_is_refused(repo: Path) -> None:
    stand_in_venv(repo, "/usr")  # /usr cannot be copied into the image
    result = build(repo)
    assert result.returncode == 1
    says = ".venv's Python (/usr) is not a Python prefix of its own: make .venv with pyenv's (scripts/setup)"
    assert result.stderr == f"build-image: {says}\n"


def test_sources_outside_a_git_checkout_are_refused(repo: Path, tmp_path: Path) -> None:
    prefix = tmp_path / "python"
    (prefix / "lib" / "python3.12").mkdir(parents=True)
    (prefix / "bin").mkdir()
    (prefix / "bin" / "python3.12").write_text("#!/bin/sh\n")
    (prefix / "bin" / "python3.12").chmod(0o755)
    stand_in_venv(repo, prefix)
    result = build(repo)
    assert result.returncode == 1
    assert result.stderr == f"build-image: {repo} is not a git checkout: the image's sources and revision are git's\n"
