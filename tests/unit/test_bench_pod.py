"""bench/pod.py's own logic, without namespaces: the start-up medians, the import profile it reads, the per-tunnel
memory, the verdicts on the targets, and the wrk script it shares with bench/run.py. (The measurements themselves
need root: `sudo .venv/bin/python -P bench/pod.py`.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def pod() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_pod", BENCH / "pod.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_pod"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_the_total_is_the_median_of_the_totals_not_the_sum_of_the_medians(pod: ModuleType) -> None:
    starts = [pod.Start(10, 100, 1, 5, 50), pod.Start(20, 300, 2, 6, 70), pod.Start(30, 200, 30, 7, 60)]
    m = pod.medians(starts)
    assert (m["fence"], m["ready"], m["first"]) == (20, 200, 2)
    assert m["total"] == 260  # the totals are 111, 322, 260; the medians would sum to 222
    assert (m["fence_cpu"], m["ready_cpu"]) == (6, 60)


IMPORTTIME = """\
airlock gateway: proxy on 127.0.0.1:3128
import time: self [us] | cumulative | imported package
import time:       128 |        128 | _signal
import time:      1000 |       3000 |   asyncio.events
import time:       378 |     157086 | asyncio
import time:      6346 |     795846 | airlock.gateway.startup.mitm
import time:      5252 |     415401 |     aiohttp
import time:      6222 |     553917 | airlock.gateway.broker_relay
"""


def test_the_import_profile_names_the_top_level_imports_costliest_first(pod: ModuleType) -> None:
    assert pod.top_imports(IMPORTTIME, 3) == [
        ("airlock.gateway.startup.mitm", 795.846),
        ("airlock.gateway.broker_relay", 553.917),
        ("asyncio", 157.086),
    ]  # a nested import (aiohttp) is in its importer's time; the header line is no import


def test_memory_per_tunnel_is_measured_from_the_warmed_up_sidecar(pod: ModuleType) -> None:
    memory = pod.Memory(idle_kib=70_000, after_request_kib=71_000, warm_kib=72_000, tunnels_kib=79_000, tunnels=200,
                        failures=[])  # fmt: skip
    assert memory.kib_per_tunnel == 35.0


def test_a_target_missed_says_so(pod: ModuleType) -> None:
    assert pod.verdict(77.4, 80, "MiB") == "met (77.4 MiB ≤ 80)"
    assert pod.verdict(1234.5, 1000, "ms") == "**missed** (1,234.5 ms)"


def test_a_new_connection_per_request_is_asked_of_wrk_by_connection_close(pod: ModuleType) -> None:
    import common  # bench/common.py, on the path bench/pod.py set

    kept, fresh = common.wrk_script("/", "allowed.test"), common.wrk_script("/", "allowed.test", new_connections=True)
    assert 'wrk.headers["Host"] = "allowed.test"' in kept and "Connection" not in kept
    assert 'wrk.headers["Connection"] = "close"' in fresh
    assert fresh.replace('wrk.headers["Connection"] = "close"', "") == kept
