"""The package builds as pyproject.toml lays it out, without setuptools warning about that layout (every folder
Python would import is a listed package), and the wheel holds the data files airlock reads and `airlock verify`'s
fake internet."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_builds_without_a_warning_and_holds_the_data(tmp_path: Path):
    source = tmp_path / "source"  # a copy: the build writes its build/ and egg-info beside the sources
    layout = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in {*layout.values()}:
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(tmp_path / "dist"), str(source)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "BuildBackendWarning" not in output and "SetuptoolsDeprecationWarning" not in output
    (wheel,) = (tmp_path / "dist").glob("airlock-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"airlock/sandbox/data/docker-seccomp-default.json", "airlock/configs/default.yaml"} <= set(names)
    assert {"airlock/verify/fakenet.py", "airlock/verify/probe.py", "airlock/cli/verify.py"} <= set(names)
