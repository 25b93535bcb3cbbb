"""The pod's broker relay (airlock/gateway/broker_relay.py) between a real aiohttp client and a real aiohttp server
standing in for the central broker, on loopback: what the broker receives, what the agent gets back, and the token
file read again as it changes (the relay in a fenced pod, with a real broker: tests/e2e/test_pod_gateway.py)."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from airlock.audit import AuditRecord
from airlock.gateway.broker_relay import BrokerRelay
from airlock.gateway.config import RelayConfig


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Upstream:
    """The central broker's stand-in: records each request, answers JSON, or a stream on /mcp."""

    url: str = ""
    seen: list[tuple[str, str, dict[str, list[str]], bytes]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)  # the stream's second event waits for it

    async def answer(self, request: web.Request) -> web.StreamResponse:
        headers: dict[str, list[str]] = {}
        for name, value in request.headers.items():
            headers.setdefault(name.lower(), []).append(value)
        self.seen.append((request.method, request.path_qs, headers, await request.read()))
        if request.path == "/mcp":
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            await stream.write(b"data: first\n\n")
            await self.release.wait()
            await stream.write(b"data: second\n\n")
            await stream.write_eof()
            return stream
        return web.json_response({"ok": True}, status=201, headers={"Set-Cookie": "s=1", "X-Broker": "yes"})


