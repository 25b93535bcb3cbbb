"""The proxy path end to end: a sandbox namespace whose only route is the gateway, a real `airlock gateway`
(mitmproxy + addon), the fake internet counting every connection. Each denial asserts what the sandbox saw
and that the forbidden upstream counted zero connections."""

from __future__ import annotations

import contextlib
import os
import ssl
import struct
import time

import pytest

from airlock.verify.fakeca import FakeCA
from airlock.verify.topology import FakeNet, Topology

from gateway_proc import PROXY, GatewayProcess
from netclient import connect_tunnel, in_netns, proxy_http, raw_request, tls_get

ALLOWED_IP = "192.0.2.10"
EVIL_IP = "203.0.113.66"
METADATA_IP = "169.254.169.254"
INTERNAL_IP = "10.1.2.3"
SERVICE_IP = "10.1.2.4"
LITERAL_IP = "198.51.100.10"  # a public address opened by CIDR rules: on 80 and 443, and as a raw tunnel on 22
PROXY_URL = f"http://{PROXY[0]}:{PROXY[1]}"


def assert_denied_json(reply, code: str, reason_part: str = "") -> dict:
    assert reply.status == 403, (reply.status, reply.error, reply.body[:300])
    assert reply.headers.get("X-Airlock-Decision") == "deny"
    body = reply.json()
    assert body["decision"] == "deny" and body["request_id"] and "rule_hint" in body
    assert body["code"] == code and reason_part in body["reason"], body
    return body


