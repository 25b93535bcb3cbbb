"""Attacks on TLS inspection, end to end: each one tries to make an inspected tunnel reach what its rule does not
allow (another host, another path, an upgrade into something no rule judges), or to get the injected secret back
into the sandbox. Each asserts what the sandbox saw and what the upstream got (nothing, for a refusal).

Websockets: an upgrade goes through only where an `http:` sub-rule says `websocket: true`, and only as a websocket
(a 101 to anything else would turn the inspected tunnel into a raw one); the upgrade request gets the injected
header, and what the server sends over the websocket is scrubbed of the secret like a response body."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway_proc import PROXY, GatewayProcess
from netclient import exchange, http_replies, in_netns, tls_tunnel, websocket_session
from test_inspect import SECRET, curl, gateway_ca, header_values, upstream_requests
from testca import TestCA
from topology import FakeNet, Topology

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
    policy = tmp_path / "attacks.yaml"
    policy.write_text(POLICY)
    secret = tmp_path / "model_api.secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    yield own_gateway(policy, ("--secret", f"model_api=file:{secret}"))


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
        ("www.allowed.test", b"GET /ws HTTP/1.1\r\nHost: www.allowed.test\r\nSec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAA==\r\n"
                             b"Sec-WebSocket-Version: 13\r\n\r\n"),
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
