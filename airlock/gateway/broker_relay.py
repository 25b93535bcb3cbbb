"""A pod's broker relay (`airlock gateway --pod --broker-url URL --broker-token-file FILE`): the agent reaches the
broker's sandbox surface (REST `/v1/tools...`, MCP `/mcp`, the JWKS) on the gateway's loopback port, and the gateway
forwards each request to the central `airlock broker` at URL with the pod's token in `Authorization`.

The token is the pod's credential: a file (a Kubernetes Secret mounted into the gateway's container alone) that the
agent never sees. It is read again whenever the file changes (a Secret is updated in place, an orchestrator may write
the token once the pod has its address); while there is none, or the file cannot be read, a request is answered 503
`broker_token_unavailable` and nothing is forwarded. The agent's own credentials (Authorization, cookies) never
leave: only the headers the broker's surface reads are forwarded. Whatever is not that surface (the broker's admin
paths among it) is answered 404 here. The gateway dials the broker itself — its UID passes the pod fence — so the
broker sees the pod's address, to which `airlock token issue --source` binds the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from airlock.audit import AuditRecord
from airlock.broker.origin import own_origin
from airlock.gateway.broker_listener import HTTP_LOG, CappedConnections
from airlock.gateway.config import RelayConfig
from airlock.inspection.files import read_regular_file
from airlock.policy import ReasonCode

log = logging.getLogger("airlock.gateway")

# The broker's sandbox surface (broker/service.py `sandbox_app`), as the raw path sent: no escapes, no dot segments.
SURFACE = re.compile(r"/v1/tools(?:/[a-z][a-z0-9_]{0,63})?|/mcp|/\.well-known/jwks\.json")
# What the surface reads of a request; nothing else of the agent's (its Authorization, cookies, Origin) leaves.
FORWARDED = (
    "Accept", "Content-Type", "Content-Length", "Idempotency-Key", "User-Agent", "MCP-Protocol-Version", "Mcp-Method",
    "Mcp-Name", "Mcp-Session-Id", "Last-Event-ID",
)  # fmt: skip
# What the relay's own server says, or what belongs to one hop: never copied from the broker's answer.
NOT_RETURNED = frozenset(
    h.lower()
    for h in ("Connection", "Keep-Alive", "Proxy-Authenticate", "Transfer-Encoding", "Upgrade", "Trailer", "TE",
              "Set-Cookie", "Date", "Server")
)  # fmt: skip
TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{1,8192}")  # a bearer token's characters (RFC 6750), a JWT's among them
MAX_TOKEN_FILE = 16 * 1024


class PodToken:
    """The pod's broker token in `path`, read again whenever the file is another or has changed (looked at with
    each request: a stat, not a read). None while the file is missing, unreadable, empty or not a token."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[int, ...] | None = None
        self._token: str | None = None
        self._problem: str | None = "not read yet"

    def current(self) -> str | None:
        try:
            st = os.stat(self.path)
        except OSError as e:
            self._seen, self._token = None, None
            self._unavailable(f"{self.path}: {e.strerror or e}")
            return None
        # ctime too: a file made readable (chmod) is read again though its content is the same.
        seen = (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if seen != self._seen:
            self._seen = seen
            self._token = self._read()
        return self._token

    def _read(self) -> str | None:
        try:
            text = read_regular_file(Path(self.path), MAX_TOKEN_FILE).decode("ascii").strip()
        except (OSError, UnicodeDecodeError) as e:
            self._unavailable(f"{self.path}: {getattr(e, 'strerror', None) or e}")
            return None
        if not text:
            self._unavailable(f"{self.path}: empty (no token yet)")
            return None
        if not TOKEN.fullmatch(text):
            self._unavailable(f"{self.path}: not a bearer token")
            return None
        if self._problem is not None:
            log.info("broker relay: the pod's token read from %s", self.path)
            self._problem = None
        return text

    def _unavailable(self, problem: str) -> None:
        """Told once per change: a relay asked every second must not repeat it every second."""
        if problem != self._problem:
            log.warning("broker relay: no token, requests answered 503: %s", problem)
            self._problem = problem


class BrokerRelay:
    """The relay's listener and its client of the broker. `identify` names the sandbox of a client address (the
    pod's one); `emit` writes each request's audit line."""

    def __init__(
        self,
        config: RelayConfig,
        emit: Callable[[AuditRecord], None],
        identify: Callable[[str], str],
        upstream_ca: str | None,
        timeouts: tuple[float, float],  # connecting to the broker; the longest wait for its next bytes
    ) -> None:
        self.config, self.emit, self.identify = config, emit, identify
        self.token = PodToken(config.token_file)
        self.upstream_ca = upstream_ca
        self.url = config.url.rstrip("/")
        parts = urlsplit(self.url)
        self._tls = parts.scheme == "https"
        self._host, self._port = parts.hostname or "-", parts.port or (443 if self._tls else 80)
        connect, idle = timeouts
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect, sock_read=idle)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None

    @property
    def listening(self) -> bool:
        return self._server is not None and self._server.is_serving()

    async def start(self, listen: str) -> None:
        """Listen on `listen`:port (OSError if it cannot)."""
        # The bytes pass as the broker sent them (its Content-Encoding with them); no cookie is ever kept.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._context()), timeout=self._timeout, auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )  # fmt: skip
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None, logger=HTTP_LOG)
        await self._runner.setup()
        assert self._runner.server is not None
        factory = CappedConnections(self._runner.server, self.config.max_connections_per_client)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(factory, listen, self.config.port, reuse_address=True)

    def _context(self) -> ssl.SSLContext | bool:
        """An https broker's certificate verified against the system's CAs and `upstream_ca`. An http one (the
        manifest's, in the cluster) is dialed without TLS: no context is made, whose CA bundle would cost every
        pod's start some 30 ms of CPU; `True` is aiohttp's own verifying default, which the relay never uses."""
        return ssl.create_default_context(cafile=self.upstream_ca) if self._tls else True

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        if self._session is not None:
            await self._session.close()
        self._server = self._runner = self._session = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One request of the agent: relayed, or refused here; audited either way."""
        started = time.monotonic()
        client = request.remote or "-"
        record = AuditRecord(
            "broker", self.identify(client), client, self._host, self._port, "deny", "", ReasonCode.INTERNAL_ERROR
        )
        record.method, record.path, record.extra["relay"] = request.method, request.path, self.url
        try:
            return await self._relay(request, record)
        finally:
            record.duration_ms = round((time.monotonic() - started) * 1000, 3)
            self.emit(record)

    async def _relay(self, request: web.Request, record: AuditRecord) -> web.StreamResponse:
        path = request.raw_path.partition("?")[0]
        if not SURFACE.fullmatch(path):
            return _refused(record, 404, "not_found", "not the broker's sandbox surface")
        if (origin := request.headers.get("Origin")) is not None and origin != own_origin(request):
            return _refused(record, 403, "bad_origin", "requests from a web origin are refused")
        token = self.token.current()
        if token is None:
            return _refused(record, 503, "broker_token_unavailable", "the pod has no broker token (yet)")
        headers = [(name, value) for name in FORWARDED for value in request.headers.getall(name, ())]
        headers.append(("Authorization", f"Bearer {token}"))
        assert self._session is not None
        try:
            async with self._session.request(
                request.method, self.url + request.raw_path, headers=headers, allow_redirects=False,
                data=request.content if request.body_exists else None,
            ) as upstream:  # fmt: skip
                record.status = upstream.status
                record.decision, record.code, record.reason = "allow", ReasonCode.ALLOWED, "relayed to the broker"
                return await _stream(request, upstream)
        except (aiohttp.ClientError, TimeoutError) as e:
            if record.status is not None:  # the answer had begun: the agent sees it cut short
                record.decision, record.reason = "error", f"the broker's answer broke off: {type(e).__name__}"
                raise
            record.decision = "error"
            return _refused(record, 502, "broker_unreachable", f"the broker could not be reached: {type(e).__name__}")


async def _stream(request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
    """The broker's answer, passed on as its bytes come (an MCP stream among them)."""
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    for name, value in upstream.headers.items():
        if name.lower() not in NOT_RETURNED:
            response.headers.add(name, value)
    await response.prepare(request)
    async for chunk in upstream.content.iter_any():
        await response.write(chunk)
    await response.write_eof()
    return response


def _refused(record: AuditRecord, status: int, code: str, message: str) -> web.Response:
    record.code, record.reason, record.status = code, message, status
    return web.json_response({"error": code, "message": message}, status=status)
