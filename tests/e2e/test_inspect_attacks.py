"""Attacks on TLS inspection, end to end: each one tries to make an inspected tunnel reach what its rule does not
allow (another host, another path, an upgrade into something no rule judges), or to get the injected secret back
into the sandbox. Each asserts what the sandbox saw and what the upstream got (nothing, for a refusal).

Websockets: an upgrade goes through only where an `http:` sub-rule says `websocket: true`, and only as a websocket
(a 101 to anything else would turn the inspected tunnel into a raw one); the upgrade request gets the injected
header, and what the server sends over the websocket is scrubbed of the secret like a response body."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_inspect import SECRET, curl, gateway_ca, gateway_with_secret, header_values, upstream_requests
from test_transparent import routed_sbx  # noqa: F401 - a fixture: sbx routed through the fence

from airlock.verify.fakeca import FakeCA
from airlock.verify.topology import FakeNet, Topology

from gateway_proc import AIRLOCK, PROXY, GatewayProcess
from netclient import exchange, h2_request, http_replies, in_netns, tls_tunnel, websocket_session

POLICY = """\
version: 1
profiles:
  default:
    allow:
      - host: allowed.test
        inspect: true
        name: model-api
        http:
          - {methods: [GET], paths: ["/headers", "/reflect", "/gzip", "/airlock-*"]}
          - {methods: [GET], paths: ["/ws"], websocket: true}
          - {methods: [POST], paths: ["/v1/**"]}
        inject:
          - {header: Authorization, value: "Bearer {secret:model_api}"}
      - host: www.allowed.test
        ports: [443]
        inspect: true
        name: no-websocket
        http:
          - {methods: [GET], paths: ["/ws", "/raw-upgrade", "/headers"]}
      - host: "*.wild.allowed.test"
        ports: [443]
        inspect: true
        name: wild
      - host: other.test
        ports: [443]
        name: passthrough
    deny:
      - host: deny.wild.allowed.test
        name: denied
"""


@pytest.fixture
def attacked(own_gateway: Callable[..., GatewayProcess], tmp_path: Path) -> Iterator[GatewayProcess]:
    yield gateway_with_secret(own_gateway, tmp_path, POLICY)


def in_tunnel(topology: Topology, gw: GatewayProcess, host: str, data: bytes) -> bytes:
    """Bytes sent as they are inside an inspected tunnel to host:443 (TLS verified against the gateway CA), and
    everything that came back."""

    def run() -> bytes:
        tls, reply = tls_tunnel(PROXY, f"{host}:443", str(gateway_ca(gw)))
        assert tls is not None, reply
        with tls:
            return exchange(tls, data)

    return in_netns(topology.sbx, run)


def refusal(data: bytes) -> tuple[int, str]:
    """The status and JSON code of the gateway's one answer in `data`."""
    ((status, body),) = http_replies(data)
    return status, json.loads(body)["code"]


# --------------------------------------------------------------------------------------------------- websockets


def test_an_allowed_websocket_carries_messages_both_ways_and_its_upgrade_gets_the_injected_header(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess
) -> None:
    def run():
        tls, reply = tls_tunnel(PROXY, "allowed.test:443", str(gateway_ca(attacked)))
        assert tls is not None, reply
        with tls:
            return websocket_session(tls, "allowed.test", "/ws", [b"hello", "\u00e9t\u00e9".encode()])

    result = in_netns(topology.sbx, run)
    assert result.status == 101, result.head
    (upgrade,) = upstream_requests(fakenet, "/ws")
    assert header_values(upgrade, "authorization") == [f"Bearer {SECRET}"]
    # The server's first message reflects the handshake's headers: the secret in it is masked.
    first, *echoes = result.messages
    assert SECRET.encode() not in first and b'"Authorization", "Bearer ****' in first
    assert echoes == [b"hello", "\u00e9t\u00e9".encode()]
    assert [m["payload"] for m in fakenet.ws_messages()] == ["hello", "\u00e9t\u00e9".encode().decode("latin-1")]
    (line,) = attacked.audit_for(host="allowed.test", kind="http")
    assert (line["path"], line["status"], line["decision"]) == ("/ws", 101, "allow")


