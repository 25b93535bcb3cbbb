"""Report mode (`mode: report`): a profile allows its policy gaps (no rule lists the name or port, a deny rule names
the host) and audits them as `report`, with the code, rule and hint of the denial they would have been. The hard
blocks stay denied exactly as in enforce mode: metadata, internal addresses no CIDR rule opens, the gateway's own
and sandbox-link addresses, deny rules on addresses, and what the proxy refuses about the traffic itself."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest
from addon_env import PUBLIC, PublicResolver, client_hello, sni
from decide_cases import DECISIONS, VETS
from decide_cases import POLICY as DECIDE_POLICY
from dnslib import QTYPE, RCODE, DNSRecord
from jsonschema import Draft202012Validator
from mitmproxy import connection, ctx, http
from mitmproxy.proxy import events, layer
from mitmproxy.proxy.context import Context
from mitmproxy.test import tflow, tutils
from policy_text import F
from repo_files import AUDIT_SCHEMA as SCHEMA

from airlock.audit import AuditRecord
from airlock.audit.notices import DenialNotices
from airlock.cli import main
from airlock.dns.admission import DnsSettings
from airlock.dns.resolver import Handler, PolicyResolver
from airlock.dns.upstream import Answer
from airlock.gateway.metrics import GatewayMetrics
from airlock.policy import (
    KnownAddresses,
    LivePolicy,
    PolicyError,
    ReasonCode,
    Sandbox,
    SandboxRegistry,
    canonical_host,
    decide,
    decide_name,
    judge,
    parse_policy,
    vet,
)
from airlock.policy.decide import POLICY_GAPS
from airlock.proxy.addon import Airlock, build_addon
from airlock.proxy.shared import GatewaySettings

ENFORCED = parse_policy(DECIDE_POLICY, F).profile()
REPORTED = parse_policy(DECIDE_POLICY + "    mode: report\n", F).profile()  # last: the rules keep their lines
OWN = ipaddress.ip_address("192.0.2.53")


def _passes_in_report_mode(code: ReasonCode, rule_is_cidr: bool) -> bool:
    return code in POLICY_GAPS and not rule_is_cidr


def _split() -> tuple[list[tuple[str, str, int]], list[tuple[str, str, int]]]:
    """The decision table's denials: the hard blocks (and deny rules on addresses), and the policy gaps."""
    hard, gaps = [], []
    for case_id, raw, port, code, _line in DECISIONS:
        if code is ReasonCode.ALLOWED:
            continue
        decision = decide(ENFORCED, canonical_host(raw), port)
        cidr = decision.rule is not None and decision.rule.cidr is not None
        (gaps if _passes_in_report_mode(code, cidr) else hard).append((case_id, raw, port))
    return hard, gaps


HARD, GAPS = _split()


def test_the_tables_cover_both_sides() -> None:
    hard_codes = {decide(ENFORCED, canonical_host(raw), port).code for _, raw, port in HARD}
    gap_codes = {decide(ENFORCED, canonical_host(raw), port).code for _, raw, port in GAPS}
    assert {ReasonCode.METADATA, ReasonCode.INTERNAL_ADDRESS, ReasonCode.DENIED_BY_RULE} <= hard_codes
    assert gap_codes == set(POLICY_GAPS)


@pytest.mark.parametrize(("raw", "port"), [h[1:] for h in HARD], ids=[h[0] for h in HARD])
def test_report_mode_never_opens_a_hard_block(raw: str, port: int) -> None:
    host = canonical_host(raw)
    enforced, reported = decide(ENFORCED, host, port), decide(REPORTED, host, port)
    assert reported == enforced
    assert not reported.allow and not reported.report
    addresses = [ipaddress.ip_address(host)]  # every hard block of the table is an address
    judged = judge(REPORTED, host, port, addresses, (), frozenset({OWN}))
    assert not judged.decision.allow
    assert judged.decision.code is judge(ENFORCED, host, port, addresses, (), frozenset({OWN})).decision.code


