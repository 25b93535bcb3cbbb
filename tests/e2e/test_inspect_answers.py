"""Everything of an answer from an inspected host that reaches the sandbox is scrubbed of the injected secret, or
the answer is withheld (a JSON answer in its place says why).

fakenet's /leak/<part> reflects the request's Authorization header (the injected secret) into one part of its
answer each: the status line's reason phrase, a header's name and value, a 103's headers, a body sent in the
transfer-coding the request's TE asked for (or one it did not), trailers, an answer mitmproxy cannot parse (its
error page quotes it), and on the HTTP/2 port a gRPC error's trailers and a GOAWAY's debug data; /leak/ws puts it in
every frame a websocket server can send. Real clients read them from the sandbox — curl (HTTP/1.1 and 2, with
`--raw` and `--tr-encoding`), Python's http.client, a raw TLS socket, a websocket client written out by hand — and
each test searches every byte they got, the audit log and the gateway's log for the secret."""

from __future__ import annotations

import http.client
import json
import os
import ssl
from base64 import b64encode
from collections.abc import Callable
from pathlib import Path

import pytest
from test_inspect import SECRET, curl, gateway_ca, header_values, policy_and_secret, upstream_requests

from airlock.verify.topology import FakeNet, Topology

from gateway_proc import PROXY, GatewayProcess
from netclient import exchange, in_netns, tls_tunnel

POLICY = """\
version: 1
profiles:
  default:
    allow:
      - host: allowed.test
        inspect: true
        http:
          - {methods: [GET], paths: ["/leak/**"], websocket: true}
        inject:
          - {header: Authorization, value: "Bearer {secret:model_api}"}
      - host: h2.allowed.test
        ports: [9443]
        inspect: true
        inject:
          - {header: Authorization, value: "Bearer {secret:model_api}"}
"""
MASKED = "Bearer " + "*" * len(SECRET)
# What the client gets of each part (lowercased, in curl's -v output or the bytes): the part scrubbed, or in its
# place the gateway's 502 JSON (an answer it cannot scrub) or mitmproxy's 502 page naming only the audit log.
PARTS = {
    "reason": f"401 invalid credentials {MASKED}",  # HTTP/2 has no reason phrase: there, the status
    "header": f"x-{'*' * len(SECRET)}: name",  # and x-echo: {MASKED}
    "early-hints": "an informational answer (103) the gateway cannot relay",
    "te": MASKED,  # the body, once the request's TE no longer asks for gzip
    "te-forced": "in transfer-coding 'gzip, chunked': not delivered",
    "trailer": "announced trailers (x-echo) the gateway cannot read over http/1.1",
    "status-line": "the reason is in the gateway audit log only",
    "bad-length": "the reason is in the gateway audit log only",
}


@pytest.fixture
def leaky(own_gateway: Callable[..., GatewayProcess], tmp_path: Path) -> GatewayProcess:
    """A gateway with -v: its log has mitmproxy's lines about each connection too, which quote upstreams."""
    policy, secret = policy_and_secret(tmp_path, POLICY)
    return own_gateway(policy, ("--secret", f"model_api=file:{secret}"), verbose=True)


def assert_secret_in_no_record(gw: GatewayProcess) -> None:
    gw.stop()  # every line written
    assert SECRET not in gw.audit_path.read_text() and SECRET not in gw.log()


def raw_tls(topology: Topology, gw: GatewayProcess, target: str, data: bytes) -> bytes:
    """Every byte that came back inside the inspected tunnel to `target` (host:port) for `data`, sent as it is."""

    def run() -> bytes:
        tls, reply = tls_tunnel(PROXY, target, str(gateway_ca(gw)))
        assert tls is not None, reply
        with tls:
            return exchange(tls, data)

    return in_netns(topology.sbx, run)


@pytest.mark.parametrize("flag", ["--http1.1", "--http2"])
def test_no_part_of_an_answer_brings_the_secret_back_to_curl(
    topology: Topology, fakenet: FakeNet, leaky: GatewayProcess, tmp_path: Path, flag: str
) -> None:
    for part, expected in PARTS.items():
        body = tmp_path / f"{part}.body"
        # --tr-encoding: curl asks for gzip in TE (HTTP/1.1); --raw: it decodes no coding, so the bytes are as sent.
        result = curl(topology, leaky, flag, "--tr-encoding", "--raw", "-v", "-o", str(body),
                      f"https://allowed.test/leak/{part}")  # fmt: skip
        got = result.stderr + (body.read_bytes().decode("latin-1") if body.exists() else "")
        assert SECRET not in got, (part, got)
        if part == "reason" and flag == "--http2":
            expected = "< http/2 401"
        assert expected.lower() in got.lower(), (part, got)
    seen = upstream_requests(fakenet)
    assert len(seen) == len(PARTS) and all(header_values(r, "authorization") == [f"Bearer {SECRET}"] for r in seen)
    assert all(header_values(r, "te") == [] for r in seen)  # the TE: gzip curl sent went no further
    assert_secret_in_no_record(leaky)
    withheld = [line for line in leaky.audit() if line["kind"] == "http" and line["decision"] == "error"]
    assert {line["path"] for line in withheld} == {f"/leak/{p}" for p in PARTS if p not in ("reason", "header", "te")}


