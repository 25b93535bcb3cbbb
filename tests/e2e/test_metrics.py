"""The gateway's metrics and health endpoints, scraped from a running `airlock gateway` on its admin listener
after real proxy, DNS and broker traffic from the sandbox, and read with prometheus-client's own text parser."""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from airlock.verify.topology import GW_IP, Topology

from gateway_proc import PROXY, AdminConnection, GatewayProcess
from netclient import connect_tunnel, in_netns, proxy_http

BROKER = (GW_IP, 8080)

type Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def admin_get(gw: GatewayProcess, path: str) -> tuple[int, str]:
    """GET on the gateway's admin listener (its unix socket: path-based, so reachable from this namespace)."""
    conn = AdminConnection(gw.workdir / "state" / "admin.sock")
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def scrape(gw: GatewayProcess) -> Samples:
    status, text = admin_get(gw, "/metrics")
    assert status == 200, text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def wait_for(predicate: Callable[[], bool], timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def broker_call(authorization: str | None) -> int:
    conn = http.client.HTTPConnection(*BROKER, timeout=10)
    headers = {"Content-Type": "application/json", **({"Authorization": authorization} if authorization else {})}
    conn.request("POST", "/v1/tools/create_pull_request", json.dumps({"repo": "acme/app"}), headers)
    status = conn.getresponse().status
    conn.close()
    return status


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs of this test's own, unmounted afterwards: an audit log that can be made to fill up."""
    mountpoint = tmp_path / "small"
    mountpoint.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def test_metrics_count_what_the_sandbox_did(topology: Topology, own_gateway) -> None:
    gw = own_gateway()
    assert admin_get(gw, "/healthz")[0] == 200
    status, body = admin_get(gw, "/readyz")
    assert (status, json.loads(body)) == (200, {"ready": True, "problems": {}})
    sbx = topology.sbx
    assert in_netns(sbx, proxy_http, PROXY, "http://allowed.test/").status == 200
    for name in ("unlisted.test", "other-unlisted.test"):
        assert in_netns(sbx, proxy_http, PROXY, f"http://{name}/").status == 403
    assert topology.dns_query(sbx, "allowed.test", server=GW_IP).rcode == "NOERROR"
    assert topology.dns_query(sbx, "unlisted.test", server=GW_IP).rcode == "REFUSED"
    assert in_netns(sbx, broker_call, None) == 401
    assert in_netns(sbx, broker_call, "Bearer not-a-token") == 401
    tunnel, reply = in_netns(sbx, connect_tunnel, PROXY, "allowed.test:443")
    assert tunnel is not None, reply
    with contextlib.closing(tunnel):
        assert wait_for(lambda: value(scrape(gw), "airlock_open_tunnels", sandbox="sbx") == 1)
    assert wait_for(lambda: value(scrape(gw), "airlock_open_tunnels", sandbox="sbx") == 0)

    found = scrape(gw)
    decisions = "airlock_decisions_total"
    assert value(found, decisions, kind="http", decision="deny", profile="default", code="not_allowlisted") == 2
    assert value(found, decisions, kind="http", decision="allow", profile="default", code="allowed") == 1
    assert value(found, decisions, kind="connect", decision="allow", profile="default", code="allowed") == 1
    assert value(found, decisions, kind="dns", decision="deny", profile="default", code="not_allowlisted") == 1
    assert value(found, "airlock_dns_queries_total", sandbox="sbx", rcode="NOERROR") == 1
    assert value(found, "airlock_dns_queries_total", sandbox="sbx", rcode="REFUSED") == 1
    assert value(found, "airlock_broker_calls_total", tool="create_pull_request", status="401") == 2
    assert value(found, "airlock_broker_token_failures_total", code="missing_token") == 1
    assert value(found, "airlock_broker_token_failures_total", code="invalid_token") == 1
    assert (value(found, "airlock_bytes_total", sandbox="sbx", kind="http", direction="out") or 0) > 0
    assert value(found, "airlock_decide_duration_seconds_count", source="proxy") == 4  # 3 requests, 1 CONNECT
    assert value(found, "airlock_decide_duration_seconds_count", source="dns") == 2
    assert value(found, "airlock_upstream_connect_duration_seconds_count") == 1  # the tunnel sent nothing
    assert (value(found, "airlock_resolve_duration_seconds_count", result="ok") or 0) >= 1
    assert value(found, "airlock_open_connections", sandbox="sbx", side="client") == 0
    assert value(found, "airlock_audit_writable") == 1
    assert not [name for name, labels in found if any(v.endswith(".test") for _, v in labels)]  # no host labels


def test_readyz_is_503_while_the_audit_log_cannot_be_written(topology: Topology, own_gateway, small_disk: Path):
    gw = own_gateway(audit_path=small_disk / "audit.jsonl")
    assert admin_get(gw, "/readyz")[0] == 200
    filler = small_disk / "filler"
    with contextlib.suppress(OSError), filler.open("wb", buffering=0) as f:
        while True:
            f.write(b"x" * 1024)

    def unready() -> bool:
        in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/")  # an audit line to write
        return admin_get(gw, "/readyz")[0] == 503

    assert wait_for(unready, timeout=10), gw.log()
    status, body = admin_get(gw, "/readyz")
    problems = json.loads(body)["problems"]
    assert status == 503 and list(problems) == ["audit"] and "No space left" in problems["audit"]
    assert admin_get(gw, "/healthz")[0] == 200  # alive all the same
    found = scrape(gw)
    assert value(found, "airlock_audit_writable") == 0
    assert (value(found, "airlock_audit_write_errors_total") or 0) >= 1
    filler.unlink()
    assert wait_for(lambda: admin_get(gw, "/readyz")[0] == 200), gw.log()
