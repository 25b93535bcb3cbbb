"""Every ReasonCode is produced by some case: one case per code, through the code path that writes it (the policy
core, the proxy's hooks on mitmproxy test flows, the DNS resolver's judgement), with fake upstream resolvers and no
sockets. A new code without a case here, or a code the docs do not list, fails."""

from __future__ import annotations

import asyncio
import ipaddress
import re
from collections.abc import Awaitable, Callable

import pytest
from addon_env import PublicResolver, client_hello, sni
from dnslib import CLASS, DNSRecord
from mitmproxy import connection, ctx, http
from mitmproxy.http import Headers
from mitmproxy.proxy import events, layer
from mitmproxy.proxy.context import Context
from mitmproxy.test import tflow, tutils
from repo_files import REPO

from airlock.audit import AuditRecord
from airlock.dns.admission import DnsSettings
from airlock.dns.resolver import Handler, PolicyResolver
from airlock.dns.upstream import Answer, NameNotFound, ResolveError
from airlock.gateway.approval_desk import Approvals
from airlock.gateway.auditing import GatewayAudit
from airlock.policy import (
    KnownAddresses,
    LivePolicy,
    Policy,
    ReasonCode,
    Sandbox,
    SandboxRegistry,
    decide,
    decide_alias,
    decide_name,
    judge_placeholders,
    judge_request,
    parse_policy,
    refused_certificate,
    vet,
)
from airlock.policy.held_requests import PendingTable
from airlock.proxy.addon import build_addon
from airlock.proxy.shared import GatewaySettings

pytestmark = pytest.mark.usefixtures("hook_options")  # every case runs with the options its hooks read

DOCS = REPO / "docs" / "audit-codes.md"
POLICY = parse_policy(
    """
version: 1
profiles:
  default:
    allow:
      - host: allowed.test
      - host: web.allowed.test
        ports: [80]
      - host: "*.names.test"
    deny:
      - host: denied.test
    dns:
      refuse_suspicious: true
      max_label_length: 10
"""
)
PROFILE = POLICY.profile()
SANDBOX = Sandbox("sbx", "default", ipaddress.ip_network("127.0.0.0/8"))  # mitmproxy's test client is 127.0.0.1
OWN = ipaddress.ip_address("192.0.2.53")


# Each case returns the code it saw: on the Decision or Vetted (policy core), or on the audit record (proxy, DNS).
CASES: dict[ReasonCode, Callable[[], Awaitable[str]]] = {}


def produces(code: ReasonCode) -> Callable[[Callable[[], Awaitable[str]]], Callable[[], Awaitable[str]]]:
    def register(case: Callable[[], Awaitable[str]]) -> Callable[[], Awaitable[str]]:
        assert code not in CASES
        CASES[code] = case
        return case

    return register


# --- the policy core ---------------------------------------------------------------------------------------------


def _decided(host: str, port: int) -> Callable[[], Awaitable[str]]:
    async def case() -> str:
        return decide(PROFILE, host, port).code

    return case


def _vetted(*addresses: str) -> Callable[[], Awaitable[str]]:
    async def case() -> str:
        return vet(PROFILE, [ipaddress.ip_address(a) for a in addresses], 443, frozenset({OWN})).code

    return case


produces(ReasonCode.ALLOWED)(_decided("allowed.test", 443))
produces(ReasonCode.NOT_ALLOWLISTED)(_decided("other.test", 443))
produces(ReasonCode.PORT_NOT_ALLOWED)(_decided("allowed.test", 22))
produces(ReasonCode.DENIED_BY_RULE)(_decided("denied.test", 443))
produces(ReasonCode.METADATA)(_decided("169.254.169.254", 80))
produces(ReasonCode.INTERNAL_ADDRESS)(_decided("10.0.0.1", 443))
produces(ReasonCode.OWN_ADDRESS)(_vetted(str(OWN)))
produces(ReasonCode.SANDBOX_LINK)(_vetted("10.231.0.1"))
produces(ReasonCode.NO_ADDRESS)(_vetted())
produces(ReasonCode.NO_ADDRESS_LEFT)(_vetted("10.0.0.1", "169.254.169.254"))


@produces(ReasonCode.ALIAS_DENIED)
async def _alias() -> str:
    decision = decide_alias(PROFILE, ["cdn.test", "denied.test"], 443)
    assert decision is not None
    return decision.code


@produces(ReasonCode.SINGLE_LABEL)
async def _single_label() -> str:
    return await _dns(DNSRecord.question("vm"))


