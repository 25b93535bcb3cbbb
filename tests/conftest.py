"""Shared pytest configuration: the privileged gate for network-namespace tests, and the PostgreSQL server.

Tests that need root, `ip netns` and `nft` carry the `netns` marker (applied automatically to everything under
tests/e2e). Without those privileges they are skipped locally, but CI sets AIRLOCK_REQUIRE_PRIVILEGED=1 so a
missing privilege becomes a failure instead of a silently green run. Tests that need PostgreSQL carry the
`postgres` marker and use the `postgres_server` (one per test process, tests/pg.py) or `postgres_database` (a fresh
database on it) fixtures: gated the same way.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# airlock's modules and the test modules are compiled (and the tests' asserts rewritten) in this process, and
# airlock again in the many subprocesses the tests start: let this process cache the bytecode even where
# PYTHONDONTWRITEBYTECODE is set (as on these machines, CI's included), so that a run, and its subprocesses, load
# modules instead of compiling them (a few seconds of the unit suite's CPU). The caches are gitignored.
sys.dont_write_bytecode = False

sys.path.insert(0, str(Path(__file__).parent))  # tests/pg.py, for this file and the tests alike
import pg  # noqa: E402

E2E_DIR = Path(__file__).parent / "e2e"
UNIT_DIR = (Path(__file__).parent / "unit").resolve()  # the arguments are resolved too (a symlinked checkout)
REQUIRE_ENV = "AIRLOCK_REQUIRE_PRIVILEGED"


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=15, check=False)


@functools.cache
def privilege_problem() -> str | None:
    """Why namespace tests cannot run here, or None when they can (probed once per process)."""
    if os.geteuid() != 0:
        return "not running as root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found on PATH"
    # A real probe: create a throwaway namespace and list nftables inside it, so a missing capability,
    # a seccomp filter or a kernel without nf_tables shows up here rather than as a confusing test error.
    probe = f"alprobe{secrets.token_hex(3)}"
    try:
        created = _run(["ip", "netns", "add", probe])
        if created.returncode != 0:
            return f"`ip netns add` failed: {created.stderr.strip()}"
        nft = _run(["ip", "netns", "exec", probe, "nft", "list", "ruleset"])
        if nft.returncode != 0:
            return f"`nft` unusable inside a namespace: {nft.stderr.strip()}"
    finally:
        _run(["ip", "netns", "delete", probe])  # also clears a half-made probe; the name is unique to us
    return None


def require_privileged() -> None:
    """Skip (or, under AIRLOCK_REQUIRE_PRIVILEGED=1, fail) unless namespace tests can run."""
    problem = privilege_problem()
    if problem is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"privileged e2e tests required ({REQUIRE_ENV}=1) but cannot run: {problem}", pytrace=False)
    pytest.skip(f"needs root + ip netns + nft: {problem}")


@pytest.fixture(scope="session")
def privileged() -> None:
    """Fixture form of require_privileged() for fixtures that build namespaces."""
    require_privileged()


def require_postgres() -> None:
    """Skip (or, under AIRLOCK_REQUIRE_PRIVILEGED=1, fail) unless the tests can run a PostgreSQL server."""
    problem = pg.problem()
    if problem is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"PostgreSQL tests required ({REQUIRE_ENV}=1) but cannot run: {problem}", pytrace=False)
    pytest.skip(f"needs a PostgreSQL server: {problem}")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[pg.PostgresServer]:
    """One PostgreSQL server for this test process, on a unix socket in a temporary folder; removed at the end."""
    require_postgres()
    server = pg.PostgresServer.start()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture
def postgres_database(postgres_server: pg.PostgresServer) -> str:
    """The URL of an empty database of the test's own (the server is restarted if a test stopped it)."""
    if not postgres_server.running():
        postgres_server.start_again()
    return postgres_server.emptied_database()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """`pytest tests/unit` (or anything in it) runs on a worker process per CPU, two at most (pytest-xdist): half
    the time on these machines. Anything else runs as asked, one test at a time: the e2e tests build namespaces and
    fences, and time what they measure. `-n 0` (or `-p no:xdist`) runs the unit tests in this process too, and so
    do `--pdb`, `--trace` and `-s` (a debugger, or output, wants this process)."""
    option = config.option
    if hasattr(config, "workerinput") or getattr(option, "numprocesses", 0) is not None:
        return
    cpus = min(2, len(os.sched_getaffinity(0)))
    if option.usepdb or getattr(option, "trace", False) or option.capture == "no" or cpus < 2:
        return
    here = config.invocation_params.dir
    paths = [(here / arg.split("::")[0]).resolve() for arg in config.args]
    if paths and all(path == UNIT_DIR or UNIT_DIR in path.parents for path in paths):
        option.numprocesses = cpus


def pytest_configure(config: pytest.Config) -> None:
    # Every gateway the tests start (airlock gateway, airlock run) enters itself among the running ones: in a
    # folder of this run's, never the host's /run/airlock/runs (a worker inherits the controller's).
    from airlock.runs import RUNS_ENV

    if RUNS_ENV not in os.environ:
        os.environ[RUNS_ENV] = tempfile.mkdtemp(prefix="airlock-test-runs-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(RUNS_ENV), ignore_errors=True))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in item.path.parents:
            item.add_marker(pytest.mark.netns)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Gate before any fixture runs, so an unprivileged run never starts building namespaces.
    if item.get_closest_marker("netns") is not None:
        require_privileged()
    if item.get_closest_marker("postgres") is not None:
        require_postgres()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Under CI nothing may be skipped, whatever the reason: a skip there is a test that did not run.
    if os.environ.get(REQUIRE_ENV) != "1" or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if skipped:
        print(f"\n{REQUIRE_ENV}=1: {skipped} test(s) skipped; failing the run")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
