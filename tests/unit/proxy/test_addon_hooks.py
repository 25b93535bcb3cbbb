"""The proxy addon's hooks on mitmproxy's test flows (proxy/), without root or a network: what the sandbox
is answered, which address mitmproxy is told to connect to, and what the audit says. The gateway is the real one on
a fake resolver (tests/unit/addon_env.py); the audit sink is a list."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from addon_env import (
    OWN,
    SANDBOX_IP,
    STRANGER_IP,
    Gateway,
    answer,
    client,
    client_hello,
    connect_flow,
    gateway,
    mitmproxy_options,
    next_layer,
    request_flow,
    sni,
    upstream,
)
from mitmproxy import http
from mitmproxy.proxy.layers import TCPLayer

from airlock.dns.upstream import Answer
from airlock.policy import parse_policy
from airlock.proxy.answers import DECISION_HEADER, REQUEST_ID_HEADER
from airlock.proxy.tunnels import MeteredTunnel


@pytest.fixture(autouse=True)
def options() -> Iterator[None]:
    with mitmproxy_options():
        yield


class Exploding:
    """A resolver whose every lookup fails with an error no code path expects."""

    def __init__(self) -> None:
        self.asked = 0

    async def resolve(self, name: str) -> Answer:
        self.asked += 1
        raise RuntimeError("resolver bug")


def exploding(gw: Gateway) -> Gateway:
    gw.shared.resolver = Exploding()  # type: ignore[assignment]
    return gw


def denial(response: http.Response | None, status: int = 403) -> dict[str, object]:
    """The JSON body of an airlock refusal, after checking the refusal's shape."""
    assert response is not None
    assert response.status_code == status
    assert response.headers[DECISION_HEADER] == "deny"
    assert response.headers["Content-Type"] == "application/json"
    assert response.headers["Connection"] == "close"
    body = json.loads(response.content or b"")
    assert body["decision"] == "deny" and body["request_id"] == response.headers[REQUEST_ID_HEADER]
    return body


# --- CONNECT ---------------------------------------------------------------------------------------------------

# (id, CONNECT host, port, source address, a fragment of the reason)
DENIED_CONNECTS = [
    ("unlisted", "unlisted.test", 443, SANDBOX_IP, "unlisted.test:443 is not in the allowlist"),
    ("deny-rule", "denied.allowed.test", 443, SANDBOX_IP, "denied by rule deny denied.allowed.test"),
    ("port", "allowed.test", 22, SANDBOX_IP, "port 22 is not allowed for allowed.test"),
    ("internal-answer", "internal.allowed.test", 443, SANDBOX_IP, "10.0.0.5 is an internal address"),
    ("metadata-literal", "169.254.169.254", 443, SANDBOX_IP, "metadata/link-local address: never reachable"),
    ("loopback-literal", "0x7f.1", 443, SANDBOX_IP, "127.0.0.1 is an internal address"),
    ("own-literal", OWN, 443, SANDBOX_IP, "the gateway's own address"),
    ("invalid-host", "allowed.test\x00.evil.test", 443, SANDBOX_IP, "invalid host: "),
    ("unknown-network", "allowed.test", 443, STRANGER_IP, "connection from an address that belongs to no sandbox"),
]


@pytest.mark.parametrize(
    ("host", "port", "source", "reason"), [d[1:] for d in DENIED_CONNECTS], ids=[d[0] for d in DENIED_CONNECTS]
)
async def test_a_denied_connect_is_answered_403_and_audited(host: str, port: int, source: str, reason: str) -> None:
    gw = gateway()
    flow = connect_flow(host, port, client(source))
    await gw.http.http_connect(flow)
    body = denial(flow.response)
    assert isinstance(body["reason"], str) and reason in body["reason"]
    [record] = gw.records
    assert (record.kind, record.decision, record.reason, record.port) == ("connect", "deny", body["reason"], port)
    assert (record.client, record.request_id, record.method) == (source, body["request_id"], "CONNECT")
    assert record.sandbox == ("-" if source == STRANGER_IP else "sbx")
    assert gw.state(flow.client_conn).tunnel is None and gw.shared.tunnels.total() == 0


