"""The gateway's metrics (airlock/gateway/metrics.py): what each audit line, timing and piece of state adds to the
exposition, read back with prometheus-client's own text parser; the label bounds; /healthz and /readyz."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from pathlib import Path

import pytest
from addon_env import client, connect_flow, gateway, upstream
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from airlock.audit import AuditLog, AuditRecord, RepeatedDecisions
from airlock.gateway.auditing import GatewayAudit
from airlock.gateway.metrics import LABEL_BOUNDS, OTHER, GatewayMetrics
from airlock.gateway.metrics_endpoint import MetricsEndpoint, ScrapedState
from airlock.policy import LivePolicy, ReasonCode, Sandbox, SandboxRegistry, parse_policy

POLICY = parse_policy("version: 1\nprofiles:\n  default: {}\n  strict: {}\n", "p.yaml")
SANDBOXES = [Sandbox("sbx", "strict", ipaddress.ip_network("10.0.0.2/32"))]

BUCKETS = ("0.00025", "0.0005", "0.001", "0.0025", "+Inf")

type Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(metrics: GatewayMetrics) -> Samples:
    """Every sample of the exposition, parsed as Prometheus would: (name, labels) → value."""
    text = metrics.exposition().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


def audited() -> tuple[GatewayMetrics, GatewayAudit]:
    metrics = GatewayMetrics()
    audit = GatewayAudit(
        lambda record: None, SANDBOXES, observe=metrics.observe, live=LivePolicy(POLICY, SandboxRegistry(SANDBOXES))
    )
    return metrics, audit


def record(kind: str, decision: str, code: str, **fields: object) -> AuditRecord:
    line = AuditRecord(kind, "sbx", "10.0.0.2", "a.test", 443, decision, "why", code)  # type: ignore[arg-type]
    for name, field_value in fields.items():
        setattr(line, name, field_value)
    return line


def test_every_audit_line_counts_as_a_decision_by_kind_decision_profile_and_code() -> None:
    metrics, audit = audited()
    for _ in range(2):
        audit.emit(record("connect", "deny", ReasonCode.NOT_ALLOWLISTED))
    audit.emit(record("http", "allow", ReasonCode.ALLOWED))
    audit.emit(AuditRecord("connect", "-", "10.9.9.9", "-", None, "deny", "who", ReasonCode.UNKNOWN_SANDBOX))
    found = samples(metrics)
    decisions = "airlock_decisions_total"
    assert value(found, decisions, kind="connect", decision="deny", profile="strict", code="not_allowlisted") == 2
    assert value(found, decisions, kind="http", decision="allow", profile="strict", code="allowed") == 1
    assert value(found, decisions, kind="connect", decision="deny", profile="-", code="unknown_sandbox") == 1


def test_bytes_are_counted_per_sandbox_and_direction() -> None:
    metrics, audit = audited()
    audit.emit(record("connect", "allow", ReasonCode.ALLOWED, bytes_in=300, bytes_out=7000))
    audit.emit(record("http", "allow", ReasonCode.ALLOWED, bytes_in=0, bytes_out=50))
    found = samples(metrics)
    assert value(found, "airlock_bytes_total", sandbox="sbx", kind="connect", direction="in") == 300
    assert value(found, "airlock_bytes_total", sandbox="sbx", kind="connect", direction="out") == 7000
    assert value(found, "airlock_bytes_total", sandbox="sbx", kind="http", direction="out") == 50
    assert value(found, "airlock_bytes_total", sandbox="sbx", kind="http", direction="in") is None


def test_dns_answers_count_by_rcode_remembered_ones_too() -> None:
    metrics, audit = audited()
    refused = record("dns", "deny", ReasonCode.NOT_ALLOWLISTED, port=None, duration_ms=0.4)
    refused.extra["rcode"] = "REFUSED"
    audit.emit(refused)
    answered = record("dns", "allow", ReasonCode.ALLOWED, port=None, duration_ms=2.0, profile="strict")
    answered.extra["rcode"] = "NOERROR"
    audit.emit(answered)
    template = RepeatedDecisions.template(answered)
    audit.emit(RepeatedDecisions(0.0, [(template, "10.0.0.2")] * 3 + [(RepeatedDecisions.template(refused), "x")]))
    audit.emit(RepeatedDecisions(0.0, [(template, "10.0.0.2")]))
    found = samples(metrics)
    assert value(found, "airlock_dns_queries_total", sandbox="sbx", rcode="NOERROR") == 5
    assert value(found, "airlock_dns_queries_total", sandbox="sbx", rcode="REFUSED") == 2
    assert value(found, "airlock_decisions_total", kind="dns", decision="allow", profile="strict", code="allowed") == 5
    assert value(found, "airlock_decide_duration_seconds_count", source="dns") == 2  # remembered: no judgement
    assert value(found, "airlock_decide_duration_seconds_sum", source="dns") == pytest.approx(0.0024)
    buckets = {le: value(found, "airlock_decide_duration_seconds_bucket", source="dns", le=le) for le in BUCKETS}
    assert buckets == {"0.00025": 0, "0.0005": 1, "0.001": 1, "0.0025": 2, "+Inf": 2}


def test_broker_calls_by_tool_and_status_and_token_failures_by_code() -> None:
    metrics, audit = audited()
    for code, status in (("allowed", 201), ("invalid_token", 401), ("invalid_token", 401), ("outside_grant", 403)):
        line = record("broker", "allow" if status < 300 else "deny", code, method="create_pull_request")
        line.extra["status"], line.duration_ms = status, 12.0
        audit.emit(line)
    limited = record("broker", "deny", "rate_limited", method="list_tools")
    limited.extra["status"] = 429
    audit.emit(limited)
    found = samples(metrics)
    assert value(found, "airlock_broker_calls_total", tool="create_pull_request", status="401") == 2
    assert value(found, "airlock_broker_calls_total", tool="create_pull_request", status="201") == 1
    assert value(found, "airlock_broker_calls_total", tool="list_tools", status="429") == 1
    assert value(found, "airlock_broker_token_failures_total", code="invalid_token") == 2
    assert value(found, "airlock_broker_token_failures_total", code="outside_grant") == 1
    assert value(found, "airlock_broker_token_failures_total", code="rate_limited") is None  # the token was fine
    assert value(found, "airlock_broker_call_duration_seconds_count", tool="create_pull_request") == 4


def test_policy_reloads_count_ok_and_refused() -> None:
    metrics, audit = audited()
    audit.policy_loaded(POLICY, "sha256:old")
    audit.policy_refused("p.yaml", ["line 3: bad"])
    audit.policy_refused("p.yaml", ["line 4: bad"])
    found = samples(metrics)
    assert value(found, "airlock_policy_reloads_total", result="ok") == 1
    assert value(found, "airlock_policy_reloads_total", result="refused") == 2


def test_a_label_past_its_bound_counts_as_other() -> None:
    metrics, audit = audited()
    bound = LABEL_BOUNDS["profile"]
    for i in range(bound + 5):
        audit.emit(record("http", "allow", ReasonCode.ALLOWED, profile=f"p{i}"))
    found = samples(metrics)
    profiles = {dict(labels)["profile"] for name, labels in found if name == "airlock_decisions_total"}
    assert len(profiles) == bound + 1 and OTHER in profiles
    assert value(found, "airlock_decisions_total", kind="http", decision="allow", profile=OTHER, code="allowed") == 5


COUNT_THEN_SCRAPE = """
import sys
from airlock.gateway.metrics import GatewayMetrics
metrics = GatewayMetrics()
metrics.decided(0.001)
metrics.resolved("ok", 0.01)
print("prometheus_client" in sys.modules)
print(b"airlock_decide_duration_seconds_count" in metrics.exposition(), "prometheus_client" in sys.modules)
"""


def test_counting_imports_no_prometheus_client_the_first_scrape_does() -> None:
    """prometheus-client is a scrape's business: a gateway that starts (and counts) does not wait for its import."""
    out = subprocess.run([sys.executable, "-c", COUNT_THEN_SCRAPE], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["False", "True True"]


def test_the_registry_is_the_gateways_own_without_created_series() -> None:
    metrics, audit = audited()
    audit.emit(record("http", "allow", ReasonCode.ALLOWED))
    assert not any(name.startswith("airlock_") for name, _ in samples_of_default())
    names = {name for name, _ in samples(metrics)}
    assert not any(name.startswith(("process_", "python_")) or name.endswith("_created") for name in names)


def samples_of_default() -> Samples:
    text = generate_latest(REGISTRY).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def test_open_tunnels_connections_and_the_audit_queue_are_read_when_scraped(tmp_path: Path) -> None:
    log = AuditLog("/dev/full")  # every write fails: no space left
    tunnels, connections, upstreams = {"sbx": 2}, {"sbx": 3}, {"sbx": 1}
    state = ScrapedState(
        lambda: ["sbx", "idle"], lambda: tunnels, lambda: connections, lambda: upstreams, log,
        {"rate_limited": 4, "rcode_NOERROR": 9},
    )  # fmt: skip
    metrics = MetricsEndpoint(GatewayMetrics(), state, dict)
    found = samples(metrics)
    assert value(found, "airlock_open_tunnels", sandbox="sbx") == 2
    assert value(found, "airlock_open_tunnels", sandbox="idle") == 0  # every sandbox served has its series
    assert value(found, "airlock_open_connections", sandbox="sbx", side="client") == 3
    assert value(found, "airlock_open_connections", sandbox="sbx", side="upstream") == 1
    assert value(found, "airlock_dns_dropped_total", reason="rate_limited") == 4
    assert value(found, "airlock_dns_dropped_total", reason="rcode_NOERROR") is None
    assert value(found, "airlock_audit_writable") == 1 and value(found, "airlock_audit_lag_seconds") == 0
    tunnels["sbx"] = 0
    log.emit(record("http", "allow", ReasonCode.ALLOWED))
    assert value(samples(metrics), "airlock_audit_pending_lines") == 1
    log.flush()
    found = samples(metrics)
    assert value(found, "airlock_open_tunnels", sandbox="sbx") == 0
    assert value(found, "airlock_audit_writable") == 0
    assert value(found, "airlock_audit_write_errors_total") == 1
    assert value(found, "airlock_audit_pending_lines") == 0
    assert (value(found, "airlock_audit_waiting_bytes") or 0) > 0
    assert (value(found, "airlock_audit_lag_seconds") or 0) > 0


async def test_the_proxy_tells_how_long_judging_and_connecting_took() -> None:
    metrics = GatewayMetrics()
    gw = gateway(timings=metrics)
    flow = connect_flow("allowed.test", 443)
    await gw.http.http_connect(flow)
    data = upstream(flow.client_conn, "allowed.test", 443, sni="allowed.test")
    await gw.pinned.server_connect(data)
    gw.pinned.server_connected(data)
    failing = upstream(client(), "www.allowed.test", 443)
    await gw.pinned.server_connect(failing)  # judged from scratch: a second judgement
    gw.pinned.server_connect_error(failing)
    found = samples(metrics)
    assert value(found, "airlock_decide_duration_seconds_count", source="proxy") == 2
    assert value(found, "airlock_upstream_connect_duration_seconds_count") == 1
    assert value(found, "airlock_upstream_connect_failures_total") == 1


def _endpoint(checks: dict[str, str | None]) -> MetricsEndpoint:
    """The endpoints of fresh metrics, ready as `checks` say (as they say at each request)."""
    state = ScrapedState(list, dict, dict, dict, AuditLog(None), {})
    return MetricsEndpoint(GatewayMetrics(), state, lambda: checks)


async def _get(metrics: MetricsEndpoint, path: str) -> tuple[int, str, str]:
    app = web.Application()
    app.add_routes(metrics.routes())
    async with TestClient(TestServer(app)) as http:
        response = await http.get(path)
        return response.status, response.headers["Content-Type"], await response.text()


async def test_healthz_readyz_and_metrics_are_served() -> None:
    checks: dict[str, str | None] = {"policy": None, "audit": None}
    metrics = _endpoint(checks)
    assert (await _get(metrics, "/healthz"))[0] == 200
    status, _, body = await _get(metrics, "/readyz")
    assert (status, body) == (200, '{"ready": true, "problems": {}}')
    checks["audit"] = "the audit log cannot be written: No space left on device"
    status, _, body = await _get(metrics, "/readyz")
    assert status == 503 and '"audit": "the audit log cannot be written: No space left on device"' in body
    status, content_type, body = await _get(metrics, "/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    assert "airlock_decisions_total" in {family.name + "_total" for family in text_string_to_metric_families(body)}
