"""bench/run.py's own logic, without namespaces: which ports its proxies take, how it reads curl's per-request
output, and the inspected-HTTPS report a reader compares. (The measurements themselves need root: `sudo
.venv/bin/python bench/run.py`.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from argparse import Namespace
from dataclasses import fields
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from airlock.gateway.config import BrokerConfig, GatewayConfig

BENCH = Path(__file__).resolve().parents[2] / "bench" / "run.py"


@pytest.fixture(scope="module")
def run() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_run", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_run"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_no_bare_proxy_listens_on_a_port_the_gateway_takes(run: ModuleType) -> None:
    # A bare mitmdump on the gateway's transparent port shared its connections with it: requests were reset.
    defaults = {f.name: f.default for f in fields(GatewayConfig)}
    taken = {defaults["proxy_port"], defaults["transparent_port"], defaults["dns_port"], BrokerConfig().port}
    bench = {run.BARE_HTTP_PORT, run.BARE_PASS_PORT, run.BARE_INTERCEPT_PORT}
    bench |= {run.INSPECTING_PORTS + i for i in range(len(run.INSPECTED))}
    assert not bench & taken
    assert len(bench) == 3 + len(run.INSPECTED)


class FakeTopology:
    """Answers `run` with what curl printed (one line per request: status, new connections, seconds)."""

    def __init__(self, lines: list[str]) -> None:
        self.stdout = "".join(line + "\n" for line in lines)

    def run(self, ns: str, argv: list[Any], timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 0, self.stdout, "")


def route(run: ModuleType) -> Any:
    return run.TlsRoute("airlock inspected", "sbx", "http://10.254.0.1:3150", Path("/ca.pem"), 1)


def test_kept_alive_requests_time_all_but_the_one_that_opened_the_connection(run: ModuleType) -> None:
    topo = FakeTopology(["200 1 0.010", "200 0 0.002", "200 0 0.003"])
    assert run.curl_requests(topo, route(run), 3, fresh=False) == pytest.approx([2.0, 3.0])


@pytest.mark.parametrize(
    ("lines", "fresh", "bad"),
    [
        (["200 1 0.010", "200 0 0.002"], True, "200 0 0.002"),  # a new connection each was asked for
        (["200 1 0.010", "200 1 0.002"], False, "200 1 0.002"),  # the kept-alive connection was not kept
        (["200 1 0.010", "403 0 0.002"], False, "403 0 0.002"),
        (["200 1 0.010"], False, ""),  # an answer missing
    ],
)
def test_a_column_that_does_not_measure_what_it_names_fails(
    run: ModuleType, lines: list[str], fresh: bool, bad: str
) -> None:
    with pytest.raises(RuntimeError, match="via airlock inspected failed") as failed:
        run.curl_requests(FakeTopology(lines), route(run), 2, fresh=fresh)
    assert f"first bad: {bad!r}" in str(failed.value)


def result(run: ModuleType, name: str, ms: float, cpu_s: float) -> Any:
    return run.TlsResult(name, rounds=[[ms] * 10], requests=10, cpu_s=cpu_s, upstream_conns=1)


def test_the_inspected_https_report_sets_airlock_against_bare_interception_and_passthrough(run: ModuleType) -> None:
    names = {
        "bare mitmproxy passthrough": 0.5, "bare mitmproxy intercepting": 2.0, "airlock passthrough": 0.5,
        "airlock inspected": 4.0, "airlock inspected + inject": 2.0, "airlock inspected + inject + http rules": 2.5,
    }  # fmt: skip
    kept = [result(run, name, ms, ms / 100) for name, ms in names.items()]
    fresh = [result(run, name, ms * 10, ms / 10) for name, ms in names.items()]
    text = run.inspect_report(Namespace(rounds=1, tls_requests=11, tls_fresh=10), kept, fresh)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["airlock inspected / bare mitmproxy intercepting"].startswith(
        "| airlock inspected / bare mitmproxy intercepting | 0.50x (target ≥ 0.90x) | 2.00x |"
    )
    assert "| 1.00x (target ≥ 0.90x) |" in rows["airlock inspected + inject / bare mitmproxy intercepting"]
    assert rows["airlock inspected minus airlock passthrough"] == (
        "| airlock inspected minus airlock passthrough | +3.50 | +3.50 | +35.00 | +35.00 |"
    )
    assert "| airlock inspected | 250 | 250 | 4.00 | 4.00 | 4,000 | 1 |" in text  # req/s of one connection
