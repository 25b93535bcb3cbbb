"""bench/overhead.py's reading of a py-spy profile, without namespaces (the measurements need root)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def overhead() -> ModuleType:
    sys.path.append(str(BENCH))  # its `common`
    spec = importlib.util.spec_from_file_location("bench_overhead", BENCH / "overhead.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_overhead"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_each_sample_counts_for_its_innermost_frame_outside_the_generic_standard_library(
    overhead: ModuleType,
) -> None:
    site = next(p for p in sys.path if p.endswith("site-packages"))
    tree, stdlib = overhead.REPO, overhead.STDLIB
    loop = f"BaseEventLoop._run_once ({stdlib}asyncio/base_events.py)"
    hook = f"HttpPolicy.requestheaders ({tree}/proxy/httppolicy.py)"
    check = f"check_option_type ({site}/mitmproxy/utils/typecheck.py)"
    raw = "\n".join([
        f"{loop};{hook};dumps ({stdlib}json/__init__.py) 3",  # json called by airlock: airlock's
        f"{loop};{check};get_origin ({stdlib}typing.py) 2",  # typing called by mitmproxy's typecheck: mitmproxy's
        f"{loop};_SelectorSocketTransport.write ({stdlib}asyncio/selector_events.py) 4",
        f"{loop};EpollSelector.select ({stdlib}selectors.py) 1",
        f"Thread.run ({stdlib}threading.py);SpliceRelay._run ({tree}/proxy/splice_relay.py) 5",  # its epoll wait
        f"SpliceRelay._run ({tree}/proxy/splice_relay.py);Direction.pump ({tree}/proxy/splice_relay.py) 2",
    ])  # fmt: skip
    profile = overhead.parse_profile("keep-alive", raw)
    assert profile.samples == 17
    assert profile.areas == {
        "airlock (its hooks, policy, audit)": 5,  # the relay's splicing is airlock's
        "mitmproxy's HTTP/1 parsing, layers, messages": 2,
        "asyncio, sockets, TLS": 4,
        "waiting in epoll (idle, mostly)": 6,  # the event loop's and the relay thread's
    }
    assert profile.own["get_origin (typing.py)"] == 2
    assert profile.total["check_option_type (mitmproxy/utils/typecheck.py)"] == 2
    assert profile.total["BaseEventLoop._run_once (asyncio/base_events.py)"] == 10
    assert profile.own["SpliceRelay._run (proxy/splice_relay.py)"] == 5