@produces(ReasonCode.NOT_A_NAME)
async def _address_as_name() -> str:
    return decide_name(PROFILE, "192.0.2.1").code


# --- the policy core on inspected hosts: the requests inside their TLS ---------------------------------------------

INSPECTED = parse_policy(
    """
version: 1
profiles:
  default:
    allow:
      - host: api.test
        inspect: true
        http:
          - {methods: [GET], paths: ["/v1/**"]}
        inject:
          - {header: Authorization, value: "Bearer {secret:api_key}"}
"""
).profile()


def _request(method: str, target: str, websocket: bool = False) -> Callable[[], Awaitable[str]]:
    async def case() -> str:
        rule = decide(INSPECTED, "api.test", 443).rule
        assert rule is not None and rule.inspect
        return judge_request(rule, method, target, websocket).code

    return case


produces(ReasonCode.AMBIGUOUS_PATH)(_request("GET", "/v1/%2e%2e/admin"))
produces(ReasonCode.METHOD_NOT_ALLOWED)(_request("POST", "/v1/models"))
produces(ReasonCode.PATH_NOT_ALLOWED)(_request("GET", "/admin"))
produces(ReasonCode.WEBSOCKET_NOT_ALLOWED)(_request("GET", "/v1/stream", websocket=True))


@produces(ReasonCode.PLACEHOLDER_MISUSE)
async def _placeholder_elsewhere() -> str:
    denied = judge_placeholders(decide(PROFILE, "allowed.test", 443).rule, ["api_key"])
    assert denied is not None
    return denied.code


@produces(ReasonCode.UPSTREAM_CERTIFICATE)
async def _bad_upstream_certificate() -> str:
    return refused_certificate(decide(INSPECTED, "api.test", 443), "api.test", "self-signed certificate").code


# --- the proxy: its hooks, on mitmproxy's test flows -------------------------------------------------------------


class Proxy:
    """The addon's hooks over a fake resolver; what they audit is in `audit`."""

    def __init__(
        self,
        resolver: PublicResolver | None = None,
        policy: Policy = POLICY,
        approvals: Callable[[Callable[[AuditRecord], None]], Approvals] | None = None,
        **settings: int,
    ) -> None:
        self.audit: list[AuditRecord] = []
        self.approvals = approvals(self.audit.append) if approvals is not None else None
        gateway = GatewaySettings(**settings)
        resolver = resolver or PublicResolver()
        live = LivePolicy(policy, SandboxRegistry([SANDBOX]), KnownAddresses(frozenset({OWN})))
        airlock = build_addon(live, resolver, self.audit.append, gateway, approvals=self.approvals)
        self.shared, self.identity, self.http, self.tunnels = (
            airlock.shared,
            airlock.identity,
            airlock.http,
            airlock.tunnels,
        )
        self.http_audit = airlock.audit

    async def connect(self, host: str, port: int = 443) -> http.HTTPFlow:
        """A CONNECT, judged by http_connect."""
        authority = f"{host}:{port}".encode()
        flow = tflow.tflow(req=tutils.treq(method=b"CONNECT", host=host, port=port, authority=authority))
        await self.http.http_connect(flow)
        return flow

    async def request(self, host: str, *headers: tuple[bytes, bytes]) -> http.HTTPFlow:
        """A plain-HTTP request on port 80, judged by requestheaders."""
        flow = tflow.tflow(req=tutils.treq(host=host, port=80, authority=b"", headers=Headers(headers)))
        await self.http.requestheaders(flow)
        return flow

    def tunnel_bytes(self, tunnel: http.HTTPFlow, data: bytes) -> str:
        """The code on the tunnel's record once next_layer has judged its first bytes from the sandbox."""
        context = Context(tunnel.client_conn, ctx.options)
        context.server = connection.Server(address=(tunnel.request.host, tunnel.request.port))
        nextlayer = layer.NextLayer(context)
        nextlayer.events.append(events.DataReceived(context.client, data))
        self.tunnels.inside_tunnel(nextlayer)
        record = self.shared.client(tunnel.client_conn).tunnel
        assert record is not None
        return record.code


@produces(ReasonCode.UNKNOWN_SANDBOX)
async def _unknown_sandbox() -> str:
    return (await Proxy().shared.evaluate(None, "allowed.test", 443)).decision.code


@produces(ReasonCode.INVALID_HOST)
async def _invalid_host() -> str:
    return (await Proxy().shared.evaluate(SANDBOX, "a b.test", 443)).decision.code