@pytest.mark.parametrize("host", ["www.allowed.test", "a.wild.allowed.test"])
def test_a_websocket_upgrade_where_no_sub_rule_allows_one_is_refused_before_the_upstream(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess, host: str
) -> None:
    def run():
        tls, reply = tls_tunnel(PROXY, f"{host}:443", str(gateway_ca(attacked)))
        assert tls is not None, reply
        with tls:
            return websocket_session(tls, host, "/ws", [b"hello"])

    result = in_netns(topology.sbx, run)
    assert result.status == 403, result.head
    assert json.loads(result.body)["code"] == "websocket_not_allowed"
    assert upstream_requests(fakenet) == [] and fakenet.ws_messages() == []


@pytest.mark.parametrize(
    ("host", "request_head"),
    [
        # No Upgrade header at all, but a server that upgrades anyway (fakenet's /ws is that lenient).
        ("www.allowed.test", b"GET /ws HTTP/1.1\r\nHost: www.allowed.test\r\n"
                             b"Sec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAA==\r\nSec-WebSocket-Version: 13\r\n\r\n"),
        # An upgrade to something that is not a websocket: after a 101 the tunnel would carry raw bytes.
        ("www.allowed.test", b"GET /raw-upgrade HTTP/1.1\r\nHost: www.allowed.test\r\nUpgrade: tcp\r\n"
                             b"Connection: Upgrade\r\n\r\n"),
    ],
)  # fmt: skip
def test_an_upgrade_the_request_was_not_judged_for_is_never_delivered(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess, host: str, request_head: bytes
) -> None:
    got = in_tunnel(topology, attacked, host, request_head + b"raw bytes after the upgrade\r\n")
    assert b" 101 " not in got and b"raw bytes" not in got, got
    assert fakenet.ws_messages() == []
    (line,) = attacked.audit_for(host=host, kind="http")
    assert line["decision"] == "deny" and line["code"] == "websocket_not_allowed", line


# --------------------------------------------------------------------------------------------------- HTTP/2 and 1.1

HTTP_VERSIONS = [("--http2", "2"), ("--http1.1", "1.1")]


@pytest.mark.parametrize(("flag", "version"), HTTP_VERSIONS)
def test_injection_scrubbing_and_denial_over_either_http_version(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess, flag: str, version: str
) -> None:
    # The sandbox speaks `version` to the gateway; fakenet speaks HTTP/1.1 only: the gateway translates.
    out = "\n%{http_version} %{http_code}"
    echoed = curl(topology, attacked, flag, "-w", out, "https://allowed.test/headers")
    reflected = curl(topology, attacked, flag, "-D", "-", "-o", "/dev/null", "-w", out, "https://allowed.test/reflect")
    denied = curl(topology, attacked, flag, "-w", out, "https://allowed.test/admin")
    fronted = curl(topology, attacked, flag, "-H", "Host: other.test", "-w", out, "https://allowed.test/headers")
    for result, status in ((echoed, 200), (reflected, 200), (denied, 403), (fronted, 403)):
        assert result.stdout.endswith(f"\n{version} {status}"), (result.stdout, result.stderr)
        assert SECRET not in result.stdout
    assert "x-reflected-authorization: bearer ****" in reflected.stdout.lower()
    assert json.loads(denied.stdout.rpartition("\n")[0])["code"] == "path_not_allowed"
    assert json.loads(fronted.stdout.rpartition("\n")[0])["code"] == "host_mismatch"
    seen = upstream_requests(fakenet)
    assert [r["target"] for r in seen] == ["/headers", "/reflect"]
    assert all(header_values(r, "authorization") == [f"Bearer {SECRET}"] for r in seen)
    attacked.stop()  # every line written
    # in the order of the requests: of their time stamps (proxy workers send their lines apart)
    lines = sorted((line for line in attacked.audit() if line["kind"] == "http"), key=lambda line: line["ts"])
    summary = [(line["path"], line["status"], line["decision"], line["code"]) for line in lines]
    assert summary == [
        ("/headers", 200, "allow", "allowed"), ("/reflect", 200, "allow", "allowed"),
        ("/admin", None, "deny", "path_not_allowed"), ("/headers", None, "deny", "host_mismatch"),
    ], summary  # fmt: skip
    assert SECRET not in attacked.audit_path.read_text() and SECRET not in attacked.log()


