"""Report mode end to end: a real `airlock gateway` whose profile says `mode: report`. The sandbox reaches a host no
rule lists (the fake internet sees it) and the audit says `report`; it still cannot reach cloud metadata or an
internal address, by address or by an unlisted name; DNS answers unlisted names, never with internal addresses;
and `policy suggest` turns the day's report lines into the rules."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from airlock.verify.fakeca import FakeCA
from airlock.verify.topology import GW_IP, FakeNet, Topology

from gateway_proc import AIRLOCK, PROXY, GatewayProcess

EVIL_IP = "203.0.113.66"  # evil.test: listed by no rule of the policy below
PROXY_URL = f"http://{PROXY[0]}:{PROXY[1]}"
POLICY = """\
# Report-mode policy of the e2e tests: what no rule lists passes, audited as `report`.
version: 1
profiles:
  default:
    mode: report
    allow:
      - host: allowed.test
        ports: [80, 443]
"""


@pytest.fixture
def gw(own_gateway, tmp_path: Path) -> GatewayProcess:
    path = tmp_path / "report.yaml"
    path.write_text(POLICY)
    return own_gateway(path)


def _curl(topology: Topology, *args: str) -> tuple[str, str]:
    """(HTTP status, body) of a curl through the proxy from the sandbox."""
    result = topology.curl(topology.sbx, "-x", PROXY_URL, "-w", "\n%{http_code}", *args)
    body, _, status = result.stdout.rpartition("\n")
    return status, body.strip()


def test_an_unlisted_host_is_reached_and_audited_as_report(
    topology: Topology, fakenet: FakeNet, gw: GatewayProcess, test_ca: FakeCA
):
    status, body = _curl(topology, "http://evil.test/canary")
    assert (status, body) == ("200", f"fakenet {EVIL_IP}:80 host=evil.test path=/canary")
    status, body = _curl(topology, "--cacert", str(test_ca.ca_cert), "https://evil.test/tls")
    assert (status, body) == ("200", f"fakenet {EVIL_IP}:443 host=evil.test path=/tls")
    assert fakenet.connections(EVIL_IP, 80) == 1 and fakenet.connections(EVIL_IP, 443) == 1
    [plain] = gw.audit_for(host="evil.test", kind="http")
    assert (plain["decision"], plain["code"], plain["chosen_ip"]) == ("report", "not_allowlisted", EVIL_IP)
    assert plain["hint"] == "allow: [{host: evil.test, ports: [80]}]"
    [tunnel] = gw.audit_for(host="evil.test", kind="connect")
    assert (tunnel["decision"], tunnel["code"]) == ("report", "not_allowlisted")
    assert tunnel["bytes_out"] > 0


@pytest.mark.parametrize(
    ("url", "code", "blocked"),
    [
        ("http://169.254.169.254/latest/meta-data/", "metadata", "169.254.169.254"),
        ("http://10.1.2.3/", "internal_address", "10.1.2.3"),
        ("http://meta.allowed.test/", "metadata", "169.254.169.254"),  # an unlisted name, to metadata
        ("http://internal.allowed.test/", "internal_address", "10.1.2.3"),  # an unlisted name, to an internal host
        (f"http://{GW_IP}:8080/", "internal_address", GW_IP),  # the gateway's sandbox-side address
        ("http://loop.allowed.test/", "own_address", "127.0.0.1"),  # an unlisted name, to the gateway itself
    ],
    ids=["metadata", "internal", "name-to-metadata", "name-to-internal", "gateway", "name-to-loopback"],
)
def test_report_mode_never_opens_a_hard_block(
    topology: Topology, fakenet: FakeNet, gw: GatewayProcess, url: str, code: str, blocked: str
):
    status, body = _curl(topology, url)
    assert status == "403" and blocked in body, body
    host = url.split("/")[2].split(":")[0]
    [record] = gw.audit_for(host=host, kind="http")
    assert (record["decision"], record["code"]) == ("deny", code)
    assert fakenet.total_connections() == 0


def test_dns_answers_an_unlisted_name_but_never_with_an_internal_address(
    topology: Topology, fakenet: FakeNet, gw: GatewayProcess
):
    assert topology.dns_query(topology.sbx, "evil.test", server=GW_IP).values() == [EVIL_IP]
    [record] = gw.audit_for(host="evil.test", kind="dns")
    assert (record["decision"], record["code"], record["hint"]) == (
        "report",
        "not_allowlisted",
        "allow: [{host: evil.test}]",
    )
    for name in ("internal.allowed.test", "meta.allowed.test", "loop.allowed.test"):
        answer = topology.dns_query(topology.sbx, name, server=GW_IP)
        assert (answer.rcode, answer.values()) == ("NXDOMAIN", []), name
        [refused] = gw.audit_for(host=name, kind="dns")
        assert refused["decision"] == "deny", refused


def test_policy_suggest_turns_the_report_lines_into_rules(
    topology: Topology, fakenet: FakeNet, gw: GatewayProcess, tmp_path: Path
):
    assert _curl(topology, "http://evil.test/one")[0] == "200"
    assert gw.audit_for(host="evil.test", kind="http")
    suggest = [AIRLOCK, "policy", "suggest", str(gw.audit_path)]
    suggested = subprocess.run(suggest, capture_output=True, text=True, timeout=30, check=False)
    assert suggested.returncode == 0, suggested.stderr
    assert "- host: evil.test" in suggested.stdout and "ports: [80]" in suggested.stdout, suggested.stdout
    assert "169.254" not in suggested.stdout and "10.1.2.3" not in suggested.stdout
    path = tmp_path / "suggested.yaml"
    path.write_text(suggested.stdout)
    checked = subprocess.run([AIRLOCK, "policy", "check", str(path)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