@produces(ReasonCode.RESOLVE_FAILED)
async def _resolve_failed() -> str:
    failing = PublicResolver({"allowed.test": ResolveError("upstream timed out")})
    return (await Proxy(failing).shared.evaluate(SANDBOX, "allowed.test", 443)).decision.code


@produces(ReasonCode.AUDIT_UNAVAILABLE)
async def _audit_unavailable() -> str:
    blocked = Proxy(audit_failure=lambda: "disk full")  # type: ignore[arg-type]
    return (await blocked.shared.evaluate(SANDBOX, "allowed.test", 443)).decision.code


@produces(ReasonCode.CONNECTION_LIMIT)
async def _connection_limit() -> str:
    gateway = Proxy(max_connections_per_sandbox=0)
    gateway.identity.client_connected(tflow.tclient_conn())
    return gateway.audit[-1].code


@produces(ReasonCode.TUNNEL_LIMIT)
async def _tunnel_limit() -> str:
    gateway = Proxy(max_tunnels_per_sandbox=0)
    await gateway.connect("allowed.test")
    return gateway.audit[-1].code


@produces(ReasonCode.REQUEST_IN_TUNNEL)
async def _request_in_tunnel() -> str:
    gateway = Proxy()
    tunnel = await gateway.connect("allowed.test")
    await gateway.http.requestheaders(tflow.tflow(client_conn=tunnel.client_conn))
    return gateway.audit[-1].code


@produces(ReasonCode.MISSING_HOST_HEADER)
async def _missing_host_header() -> str:
    gateway = Proxy()
    await gateway.request("web.allowed.test")
    return gateway.audit[-1].code


@produces(ReasonCode.HOST_MISMATCH)
async def _host_mismatch() -> str:
    gateway = Proxy()
    await gateway.request("web.allowed.test", (b"Host", b"other.test"))
    return gateway.audit[-1].code


@produces(ReasonCode.REQUEST_FAILED)
async def _request_failed() -> str:
    gateway = Proxy()
    flow = await gateway.request("web.allowed.test", (b"Host", b"web.allowed.test"))
    assert not gateway.audit  # allowed: audited when it ends
    flow.error = tflow.terr("connection refused")
    gateway.http_audit.error(flow)
    return gateway.audit[-1].code


def _tunnel_carrying(data: bytes) -> Callable[[], Awaitable[str]]:
    async def case() -> str:
        gateway = Proxy()
        return gateway.tunnel_bytes(await gateway.connect("allowed.test"), data)

    return case


produces(ReasonCode.MALFORMED_CLIENT_HELLO)(_tunnel_carrying(b"\x16\x03\x01\x00\x04\x02\x00\x00\x00"))  # a ServerHello
produces(ReasonCode.INVALID_SNI)(_tunnel_carrying(client_hello(sni(b"allowed.test", b"other.test"))))
produces(ReasonCode.SNI_MISMATCH)(_tunnel_carrying(client_hello(sni(b"other.test"))))
produces(ReasonCode.ECH)(_tunnel_carrying(client_hello(sni(b"allowed.test"), (0xFE0D, b"\x00" + bytes(32)))))
produces(ReasonCode.NOT_TLS)(_tunnel_carrying(b"SSH-2.0-OpenSSH_9.6\r\n"))


# --- DNS: the resolver's judgement of one query -------------------------------------------------------------------


async def _dns(request: DNSRecord, **settings: int) -> str:
    answers: dict[str, Answer | Exception] = {
        "gone.names.test": NameNotFound("NXDOMAIN"),
        "bug.names.test": RuntimeError("a bug"),  # what no resolver should raise: a fault in airlock itself
    }
    audit: list[AuditRecord] = []
    live = LivePolicy(POLICY, SandboxRegistry([SANDBOX]))
    resolver = PolicyResolver(live, PublicResolver(answers), audit.append, DnsSettings(**settings))
    await resolver.resolve(request, Handler("127.0.0.1", "udp", SANDBOX))
    [record] = audit
    return record.code


@produces(ReasonCode.UNSUPPORTED_QUERY)
async def _dns_status_query() -> str:
    request = DNSRecord.question("allowed.test")
    request.header.opcode = 2  # STATUS
    return await _dns(request)


@produces(ReasonCode.UNSUPPORTED_CLASS)
async def _dns_chaos_class() -> str:
    request = DNSRecord.question("allowed.test")
    request.q.qclass = CLASS.CH
    return await _dns(request)


