"""The unit tests sit in folders that mirror the packages (policy/, proxy/, dns/, broker/, audit/, gateway/,
sandbox/, launch/, inspection/, verify/, cli/); tests of the project as a whole (packaging, the setup script, the
README's commands, the reason codes, how the suite runs, the Kubernetes manifests) sit here at the top. The helper
modules they share sit here too (addon_env.py, approvals_env.py, broker_env.py, decide_cases.py, policy_text.py,
repo_files.py, tasks.py): this folder is put on sys.path so that a test in any folder imports them by name, the repo
root stays off it because its dns/ would shadow dnspython. A fixture only one folder's tests use is in that folder's
conftest.py.

A module marked `pytestmark = pytest.mark.tmpfs` gets each test's `tmp_path` on tmpfs (/dev/shm) where the machine
has one with room: the SQLite stores the broker tests open and close by the hundred (and the push tests' git
repositories) then never wait on a disk's fsync, which on a shared disk was a third of the suite's time. Only where
marked: a test of which paths may be mounted or hidden must see a folder where users' folders are."""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from mitmproxy import ctx
from mitmproxy.options import Options

sys.path.insert(0, str(Path(__file__).parent))

TMPFS = Path("/dev/shm")
TMPFS_ROOM = 1 << 30  # bytes free, at least: docker's default /dev/shm (64 MiB) is too small for the suite


@functools.cache
def _tmpfs_with_room() -> bool:
    try:
        stats = os.statvfs(TMPFS)
    except OSError:
        return False
    runs_programs = not stats.f_flag & os.ST_NOEXEC  # some tests run scripts they write there
    return runs_programs and os.access(TMPFS, os.W_OK) and stats.f_bavail * stats.f_frsize >= TMPFS_ROOM


@pytest.fixture
def tmp_path(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """pytest's `tmp_path`; for a test marked `tmpfs`, a folder of its own on tmpfs (0700, removed after it)."""
    if request.node.get_closest_marker("tmpfs") is None or not _tmpfs_with_room():
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix=f"airlock-unit-{tmp_path.name}-", dir=TMPFS))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def hook_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """mitmproxy's `ctx.options` with the one option the addon's hooks read declared alone (taddons' context would
    load mitmproxy's whole set)."""
    options = Options()
    options.add_option("stream_large_bodies", str | None, None, "")
    monkeypatch.setattr(ctx, "options", options, raising=False)