async def test_a_denied_connect_opens_no_upstream_connection() -> None:
    gw = gateway()
    flow = connect_flow("unlisted.test", 443)
    await gw.http.http_connect(flow)
    data = upstream(flow.client_conn, "unlisted.test", 443)
    await gw.pinned.server_connect(data)  # were mitmproxy to try anyway
    assert data.server.error is not None and "not in the allowlist" in data.server.error
    assert data.server.address == ("unlisted.test", 443)


async def test_the_deny_body_carries_the_hint() -> None:
    gw = gateway()
    flow = connect_flow("unlisted.test", 443)
    await gw.http.http_connect(flow)
    assert denial(flow.response)["rule_hint"] == "allow: [{host: unlisted.test, ports: [443]}]"


async def test_an_allowed_connect_is_pinned_to_the_vetted_address_and_audited_on_close() -> None:
    gw = gateway()
    flow = connect_flow("Allowed.Test", 443)
    await gw.http.http_connect(flow)
    assert flow.response is None and gw.records == []  # the tunnel's line is written when it closes
    data = upstream(flow.client_conn, "Allowed.Test", 443, sni="allowed.test")
    await gw.pinned.server_connect(data)
    assert data.server.error is None
    assert data.server.address == ("203.0.113.10", 443)
    assert data.server.sni == "allowed.test"  # TLS still names the host, never the address
    assert gw.resolver.asked == ["allowed.test"]  # the CONNECT's answer is the one connected to
    gw.pinned.server_connected(data)
    assert data.server.address == ("Allowed.Test", 443)  # its name again, for mitmproxy's connection reuse
    gw.identity.disconnected(flow.client_conn)
    [record] = gw.records
    assert (record.kind, record.decision, record.host, record.port) == ("connect", "allow", "allowed.test", 443)
    assert (record.chosen_ip, record.resolved, record.rule_source) == ("203.0.113.10", ["203.0.113.10"], "p.yaml:5")
    assert record.duration_ms is not None and record.duration_ms >= 0
    assert gw.shared.tunnels["sbx"] == 0 and gw.shared.clients == {}


@pytest.mark.parametrize(
    ("first", "then", "pinned"),
    [
        (answer("203.0.113.30"), answer("127.0.0.1"), "203.0.113.30"),  # vetted public, then rebinds to loopback
        (answer("169.254.169.254"), answer("203.0.113.30"), None),  # denied on the first answer, whatever follows
    ],
    ids=["public-then-loopback", "metadata-then-public"],
)
async def test_a_rebinding_name_gets_no_second_answer(first: Answer, then: Answer, pinned: str | None) -> None:
    gw = gateway({"rebind.allowed.test": [first, then]})
    flow = connect_flow("rebind.allowed.test", 443)
    await gw.http.http_connect(flow)
    assert (flow.response is None) is (pinned is not None)
    if pinned is not None:
        data = upstream(flow.client_conn, "rebind.allowed.test", 443)
        await gw.pinned.server_connect(data)
        assert data.server.address == (pinned, 443) and data.server.error is None
        gw.pinned.server_connect_error(data)
    assert gw.resolver.asked == ["rebind.allowed.test"]


async def test_a_rebinding_name_in_a_plain_request_gets_no_second_answer() -> None:
    gw = gateway({"rebind.allowed.test": [answer("203.0.113.30"), answer("169.254.169.254")]})
    flow = request_flow("rebind.allowed.test")
    await gw.http.requestheaders(flow)
    assert flow.response is None
    data = upstream(flow.client_conn, "rebind.allowed.test", 80)
    await gw.pinned.server_connect(data)
    assert data.server.address == ("203.0.113.30", 80) and data.server.error is None
    assert gw.resolver.asked == ["rebind.allowed.test"]
    gw.pinned.server_connect_error(data)