@pytest.mark.parametrize(("raw", "port"), [g[1:] for g in GAPS], ids=[g[0] for g in GAPS])
def test_report_mode_reports_a_policy_gap_with_the_denial_it_would_be(raw: str, port: int) -> None:
    host = canonical_host(raw)
    enforced, reported = decide(ENFORCED, host, port), decide(REPORTED, host, port)
    assert reported.allow and reported.report and reported.verdict == "report"
    assert (reported.code, reported.reason, reported.rule, reported.hint) == (
        enforced.code,
        enforced.reason,
        enforced.rule,
        enforced.hint,
    )
    assert not reported.tunnel and not reported.ech  # only an allow rule says a tunnel may carry other than TLS


@pytest.mark.parametrize(("raw", "port", "code"), [d[1:4] for d in DECISIONS if d[3] is ReasonCode.ALLOWED])
def test_what_a_rule_allows_is_allowed_as_before(raw: str, port: int, code: ReasonCode) -> None:
    host = canonical_host(raw)
    assert decide(REPORTED, host, port) == decide(ENFORCED, host, port)
    assert decide(REPORTED, host, port).verdict == "allow"


@pytest.mark.parametrize(("addresses", "port"), [v[1:3] for v in VETS], ids=[v[0] for v in VETS])
def test_vetting_is_the_same_in_report_mode(addresses: list[str], port: int) -> None:
    ips = [ipaddress.ip_address(a) for a in addresses]
    assert vet(REPORTED, ips, port, frozenset({OWN})) == vet(ENFORCED, ips, port, frozenset({OWN}))


# An unlisted name that resolves to what no rule may open: denied for the address, with no host-rule hint.
NAME_TO_HARD_BLOCK = [
    ("internal", ["10.0.0.1"], ReasonCode.INTERNAL_ADDRESS),
    ("loopback", ["127.0.0.1", "::1"], ReasonCode.INTERNAL_ADDRESS),
    ("metadata", ["169.254.169.254"], ReasonCode.METADATA),
    ("metadata-v6", ["fd00:ec2::254"], ReasonCode.METADATA),
    ("mapped-internal", ["::ffff:192.168.1.1"], ReasonCode.INTERNAL_ADDRESS),
    ("cgnat", ["100.64.0.1"], ReasonCode.INTERNAL_ADDRESS),
    ("own", ["192.0.2.53"], ReasonCode.OWN_ADDRESS),
    ("sandbox-link", ["10.231.0.1"], ReasonCode.SANDBOX_LINK),
    ("deny-cidr", ["198.51.100.66"], ReasonCode.DENIED_BY_RULE),
]


@pytest.mark.parametrize(
    ("addresses", "code"), [n[1:] for n in NAME_TO_HARD_BLOCK], ids=[n[0] for n in NAME_TO_HARD_BLOCK]
)
def test_an_unlisted_name_resolving_to_a_hard_block_is_denied(addresses: list[str], code: ReasonCode) -> None:
    ips = [ipaddress.ip_address(a) for a in addresses]
    judged = judge(REPORTED, "unlisted.example.net", 443, ips, (), frozenset({OWN}))
    assert (judged.decision.allow, judged.decision.code, judged.decision.hint) == (False, code, None)


def test_an_unlisted_name_resolving_to_a_public_address_is_reported_and_connected() -> None:
    ips = [ipaddress.ip_address("10.0.0.1"), ipaddress.ip_address("203.0.113.7")]
    judged = judge(REPORTED, "unlisted.example.net", 443, ips, (), frozenset({OWN}))
    assert judged.decision.report and judged.decision.code is ReasonCode.NOT_ALLOWLISTED
    assert str(judged.chosen) == "203.0.113.7"


def test_a_deny_rule_on_the_cname_chain_still_denies() -> None:
    ips = [ipaddress.ip_address("203.0.113.7")]
    judged = judge(REPORTED, "unlisted.example.net", 443, ips, ("x.blocked.example.com",), frozenset({OWN}))
    assert (judged.decision.allow, judged.decision.code) == (False, ReasonCode.ALIAS_DENIED)