@produces(ReasonCode.SUSPICIOUS_NAME)
async def _dns_long_label() -> str:
    return await _dns(DNSRecord.question("averyveryverylonglabel.names.test"))  # longer than max_label_length


@produces(ReasonCode.TYPE_NOT_ANSWERED)
async def _dns_mx() -> str:
    return await _dns(DNSRecord.question("allowed.test", "MX"))


@produces(ReasonCode.NAME_NOT_FOUND)
async def _dns_nxdomain() -> str:
    return await _dns(DNSRecord.question("gone.names.test"))


@produces(ReasonCode.INFLIGHT_LIMIT)
async def _dns_inflight() -> str:
    return await _dns(DNSRecord.question("allowed.test"), max_inflight_per_sandbox=0)


@produces(ReasonCode.INTERNAL_ERROR)
async def _dns_bug() -> str:
    return await _dns(DNSRecord.question("bug.names.test"))


# --- approvals: a profile that asks a person about what no rule lists ----------------------------------------------


def _asking(timeout: float = 60) -> Policy:
    return parse_policy(f"version: 1\nprofiles:\n  default:\n    on_unlisted: ask\n    ask_timeout: {timeout}\n")


type Answering = Callable[[Approvals, str], Awaitable[object]]


async def _held(answer: Answering, timeout: float = 60, **table: int) -> str:
    """The code of a proxy request for an unlisted host, once `answer` has answered its pending approval."""
    gateway = Proxy(policy=_asking(timeout), approvals=lambda emit: Approvals(emit, table=PendingTable(**table)))
    approvals = gateway.approvals
    assert approvals is not None
    request = asyncio.ensure_future(gateway.shared.evaluate(SANDBOX, "new.test", 443))
    while not request.done() and not approvals.table.pending():
        await asyncio.sleep(0)
    if pending := approvals.table.pending():
        await answer(approvals, pending[0].id)
    return (await request).decision.code


async def _approve(desk: Approvals, held: str) -> None:
    await desk.approve(held, "once", None, "tester")


async def _deny(desk: Approvals, held: str) -> None:
    await desk.deny(held, "tester")


async def _no_answer(desk: Approvals, held: str) -> None:
    return None


produces(ReasonCode.APPROVED)(lambda: _held(_approve))
produces(ReasonCode.APPROVAL_DENIED)(lambda: _held(_deny))
produces(ReasonCode.APPROVAL_TIMEOUT)(lambda: _held(_no_answer, timeout=0.01))
produces(ReasonCode.APPROVAL_LIMIT)(lambda: _held(_no_answer, per_sandbox=0))


@produces(ReasonCode.APPROVAL_PENDING)
async def _dns_held() -> str:
    audit: list[AuditRecord] = []
    live = LivePolicy(_asking(), SandboxRegistry([SANDBOX]))
    approvals = Approvals(audit.append)
    resolver = PolicyResolver(
        live, PublicResolver(), audit.append, DnsSettings(approval_hold=0.01), approvals=approvals
    )  # fmt: skip
    await resolver.resolve(DNSRecord.question("new.test"), Handler("127.0.0.1", "udp", SANDBOX))
    await approvals.close()
    [record] = audit
    return record.code


# --- the gateway: policy reloads -----------------------------------------------------------------------------------


@produces(ReasonCode.POLICY_LOADED)
async def _policy_loaded() -> str:
    audit: list[AuditRecord] = []
    GatewayAudit(audit.append, [SANDBOX]).policy_loaded(POLICY, "sha256:0")
    return audit[-1].code


@produces(ReasonCode.POLICY_REFUSED)
async def _policy_refused() -> str:
    audit: list[AuditRecord] = []
    GatewayAudit(audit.append, [SANDBOX]).policy_refused("p.yaml", ["p.yaml:1: invalid YAML"])
    return audit[-1].code


@pytest.mark.parametrize("code", list(ReasonCode), ids=str)
async def test_every_code_is_produced_by_its_case(code: ReasonCode) -> None:
    assert code in CASES, f"no case produces {code}: add one"
    assert await CASES[code]() == code


def test_the_docs_list_every_code_once() -> None:
    listed = re.findall(r"^\| `([a-z_]+)` \|", DOCS.read_text(encoding="utf-8"), re.MULTILINE)
    assert sorted(listed) == sorted(ReasonCode) and len(listed) == len(set(listed))
