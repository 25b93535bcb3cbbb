"""The proxy's inspection of rules with `inspect: true`, without a network: which tunnels get TLS layers, how each
request inside is judged, what is injected and what is scrubbed (mitmproxy's own test flows)."""

from __future__ import annotations

import base64
import json

from addon_env import ZONE, Gateway, answer, client_hello, connect_flow, gateway, mitmproxy_options, next_layer, sni
from mitmproxy import http
from mitmproxy.proxy import layers
from mitmproxy.test import tflow, tutils
from mitmproxy.websocket import WebSocketMessage
from wsproto.frame_protocol import Opcode

from airlock.audit import AuditRecord
from airlock.policy import parse_policy
from airlock.proxy.shared import Credentials
from airlock.proxy.tunnels import MeteredTunnel

SECRET = "sk-unit-0123456789abcdef"
POLICY = parse_policy(
    """\
version: 1
profiles:
  default:
    allow:
      - host: api.allowed.test
        inspect: true
        name: model
        http:
          - {methods: [GET], paths: ["/v1/**"]}
        inject:
          - {header: Authorization, value: "Bearer {secret:model_api}"}
      - host: open.allowed.test
        inspect: true
      - host: allowed.test
        ports: [80, 443]
"""
)


def inspecting() -> Gateway:
    zone = ZONE | {"api.allowed.test": answer("203.0.113.30"), "open.allowed.test": answer("203.0.113.31")}
    gw = gateway(zone, policy=POLICY)
    gw.shared.credentials = Credentials.of({"model_api": SECRET})
    return gw


async def tunnel(gw: Gateway, host: str) -> tuple[http.HTTPFlow, object]:
    """A CONNECT to host:443 and the layer chosen for its ClientHello."""
    flow = connect_flow(host, 443)
    await gw.http.http_connect(flow)
    nextlayer = next_layer(flow.client_conn, host, 443, client_hello(sni(host.encode())))
    gw.tunnels.inside_tunnel(nextlayer)
    return flow, nextlayer.layer


def inner_request(connect: http.HTTPFlow, method: str, path: str, *headers: tuple[bytes, bytes]) -> http.HTTPFlow:
    host = connect.request.host
    fields = http.Headers([(b"Host", host.encode()), *headers])
    request = tutils.treq(method=method.encode(), scheme=b"https", host=host, port=443, authority=b"",
                          path=path.encode(), headers=fields, content=b"")  # fmt: skip
    return tflow.tflow(client_conn=connect.client_conn, req=request)


async def test_only_an_inspected_rules_tunnel_gets_tls_layers() -> None:
    gw = inspecting()
    _, inspected = await tunnel(gw, "api.allowed.test")
    assert isinstance(inspected, layers.ServerTLSLayer)
    assert isinstance(inspected.child_layer, layers.ClientTLSLayer)
    _, passthrough = await tunnel(gw, "allowed.test")
    assert isinstance(passthrough, MeteredTunnel)


async def test_the_layer_after_both_tls_sessions_is_http() -> None:
    gw = inspecting()
    flow, _ = await tunnel(gw, "api.allowed.test")
    inner = next_layer(flow.client_conn, "api.allowed.test", 443, b"GET / HTTP/1.1\r\n")
    gw.tunnels.inside_tunnel(inner)
    assert isinstance(inner.layer, layers.HttpLayer)


async def test_an_allowed_request_gets_the_canonical_path_and_only_the_injected_header() -> None:
    gw = inspecting()
    connect, _ = await tunnel(gw, "api.allowed.test")
    flow = inner_request(connect, "GET", "/v1//models/./x?q=1", (b"Authorization", b"mine"), (b"authorization", b"2"))
    with mitmproxy_options():
        await gw.http.requestheaders(flow)
    assert flow.response is None
    assert flow.request.path == "/v1/models/x?q=1"
    assert flow.request.headers.get_all("authorization") == [f"Bearer {SECRET}"]
    assert flow.request.headers["accept-encoding"] == "identity"
    record = flow.metadata["airlock"]
    assert (record.method, record.path, record.rule, record.extra["inspected"]) == (
        "GET",
        "/v1/models/x",
        "model",
        True,
    )


async def test_requests_the_sub_rules_do_not_allow_are_answered_and_never_sent() -> None:
    gw = inspecting()
    connect, _ = await tunnel(gw, "api.allowed.test")
    cases = [("POST", "/v1/x", 403, "method_not_allowed"), ("GET", "/admin", 403, "path_not_allowed"),
             ("GET", "/v1/%2e%2e/admin", 400, "ambiguous_path")]  # fmt: skip
    for method, path, status, code in cases:
        flow = inner_request(connect, method, path)
        with mitmproxy_options():
            await gw.http.requestheaders(flow)
        assert flow.response is not None and flow.response.status_code == status, (method, path)
        assert json.loads(flow.response.content)["code"] == code
        assert "authorization" not in flow.request.headers  # nothing injected into a refused request


async def test_a_host_header_naming_another_host_inside_the_tunnel_is_fronting() -> None:
    gw = inspecting()
    connect, _ = await tunnel(gw, "api.allowed.test")
    flow = inner_request(connect, "GET", "/v1/x")
    flow.request.headers["Host"] = "evil.test"
    with mitmproxy_options():
        await gw.http.requestheaders(flow)
    assert flow.response is not None and json.loads(flow.response.content)["code"] == "host_mismatch"


