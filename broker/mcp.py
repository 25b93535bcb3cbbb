"""The broker's tools over the Model Context Protocol, at `POST /mcp` on the sandbox app.

Streamable HTTP, JSON-RPC 2.0, in both eras of the protocol:
- the handshake era, 2025-06-18 and 2025-11-25: `initialize` (answering the client's version if we speak it, else
  the newest), `ping`, `tools/list`, `tools/call`; later requests carry `MCP-Protocol-Version` or none;
- the stateless era, 2026-07-28 (what the official SDK probes first, with `server/discover`): every request carries
  the version in that header and in `params._meta` with the client's capabilities, `Mcp-Method` and, for
  `tools/call`, `Mcp-Name`; a header that disagrees with the body is 400 `HeaderMismatch` (-32020); `server/discover`,
  `tools/list`, `tools/call`; results carry `resultType`, listings their cache hints (`ttlMs` 0: a policy reload may
  change a declared tool; `cacheScope` private: a listing is the token's).
A version neither era has is 400 `UnsupportedProtocolVersion` (-32022) naming the ones we speak.

One JSON-RPC message a POST, answered `application/json`: batches are refused (both eras removed them, and a batch
would be many calls behind one rate-limit token and one audit line); nothing is streamed (the broker never sends
the client a request or a notification), so `GET` and `DELETE` are 405, as both eras say a server without a stream
or a session answers them.

Stateless: no `Mcp-Session-Id` is issued (the handshake era makes sessions optional, the stateless era has none), so
one presented is unknown (404) there, and ignored in the stateless era as it says. Every request already carries
the bearer token, checked and bound to the sandbox's network by the sandbox app's middleware like any REST call; a
session would add state a sandbox could grow and nothing to authorise with.

`tools/list` is exactly the token's granted tools (`Broker.granted_tools`); `tools/call` runs `Broker.invoke` with
the arguments as the REST body: the result is the REST result (text and `structuredContent`), a refusal is a tool
error (`isError`) carrying the REST error body (`{"error": code, "message": ...}`), audited with its code. A refusal
of the token itself (a tool outside its grants: 403 with `WWW-Authenticate: Bearer error="insufficient_scope"`;
before any message is read, a missing or invalid token: 401, the rate limit: 429) is answered at the HTTP layer as
MCP's authorization says, with a JSON-RPC error (`BROKER_REFUSAL`, the REST body as its `data`) that an SDK shows.

What a client asks while it finds out what the server offers (a method this server does not have, a version it
does not speak, a GET for a stream) is answered as the protocol says and audited as allowed with that code: it
refuses the sandbox nothing, and is no denial to tell.

The transport is our own on aiohttp rather than the SDK's (an ASGI/Starlette app with its own task groups, session
manager and dependencies): it is a few checks in front of the same `Broker.invoke`, and it runs inside the
middleware that authenticates, rate limits and audits every sandbox request. The messages are checked here, a
handful of fields by hand (as broker.shapes does upstream answers), not with the SDK's pydantic models: no value
is ever quoted back in an error (but the version asked for, in its shape, which -32022 must name), and no SDK is
needed at run time; the tests check every answer against the SDK's own models and drive the SDK's client.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import importlib.metadata
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from airlock.audit import AuditRecord

from .bodies import MAX_REQUEST_BYTES, MAX_REQUEST_DEPTH, parsed, read_body
from .calls import Tool, bounded
from .errors import BrokerError, Result
from .origin import own_origin
from .redact import Redactor
from .tokens import Claims

HANDSHAKE_VERSIONS = ("2025-06-18", "2025-11-25")  # oldest to newest
STATELESS_VERSIONS = ("2026-07-28",)
VERSIONS = (*HANDSHAKE_VERSIONS, *STATELESS_VERSIONS)
LATEST_HANDSHAKE = HANDSHAKE_VERSIONS[-1]
VERSION_HEADER, METHOD_HEADER, NAME_HEADER = "MCP-Protocol-Version", "Mcp-Method", "Mcp-Name"
SESSION_HEADER = "Mcp-Session-Id"
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
_VERSION_SHAPE = re.compile(r"[A-Za-z0-9._-]{1,32}")  # a version as -32022 names it back
_BASE64_SENTINEL = re.compile(r"=\?base64\?(.*)\?=")  # a header value that is not plain ASCII (2026-07-28)
# The envelope (message, params) nests two levels above the arguments, which nest as deep as a REST body may.
MAX_DEPTH = MAX_REQUEST_DEPTH + 2
LARGE_READS = 4  # bodies above the common limit (push_branch bundles) read and held at once, broker-wide
LARGE_WAIT = 5.0  # seconds a large body waits for its turn before 503
HANDSHAKE_METHODS = frozenset({"initialize", "ping", "tools/list", "tools/call"})
STATELESS_METHODS = frozenset({"server/discover", "tools/list", "tools/call"})
# Audited by name: what MCP's clients send in any version (any other method is "mcp:-", its name not kept).
CLIENT_METHODS = HANDSHAKE_METHODS | STATELESS_METHODS | {
    "notifications/initialized", "notifications/cancelled", "notifications/progress",
    "notifications/roots/list_changed", "logging/setLevel", "completion/complete", "resources/list",
    "resources/templates/list", "resources/read", "resources/subscribe", "resources/unsubscribe", "prompts/list",
    "prompts/get", "subscriptions/listen",
}  # fmt: skip
SERVER_INFO = {"name": "airlock-broker", "version": importlib.metadata.version("airlock")}
CAPABILITIES = {"tools": {"listChanged": False}}
INSTRUCTIONS = (
    "Tools brokered by airlock for this sandbox: each call is checked against this token's grants, run with "
    "the broker's own credential, and audited."
)

# JSON-RPC 2.0 error codes, MCP's of the stateless era, and the broker's own (outside JSON-RPC's reserved range, as
# MCP asks of codes it does not define): the broker refused the request, its REST code in `data.error`.
PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
HEADER_MISMATCH, UNSUPPORTED_PROTOCOL_VERSION = -32020, -32022
BROKER_REFUSAL = -31000
# The handshake era answers an accepted request's error 200; the stateless era an unknown method 404, bad params 400.
ACCEPTED = 200

type Reply = Callable[[dict[str, Any], int, dict[str, str] | None], web.Response]
type RequestId = str | int


class RpcError(BrokerError):
    """A JSON-RPC error answer: `rpc` its code, `status` the HTTP status, `code` the broker's own (the audit's,
    and `data.error` in the answer)."""

    def __init__(
        self,
        rpc: int,
        status: int,
        code: str,
        message: str,
        details: dict[str, Any] | None = None,
        request_id: RequestId | None = None,
        headers: dict[str, str] | None = None,
        quiet: bool = False,
    ) -> None:
        super().__init__(status, code, message, headers=headers, details=details, quiet=quiet)
        self.rpc, self.request_id = rpc, request_id


@dataclass(frozen=True)
class Message:
    id: RequestId | None  # None: a notification
    method: str
    params: dict[str, Any]


class McpBroker(Protocol):
    """What the MCP surface asks of the broker (`broker.service.Broker`, which builds it)."""

    redactor: Redactor

    def all_tools(self) -> dict[str, Tool]: ...

    def granted_tools(self, claims: Claims) -> list[dict[str, Any]]: ...

    async def invoke(
        self,
        name: str,
        claims: Claims,
        record: AuditRecord,
        read_input: Callable[[int], Awaitable[dict[str, Any]]],
        idempotency_key: str | None = None,
    ) -> Result: ...


class McpSurface:
    def __init__(self, broker: McpBroker, reply: Reply) -> None:
        self.broker = broker
        self.reply = reply  # the broker's one exit for JSON: redacted
        self.large = asyncio.Semaphore(LARGE_READS)

    async def not_allowed(self, request: web.Request) -> web.StreamResponse:
        """GET (a server-to-client stream) and DELETE (a session's end): neither exists here, which is how both eras
        say so (a client asks to find out)."""
        raise BrokerError(
            405, "method_not_allowed", "MCP here is POST only: no stream, no session", {"Allow": "POST"}, quiet=True
        )

    def refusal(self, e: BrokerError, request_id: RequestId | None = None) -> web.Response:
        """A refusal as a JSON-RPC error, at its HTTP status and with its headers (a Bearer challenge, Retry-After)."""
        rpc = e.rpc if isinstance(e, RpcError) else BROKER_REFUSAL
        error = {"code": rpc, "message": e.message, "data": e.body()}
        return self.reply({"jsonrpc": "2.0", "id": request_id, "error": error}, e.status, e.headers)

    async def handle(
        self, request: web.Request, claims: Claims, record: AuditRecord
    ) -> tuple[web.StreamResponse, BrokerError | None]:
        """One POST: the answer, and the refusal it carries if any (answered 200 or 202 but audited as one)."""
        message: Message | None = None
        try:
            _check_headers(request)
            limit = self._body_limit(claims)
            async with bounded(self.large if _may_be_large(request, limit) else None, LARGE_WAIT, "large requests"):
                data = await self._read(request, limit)
                message = _message(await self._parse(data))
                record.method = f"mcp:{message.method}" if message.method in CLIENT_METHODS else "mcp:-"
                stateless = _stateless(request)
                if message.id is None:  # a notification (notifications/initialized, cancelled): nothing to do
                    return web.Response(status=202), None
                answer = self._stateless if stateless else self._handshake
                result, refusal = await answer(message, claims, record, request, len(data))
            return self.reply({"jsonrpc": "2.0", "id": message.id, "result": result}, 200, None), refusal
        except BrokerError as e:  # an RpcError, or the broker too busy for a large body
            request_id = message.id if message is not None else e.request_id if isinstance(e, RpcError) else None
            return self.refusal(e, request_id), e

    def _body_limit(self, claims: Claims) -> int:
        """The largest body one of the token's tools takes (the common limit at least, for the other methods)."""
        granted = {g.tool for g in claims.grants}
        sizes = [t.max_request_bytes for t in self.broker.all_tools().values() if t.name in granted]
        return max([MAX_REQUEST_BYTES, *sizes])

    async def _read(self, request: web.Request, limit: int) -> bytes:
        try:
            return await read_body(request, limit)
        except BrokerError as e:
            raise RpcError(INVALID_REQUEST, e.status, e.code, e.message) from None

    async def _parse(self, data: bytes) -> Any:
        try:
            return await parsed(data, MAX_DEPTH)
        except BrokerError as e:
            message = e.message if e.code == "too_deep" else "the request body must be JSON"
            raise RpcError(PARSE_ERROR, 400, e.code, message) from None

    async def _handshake(
        self, message: Message, claims: Claims, record: AuditRecord, request: web.Request, size: int
    ) -> tuple[dict[str, Any], BrokerError | None]:
        """A request of the handshake era: the result, and the tool's refusal when it is a tool error."""
        if SESSION_HEADER in request.headers:
            raise RpcError(INVALID_REQUEST, 404, "unknown_session", "no such session: this server issues none")
        params = message.params
        if message.method == "initialize":
            return _initialized(params), None
        if message.method == "ping":
            return {}, None
        if message.method == "tools/list":
            return self._listing(params, claims, ACCEPTED), None
        if message.method == "tools/call":
            return await self._call(params, claims, record, request, size, ACCEPTED)
        raise _unknown_method(HANDSHAKE_METHODS, ACCEPTED)

    async def _stateless(
        self, message: Message, claims: Claims, record: AuditRecord, request: web.Request, size: int
    ) -> tuple[dict[str, Any], BrokerError | None]:
        """A request of the stateless era (2026-07-28): its envelope checked, then the result with its type."""
        _check_envelope(message, request)
        if message.method == "server/discover":
            return _discovered(), None
        if message.method == "tools/list":
            return self._listing(message.params, claims, 400) | _fresh_for("private"), None
        if message.method == "tools/call":
            result, refusal = await self._call(message.params, claims, record, request, size, 400)
            return result | {"resultType": "complete"}, refusal
        raise _unknown_method(STATELESS_METHODS, 404)

    def _listing(self, params: dict[str, Any], claims: Claims, invalid: int) -> dict[str, Any]:
        if "cursor" in params:  # every listing is one page: no cursor was ever handed out
            raise RpcError(INVALID_PARAMS, invalid, "invalid_params", "unknown cursor")
        return {"tools": [_tool(t) for t in self.broker.granted_tools(claims)]}

    async def _call(
        self,
        params: dict[str, Any],
        claims: Claims,
        record: AuditRecord,
        request: web.Request,
        size: int,
        invalid: int,  # the HTTP status of invalid params in this era
    ) -> tuple[dict[str, Any], BrokerError | None]:
        name, arguments = params.get("name"), params.get("arguments", {})
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise RpcError(INVALID_PARAMS, invalid, "invalid_params", "tools/call takes a name and an arguments object")
        # An unknown tool is a protocol error in MCP (a refusal of the tool's own is a tool error).
        if name not in (tools := self.broker.all_tools()):
            raise RpcError(INVALID_PARAMS, invalid, "unknown_tool", f"no such tool; known: {', '.join(tools)}")
        record.method = name
        try:
            _, body, _ = await self.broker.invoke(
                name, claims, record, _arguments(arguments, size), request.headers.get("Idempotency-Key")
            )
        except BrokerError as e:
            if e.challenges:  # the token's scope, not the call: HTTP 403 with the challenge, as MCP's authorization
                raise RpcError(BROKER_REFUSAL, e.status, e.code, e.message, e.details, headers=e.headers) from None
            return self._content(e.body(), error=True), e
        return self._content(body, error=False), None

    def _content(self, body: dict[str, Any], error: bool) -> dict[str, Any]:
        """The REST answer as a tool result: as text (for any client) and as structured content. Redacted before
        it is encoded: an escaped credential in the text would not be found afterwards."""
        body = self.broker.redactor.value(body)
        return {"content": [{"type": "text", "text": json.dumps(body)}], "structuredContent": body, "isError": error}


def _check_headers(request: web.Request) -> None:
    # DNS rebinding: a web page's script reaching the broker under a name of its own. The only origin the broker
    # would serve a page from is its own address, as the sandbox dialled it.
    origin = request.headers.get("Origin")
    if origin is not None and origin != own_origin(request):
        raise RpcError(INVALID_REQUEST, 403, "bad_origin", "requests from a web origin are refused")
    if not _accepts_json(request.headers.get("Accept", "*/*")):
        raise RpcError(INVALID_REQUEST, 406, "not_acceptable", "answers are application/json; accept it")
    if request.content_type != "application/json":
        raise RpcError(INVALID_REQUEST, 415, "unsupported_media_type", "send Content-Type: application/json")
    for name in (VERSION_HEADER, METHOD_HEADER, NAME_HEADER):
        if len(request.headers.getall(name, ())) > 1:  # one reader would take the first, another the last
            raise RpcError(HEADER_MISMATCH, 400, "header_mismatch", f"{name} appears more than once")


def _stateless(request: web.Request) -> bool:
    """Whether the request is of the stateless era (by its MCP-Protocol-Version): absent (a client of a version
    before the header) or of the handshake era, it is not; one of neither era is 400 -32022, as both eras say."""
    version = request.headers.get(VERSION_HEADER)
    if version is None or version in HANDSHAKE_VERSIONS:
        return False
    if version in STATELESS_VERSIONS:
        return True
    shown = version if _VERSION_SHAPE.fullmatch(version) else "?"
    raise RpcError(
        UNSUPPORTED_PROTOCOL_VERSION, 400, "unsupported_protocol_version",
        f"{VERSION_HEADER} must be one of {', '.join(VERSIONS)}", {"supported": list(VERSIONS), "requested": shown},
        quiet=True,
    )  # fmt: skip


def _check_envelope(message: Message, request: web.Request) -> None:
    """The stateless era's envelope: `_meta` with the version and the client's capabilities, and the routing headers
    saying what the body says (an intermediary may have routed on them)."""
    meta = message.params.get("_meta")
    if not isinstance(meta, dict) or META_VERSION not in meta or not isinstance(meta.get(META_CAPABILITIES), dict):
        raise RpcError(
            INVALID_PARAMS, 400, "invalid_params", f"params._meta must carry {META_VERSION} and {META_CAPABILITIES}"
        )
    said = {VERSION_HEADER: meta[META_VERSION], METHOD_HEADER: message.method}
    if message.method == "tools/call" and isinstance(name := message.params.get("name"), str):
        said[NAME_HEADER] = name
    for header, body in said.items():  # a header absent, or a body's null, is a mismatch too
        sent = request.headers.get(header)
        if (_decoded(sent) if header == NAME_HEADER else sent) != body or body is None:
            raise RpcError(HEADER_MISMATCH, 400, "header_mismatch", f"{header} does not match the request body")


def _decoded(value: str | None) -> str | None:
    """A routing header's value: as sent, or decoded from its base64 sentinel (None when that is malformed)."""
    if value is None or (match := _BASE64_SENTINEL.fullmatch(value)) is None:
        return value
    try:
        raw = base64.b64decode(match[1], validate=True)
        return raw.decode() if base64.b64encode(raw).decode() == match[1] else None
    except (binascii.Error, UnicodeDecodeError):
        return None


def _unknown_method(known: frozenset[str], status: int) -> RpcError:
    """A method this server does not offer (a client finding out, e.g. `resources/list`): answered, not a denial."""
    message = "no such method; known: " + ", ".join(sorted(known))
    return RpcError(METHOD_NOT_FOUND, status, "unknown_method", message, quiet=True)


def _message(value: Any) -> Message:
    """A JSON-RPC request or notification, or the error its shape earns (never quoting the value back)."""
    if isinstance(value, list):
        raise RpcError(INVALID_REQUEST, 400, "batch_refused", "batches are not part of MCP since 2025-06-18")
    if not isinstance(value, dict) or value.get("jsonrpc") != "2.0" or not isinstance(value.get("method"), str):
        # Also a response: the broker never sends the client a request, so there is none to answer.
        raise RpcError(INVALID_REQUEST, 400, "invalid_request", "send a JSON-RPC 2.0 request or notification")
    request_id = value.get("id")
    if "id" in value and not (isinstance(request_id, str) or type(request_id) is int):
        raise RpcError(INVALID_REQUEST, 400, "invalid_request", "a request id is a string or an integer")
    params = value.get("params", {})
    if not isinstance(params, dict):
        status = 400 if request_id is None else 200  # a notification's error has no request to answer
        raise RpcError(INVALID_PARAMS, status, "invalid_params", "params must be an object", request_id=request_id)
    return Message(request_id, value["method"], params)


def _initialized(params: dict[str, Any]) -> dict[str, Any]:
    asked = params.get("protocolVersion")
    if not isinstance(asked, str) or not isinstance(params.get("capabilities", {}), dict):
        raise RpcError(INVALID_PARAMS, 200, "invalid_params", "initialize takes a protocolVersion and capabilities")
    return {
        # The client's if we speak it in this era, else our newest of it (the stateless era has no initialize).
        "protocolVersion": asked if asked in HANDSHAKE_VERSIONS else LATEST_HANDSHAKE,
        "capabilities": CAPABILITIES,
        "serverInfo": SERVER_INFO,
        "instructions": INSTRUCTIONS,
    }


def _discovered() -> dict[str, Any]:
    return {
        "supportedVersions": list(VERSIONS), "capabilities": CAPABILITIES, "instructions": INSTRUCTIONS,
        "_meta": {META_SERVER_INFO: SERVER_INFO},
    } | _fresh_for("public")  # fmt: skip


def _fresh_for(scope: str) -> dict[str, Any]:
    """A complete result's type and cache hints: never fresh (a reload may change a tool), cached only in `scope`."""
    return {"resultType": "complete", "ttlMs": 0, "cacheScope": scope}


def _tool(listing: dict[str, Any]) -> dict[str, Any]:
    return {"name": listing["name"], "description": listing["description"], "inputSchema": listing["input_schema"]}


def _arguments(arguments: dict[str, Any], size: int) -> Callable[[int], Awaitable[dict[str, Any]]]:
    """The call's input for `Broker.invoke`, within the tool's byte limit (counted on the whole message)."""

    async def read(limit: int) -> dict[str, Any]:
        if size > limit:
            raise BrokerError(413, "too_large", f"request bodies are limited to {limit} bytes")
        return arguments

    return read


def _may_be_large(request: web.Request, limit: int) -> bool:
    """Whether the body may exceed the common limit: then it waits for one of the few large reads."""
    declared = request.content_length
    return limit > MAX_REQUEST_BYTES and (declared is None or declared > MAX_REQUEST_BYTES)


def _accepts_json(accept: str) -> bool:
    types = {part.split(";", 1)[0].strip().lower() for part in accept.split(",")}
    return bool(types & {"application/json", "application/*", "*/*"})