def test_dns_names_are_reported_not_refused() -> None:
    reported, enforced = decide_name(REPORTED, "unlisted.example.net"), decide_name(ENFORCED, "unlisted.example.net")
    assert not enforced.allow and reported.report and reported.code is ReasonCode.NOT_ALLOWLISTED
    assert decide_name(REPORTED, "both.example.org").report  # a host deny rule: reported too
    assert not decide_name(REPORTED, "10.0.0.1").allow  # an address asked as a name: never


# --- the loader --------------------------------------------------------------------------------------------------

BASE = "version: 1\nprofiles:\n  default:\n    allow: [{host: a.example}]\n"


def test_the_loader_reads_mode_and_only_a_report_mode_changes_the_hash() -> None:
    assert parse_policy(BASE).profile().mode == "enforce"
    assert parse_policy(BASE + "    mode: enforce\n").profile().mode == "enforce"
    assert parse_policy(BASE + "    mode: report\n").profile().mode == "report"
    assert parse_policy(BASE + "    mode: enforce\n").hash == parse_policy(BASE).hash
    assert parse_policy(BASE + "    mode: report\n").hash != parse_policy(BASE).hash


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ("    mode: audit\n", "p.yaml:5: mode must be 'enforce' or 'report'"),
        ("    mode: [report]\n", "p.yaml:5: mode must be 'enforce' or 'report'"),
        (
            "    on_unlisted: ask\n    mode: report\n",
            "p.yaml:6: profile 'default': mode: report cannot be combined with on_unlisted: ask",
        ),
    ],
    ids=["unknown", "list", "with-ask"],
)
def test_the_loader_refuses_a_bad_mode_with_file_and_line(extra: str, error: str) -> None:
    with pytest.raises(PolicyError) as raised:
        parse_policy(BASE + extra, "p.yaml")
    assert error in str(raised.value)


# --- the proxy and DNS: what the audit line says -----------------------------------------------------------------

REPORT_POLICY = parse_policy(BASE + "    mode: report\n", "p.yaml")
SANDBOX = Sandbox("sbx", "default", ipaddress.ip_network("127.0.0.0/8"))  # mitmproxy's test client is 127.0.0.1


def _proxy(answers: dict[str, Answer | Exception] | None = None) -> tuple[Airlock, list[AuditRecord]]:
    audit: list[AuditRecord] = []
    live = LivePolicy(REPORT_POLICY, SandboxRegistry([SANDBOX]), KnownAddresses(frozenset({OWN})))
    return build_addon(live, PublicResolver(answers), audit.append, GatewaySettings()), audit


def _connect(host: str, port: int = 443) -> http.HTTPFlow:
    authority = f"{host}:{port}".encode()
    return tflow.tflow(req=tutils.treq(method=b"CONNECT", host=host, port=port, authority=authority))


async def test_a_reported_connect_goes_through_and_its_record_says_report() -> None:
    airlock, _ = _proxy()
    flow = _connect("unlisted.example.net")
    await airlock.http.http_connect(flow)
    assert flow.response is None  # not refused
    record = airlock.shared.client(flow.client_conn).tunnel
    assert (record.decision, record.code, record.chosen_ip) == ("report", ReasonCode.NOT_ALLOWLISTED, str(PUBLIC))
    assert record.hint == "allow: [{host: unlisted.example.net, ports: [443]}]"


@pytest.mark.parametrize(
    ("target", "answers", "code"),
    [
        ("169.254.169.254", {}, ReasonCode.METADATA),
        ("10.0.0.1", {}, ReasonCode.INTERNAL_ADDRESS),
        (
            "inside.example.net",
            {"inside.example.net": Answer((ipaddress.ip_address("10.0.0.1"),), 60)},
            "internal_address",
        ),
        ("own.example.net", {"own.example.net": Answer((OWN,), 60)}, ReasonCode.OWN_ADDRESS),
    ],
    ids=["metadata", "internal-literal", "name-to-internal", "name-to-own"],
)
async def test_a_report_mode_connect_to_a_hard_block_is_refused(target: str, answers: dict, code: str) -> None:
    airlock, audit = _proxy(answers)
    flow = _connect(target, 80 if target.startswith("169") else 443)
    await airlock.http.http_connect(flow)
    assert flow.response is not None and flow.response.status_code == 403
    assert (audit[-1].decision, audit[-1].code) == ("deny", code)


