"""The proxy's inspection of rules with `inspect: true`, without a network: which tunnels get TLS layers, how each
request inside is judged, what is injected and what is scrubbed (mitmproxy's own test flows)."""

from __future__ import annotations

import base64
import json
import logging

import pytest
from addon_env import ZONE, Gateway, answer, client_hello, connect_flow, gateway, mitmproxy_options, next_layer, sni
from mitmproxy import http
from mitmproxy.proxy import layers
from mitmproxy.test import tflow, tutils
from mitmproxy.websocket import WebSocketMessage
from wsproto.frame_protocol import Opcode

from airlock.audit import AuditRecord
from airlock.policy import parse_policy
from airlock.proxy.shared import Credentials, ScrubbedLog
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
    gw.shared.inject({"model_api": SECRET})
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
    half = len(SECRET) // 2
    out = streamed(flow, b"token=" + SECRET[:half].encode(), SECRET[half:].encode() + b";")
    assert SECRET.encode() not in out and out.startswith(b"token=") and out.endswith(b";")
    assert len(out) == len(b"token=" + SECRET.encode() + b";")  # same length: the framing stays true


def streamed(flow: http.HTTPFlow, *chunks: bytes) -> bytes:
    """What the response's stream sends for `chunks`, then the end of the body (the empty chunk)."""
    stream = flow.response.stream
    assert callable(stream)
    return b"".join(b"".join(stream(chunk)) for chunk in (*chunks, b""))


def test_a_chunk_the_scrubber_holds_back_is_no_chunk_at_all() -> None:
    # mitmproxy writes an empty chunk to an HTTP/1.1 client as chunked encoding's last one: the body would end there.
    gw = inspecting()
    flow = tflow.tflow(resp=tutils.tresp(content=b""))
    flow.metadata["airlock"] = AuditRecord("http", "sbx", "10.99.0.2", "api.allowed.test", 443, "allow", "", "allowed")
    gw.addon_named("Inspection").responseheaders(flow)
    assert list(flow.response.stream(b"short")) == [] and list(flow.response.stream(b"")) == [b"short"]


def test_the_reason_phrase_header_names_and_trailers_are_scrubbed_too() -> None:
    gw = inspecting()
    inspection = gw.addon_named("Inspection")
    fields = http.Headers([(f"X-{SECRET}".encode(), b"1")])
    flow = tflow.tflow(resp=tutils.tresp(status_code=401, reason=f"Bad token {SECRET}".encode(), headers=fields))
    flow.metadata["airlock"] = AuditRecord("http", "sbx", "10.99.0.2", "api.allowed.test", 443, "allow", "", "allowed")
    inspection.responseheaders(flow)
    assert flow.response.reason == "Bad token " + "*" * len(SECRET)
    assert flow.response.headers.fields == ((b"X-" + b"*" * len(SECRET), b"1"),)
    flow.response.trailers = http.Headers(grpc_message=f"invalid token Bearer {SECRET}")
    inspection.response(flow)
    assert flow.response.trailers["grpc-message"] == "invalid token Bearer " + "*" * len(SECRET)


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
        out = streamed(flow, body[:cut], body[cut:])
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
    # A request that did not ask for an upgrade, answered with one anyway (websocket or raw): withheld, audited.
    for protocol in (b"websocket", b"tcp"):
        flow = await judged(gw, "/v1/x")
        flow.response = tutils.tresp(status_code=101, headers=http.Headers(Upgrade=protocol), content=b"")
        withheld(gw, flow, 403, "websocket_not_allowed")
        line = gw.records[-1]
        assert (line.decision, line.code, line.status) == ("deny", "websocket_not_allowed", 101)