@pytest.mark.parametrize(("flag", "version"), HTTP_VERSIONS)
def test_a_compressed_answer_to_a_request_that_carried_the_secret_is_withheld_and_audited(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess, flag: str, version: str
) -> None:
    result = curl(topology, attacked, flag, "--compressed", "-w", "\n%{http_version} %{http_code}",
                  "https://allowed.test/gzip")  # fmt: skip
    body, _, status = result.stdout.rpartition("\n")
    assert status == f"{version} 502" and SECRET not in result.stdout, result.stdout
    (seen,) = upstream_requests(fakenet, "/gzip")
    assert header_values(seen, "accept-encoding") == ["identity"]  # asked for none: fakenet compresses anyway
    (line,) = attacked.audit_for(host="allowed.test", kind="http")
    assert (line["path"], line["status"], line["decision"]) == ("/gzip", 200, "error")
    assert "compressed" in line["reason"]
    assert json.loads(body) == {"decision": "error", "reason": line["reason"], "code": "request_failed",
                                "rule_hint": None, "request_id": line["request_id"]}  # fmt: skip


# --------------------------------------------------------------------------------------------------- other hosts

GET_HEADERS = b"GET /headers HTTP/1.1\r\nHost: allowed.test\r\n\r\n"


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /headers HTTP/1.1\r\nHost: other.test\r\n\r\n",  # a passthrough host
        b"GET /headers HTTP/1.1\r\nHost: evil.test\r\n\r\n",  # a host no rule allows
        b"GET /headers HTTP/1.1\r\nHost: allowed.test:8443\r\n\r\n",  # another port
        b"GET https://other.test/headers HTTP/1.1\r\nHost: allowed.test\r\n\r\n",  # absolute form: read first
        b"GET http://evil.test/headers HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
        b"GET /headers HTTP/1.1\r\nHost: allowed.test\r\nHost: evil.test\r\n\r\n",  # two Host headers
    ],
)
def test_a_request_inside_the_tunnel_naming_another_host_is_fronting(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess, request_head: bytes
) -> None:
    got = in_tunnel(topology, attacked, "allowed.test", request_head)
    status, _ = http_replies(got)[0]
    assert status in (400, 403), got
    assert upstream_requests(fakenet) == []


def test_a_second_request_on_the_keep_alive_connection_to_another_host_is_refused(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess
) -> None:
    got = in_tunnel(
        topology, attacked, "allowed.test", GET_HEADERS + b"GET /headers HTTP/1.1\r\nHost: other.test\r\n\r\n"
    )
    (first, second) = http_replies(got)
    assert first[0] == 200 and SECRET.encode() not in first[1]
    assert second[0] == 403 and json.loads(second[1])["code"] == "host_mismatch"
    (seen,) = upstream_requests(fakenet)
    assert seen["host"] == "allowed.test"