async def test_the_tunnel_limit_answers_429() -> None:
    gw = gateway(max_tunnels_per_sandbox=1)
    first, second = connect_flow("allowed.test", 443), connect_flow("www.allowed.test", 443)
    await gw.http.http_connect(first)
    await gw.http.http_connect(second)
    assert first.response is None
    assert "1 open tunnels" in str(denial(second.response, 429)["reason"])
    [record] = gw.records
    assert (record.decision, record.host) == ("deny", "www.allowed.test")
    gw.identity.disconnected(first.client_conn)  # a slot is free again
    third = connect_flow("www.allowed.test", 443)
    await gw.http.http_connect(third)
    assert third.response is None


# --- plain HTTP ------------------------------------------------------------------------------------------------


async def test_a_kept_alive_connections_next_request_to_the_same_host_is_not_judged_again() -> None:
    gw = gateway()
    conn = client()
    flows = [request_flow("allowed.test", conn=conn) for _ in range(3)]
    for flow in flows:
        await gw.http.requestheaders(flow)
        assert flow.response is None
    assert gw.resolver.asked == ["allowed.test"]  # judged once: resolved once
    other = request_flow("www.allowed.test", conn=conn)
    await gw.http.requestheaders(other)
    assert gw.resolver.asked == ["allowed.test", "www.allowed.test"]  # another target: judged


async def test_after_a_reload_the_same_connections_next_request_is_judged_by_the_new_policy() -> None:
    gw = gateway()
    conn = client()
    await gw.http.requestheaders(first := request_flow("allowed.test", conn=conn))
    assert first.response is None
    profile = "    allow:\n      - host: other.test\n"
    gw.shared.live.replace(parse_policy(f"version: 1\nprofiles:\n  default:\n{profile}  strict:\n{profile}"))
    await gw.http.requestheaders(after := request_flow("allowed.test", conn=conn))
    assert denial(after.response)["code"] == "not_allowlisted"


async def test_a_kept_judgement_allows_nothing_while_the_audit_log_cannot_be_written() -> None:
    failure: list[str] = []
    gw = gateway(audit_failure=lambda: failure[0] if failure else None)
    conn = client()
    await gw.http.requestheaders(request_flow("allowed.test", conn=conn))
    failure.append("disk full")
    await gw.http.requestheaders(refused := request_flow("allowed.test", conn=conn))
    assert denial(refused.response)["code"] == "audit_unavailable"


class GrowingAddresses:
    """The gateway's own addresses as its probe finds them while it runs: more may come."""

    def __init__(self) -> None:
        self.addresses: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()

    def among(self, addresses: Iterable[ipaddress.IPv4Address | ipaddress.IPv6Address]) -> frozenset[Any]:
        return frozenset(self.addresses.intersection(addresses))


async def test_a_kept_judgement_ends_when_its_address_becomes_the_gateways_own() -> None:
    own = GrowingAddresses()
    gw = gateway(own=own)
    conn = client()
    await gw.http.requestheaders(first := request_flow("allowed.test", conn=conn))
    assert first.response is None
    own.addresses.add(ipaddress.ip_address("203.0.113.10"))  # allowed.test's address is now one of the gateway's
    await gw.http.requestheaders(after := request_flow("allowed.test", conn=conn))
    assert after.response is not None and after.response.status_code == 403


async def test_a_judgement_is_kept_no_longer_than_the_names_ttl() -> None:
    gw = gateway({"allowed.test": Answer((ipaddress.ip_address("203.0.113.10"),), 0)})
    conn = client()
    for _ in range(2):
        await gw.http.requestheaders(request_flow("allowed.test", conn=conn))
    assert gw.resolver.asked == ["allowed.test", "allowed.test"]