@pytest.mark.usefixtures("hook_options")
async def test_a_reported_plain_request_is_delivered_and_audited_as_report() -> None:
    airlock, audit = _proxy()
    flow = tflow.tflow(req=tutils.treq(host="a.example", port=80, authority=b""))
    flow.request.host_header = "a.example"
    await airlock.http.requestheaders(flow)
    assert flow.response is None
    flow.response = tutils.tresp()
    airlock.audit.answered(flow)
    assert (audit[-1].kind, audit[-1].decision, audit[-1].code) == ("http", "report", ReasonCode.PORT_NOT_ALLOWED)


@pytest.mark.usefixtures("hook_options")
async def test_a_host_header_naming_another_target_is_refused_in_report_mode() -> None:
    airlock, audit = _proxy()
    flow = tflow.tflow(req=tutils.treq(host="unlisted.example.net", port=80, authority=b""))
    flow.request.host_header = "other.example.net"
    await airlock.http.requestheaders(flow)
    assert flow.response is not None and flow.response.status_code == 403
    assert (audit[-1].decision, audit[-1].code) == ("deny", ReasonCode.HOST_MISMATCH)


@pytest.mark.usefixtures("hook_options")
@pytest.mark.parametrize(
    ("data", "code"),
    [
        (client_hello(sni(b"other.example.net")), ReasonCode.SNI_MISMATCH),
        (client_hello(sni(b"unlisted.example.net"), (0xFE0D, b"\x00" + bytes(32))), ReasonCode.ECH),
        (b"\x16\x03\x01\x00\x04\x02\x00\x00\x00", ReasonCode.MALFORMED_CLIENT_HELLO),
        (b"SSH-2.0-OpenSSH_9.6\r\n", ReasonCode.NOT_TLS),
    ],
    ids=["sni-mismatch", "ech", "malformed", "not-tls"],
)
async def test_a_reported_tunnel_still_refuses_what_its_bytes_do(data: bytes, code: ReasonCode) -> None:
    airlock, _ = _proxy()
    flow = _connect("unlisted.example.net")
    await airlock.http.http_connect(flow)
    context = Context(flow.client_conn, ctx.options)
    context.server = connection.Server(address=("unlisted.example.net", 443))
    nextlayer = layer.NextLayer(context)
    nextlayer.events.append(events.DataReceived(context.client, data))
    airlock.tunnels.inside_tunnel(nextlayer)
    record = airlock.shared.client(flow.client_conn).tunnel
    assert (record.decision, record.code) == ("deny", code)


async def _dns(name: str, answers: dict[str, Answer | Exception] | None = None) -> tuple[DNSRecord, AuditRecord]:
    audit: list[AuditRecord] = []
    live = LivePolicy(REPORT_POLICY, SandboxRegistry([SANDBOX]), KnownAddresses(frozenset({OWN})))
    resolver = PolicyResolver(live, PublicResolver(answers), audit.append, DnsSettings())
    reply = await resolver.resolve(DNSRecord.question(name, "A"), Handler("127.0.0.1", "udp", SANDBOX))
    [record] = audit
    return reply, record


async def test_dns_answers_an_unlisted_name_in_report_mode() -> None:
    reply, record = await _dns("unlisted.example.net")
    assert reply.header.rcode == RCODE.NOERROR and [str(rr.rdata) for rr in reply.rr] == [str(PUBLIC)]
    assert (record.decision, record.code) == ("report", ReasonCode.NOT_ALLOWLISTED)
    assert record.hint == "allow: [{host: unlisted.example.net}]"