def withheld(gw: Gateway, flow: http.HTTPFlow, status: int, code: str) -> dict[str, object]:
    """The answer that stands in for the upstream's after the response hooks, its JSON body: all the upstream sent
    of its body is dropped (the stream sends the JSON at once, then nothing)."""
    inspection = gw.addon_named("Inspection")
    inspection.responseheaders(flow)
    assert "airlock" not in flow.metadata  # its audit line is written: the response hook writes none
    body = b"".join(b"".join(flow.response.stream(chunk)) for chunk in (b"upstream's", b"body", b""))
    flow.response.content = b""  # what mitmproxy leaves of a body it read without streaming it
    inspection.response(flow)
    assert flow.response.status_code == status and flow.response.content == body
    answer = json.loads(body)
    assert answer["code"] == code
    return answer


@pytest.mark.parametrize(
    ("header", "value", "why"),
    [("content-encoding", "gzip", "compressed"), ("transfer-encoding", "gzip, chunked", "transfer-coding")],
)
async def test_a_coded_answer_to_an_injected_request_is_withheld_and_audited(header: str, value: str, why: str) -> None:
    gw = inspecting()
    flow = await judged(gw, "/v1/x")
    flow.response.headers[header] = value
    answer = withheld(gw, flow, 502, "request_failed")
    line = gw.records[-1]
    assert (line.decision, line.code, line.path) == ("error", "request_failed", "/v1/x") and why in line.reason
    assert (answer["decision"], answer["reason"], answer["request_id"]) == ("error", line.reason, line.request_id)


@pytest.mark.parametrize(
    ("status", "headers", "why"), [(103, {}, "informational answer (103)"), (200, {"Trailer": "X-A"}, "trailers")]
)
async def test_an_answer_mitmproxy_cannot_relay_from_http11_is_withheld(
    status: int, headers: dict[str, str], why: str
) -> None:
    gw = inspecting()
    flow = await judged(gw, "/v1/x")
    flow.response = tutils.tresp(status_code=status, headers=http.Headers(**headers), content=b"")
    withheld(gw, flow, 502, "request_failed")
    assert why in gw.records[-1].reason


async def test_a_request_carrying_a_secret_asks_for_no_transfer_coding() -> None:
    gw = inspecting()
    flow = await judged(gw, "/v1/x", (b"TE", b"gzip, trailers"), (b"te", b"deflate"))
    assert flow.request.headers.get_all("te") == []  # HTTP/1.1: mitmproxy reads no trailers there either
    connect, _ = await tunnel(gw, "api.allowed.test")
    h2 = inner_request(connect, "GET", "/v1/x", (b"te", b"trailers"))
    h2.request.http_version = "HTTP/2.0"
    with mitmproxy_options():
        await gw.http.requestheaders(h2)
    assert h2.request.headers.get_all("te") == ["trailers"] and h2.request.headers["accept-encoding"] == "identity"


async def test_mitmproxys_error_page_names_the_audit_log_to_a_request_that_carried_a_secret() -> None:
    gw = inspecting()
    inspection = gw.addon_named("Inspection")
    flow = await judged(gw, "/v1/x")
    quoted = f"Cannot parse HTTP response: Bad HTTP response line: b'HTTP/1.1 2xx Bearer {SECRET}'"
    told = inspection.error_text(flow, quoted)
    assert SECRET not in told and "2xx" not in told and "gateway audit log" in told
    other = tflow.tflow()
    assert inspection.error_text(other, quoted) == quoted.replace(SECRET, "*" * len(SECRET))
    assert inspection.control_payload(f"ping {SECRET}".encode()) == b"ping " + b"*" * len(SECRET)


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


def test_mitmproxys_log_lines_quote_no_secret() -> None:
    # mitmproxy logs a websocket ping's payload, an answer it could not parse: what the upstream sent, at INFO (-v).
    credentials = Credentials.of({"model_api": SECRET})
    line = logging.LogRecord("mitmproxy.proxy.server", logging.INFO, __file__, 1, "ping (payload: %r)",
                             (f"Bearer {SECRET}".encode(),), None)  # fmt: skip
    assert ScrubbedLog(lambda: credentials).filter(line)
    assert line.getMessage() == "ping (payload: b'Bearer " + "*" * len(SECRET) + "')"