async def test_an_allowed_request_is_pinned_and_audited_once_answered() -> None:
    gw = gateway()
    flow = request_flow("allowed.test")
    await gw.http.requestheaders(flow)
    assert flow.response is None and gw.records == []
    data = upstream(flow.client_conn, "allowed.test", 80)
    await gw.pinned.server_connect(data)
    assert data.server.address == ("203.0.113.10", 80)
    data.server.peername = ("203.0.113.10", 80)
    gw.pinned.server_connected(data)
    flow.server_conn = data.server
    flow.response = http.Response.make(200, b"hello")
    gw.audit.answered(flow)
    [record] = gw.records
    assert (record.kind, record.decision, record.method, record.path) == ("http", "allow", "GET", "/path")
    assert (record.host, record.chosen_ip, record.resolved, record.bytes_out) == (
        "allowed.test", "203.0.113.10", ["203.0.113.10"], 5,
    )  # fmt: skip
    assert "secret" not in record.to_json()  # the query string is not audited


# (id, target host, port, Host header (None: none), HTTP version, status, a fragment of the reason)
DENIED_REQUESTS = [
    ("unlisted", "unlisted.test", 80, "", "HTTP/1.1", 403, "unlisted.test:80 is not in the allowlist"),
    ("metadata", "169.254.169.254", 80, "", "HTTP/1.1", 403, "metadata/link-local address: never reachable"),
    ("fronting", "allowed.test", 80, "denied.allowed.test", "HTTP/1.1", 403,
     "Host header 'denied.allowed.test' does not match the request target allowed.test:80"),
    ("fronting-port", "allowed.test", 80, "allowed.test:8080", "HTTP/1.1", 403, "does not match the request target"),
    ("fronting-ip-literal", "198.51.100.10", 80, "allowed.test", "HTTP/1.1", 403, "does not match the request target"),
    ("no-host-header", "allowed.test", 80, None, "HTTP/1.1", 400, "HTTP/1.1 request without a Host header"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("host", "port", "header", "version", "status", "reason"),
    [d[1:] for d in DENIED_REQUESTS],
    ids=[d[0] for d in DENIED_REQUESTS],
)
async def test_a_denied_request_is_answered_and_audited(
    host: str, port: int, header: str | None, version: str, status: int, reason: str
) -> None:
    gw = gateway()
    flow = request_flow(host, port, header, http_version=version)
    await gw.http.requestheaders(flow)
    body = denial(flow.response, status)
    assert reason in str(body["reason"])
    [record] = gw.records
    assert (record.kind, record.decision, record.path, record.rule) == ("http", "deny", "/path", None)
    assert "airlock" not in flow.metadata  # the response hook writes no second line


async def test_a_host_header_naming_the_target_in_another_spelling_passes() -> None:
    gw = gateway()
    flow = request_flow("allowed.test", 80, "ALLOWED.test.:80")
    await gw.http.requestheaders(flow)
    assert flow.response is None


async def test_http10_without_host_gets_the_judged_name() -> None:
    gw = gateway()
    flow = request_flow("ALLOWED.test", 443, None, http_version="HTTP/1.0")
    await gw.http.requestheaders(flow)
    assert flow.response is None and flow.request.host_header == "allowed.test:443"


async def test_a_request_inside_a_tunnel_is_refused() -> None:
    gw = gateway()
    tunnel = connect_flow("allowed.test", 443)
    await gw.http.http_connect(tunnel)
    inside = request_flow("allowed.test", 443, scheme="https", conn=tunnel.client_conn)
    await gw.http.requestheaders(inside)
    assert denial(inside.response)["reason"] == "HTTP request inside a tunnel"


@pytest.mark.parametrize(
    "headers",
    [{"transfer-encoding": "chunked"}, {"content-length": str(2 * 1024 * 1024)}],
    ids=["chunked", "larger-than-stream_large_bodies"],
)
async def test_a_denied_request_with_a_streamed_body_is_answered_at_its_headers(headers: dict[str, str]) -> None:
    gw = gateway()
    flow = request_flow("unlisted.test", headers={**headers, "expect": "100-continue"})
    await gw.http.requestheaders(flow)
    denial(flow.response)
    # The answer goes before the body (httplayer.py reads the rest to drop it); no 100 Continue asks for it.
    assert flow.request.stream is True and "expect" not in flow.request.headers
    assert [r.decision for r in gw.records] == ["deny"]


async def test_a_denied_head_request_gets_the_status_and_headers_alone() -> None:
    gw = gateway()
    flow = request_flow("unlisted.test")
    flow.request.method = "HEAD"
    await gw.http.requestheaders(flow)
    assert flow.response.status_code == 403 and flow.response.raw_content == b""
    assert int(flow.response.headers["content-length"]) > 0  # the length a GET's answer has


# --- server_connect: the one enforcement point -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "port", "pinned"),
    [("allowed.test", 443, "203.0.113.10"), ("dual.allowed.test", 80, "203.0.113.12"), ("3325256714", 443, None)],
    ids=["name", "ipv4-first", "ip-literal-spelling"],
)
async def test_a_connection_no_early_hook_vetted_is_judged_from_scratch(
    host: str, port: int, pinned: str | None
) -> None:
    gw = gateway()
    data = upstream(client(), host, port)
    await gw.pinned.server_connect(data)
    assert data.server.error is None
    assert data.server.address == (pinned or "198.51.100.10", port)
    gw.pinned.server_disconnected(data)