@pytest.mark.parametrize(
    ("address", "code"),
    [
        ("10.0.0.1", ReasonCode.INTERNAL_ADDRESS),
        ("169.254.169.254", ReasonCode.METADATA),
        ("192.0.2.53", "own_address"),
    ],
)
async def test_dns_in_report_mode_still_filters_internal_answers(address: str, code: str) -> None:
    reply, record = await _dns(
        "inside.example.net", {"inside.example.net": Answer((ipaddress.ip_address(address),), 60)}
    )
    assert reply.header.rcode == RCODE.NXDOMAIN and not reply.rr
    assert (record.decision, record.code) == ("deny", code)


async def test_dns_in_report_mode_reports_an_unlisted_name_asked_for_another_type() -> None:
    audit: list[AuditRecord] = []
    live = LivePolicy(REPORT_POLICY, SandboxRegistry([SANDBOX]))
    resolver = PolicyResolver(live, PublicResolver(), audit.append, DnsSettings())
    await resolver.resolve(DNSRecord.question("unlisted.example.net", "MX"), Handler("127.0.0.1", "udp", SANDBOX))
    assert (audit[0].method, audit[0].decision, audit[0].code) == (QTYPE.get(QTYPE.MX), "report", "not_allowlisted")


async def test_a_report_line_validates_against_the_schema_and_is_counted() -> None:
    _, record = await _dns("unlisted.example.net")
    record.profile, record.policy_hash = "default", REPORT_POLICY.hash
    assert list(Draft202012Validator(SCHEMA).iter_errors(json.loads(record.to_json()))) == []
    metrics = GatewayMetrics()
    metrics.observe(record)
    assert 'decision="report"' in metrics.exposition().decode()


# --- the CLI: explain, test, suggest -----------------------------------------------------------------------------


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_policy_explain_json_says_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = _write(tmp_path, "p.yaml", BASE + "    mode: report\n")
    assert main(["policy", "explain", "--policy", policy, "https://unlisted.example.net/", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["decision"], shown["code"]) == ("report", "not_allowlisted")
    assert main(["policy", "explain", "--policy", policy, "http://169.254.169.254/", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["decision"] == "deny"


def test_policy_test_expects_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = _write(tmp_path, "p.yaml", BASE + "    mode: report\n")
    cases = _write(
        tmp_path,
        "cases.yaml",
        "cases:\n"
        "  - {target: 'https://new.example/', expect: {decision: report, code: not_allowlisted},"
        " resolve: {new.example: [198.51.100.10]}}\n"
        "  - {target: 'https://inside.example/', expect: {decision: deny, code: internal_address},"
        " resolve: {inside.example: [10.0.0.1]}}\n"
        "  - {target: 'http://169.254.169.254/', expect: deny}\n"
        "  - {target: 'https://a.example/', expect: allow, resolve: {a.example: [198.51.100.11]}}\n",
    )
    assert main(["policy", "test", policy, cases]) == 0, capsys.readouterr().out


def test_policy_suggest_keeps_what_a_report_mode_policy_only_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = _write(tmp_path, "p.yaml", BASE + "    mode: report\n")
    line = AuditRecord("connect", "sbx", "10.0.0.2", "new.example", 443, "report", "x", "not_allowlisted")
    line.profile = "default"
    audit = _write(tmp_path, "audit.jsonl", line.to_json() + "\n")
    assert main(["policy", "suggest", audit, "--merge", policy]) == 0
    merged = capsys.readouterr().out
    assert "new.example" in merged
    assert parse_policy(merged).profile().allow_rules_for_host("new.example")


def test_airlock_run_tells_a_reported_request_as_what_would_be_denied() -> None:
    lines: list[str] = []
    notices = DenialNotices(lines.append, 10.0, 20, lambda: 0.0, lambda delay, callback: None)
    record = AuditRecord(
        "connect",
        "sbx",
        "10.0.0.2",
        "new.example",
        443,
        "report",
        "new.example:443 is not in the allowlist",
        "not_allowlisted",
    )
    record.hint = "allow: [{host: new.example, ports: [443]}]"
    notices.observe(record)
    assert lines == [
        "airlock: would deny (report mode, allowed) new.example:443 — new.example:443 is not in the allowlist"
        " · to allow: allow: [{host: new.example, ports: [443]}]"
    ]