@dataclass
class Relay:
    url: str
    upstream: Upstream
    token: Path
    audit: list[AuditRecord]
    http: aiohttp.ClientSession


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[Relay]:
    upstream = Upstream()
    app = web.Application()
    app.router.add_route("*", "/{path:.*}", upstream.answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    upstream.url = f"http://127.0.0.1:{port}"
    token = tmp_path / "token"
    token.write_text("pod-token\n")
    audit: list[AuditRecord] = []
    config = RelayConfig(upstream.url + "/", str(token), free_port())
    relayed = BrokerRelay(config, audit.append, lambda client: "pod-1", None, (5.0, 30.0))
    await relayed.start("127.0.0.1")
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            yield Relay(f"http://127.0.0.1:{config.port}", upstream, token, audit, http)
    finally:
        upstream.release.set()
        await relayed.stop()
        await runner.cleanup()


async def call(relay: Relay, path: str = "/v1/tools/create_pull_request", **kw: Any) -> tuple[int, Any]:
    async with relay.http.post(relay.url + path, json={"repo": "acme/app"}, **kw) as reply:
        return reply.status, await reply.json()


async def test_the_pods_token_goes_in_place_of_the_agents_credentials(relay: Relay) -> None:
    sent = {
        "Authorization": "Bearer agent-own", "Cookie": "session=agent", "Proxy-Authorization": "Basic eA==",
        "X-Forwarded-For": "10.9.9.9", "Idempotency-Key": "k-1",
    }  # fmt: skip
    async with relay.http.post(relay.url + "/v1/tools/create_pull_request?x=1", json={"a": 1}, headers=sent) as reply:
        assert (reply.status, await reply.json()) == (201, {"ok": True})
        assert "Set-Cookie" not in reply.headers and reply.headers["X-Broker"] == "yes"
    ((method, path, headers, body),) = relay.upstream.seen
    assert (method, path, body) == ("POST", "/v1/tools/create_pull_request?x=1", b'{"a": 1}')
    assert headers["authorization"] == ["Bearer pod-token"] and headers["idempotency-key"] == ["k-1"]
    assert not {"cookie", "proxy-authorization", "x-forwarded-for"} & headers.keys()
    (line,) = relay.audit
    assert (line.kind, line.sandbox, line.method, line.path, line.status, line.decision) == (
        "broker", "pod-1", "POST", "/v1/tools/create_pull_request", 201, "allow",
    )  # fmt: skip


async def test_a_streamed_answer_reaches_the_agent_as_it_comes(relay: Relay) -> None:
    async with relay.http.post(relay.url + "/mcp", json={"jsonrpc": "2.0"}) as reply:
        assert reply.headers["Content-Type"] == "text/event-stream"
        first = await asyncio.wait_for(reply.content.readuntil(b"\n\n"), 5)  # while the broker still holds the rest
        relay.upstream.release.set()
        assert (first, await reply.content.read()) == (b"data: first\n\n", b"data: second\n\n")


async def test_the_token_file_is_read_again_as_it_changes(relay: Relay) -> None:
    relay.token.write_text("")  # no token yet: nothing forwarded
    assert await call(relay) == (
        503,
        {"error": "broker_token_unavailable", "message": "the pod has no broker token (yet)"},
    )
    relay.token.unlink()
    assert (await call(relay))[0] == 503
    # A Secret's update: a new directory, the file a symlink into it, swapped whole.
    (relay.token.parent / "..2026_1").mkdir()
    (relay.token.parent / "..2026_1" / "token").write_text("second-token")
    relay.token.symlink_to("..2026_1/token")
    assert (await call(relay))[0] == 201
    relay.token.unlink()
    (relay.token.parent / "..2026_2").mkdir()
    (relay.token.parent / "..2026_2" / "token").write_text("third-token\n")
    os.symlink("..2026_2/token", relay.token)
    assert (await call(relay))[0] == 201
    (relay.token.parent / "..2026_2" / "token").write_text("not a token, spaces\n")
    assert (await call(relay))[0] == 503
    assert [h["authorization"] for _, _, h, _ in relay.upstream.seen] == [
        ["Bearer second-token"],
        ["Bearer third-token"],
    ]
    assert [line.code for line in relay.audit] == [
        "broker_token_unavailable", "broker_token_unavailable", "allowed", "allowed", "broker_token_unavailable"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "path",
    ["/v1/tokens", "/v1/revocations", "/v1/keys/rotate", "/v1/jwks", "/v1/tools/../tokens", "/v1/tools/%2e%2e",
     "/v1/tools/x/y", "/v1/toolsx", "/mcp/", "/metrics", "/", "//v1/tools"],
)  # fmt: skip
async def test_anything_but_the_sandbox_surface_is_404_here(relay: Relay, path: str) -> None:
    async with relay.http.get(yarl_url(relay.url + path)) as reply:
        assert (reply.status, (await reply.json())["error"]) == (404, "not_found")
    assert relay.upstream.seen == [] and [line.status for line in relay.audit] == [404]


@pytest.mark.parametrize("path", ["/v1/tools", "/v1/tools/create_pull_request", "/mcp", "/.well-known/jwks.json"])
async def test_the_sandbox_surface_is_relayed(relay: Relay, path: str) -> None:
    relay.upstream.release.set()
    async with relay.http.get(relay.url + path) as reply:
        assert reply.status in (200, 201)
    assert [seen[1] for seen in relay.upstream.seen] == [path]


async def test_a_web_origin_other_than_the_relays_is_refused(relay: Relay) -> None:
    assert (await call(relay, headers={"Origin": "http://evil.example"}))[0] == 403
    assert relay.upstream.seen == []
    assert (await call(relay, headers={"Origin": relay.url}))[0] == 201  # its own: not forwarded, the broker's differs
    assert "origin" not in relay.upstream.seen[0][2]


async def test_a_broker_out_of_reach_is_502(relay: Relay) -> None:
    audit: list[AuditRecord] = []
    config = RelayConfig(f"http://127.0.0.1:{free_port()}", str(relay.token), free_port())
    gone = BrokerRelay(config, audit.append, lambda client: "pod-1", None, (5.0, 30.0))
    await gone.start("127.0.0.1")
    try:
        async with relay.http.get(f"http://127.0.0.1:{config.port}/v1/tools") as reply:
            assert (reply.status, (await reply.json())["error"]) == (502, "broker_unreachable")
    finally:
        await gone.stop()
    assert [(line.decision, line.code) for line in audit] == [("error", "broker_unreachable")]


async def test_an_http_broker_is_relayed_with_no_tls_context_made(relay: Relay, tmp_path: Path) -> None:
    """An http:// broker is dialed without TLS: the relay starts and relays without reading `upstream_ca` (a CA
    bundle costs every pod's start some 30 ms of CPU to load), which here is no bundle at all."""
    not_a_bundle = tmp_path / "not-a-bundle.pem"
    not_a_bundle.write_text("no certificate here\n")
    config, audit = RelayConfig(relay.upstream.url, str(relay.token), free_port()), list[AuditRecord]()
    plain = BrokerRelay(config, audit.append, lambda client: "pod-1", str(not_a_bundle), (5.0, 30.0))
    await plain.start("127.0.0.1")
    try:
        async with relay.http.get(f"http://127.0.0.1:{config.port}/v1/tools") as reply:
            assert reply.status == 201
    finally:
        await plain.stop()
    assert (relay.upstream.seen[0][:2], [line.decision for line in audit]) == (("GET", "/v1/tools"), ["allow"])


def yarl_url(text: str) -> Any:
    import yarl

    return yarl.URL(text, encoded=True)  # sent as written: no dot segment or escape resolved on the way