@pytest.mark.parametrize(
    ("host", "port", "source", "error"),
    [
        ("unlisted.test", 443, SANDBOX_IP, "airlock: unlisted.test:443 is not in the allowlist"),
        ("mixed.allowed.test", 22, SANDBOX_IP, "airlock: port 22 is not allowed for mixed.allowed.test"),
        ("127.0.0.1", 443, SANDBOX_IP, "airlock: 127.0.0.1 is an internal address (loopback)"),
        ("allowed.test", 443, STRANGER_IP, "airlock: connection from an address that belongs to no sandbox"),
    ],
    ids=["unlisted", "port", "loopback", "unknown-network"],
)
async def test_server_connect_refuses_what_the_policy_refuses(host: str, port: int, source: str, error: str) -> None:
    gw = gateway()
    data = upstream(client(source), host, port)
    await gw.pinned.server_connect(data)
    assert data.server.error is not None and data.server.error.startswith(error)
    assert data.server.address == (host, port)


async def test_server_connect_without_an_address_is_refused() -> None:
    gw = gateway()
    data = upstream(client(), "allowed.test", 443)
    data.server.address = None
    await gw.pinned.server_connect(data)
    assert data.server.error == "airlock: no upstream address"


async def test_a_denied_tunnel_records_the_denial_of_its_connection() -> None:
    # Allowed at CONNECT, then the policy no longer allows it when mitmproxy connects (a reload in between).
    gw = gateway()
    flow = connect_flow("allowed.test", 443)
    await gw.http.http_connect(flow)
    gw.state(flow.client_conn).vetted.clear()
    gw.resolver.zone["allowed.test"] = answer("10.0.0.5")
    data = upstream(flow.client_conn, "allowed.test", 443)
    await gw.pinned.server_connect(data)
    assert data.server.error is not None and "internal address" in data.server.error
    tunnel = gw.state(flow.client_conn).tunnel
    assert tunnel is not None and tunnel.decision == "deny" and "10.0.0.5" in tunnel.reason


async def test_the_connect_timeout_cancels_the_connecting_task_and_forgets_it() -> None:
    gw = gateway(connect_timeout=0)
    data = upstream(client(), "allowed.test", 443)

    async def connect() -> None:
        await gw.pinned.server_connect(data)
        async with asyncio.timeout(1):  # a connect that never completes: cancelled at once, or this fails
            await asyncio.Event().wait()

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(connect())
    assert (gw.shared.resolved, gw.pinned._names, gw.pinned._timers) == ({}, {}, {})