def test_an_http2_authority_or_host_naming_another_host_is_refused(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess
) -> None:
    def run(headers: list[tuple[str, str]]):
        tls, reply = tls_tunnel(PROXY, "allowed.test:443", str(gateway_ca(attacked)), alpn=("h2",))
        assert tls is not None and tls.selected_alpn_protocol() == "h2", reply
        with tls:
            return h2_request(tls, headers)

    base = [(":method", "GET"), (":scheme", "https"), (":path", "/headers")]
    allowed = in_netns(topology.sbx, run, [*base, (":authority", "allowed.test")])
    assert allowed.status == 200 and allowed.error is None, allowed
    attacks = [
        [*base, (":authority", "other.test")],
        [*base, (":authority", "allowed.test"), ("host", "other.test")],  # the Host an HTTP/1.1 upstream reads
        [*base, ("host", "other.test")],
    ]
    for headers in attacks:
        reply = in_netns(topology.sbx, run, headers)
        assert reply.status in (400, 403) or reply.error is not None, (headers, reply)
        assert reply.status != 200
    assert [r["host"] for r in upstream_requests(fakenet)] == ["allowed.test"]


def test_connect_inside_an_inspected_tunnel_opens_nothing(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess
) -> None:
    got = in_tunnel(
        topology, attacked, "allowed.test", b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n"
    )
    assert http_replies(got)[0][0] in (400, 403), got
    assert fakenet.total_connections() == 0