def test_no_part_of_an_answer_brings_the_secret_back_over_a_raw_tls_socket(
    topology: Topology, fakenet: FakeNet, leaky: GatewayProcess
) -> None:
    for part, expected in PARTS.items():
        request = f"GET /leak/{part} HTTP/1.1\r\nHost: allowed.test\r\nTE: gzip, trailers\r\nConnection: TE\r\n\r\n"
        got = raw_tls(topology, leaky, "allowed.test:443", request.encode())
        assert SECRET.encode() not in got, (part, got)
        assert expected.lower().encode() in got.lower(), (part, got)
    reflected = raw_tls(topology, leaky, "allowed.test:443", b"GET /leak/header HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    assert f"X-Echo: {MASKED}\r\n".encode() in reflected
    early = raw_tls(
        topology, leaky, "allowed.test:443", b"GET /leak/early-hints HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    )
    assert early.startswith(b"HTTP/1.1 502 ") and b" 103 " not in early  # not relayed as if it were the answer
    assert all(header_values(r, "te") == [] for r in upstream_requests(fakenet))  # nor trailers, over HTTP/1.1
    assert_secret_in_no_record(leaky)


def test_http_client_reads_the_reason_phrase_scrubbed(
    topology: Topology, fakenet: FakeNet, leaky: GatewayProcess
) -> None:
    def run() -> tuple[int, str, bytes]:
        context = ssl.create_default_context(cafile=str(gateway_ca(leaky)))
        conn = http.client.HTTPSConnection(*PROXY, context=context, timeout=10)
        conn.set_tunnel("allowed.test", 443)
        conn.request("GET", "/leak/reason")
        response = conn.getresponse()
        return response.status, response.reason, response.read()

    status, reason, body = in_netns(topology.sbx, run)
    assert (status, reason, body) == (401, f"Invalid credentials {MASKED}", b"denied\n")
    assert_secret_in_no_record(leaky)


def test_http2_trailers_and_a_goaway_from_an_http2_upstream_bring_no_secret(
    topology: Topology, fakenet: FakeNet, leaky: GatewayProcess, tmp_path: Path
) -> None:
    body = tmp_path / "body"
    grpc = curl(topology, leaky, "--http2", "-v", "-H", "TE: trailers", "-o", str(body),
                "https://h2.allowed.test:9443/leak/grpc")  # fmt: skip
    assert grpc.returncode == 0 and body.read_bytes() == b"ok\n", grpc.stderr
    assert SECRET not in grpc.stderr and f"< grpc-message: invalid token {MASKED}" in grpc.stderr
    goaway = curl(topology, leaky, "--http2", "-v", "https://h2.allowed.test:9443/leak/goaway")
    assert "< HTTP/2 502" in goaway.stderr and "the reason is in the gateway audit log only" in goaway.stdout, goaway
    assert SECRET not in goaway.stdout + goaway.stderr
    grpc_seen, _ = upstream_requests(fakenet)
    assert header_values(grpc_seen, "authorization") == [f"Bearer {SECRET}"]
    assert header_values(grpc_seen, "te") == ["trailers"]  # gRPC's, over HTTP/2: it codes nothing
    assert_secret_in_no_record(leaky)


def test_every_frame_a_websocket_server_sends_reaches_the_sandbox_scrubbed(
    topology: Topology, fakenet: FakeNet, leaky: GatewayProcess
) -> None:
    key = b64encode(os.urandom(16)).decode()
    upgrade = (
        f"GET /leak/ws HTTP/1.1\r\nHost: allowed.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    got = raw_tls(topology, leaky, "allowed.test:443", upgrade.encode())
    assert got.startswith(b"HTTP/1.1 101 ") and SECRET.encode() not in got, got
    frames = _frames(got.partition(b"\r\n\r\n")[2])
    masked = MASKED.encode()
    assert frames == [(0x1, masked), (0x2, masked), (0x9, masked), (0xA, masked), (0x8, b"\x03\xf0" + masked)]
    (seen,) = upstream_requests(fakenet)
    assert header_values(seen, "authorization") == [f"Bearer {SECRET}"]
    assert_secret_in_no_record(leaky)


def _frames(data: bytes) -> list[tuple[int, bytes]]:
    """The (opcode, payload) of each unmasked frame a server sent, short ones only (as /leak/ws sends)."""
    frames = []
    while data:
        opcode, length = data[0] & 0x0F, data[1] & 0x7F
        frames.append((opcode, data[2 : 2 + length]))
        data = data[2 + length :]
    return frames


def test_a_withheld_answer_says_why_in_json(topology: Topology, fakenet: FakeNet, leaky: GatewayProcess) -> None:
    result = curl(topology, leaky, "--http1.1", "-w", "\n%{http_code}", "https://allowed.test/leak/te-forced")
    body, _, status = result.stdout.rpartition("\n")
    answer = json.loads(body)
    assert (status, answer["decision"], answer["code"]) == ("502", "error", "request_failed")
    assert "transfer-coding" in answer["reason"] and answer["request_id"]
    (line,) = leaky.audit_for(request_id=answer["request_id"])
    assert (line["decision"], line["code"], line["status"], line["path"]) == ("error", "request_failed", 200,
                                                                              "/leak/te-forced")  # fmt: skip