async def test_a_connected_upstream_cancels_its_timer() -> None:
    gw = gateway()
    data = upstream(client(), "allowed.test", 443)
    await gw.pinned.server_connect(data)
    [timer] = gw.pinned._timers.values()
    gw.pinned.server_connected(data)
    assert timer.cancelled() and gw.pinned._timers == {}
    gw.pinned.server_disconnected(data)
    assert (gw.shared.resolved, gw.pinned._names) == ({}, {})


# --- the inside of a tunnel ------------------------------------------------------------------------------------


async def _tunnel(gw: Gateway, host: str, port: int, data: bytes) -> tuple[object, str | None]:
    """Open a CONNECT tunnel, let the client send `data`, and return the layer chosen and the denial, if any."""
    flow = connect_flow(host, port)
    await gw.http.http_connect(flow)
    assert flow.response is None
    nextlayer = next_layer(flow.client_conn, host, port, data)
    gw.tunnels.inside_tunnel(nextlayer)
    return nextlayer.layer, gw.state(flow.client_conn).denied


@pytest.mark.parametrize(
    ("host", "port", "data", "denied"),
    [
        ("allowed.test", 443, client_hello(sni(b"allowed.test")), None),
        ("allowed.test", 443, client_hello(sni(b"evil.test")), "TLS SNI 'evil.test' does not match CONNECT host"),
        ("allowed.test", 443, client_hello(sni(b"allowed.test"), (0xFE0D, b"\x00")), "Encrypted Client Hello"),
        ("allowed.test", 443, client_hello(sni(b"a.test"), sni(b"allowed.test")), "invalid TLS SNI: 2 server_name"),
        ("198.51.100.10", 443, client_hello(), None),
        ("allowed.test", 443, b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00", "malformed TLS ClientHello"),
        ("allowed.test", 443, b"SSH-2.0-OpenSSH_9.6\r\n", "no rule allows a raw tunnel"),
        ("ssh.allowed.test", 22, b"SSH-2.0-OpenSSH_9.6\r\n", None),
        ("ssh.allowed.test", 22, client_hello(sni(b"evil.test")), "TLS SNI 'evil.test' does not match"),
    ],
    ids=["sni", "sni-mismatch", "ech", "two-snis", "ip-without-sni", "malformed", "raw", "raw-allowed", "raw-rule-tls"],
)
async def test_a_tunnel_carries_only_what_its_rule_allows(
    host: str, port: int, data: bytes, denied: str | None
) -> None:
    gw = gateway()
    chosen, refusal = await _tunnel(gw, host, port, data)
    assert isinstance(chosen, MeteredTunnel)  # passed through untouched: never a TLS layer, never intercepted
    if denied is None:
        assert refusal is None
    else:
        assert refusal is not None and denied in refusal


async def test_a_refused_tunnel_opens_no_upstream_and_is_audited_as_denied() -> None:
    gw = gateway()
    flow = connect_flow("allowed.test", 443)
    await gw.http.http_connect(flow)
    gw.tunnels.inside_tunnel(next_layer(flow.client_conn, "allowed.test", 443, client_hello(sni(b"evil.test"))))
    data = upstream(flow.client_conn, "allowed.test", 443)
    await gw.pinned.server_connect(data)
    assert data.server.error is not None and data.server.error.startswith("airlock: TLS SNI 'evil.test'")
    assert data.server.address == ("allowed.test", 443)
    gw.identity.disconnected(flow.client_conn)
    [record] = gw.records
    assert record.decision == "deny" and record.reason.startswith("TLS SNI 'evil.test'")


async def test_a_connects_host_header_names_nothing_the_sni_is_held_to_the_connect_host() -> None:
    gw = gateway()
    flow = connect_flow("allowed.test", 443)
    flow.request.headers["Host"] = "evil.test"  # the tunnel goes to the CONNECT target whatever Host says
    await gw.http.http_connect(flow)
    assert flow.response is None
    gw.tunnels.inside_tunnel(next_layer(flow.client_conn, "allowed.test", 443, client_hello(sni(b"evil.test"))))
    assert gw.state(flow.client_conn).denied == "TLS SNI 'evil.test' does not match CONNECT host allowed.test"


async def test_a_partial_client_hello_waits_for_the_rest() -> None:
    chosen, refusal = await _tunnel(gateway(), "allowed.test", 443, client_hello(sni(b"allowed.test"))[:20])
    assert chosen is None and refusal is None


def test_the_first_layer_of_a_connection_is_left_to_mitmproxy() -> None:
    gw = gateway()
    nextlayer = next_layer(client(), "allowed.test", 443, b"CONNECT allowed.test:443 HTTP/1.1\r\n\r\n")
    gw.tunnels.inside_tunnel(nextlayer)  # no tunnel on this connection yet
    assert nextlayer.layer is None and gw.shared.clients == {}


# --- fail closed -----------------------------------------------------------------------------------------------


async def test_a_fault_in_http_connect_denies_with_500_and_no_upstream(caplog: pytest.LogCaptureFixture) -> None:
    gw = exploding(gateway())
    flow = connect_flow("allowed.test", 443)
    with caplog.at_level(logging.ERROR, "airlock.proxy"):
        await gw.http.http_connect(flow)
    assert "airlock hook http_connect failed: denying" in caplog.text
    assert denial(flow.response, 500)["reason"] == "airlock internal error"
    [record] = gw.records
    assert (record.decision, record.reason) == ("error", "airlock internal error")
    data = upstream(flow.client_conn, "allowed.test", 443)
    await gw.pinned.server_connect(data)
    assert data.server.error == "airlock: internal error"


async def test_a_fault_in_requestheaders_denies_with_500() -> None:
    gw = exploding(gateway())
    flow = request_flow("allowed.test")
    await gw.http.requestheaders(flow)
    denial(flow.response, 500)
    assert gw.state(flow.client_conn).denied == "internal error"


async def test_a_fault_in_server_connect_refuses_the_connection() -> None:
    gw = exploding(gateway())
    data = upstream(client(), "allowed.test", 443)
    await gw.pinned.server_connect(data)
    assert data.server.error == "airlock: internal error while vetting the upstream"
    assert data.server.address == ("allowed.test", 443)


async def test_a_fault_while_reading_a_tunnel_refuses_it() -> None:
    gw = gateway()
    flow = connect_flow("allowed.test", 443)
    await gw.http.http_connect(flow)
    nextlayer = next_layer(flow.client_conn, "allowed.test", 443, b"\x16")
    nextlayer.data_client = lambda: 1 / 0  # type: ignore[method-assign,assignment,return-value]
    gw.tunnels.inside_tunnel(nextlayer)
    assert isinstance(nextlayer.layer, TCPLayer) and gw.state(flow.client_conn).denied == "internal error"


# --- client connections ----------------------------------------------------------------------------------------


def test_a_connection_from_no_sandboxs_network_is_refused_and_audited() -> None:
    gw = gateway()
    conn = client(STRANGER_IP)
    gw.identity.client_connected(conn)
    assert conn.error == "airlock: connection from an address that belongs to no sandbox"
    [record] = gw.records
    assert (record.sandbox, record.client, record.decision) == ("-", STRANGER_IP, "deny")


def test_the_connection_limit_refuses_the_next_and_frees_a_slot_on_close() -> None:
    gw = gateway(max_connections_per_sandbox=2)
    conns = [client() for _ in range(3)]
    for conn in conns:
        gw.identity.client_connected(conn)
    assert [c.error for c in conns[:2]] == [None, None]
    assert conns[2].error == "airlock: sandbox already has 2 connections open"
    assert [r.reason for r in gw.records] == ["sandbox already has 2 connections open"]
    gw.identity.disconnected(conns[2])  # the refused one held no slot
    gw.identity.disconnected(conns[0])
    assert gw.shared.connections["sbx"] == 1
    again = client()
    gw.identity.client_connected(again)
    assert again.error is None
