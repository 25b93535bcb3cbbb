"""The cycle collector paused while the gateway makes what it keeps (its start's imports, a policy's load):
overlapping pauses leave it paused until the last one ends, whatever the order, and then what exists is frozen."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator

import pytest

from airlock.gateway.startup.collection import paused_collection


@pytest.fixture
def collecting() -> Iterator[None]:
    assert gc.isenabled()
    yield
    gc.enable()


@pytest.mark.parametrize("first_out", ["first_in", "last_in"])
def test_overlapping_pauses_collect_again_once_the_last_one_ends(collecting: None, first_out: str) -> None:
    one, two = paused_collection(), paused_collection()
    one.__enter__()
    two.__enter__()
    (one if first_out == "first_in" else two).__exit__(None, None, None)
    assert not gc.isenabled()  # the other still works
    frozen = gc.get_freeze_count()
    kept = [[] for _ in range(1000)]
    (two if first_out == "first_in" else one).__exit__(None, None, None)
    assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(kept)  # what was made meanwhile is frozen


def test_a_collector_turned_off_before_stays_off(collecting: None) -> None:
    gc.disable()
    with paused_collection():
        pass
    assert not gc.isenabled()


def test_work_that_fails_collects_again(collecting: None) -> None:
    with pytest.raises(RuntimeError), paused_collection():
        raise RuntimeError
    assert gc.isenabled()


def test_mitmproxys_and_aiohttps_import_runs_no_collection() -> None:
    """The thread's imports (some 300,000 objects) are walked by no collection, and are frozen once done."""
    probe = (
        "import gc, sys\nfrom airlock.gateway.startup import preload\nruns = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and runs.append(info['generation']))\n"
        "preload.preload_proxy().result(60)\ngc.callbacks.clear()\n"
        "print(runs, gc.isenabled(), gc.get_freeze_count() > 100_000)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out == "[] True True\n"
