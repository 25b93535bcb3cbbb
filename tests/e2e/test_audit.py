"""The audit as an operator reads it: a line of every kind, each matching the published schema and carrying the
profile, the policy hash and stable rule ids; policy reloads audited; the file reopened on SIGUSR1; `--audit -`."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from airlock.policy import load_policy
from airlock.verify.fakeca import FakeCA
from airlock.verify.topology import GW_IP, FakeNet, Topology

from gateway_proc import E2E_POLICY, PROXY, GatewayProcess, assert_audit_schema
from netclient import connect_tunnel, in_netns, proxy_http, tls_get

KINDS = {"http", "connect", "dns", "broker", "policy"}


def _broker_status(url: str) -> int:
    """A broker call without a token, straight to the gateway (no proxy)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        return opener.open(url, timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code


def _wait_for(gw: GatewayProcess, found: Any, timeout: float = 5) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while not found(records := gw.audit()):
        assert time.monotonic() < deadline, records
        time.sleep(0.05)
    return records


def test_every_kind_of_audit_line_matches_the_published_schema(
    topology: Topology, fakenet: FakeNet, own_gateway, test_ca: FakeCA, tmp_path: Path
):
    policy_path = tmp_path / "live.yaml"
    policy_path.write_text(E2E_POLICY.read_text())
    gw = own_gateway(policy_path)
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/a").status == 200
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://evil.test/b").status == 403
    assert in_netns(topology.sbx, tls_get, PROXY, "allowed.test:443", "allowed.test", test_ca.ca_cert).status == 200
    sock, reply = in_netns(topology.sbx, connect_tunnel, PROXY, "evil.test:443")
    assert sock is None and reply.status == 403
    assert topology.dns_query(topology.sbx, "allowed.test", server=GW_IP).rcode == "NOERROR"
    assert topology.dns_query(topology.sbx, "evil.test", server=GW_IP).rcode == "REFUSED"
    assert in_netns(topology.sbx, _broker_status, f"http://{GW_IP}:8080/v1/tools") == 401
    first_hash = load_policy(policy_path).hash
    # A reload that adds a rule, then one that is refused: both audited, with the hashes.
    policy_path.write_text(E2E_POLICY.read_text().replace("    allow:\n", "    allow:\n      - host: new.test\n", 1))
    gw.proc.send_signal(signal.SIGHUP)
    _wait_for(gw, lambda records: any(r["kind"] == "policy" for r in records))
    second_hash = load_policy(policy_path).hash
    policy_path.write_text("version: 1\nprofiles:\n  default:\n    allow:\n      - host: '*'\n")
    gw.proc.send_signal(signal.SIGHUP)
    records = _wait_for(gw, lambda records: sum(r["kind"] == "policy" for r in records) == 2)
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://evil.test/after").status == 403
    gw.stop()  # writes out every line, and checks each against the schema
    records = gw.audit()
    assert_audit_schema(records)
    assert {r["kind"] for r in records} == KINDS
    for record in records:
        assert record["schema"] == 1
        assert record["profile"] == (None if record["kind"] == "policy" else "default"), record
    loaded, refused = [r for r in records if r["kind"] == "policy"]
    assert (loaded["decision"], loaded["code"], loaded["policy_hash"]) == ("allow", "policy_loaded", second_hash)
    assert loaded["extra"] == {"source": str(policy_path), "previous_hash": first_hash}
    assert (refused["decision"], refused["code"], refused["policy_hash"]) == ("deny", "policy_refused", second_hash)
    assert refused["extra"]["errors"][0].startswith(f"{policy_path}:5: ")
    denied = next(r for r in records if r["kind"] == "http" and r["path"] == "/b")
    assert (denied["policy_hash"], denied["code"]) == (first_hash, "not_allowlisted")
    assert denied["hint"] == "allow: [{host: evil.test, ports: [80]}]"
    after = next(r for r in records if r["kind"] == "http" and r["path"] == "/after")
    assert after["policy_hash"] == second_hash  # the refused reload left the reloaded policy in force
    allowed = next(r for r in records if r["kind"] == "http" and r["path"] == "/a")
    rule = load_policy(E2E_POLICY).profile().allow[0]
    assert (allowed["rule"], allowed["rule_source"]) == (rule.id, f"{policy_path}:6")


# With workers, the supervisor is the audit file's one writer: it reopens it, the workers' lines follow.
@pytest.mark.parametrize("workers", [("--workers", "1"), ("--workers", "2")], ids=["one-process", "two-workers"])
def test_sigusr1_reopens_the_audit_file(topology: Topology, fakenet: FakeNet, own_gateway, workers: tuple[str, ...]):
    gw = own_gateway(extra=workers)
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/before").status == 200
    _wait_for(gw, lambda records: len(records) == 1)
    rotated = gw.audit_path.with_suffix(".1")
    gw.audit_path.rename(rotated)  # what log rotation does, then it sends SIGUSR1
    gw.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while not gw.audit_path.exists():  # opened anew at once, before any new line
        assert gw.proc.poll() is None and time.monotonic() < deadline, gw.log()
        time.sleep(0.05)
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/after").status == 200
    assert [r["path"] for r in _wait_for(gw, lambda records: len(records) == 1)] == ["/after"]
    assert [json.loads(line)["path"] for line in rotated.read_text().splitlines()] == ["/before"]
    assert gw.proc.poll() is None


def test_audit_dash_writes_the_audit_to_stdout(topology: Topology, fakenet: FakeNet, own_gateway):
    gw = own_gateway(extra=("--audit", "-"))  # the last --audit wins over the file the test harness passes
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://evil.test/streamed").status == 403
    deadline = time.monotonic() + 5
    while '"/streamed"' not in gw.log():
        assert time.monotonic() < deadline, gw.log()
        time.sleep(0.05)
    [line] = [line for line in gw.log().splitlines() if '"/streamed"' in line]
    record = json.loads(line)
    assert_audit_schema([record])
    assert (record["host"], record["decision"]) == ("evil.test", "deny")
    assert not gw.audit_path.exists()