def client_hello(sni: str | None, extension: int | None = None) -> bytes:
    """The first TLS record of a real handshake (Python's ssl), with one more extension of type `extension`
    (e.g. Encrypted Client Hello) appended when asked: a ClientHello built by hand, as a hostile client would."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    outgoing = ssl.MemoryBIO()
    tls = context.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname=sni)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    record = outgoing.read()
    if extension is None:
        return record
    payload = b"\x00" + os.urandom(64)  # an ECH "outer" body: the server cannot read it, the gateway must not
    return with_extension(record, extension, payload)


def with_extension(record: bytes, extension: int, payload: bytes) -> bytes:
    """The ClientHello record with one more extension appended (lengths fixed up)."""
    body = record[9:]  # after the record header (5) and the handshake header (4)
    at = 34  # legacy_version, random
    at += 1 + body[at]  # session id
    at += 2 + struct.unpack("!H", body[at : at + 2])[0]  # cipher suites
    at += 1 + body[at]  # compression methods
    extensions = body[at + 2 :] + struct.pack("!HH", extension, len(payload)) + payload
    body = body[:at] + struct.pack("!H", len(extensions)) + extensions
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    return record[:3] + struct.pack("!H", len(handshake)) + handshake


def server_names(*names: bytes) -> bytes:
    """A server_name extension body listing these host_name entries."""
    entries = b"".join(struct.pack("!BH", 0, len(name)) + name for name in names)
    return struct.pack("!H", len(entries)) + entries


def through_tunnel(target: str, *chunks: bytes) -> bytes:
    """CONNECT target, send each chunk as its own segment, return what comes back (b"" when closed)."""
    sock, reply = connect_tunnel(PROXY, target)
    assert sock is not None, reply
    with sock:
        for chunk in chunks:
            sock.sendall(chunk)
            time.sleep(0.2)
        sock.settimeout(5)
        try:
            return sock.recv(65536)
        except ConnectionResetError:
            return b""


def new_audit(gateway: GatewayProcess, before: int, host: str, wait: float = 5) -> dict:
    """The last audit line for host written after the first `before` lines (tunnels are logged when they close)."""
    deadline = time.monotonic() + wait
    while not (found := [r for r in gateway.audit()[before:] if r["host"] == host]):
        assert time.monotonic() < deadline, f"no new audit line for {host}"
        time.sleep(0.05)
    return found[-1]


def test_allowed_plain_http_returns_the_real_body(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    result = topology.curl(topology.sbx, "-x", PROXY_URL, "http://allowed.test/hello")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/hello\n"
    assert fakenet.connections(ALLOWED_IP, 80) == 1


def test_allowed_connect_tls_returns_the_real_body(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, test_ca: FakeCA
):
    result = topology.curl(topology.sbx, "-x", PROXY_URL, "--cacert", test_ca.ca_cert, "https://allowed.test/tls")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"fakenet {ALLOWED_IP}:443 host=allowed.test path=/tls\n"
    assert fakenet.snis() == ["allowed.test"]  # the sandbox's own TLS, passed through untouched


def test_unlisted_host_gets_403_with_reason(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    reply = in_netns(topology.sbx, proxy_http, PROXY, "http://evil.test/steal")
    body = assert_denied_json(reply, "not_allowlisted", "not in the allowlist")
    assert "evil.test" in body["rule_hint"]
    connect = in_netns(topology.sbx, tls_get, PROXY, "evil.test:443", "evil.test", "/dev/null")
    assert connect.status == 403
    assert fakenet.connections(EVIL_IP, 80) == fakenet.connections(EVIL_IP, 443) == 0
    assert fakenet.dns_queries("evil.test") == 0  # denied before any resolution


def test_allowed_host_on_unlisted_port_is_denied(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    reply = in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test:8080/")
    assert_denied_json(reply, "port_not_allowed", "port 8080")
    connect = in_netns(topology.sbx, tls_get, PROXY, "allowed.test:8443", "allowed.test", "/dev/null")
    assert connect.status == 403
    assert fakenet.connections(ALLOWED_IP, 8080) == fakenet.connections(ALLOWED_IP, 8443) == 0


METADATA_SPELLINGS = [
    "2852039166",  # 169.254.169.254 as one decimal number
    "0xa9fea9fe",
    "0251.0376.0251.0376",
    "0xa9.0xfe.0xa9.0xfe",
    "169.254.43518",
    "[::ffff:169.254.169.254]",
    "[::ffff:a9fe:a9fe]",
    "[64:ff9b::a9fe:a9fe]",
    "[2002:a9fe:a9fe::1]",
    "100.100.100.200",
]
LOOPBACK_SPELLINGS = ["2130706433", "0x7f.1", "0177.0.0.1", "127.1", "[::1]", "[::ffff:127.0.0.1]", "0"]


@pytest.mark.parametrize(
    ("host", "code"),
    [(h, "metadata") for h in METADATA_SPELLINGS] + [(h, "internal_address") for h in LOOPBACK_SPELLINGS],
)
def test_metadata_and_loopback_in_any_spelling_are_denied(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, host: str, code: str
):
    reply = in_netns(topology.sbx, proxy_http, PROXY, f"http://{host}/latest/meta-data/")
    assert_denied_json(reply, code)
    connect = in_netns(topology.sbx, tls_get, PROXY, f"{host}:443", None, "/dev/null")
    assert connect.status == 403, connect
    assert fakenet.total_connections() == 0


@pytest.mark.parametrize(
    ("name", "blocked_ip", "code"),
    [
        ("internal.allowed.test", INTERNAL_IP, "internal_address"),
        ("loop.allowed.test", "127.0.0.1", "own_address"),  # the gateway can bind it: one of its own
        ("meta.allowed.test", METADATA_IP, "metadata"),
    ],
)
def test_allowlisted_name_resolving_inside_is_denied(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, name: str, blocked_ip: str, code: str
):
    reply = in_netns(topology.sbx, proxy_http, PROXY, f"http://{name}/")
    body = assert_denied_json(reply, code, blocked_ip)
    assert "every address is blocked" in body["reason"]
    connect = in_netns(topology.sbx, tls_get, PROXY, f"{name}:443", name, "/dev/null")
    assert connect.status == 403
    assert fakenet.total_connections() == 0


def test_cname_to_internal_is_denied(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    reply = in_netns(topology.sbx, proxy_http, PROXY, "http://cname-internal.allowed.test/")
    assert_denied_json(reply, "internal_address", INTERNAL_IP)
    assert fakenet.total_connections() == 0


def test_rebinding_name_never_reaches_the_internal_host(
    topology: Topology, fakenet: FakeNet, own_gateway, test_ca: FakeCA
):
    # No cache floor: every lookup goes upstream, so the answers alternate public/internal (TTL 0).
    own_gateway(extra=("--dns-min-ttl", "0"))
    statuses = []
    for _ in range(6):
        statuses.append(in_netns(topology.sbx, proxy_http, PROXY, "http://rebind.allowed.test/").status)
        tls = in_netns(topology.sbx, tls_get, PROXY, "rebind.allowed.test:443", "rebind.allowed.test", test_ca.ca_cert)
        statuses.append(tls.status)
    assert fakenet.dns_queries("rebind.allowed.test") >= 12  # it really did rebind under us
    # Each request is judged on one answer, used for both the decision and the connection: public → 200,
    # internal → 403. Never a connection to the internal host.
    assert set(statuses) == {200, 403}
    assert fakenet.connections(INTERNAL_IP, 80) == fakenet.connections(INTERNAL_IP, 443) == 0


def test_mixed_answer_drops_the_internal_address(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    for _ in range(3):
        result = topology.curl(topology.sbx, "-x", PROXY_URL, "http://mixed.allowed.test/")
        assert result.returncode == 0 and result.stdout.startswith(f"fakenet {ALLOWED_IP}:80 ")
    assert fakenet.connections(INTERNAL_IP, 80) == 0
    record = gateway.audit_for(host="mixed.allowed.test")[-1]
    assert record["resolved"] == [ALLOWED_IP, INTERNAL_IP] and record["chosen_ip"] == ALLOWED_IP


def test_connect_with_mismatched_sni_is_closed(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, test_ca: FakeCA
):
    reply = in_netns(topology.sbx, tls_get, PROXY, "allowed.test:443", "evil.test", test_ca.ca_cert)
    assert reply.error is not None and reply.extra["connect_status"] == 200, reply
    assert fakenet.total_connections() == 0
    record = gateway.audit_for(host="allowed.test")[-1]
    assert (record["kind"], record["decision"], record["code"]) == ("connect", "deny", "sni_mismatch")
    assert "SNI" in record["reason"]


def test_connect_without_sni_to_a_name_is_closed(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, test_ca: FakeCA
):
    reply = in_netns(topology.sbx, tls_get, PROXY, "allowed.test:443", None, test_ca.ca_cert)
    assert reply.error is not None
    assert fakenet.total_connections() == 0


def test_plaintext_in_a_tls_only_tunnel_is_closed(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    def plaintext_through_tunnel() -> bytes:
        from netclient import connect_tunnel

        sock, reply = connect_tunnel(PROXY, "allowed.test:443")
        assert sock is not None, reply
        with sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
            sock.settimeout(5)
            return sock.recv(100)

    assert in_netns(topology.sbx, plaintext_through_tunnel) == b""
    assert fakenet.total_connections() == 0


def test_raw_tunnel_only_where_a_rule_says_so(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    def echo_through_tunnel() -> bytes:
        from netclient import connect_tunnel

        sock, reply = connect_tunnel(PROXY, "ssh.allowed.test:22")
        assert sock is not None, reply
        with sock:
            sock.sendall(b"SSH-2.0-test\r\n")
            sock.settimeout(5)
            return sock.recv(100)

    assert in_netns(topology.sbx, echo_through_tunnel).startswith(b"SSH-2.0-test")
    assert fakenet.connections(ALLOWED_IP, 22) == 1


def test_host_header_fronting_is_denied(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    reply = in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/", {"Host": "evil.test"})
    assert_denied_json(reply, "host_mismatch", "Host header")
    reply = in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/", {"Host": "allowed.test:8080"})
    assert_denied_json(reply, "host_mismatch", "Host header")
    assert fakenet.total_connections() == 0
    ok = in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/", {"Host": "ALLOWED.test."})
    assert ok.status == 200


def test_cidr_rule_opens_the_named_internal_service_on_its_port_only(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, test_ca: FakeCA
):
    ok = in_netns(topology.sbx, tls_get, PROXY, "svc.internal.test:443", "svc.internal.test", test_ca.ca_cert)
    assert ok.status == 200 and ok.body.startswith(f"fakenet {SERVICE_IP}:443".encode()), ok
    denied = in_netns(topology.sbx, proxy_http, PROXY, "http://svc.internal.test/")
    assert_denied_json(denied, "internal_address", SERVICE_IP)
    assert fakenet.connections(SERVICE_IP, 443) == 1 and fakenet.connections(SERVICE_IP, 80) == 0


@pytest.mark.parametrize("target", ["10.254.0.1:3128", "10.253.0.1:80", "0.0.0.0:3128", "127.0.0.1:3128"])
def test_the_gateways_own_addresses_are_denied(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, target: str
):
    reply = in_netns(topology.sbx, proxy_http, PROXY, f"http://{target}/")
    assert_denied_json(reply, "internal_address")  # internal before they are the gateway's: no rule opens them
    connect = in_netns(topology.sbx, tls_get, PROXY, target, None, "/dev/null")
    assert connect.status == 403


def test_twenty_keepalive_requests_on_one_connection(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    def twenty_requests() -> list[int]:
        import http.client

        conn = http.client.HTTPConnection(*PROXY, timeout=10)
        statuses = []
        for i in range(20):
            conn.request("GET", f"http://allowed.test/{i}")
            response = conn.getresponse()
            response.read()
            statuses.append(response.status)
        conn.close()
        return statuses

    assert in_netns(topology.sbx, twenty_requests) == [200] * 20
    assert fakenet.connections(ALLOWED_IP, 80) == 1  # one upstream connection, reused: the pin kept its name


def test_public_ip_literal_needs_a_cidr_rule(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    ok = in_netns(topology.sbx, proxy_http, PROXY, "http://198.51.100.10/")
    assert ok.status == 200
    denied = in_netns(topology.sbx, proxy_http, PROXY, f"http://{ALLOWED_IP}/")
    assert_denied_json(denied, "not_allowlisted", "no rule allows")
    assert fakenet.connections(ALLOWED_IP, 80) == 0


def test_deny_rule_wins(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    reply = in_netns(topology.sbx, proxy_http, PROXY, "http://denied.allowed.test/")
    body = assert_denied_json(reply, "denied_by_rule", "denied by rule")
    assert "e2e.yaml" in body["reason"]
    assert fakenet.total_connections() == 0


@pytest.mark.parametrize(
    "request_line",
    [
        b"GET http://user:pw@evil.test@allowed.test/ HTTP/1.1",
        b"GET http://allowed.test%00.evil.test/ HTTP/1.1",
        b"GET http://allowed.test\x00.evil.test/ HTTP/1.1",
        b"GET http://[fe80::1%25eth0]/ HTTP/1.1",
        b"GET http://allowed.test:99999/ HTTP/1.1",
        b"GET http://" + b"a" * 300 + b".allowed.test/ HTTP/1.1",
        b"CONNECT allowed.test:443@evil.test:443 HTTP/1.1",
        b"CONNECT [::ffff:169.254.169.254]:80 HTTP/1.1",
    ],
)
def test_hostile_request_lines_are_refused(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, request_line: bytes
):
    reply = in_netns(topology.sbx, raw_request, PROXY, request_line + b"\r\nHost: allowed.test\r\n\r\n")
    assert reply.status in (400, 403, 502) or reply.error, reply
    assert fakenet.total_connections() == 0


@pytest.mark.parametrize(
    "request_line", [b"GET /origin-form HTTP/1.1", b"GET http://allowed.test:0/port-zero HTTP/1.1"]
)
def test_odd_request_forms_are_judged_as_the_target_actually_used(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, request_line: bytes
):
    # mitmproxy takes the target of an origin-form request from Host, and reads port 0 as the default port;
    # what is judged is what is connected to, so these reach allowed.test:80 and nothing else.
    reply = in_netns(topology.sbx, raw_request, PROXY, request_line + b"\r\nHost: allowed.test\r\n\r\n")
    assert reply.status == 200
    assert fakenet.stats()["connections"] == {f"{ALLOWED_IP}:80": 1}
    denied = in_netns(topology.sbx, raw_request, PROXY, b"GET /origin-form HTTP/1.1\r\nHost: evil.test\r\n\r\n")
    assert denied.status == 403


def test_mitmproxy_onboarding_app_is_not_served(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    # mitmproxy's own apps (mitm.it hands out its CA) are not part of the gateway: an unlisted host, like any.
    reply = in_netns(topology.sbx, proxy_http, PROXY, "http://mitm.it/cert/pem")
    assert_denied_json(reply, "not_allowlisted", "not in the allowlist")
    assert fakenet.total_connections() == 0


BIG = 2 << 20  # over the gateway's stream_large_bodies (1 MiB): mitmproxy streams such a body


def chunked(size: int) -> bytes:
    return b"".join(b"10000\r\n" + b"a" * 0x10000 + b"\r\n" for _ in range(size // 0x10000)) + b"0\r\n\r\n"


@pytest.mark.parametrize(
    ("head", "body", "code"),
    [
        (
            b"POST http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\nTransfer-Encoding: chunked",
            chunked(BIG),
            "not_allowlisted",
        ),
        (
            b"POST http://allowed.test/ HTTP/1.1\r\nHost: evil.test\r\nTransfer-Encoding: chunked",
            chunked(BIG),
            "host_mismatch",
        ),
        (
            b"POST http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\nTransfer-Encoding: chunked",
            b"3\r\nabc\r\n0\r\n\r\n",
            "not_allowlisted",
        ),
        (
            b"POST http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\nContent-Length: %d" % BIG,
            b"a" * BIG,
            "not_allowlisted",
        ),
        (b"POST http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\nContent-Length: 3", b"abc", "not_allowlisted"),
        (
            b"POST http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\nContent-Length: 3\r\nExpect: 100-continue",
            b"",
            "not_allowlisted",
        ),
    ],
    ids=["chunked-2MiB", "chunked-2MiB-fronting", "chunked-small", "length-2MiB", "length-small", "expect-100"],
)
def test_a_denied_request_with_a_body_is_answered_at_once_and_never_forwarded(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, head: bytes, body: bytes, code: str
):
    # mitmproxy 12 alone would read a body it buffers before answering, and raise ("Can't set a response and enable
    # streaming at the same time") on a body it streams (unknown length, or over the limit): the gateway answers at
    # the headers, and reads the rest of the body only to drop it. A client waiting for 100 Continue gets the 403.
    log_before, audit_before = len(gateway.log()), gateway.audit_mark()
    reply = in_netns(topology.sbx, raw_request, PROXY, head + b"\r\n\r\n" + body, 10)
    assert_denied_json(reply, code)
    assert b"100 Continue" not in reply.body
    assert fakenet.total_connections() == 0
    assert fakenet.dns_queries("evil.test") == 0
    denial = new_audit(gateway, audit_before, head.split(b"/")[2].decode())
    assert denial["kind"] == "http" and denial["decision"] == "deny" and denial["method"] == "POST"
    log = gateway.log()[log_before:]
    assert "Traceback" not in log and "streaming" not in log, log
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/").status == 200  # still serving


@pytest.mark.parametrize(
    "extension", [0xFE0D, 0xFE08, 0xFFCE, 0xFD00], ids=["ech", "ech-draft-08", "esni-draft", "ech-outer-extensions"]
)
@pytest.mark.parametrize(
    "target",
    ["allowed.test:443", "ssh.allowed.test:22", f"{LITERAL_IP}:443"],
    ids=["tls-tunnel", "raw-tunnel", "ip-literal"],
)
def test_encrypted_client_hello_is_refused(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, extension: int, target: str
):
    # With ECH the SNI the gateway reads is only the outer one; the real name is encrypted: fronting.
    host, audit_before = target.rsplit(":", 1)[0], gateway.audit_mark()
    sni = None if host == LITERAL_IP else host
    assert in_netns(topology.sbx, through_tunnel, target, client_hello(sni, extension)) == b""
    assert fakenet.total_connections() == 0
    record = new_audit(gateway, audit_before, host)
    assert (record["kind"], record["decision"], record["code"]) == ("connect", "deny", "ech"), record
    assert f"Encrypted Client Hello extension 0x{extension:04x}" in record["reason"], record
    assert in_netns(topology.sbx, through_tunnel, target, client_hello(sni)) != b""  # the same hello without ECH
    assert fakenet.total_connections() == 1


def test_encrypted_client_hello_where_a_rule_allows_it(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    hello = client_hello("ech.allowed.test", 0xFE0D)
    assert in_netns(topology.sbx, through_tunnel, "ech.allowed.test:443", hello) != b""
    assert fakenet.total_connections() == 1
    # Still the outer SNI must name the CONNECT host.
    assert in_netns(topology.sbx, through_tunnel, "ech.allowed.test:443", client_hello("evil.test", 0xFE0D)) == b""
    assert fakenet.total_connections() == 1


def split(data: bytes, at: int) -> list[bytes]:
    return [data[:at], data[at:]]


@pytest.mark.parametrize(
    "chunks",
    [
        pytest.param([client_hello("evil.test")], id="other-sni"),
        pytest.param([client_hello(None)], id="no-sni"),
        pytest.param(split(client_hello("evil.test"), 1), id="split-hello"),  # b"\x16" alone is not TLS-like yet
        pytest.param([b"\x16\x03\x09" + client_hello("evil.test")[3:]], id="odd-record-version"),
    ],
)
def test_tls_in_a_raw_tunnel_still_needs_the_connect_host_as_sni(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, chunks: list[bytes]
):
    # `tunnel: true` allows bytes that are not TLS; TLS in such a tunnel is judged like TLS anywhere.
    audit_before = gateway.audit_mark()
    assert in_netns(topology.sbx, through_tunnel, "ssh.allowed.test:22", *chunks) == b""
    assert fakenet.total_connections() == 0
    record = new_audit(gateway, audit_before, "ssh.allowed.test")
    assert record["decision"] == "deny" and record["code"] in {"sni_mismatch", "malformed_client_hello"}, record
    hello = client_hello("ssh.allowed.test")
    assert in_netns(topology.sbx, through_tunnel, "ssh.allowed.test:22", *split(hello, 1)) == hello  # echoed
    assert fakenet.connections(ALLOWED_IP, 22) == 1


@pytest.mark.parametrize(
    "server_name",
    [
        pytest.param(server_names(b"other.test", b"evil.test"), id="two-names"),
        pytest.param(server_names(b"name.test:443"), id="with-port"),
        pytest.param(server_names(b"other.test\x00.evil.test"), id="nul"),
        pytest.param(server_names(LITERAL_IP.encode()), id="ip-literal"),
        pytest.param(server_names(b"evil.test"), id="a-name"),  # valid, but the CIDR rule never judged it
    ],
)
@pytest.mark.parametrize("port", [443, 22], ids=["tls-tunnel", "raw-tunnel"])
def test_sni_to_an_ip_literal_connect_must_be_absent(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, server_name: bytes, port: int
):
    # mitmproxy reads all of these as "no SNI", which an IP-literal CONNECT may send; a server may still pick
    # its virtual host by the name. SNI never carries an address, so such a CONNECT must send none at all.
    target, audit_before = f"{LITERAL_IP}:{port}", gateway.audit_mark()
    hello = with_extension(client_hello(None), 0, server_name)
    assert in_netns(topology.sbx, through_tunnel, target, hello) == b""
    assert fakenet.total_connections() == 0
    record = new_audit(gateway, audit_before, LITERAL_IP)
    assert record["kind"] == "connect" and record["decision"] == "deny" and "TLS SNI" in record["reason"], record
    assert record["code"] in {"invalid_sni", "sni_mismatch"}, record
    assert in_netns(topology.sbx, through_tunnel, target, client_hello(None)) != b""  # the same hello without SNI
    assert fakenet.connections(LITERAL_IP, port) == 1


def test_http11_request_without_host_is_refused(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    reply = in_netns(topology.sbx, raw_request, PROXY, b"GET http://allowed.test/ HTTP/1.1\r\n\r\n")
    assert reply.status == 400 and reply.headers.get("X-Airlock-Decision") == "deny", reply
    assert reply.json()["code"] == "missing_host_header" and "Host" in reply.json()["reason"]
    origin_form = in_netns(topology.sbx, raw_request, PROXY, b"GET / HTTP/1.1\r\n\r\n")
    assert origin_form.status == 400  # mitmproxy's own: no target at all
    assert fakenet.total_connections() == 0


def test_http10_absolute_form_without_host_gets_the_judged_host(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess
):
    # HTTP/1.0 may omit Host; the upstream then gets the name that was judged, not its default site.
    reply = in_netns(topology.sbx, raw_request, PROXY, b"GET http://allowed.test/old HTTP/1.0\r\n\r\n")
    assert reply.status == 200 and reply.body == f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/old\n".encode()
    denied = in_netns(topology.sbx, raw_request, PROXY, b"GET / HTTP/1.0\r\n\r\n")
    assert denied.status == 400  # origin-form without Host names no target: mitmproxy refuses it
    assert fakenet.stats()["connections"] == {f"{ALLOWED_IP}:80": 1}


@pytest.mark.parametrize(
    "headers",
    [
        b"Content-Length: 5\r\nTransfer-Encoding: chunked",
        b"Content-Length: 5\r\nContent-Length: 6",
        b"Transfer-Encoding: gzip",
    ],
)
def test_request_smuggling_shapes_are_refused(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, headers: bytes
):
    # The gateway pins mitmproxy's validate_inbound_headers: ambiguous framing never reaches an upstream.
    request = b"POST http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n" + headers + b"\r\n\r\n0\r\n\r\n"
    reply = in_netns(topology.sbx, raw_request, PROXY, request)
    assert reply.status == 400 or reply.error, reply
    assert fakenet.total_connections() == 0