@pytest.mark.parametrize(
    "smuggled",
    [
        b"POST /v1/x HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\nGET /admin HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
        b"POST /v1/x HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 0\r\nContent-Length: 44\r\n\r\n"
        b"GET /admin HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
        b"POST /v1/x HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n"
        b"Transfer-Encoding: identity\r\n\r\n"
        b"0\r\n\r\nGET /admin HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
        b"POST /v1/x HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: xchunked\r\n\r\n"
        b"0\r\n\r\nGET /admin HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    ],
)
def test_request_smuggling_shapes_to_an_inspected_host_are_refused_before_the_upstream(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess, smuggled: bytes
) -> None:
    got = in_tunnel(topology, attacked, "allowed.test", smuggled)
    assert http_replies(got)[0][0] == 400, got
    assert upstream_requests(fakenet) == []


def test_an_inspected_host_by_ip_literal_or_a_denied_name_beside_an_inspected_wildcard_gets_no_tunnel(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess
) -> None:
    ca = str(gateway_ca(attacked))
    by_ip = in_netns(topology.sbx, tls_tunnel, PROXY, "192.0.2.10:443", ca)
    assert by_ip[0] is None and by_ip[1].status == 403, by_ip
    denied = in_netns(topology.sbx, tls_tunnel, PROXY, "deny.wild.allowed.test:443", ca)
    assert denied[0] is None and denied[1].status == 403, denied
    (line,) = attacked.audit_for(host="deny.wild.allowed.test", kind="connect")
    assert line["code"] == "denied_by_rule" and line["rule"] == "denied"
    # Inside a tunnel the wildcard allows, a Host naming the denied name is fronting like any other.
    got = in_tunnel(
        topology, attacked, "a.wild.allowed.test", b"GET / HTTP/1.1\r\nHost: deny.wild.allowed.test\r\n\r\n"
    )
    assert refusal(got) == (403, "host_mismatch")
    assert fakenet.total_connections() == 0


def test_a_client_that_pins_the_upstreams_own_ca_fails_closed(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess, test_ca: FakeCA
) -> None:
    # The client trusts only the CA that really signed fakenet's certificate: the gateway's leaf fails it, and no
    # fallback hands it the upstream's own TLS.
    tls, reply = in_netns(topology.sbx, tls_tunnel, PROXY, "allowed.test:443", str(test_ca.ca_cert))
    assert tls is None and "CERTIFICATE_VERIFY_FAILED" in (reply.error or ""), reply
    pinned = topology.curl(topology.sbx, "-x", f"http://{PROXY[0]}:{PROXY[1]}", "--cacert", str(test_ca.ca_cert),
                           "https://allowed.test/headers")  # fmt: skip
    assert pinned.returncode == 60, pinned.stderr  # curl: the peer's certificate cannot be authenticated
    assert fakenet.total_connections() == 0


# --------------------------------------------------------------------------------------------------- placeholders


# In scope: the placeholder as the sandbox holds it, in what is forwarded — the target (path as canonicalized, so an
# escaped `-` counts; the query as sent) and every header value, whatever the header name's case. Out of scope: a
# placeholder encoded, split or transformed (it holds no secret: refusing it is a signal, not the containment,
# which is that the real value never enters the sandbox).
@pytest.mark.parametrize(
    ("target", "header"),
    [
        ("/airlock-placeholder-model_api", None),
        ("/airlock%2Dplaceholder%2dmodel_api", None),  # what the upstream gets once the path is canonical
        ("/x?key=airlock-placeholder-model_api", None),
        ("/x", "x-API-kEY: airlock-placeholder-model_api"),
        ("/x", "Cookie: a=1; k=airlock-placeholder-model_api"),
    ],
)
def test_a_placeholder_to_a_host_that_does_not_inject_it_is_refused(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess, target: str, header: str | None
) -> None:
    headers = ("-H", header) if header else ()
    result = curl(
        topology, attacked, "--path-as-is", *headers, "-w", "\n%{http_code}", f"https://a.wild.allowed.test{target}"
    )
    body, _, status = result.stdout.rpartition("\n")
    assert status == "403" and json.loads(body)["code"] == "placeholder_misuse", result.stdout
    assert upstream_requests(fakenet) == []


# --------------------------------------------------------------------------------------------------- transparent


@pytest.mark.usefixtures("routed_sbx")
def test_transparent_sni_of_an_inspected_host_with_the_host_header_of_another_is_refused(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess
) -> None:
    """A client that ignores the proxy dials allowed.test's address itself: the fence hands the connection to the
    transparent listener, which inspects it by its SNI; each request inside must still name that host."""

    def direct(host_header: str) -> bytes:
        context = ssl.create_default_context(cafile=str(gateway_ca(attacked)))
        with (
            socket.create_connection(("192.0.2.10", 443), timeout=10) as sock,
            context.wrap_socket(sock, server_hostname="allowed.test") as tls,
        ):
            return exchange(tls, f"GET /headers HTTP/1.1\r\nHost: {host_header}\r\n\r\n".encode())

    for fronted in ("other.test", "evil.test", "deny.wild.allowed.test"):
        assert refusal(in_netns(topology.sbx, direct, fronted)) == (403, "host_mismatch")
    assert upstream_requests(fakenet) == []
    ((status, body),) = http_replies(in_netns(topology.sbx, direct, "allowed.test"))
    assert status == 200 and SECRET.encode() not in body
    (seen,) = upstream_requests(fakenet)
    assert header_values(seen, "authorization") == [f"Bearer {SECRET}"]


# --------------------------------------------------------------------------------------------------- nowhere


def test_the_secret_is_in_no_answer_audit_line_log_or_explanation(
    topology: Topology, fakenet: FakeNet, attacked: GatewayProcess
) -> None:
    answers = [
        curl(topology, attacked, "-i", *args, f"https://{target}")
        for target, args in [
            ("allowed.test/headers", ()), ("allowed.test/reflect", ("--http2",)), ("allowed.test/admin", ()),
            ("allowed.test/simple/%2e%2e/x", ("--path-as-is",)), ("allowed.test/gzip", ()),
            ("allowed.test/headers", ("-H", "Host: evil.test")), ("a.wild.allowed.test/", ()),  # a 502: no cert
            ("allowed.test/x?airlock-placeholder-model_api", ()), ("allowed.test/v1/x", ("-d", SECRET[:8])),
        ]
    ]  # fmt: skip
    assert len(upstream_requests(fakenet)) >= 3  # what was allowed did get the secret
    explained = topology.run(topology.gw, [AIRLOCK, "policy", "explain", "--policy", str(attacked.policy), "--json",
                                           "https://allowed.test/headers"])  # fmt: skip
    assert explained.returncode == 0 and "{secret:model_api}" in explained.stdout, explained.stderr
    attacked.stop()
    for text in [*(a.stdout + a.stderr for a in answers), explained.stdout + explained.stderr,
                 attacked.audit_path.read_text(), attacked.log()]:  # fmt: skip
        assert SECRET not in text