async def test_a_placeholder_goes_only_to_the_host_that_injects_its_secret() -> None:
    gw = inspecting()
    connect, _ = await tunnel(gw, "open.allowed.test")
    flow = inner_request(connect, "GET", "/", (b"X-Api-Key", b"airlock-placeholder-model_api"))
    with mitmproxy_options():
        await gw.http.requestheaders(flow)
    assert flow.response is not None and json.loads(flow.response.content)["code"] == "placeholder_misuse"
    own, _ = await tunnel(gw, "api.allowed.test")
    flow = inner_request(own, "GET", "/v1/x", (b"Authorization", b"Bearer airlock-placeholder-model_api"))
    with mitmproxy_options():
        await gw.http.requestheaders(flow)
    assert flow.response is None and flow.request.headers["authorization"] == f"Bearer {SECRET}"


async def test_a_reload_that_stops_inspecting_refuses_the_tunnels_next_request() -> None:
    gw = inspecting()
    connect, _ = await tunnel(gw, "api.allowed.test")
    passthrough = "version: 1\nprofiles:\n  default: {allow: [{host: api.allowed.test}]}\n  strict: {allow: []}\n"
    gw.shared.live.replace(parse_policy(passthrough))
    flow = inner_request(connect, "GET", "/v1/x")
    with mitmproxy_options():
        await gw.http.requestheaders(flow)
    assert flow.response is not None and json.loads(flow.response.content)["code"] == "request_in_tunnel"


def test_responses_are_scrubbed_in_headers_and_streamed_bodies() -> None:
    gw = inspecting()
    flow = tflow.tflow(resp=tutils.tresp(headers=http.Headers(X_Echo=f"Bearer {SECRET}"), content=b""))
    flow.metadata["airlock"] = AuditRecord("http", "sbx", "10.99.0.2", "api.allowed.test", 443, "allow", "", "allowed")
    gw.addon_named("Inspection").responseheaders(flow)
    assert SECRET not in flow.response.headers["x-echo"]
    stream = flow.response.stream
    assert callable(stream)
    half = len(SECRET) // 2
    out = stream(b"token=" + SECRET[:half].encode()) + stream(SECRET[half:].encode() + b";") + stream(b"")
    assert SECRET.encode() not in out and out.startswith(b"token=") and out.endswith(b";")
    assert len(out) == len(b"token=" + SECRET.encode() + b";")  # same length: the framing stays true


async def judged(gw: Gateway, path: str, *headers: tuple[bytes, bytes]) -> http.HTTPFlow:
    """A request to api.allowed.test judged (and allowed) inside its tunnel, with an upstream's 200 to come."""
    connect, _ = await tunnel(gw, "api.allowed.test")
    flow = inner_request(connect, "GET", path, *headers)
    with mitmproxy_options():
        await gw.http.requestheaders(flow)
    assert flow.response is None, flow.response
    flow.response = tutils.tresp(content=b"")
    return flow


async def test_a_chunked_body_cut_at_any_offset_reaches_the_sandbox_masked_and_as_long() -> None:
    gw = inspecting()
    body = (
        b'{"echo": "Authorization: Bearer '
        + SECRET.encode()
        + b'", "b64": "'
        + base64.b64encode(SECRET.encode())
        + b'"}'
    )
    for cut in range(len(body) + 1):
        flow = await judged(gw, "/v1/x")
        gw.addon_named("Inspection").responseheaders(flow)
        stream = flow.response.stream
        out = stream(body[:cut]) + stream(body[cut:]) + stream(b"")
        assert SECRET.encode() not in out and base64.b64encode(SECRET.encode()) not in out, cut
        assert len(out) == len(body) and flow.metadata["airlock_bytes_out"] == len(body)


async def test_a_101_is_delivered_only_as_the_websocket_the_rule_allowed() -> None:
    gw = inspecting()
    upgrade = ((b"Upgrade", b"websocket"), (b"Connection", b"Upgrade"))
    # The rule's sub-rule has no `websocket: true`: the request is refused before it leaves.
    connect, _ = await tunnel(gw, "api.allowed.test")
    asked = inner_request(connect, "GET", "/v1/ws", *upgrade)
    with mitmproxy_options():
        await gw.http.requestheaders(asked)
    assert json.loads(asked.response.content)["code"] == "websocket_not_allowed"
    # A request that did not ask for an upgrade, answered with one anyway (websocket or raw): killed, audited.
    for protocol in (b"websocket", b"tcp"):
        flow = await judged(gw, "/v1/x")
        flow.response = tutils.tresp(status_code=101, headers=http.Headers(Upgrade=protocol), content=b"")
        gw.addon_named("Inspection").responseheaders(flow)
        assert flow.error is not None and "airlock" not in flow.metadata
        line = gw.records[-1]
        assert (line.decision, line.code, line.status) == ("deny", "websocket_not_allowed", 101)


async def test_a_compressed_answer_to_an_injected_request_is_killed_and_audited() -> None:
    gw = inspecting()
    flow = await judged(gw, "/v1/x")
    flow.response.headers["content-encoding"] = "gzip"
    gw.addon_named("Inspection").responseheaders(flow)
    assert flow.error is not None
    line = gw.records[-1]
    assert (line.decision, line.code, line.path) == ("error", "request_failed", "/v1/x") and "compressed" in line.reason


def test_what_the_server_sends_over_a_websocket_is_scrubbed_and_not_kept() -> None:
    gw = inspecting()
    flow = tflow.twebsocketflow(messages=False)
    hook = gw.addon_named("Inspection").websocket_message
    sent = []
    for from_client, content in ((False, f"echo: Bearer {SECRET}".encode()), (True, f"mine {SECRET}".encode())):
        flow.websocket.messages.append(WebSocketMessage(Opcode.TEXT, from_client, content))
        hook(flow)
        assert len(flow.websocket.messages) == 1  # a long-lived websocket grows nothing in the gateway
        sent.append(flow.websocket.messages[-1].content)
    # The client's own message goes as it is: the sandbox never held the secret to send.
    assert sent == [b"echo: Bearer " + b"*" * len(SECRET), f"mine {SECRET}".encode()]
