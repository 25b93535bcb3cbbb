"""How the suite itself runs (tests/conftest.py): the unit tests on a worker per CPU, anything with e2e tests in it
one test at a time."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]


def _pytest(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "AIRLOCK_REQUIRE"))}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done.stdout + done.stderr


def test_the_unit_tests_run_on_a_worker_per_cpu_two_at_most_unless_told_otherwise() -> None:
    workers = min(2, len(os.sched_getaffinity(0)))  # one CPU: no workers at all
    assert (f"created: {workers}/{workers} workers" in _pytest("tests/unit/policy/test_suffixes.py")) is (workers == 2)
    assert "created:" not in _pytest("-n", "0", "tests/unit/policy/test_suffixes.py")
    assert "created:" not in _pytest("-p", "no:xdist", "tests/unit/policy/test_suffixes.py")


def _workers(*args: str, **options: object) -> object:
    """How many workers tests/conftest.py asks pytest-xdist for, given these paths and options."""
    spec = importlib.util.spec_from_file_location("root_conftest", REPO / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    option = SimpleNamespace(**({"numprocesses": None, "usepdb": False, "trace": False, "capture": "fd"} | options))
    config = SimpleNamespace(option=option, args=list(args), invocation_params=SimpleNamespace(dir=REPO))
    conftest.pytest_cmdline_main(config)
    return option.numprocesses


def test_only_a_selection_of_unit_tests_alone_is_spread_over_workers() -> None:
    workers = min(2, len(os.sched_getaffinity(0)))
    spread = workers if workers == 2 else None
    assert _workers("tests/unit") == _workers("tests/unit/policy/test_paths.py::test_x") == spread
    assert _workers("tests/unit/broker") == _workers("tests/unit/dns", "tests/unit/test_packaging.py") == spread
    assert _workers("tests") is _workers("tests/e2e/test_run.py") is None  # the whole suite, or e2e tests: serial
    assert _workers("tests/unit/policy/test_paths.py", "tests/e2e/test_run.py") is None
    assert _workers("tests/unit", numprocesses=0) == 0 and _workers("tests/unit", usepdb=True) is None
    assert _workers("tests/unit", trace=True) is _workers("tests/unit", capture="no") is None
