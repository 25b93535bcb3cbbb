"""The broker's tools over the Model Context Protocol, at `POST /mcp` on the sandbox app.

Streamable HTTP transport, JSON-RPC 2.0, protocol versions 2025-06-18 and 2025-11-25 (the newest the official SDK
negotiates with `initialize`; its `server/discover` probe of the stateless 2026 era is refused, and the SDK falls
back to `initialize`). One JSON-RPC message a POST, answered `application/json`: batches are refused (both
versions removed them, and a batch would be many calls behind one rate-limit token and one audit line); nothing is
streamed (the broker never sends the client a request or a notification), so `GET` and `DELETE` are 405.

Stateless: no `Mcp-Session-Id` is issued (the spec makes sessions optional), so one presented is unknown (404).
Every request already carries the bearer token, checked and bound to the sandbox's network by the sandbox app's
middleware like any REST call; a session would add state a sandbox could grow and nothing to authorise with.

`tools/list` is exactly the token's granted tools (`Broker.granted_tools`); `tools/call` runs `Broker.invoke` with
the arguments as the REST body: the result is the REST result (text and `structuredContent`), a refusal is a tool
error (`isError`) carrying the REST error body (`{"error": code, "message": ...}`), audited with its code.

The transport is our own on aiohttp rather than the SDK's (an ASGI/Starlette app with its own task groups, session
manager and dependencies): it is a few checks in front of the same `Broker.invoke`, and it runs inside the
middleware that authenticates, rate limits and audits every sandbox request. The messages are checked here, a
handful of fields by hand (as broker.shapes does upstream answers), not with the SDK's pydantic models: no value
is ever quoted back in an error, and no SDK is needed at run time; the tests check every answer against the SDK's
own models and drive the SDK's client.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from airlock.audit import AuditRecord

from .bodies import MAX_REQUEST_BYTES, MAX_REQUEST_DEPTH, parsed, read_body
from .calls import bounded
from .errors import BrokerError
from .tokens import Claims

if TYPE_CHECKING:
    from .service import Broker

VERSIONS = ("2025-06-18", "2025-11-25")  # oldest to newest
LATEST = VERSIONS[-1]
VERSION_HEADER = "MCP-Protocol-Version"
SESSION_HEADER = "Mcp-Session-Id"
# The envelope (message, params) nests two levels above the arguments, which nest as deep as a REST body may.
MAX_DEPTH = MAX_REQUEST_DEPTH + 2
LARGE_READS = 4  # bodies above the common limit (push_branch bundles) read and held at once, broker-wide
LARGE_WAIT = 5.0  # seconds a large body waits for its turn before 503
METHODS = frozenset({"initialize", "ping", "tools/list", "tools/call"})
# Audited by name (any other method is "mcp:-"); server/discover is the SDK's probe for the 2026 era.
AUDITED = METHODS | {"notifications/initialized", "notifications/cancelled", "server/discover"}
SERVER_INFO = {"name": "airlock-broker", "version": importlib.metadata.version("airlock")}
INSTRUCTIONS = (
    "Tools brokered by airlock for this sandbox: each call is checked against this token's grants, run with "
    "the broker's own credential, and audited."
)

# JSON-RPC 2.0 error codes; -32000 is the first of the server's own, here: the broker could not take the request.
PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, SERVER_ERROR = -32700, -32600, -32601, -32602, -32000

type Reply = Callable[[dict[str, Any], int, dict[str, str] | None], web.Response]
type RequestId = str | int


class RpcError(BrokerError):
    """A JSON-RPC error answer: `rpc` its code, `status` the HTTP status (200 once a request was accepted),
    `code` the broker's own (the audit's, and `data.error` in the answer)."""

    def __init__(
        self,
        rpc: int,
        status: int,
        code: str,
        message: str,
        details: dict[str, Any] | None = None,
        request_id: RequestId | None = None,
    ) -> None:
        super().__init__(status, code, message, details=details)
        self.rpc, self.request_id = rpc, request_id


@dataclass(frozen=True)
class Message:
    id: RequestId | None  # None: a notification
    method: str
    params: dict[str, Any]


class McpSurface:
    def __init__(self, broker: Broker, reply: Reply) -> None:
        self.broker = broker
        self.reply = reply  # the broker's one exit for JSON: redacted
        self.large = asyncio.Semaphore(LARGE_READS)

    async def not_allowed(self, request: web.Request) -> web.StreamResponse:
        """GET (a server-to-client stream) and DELETE (a session's end): neither exists here."""
        raise BrokerError(405, "method_not_allowed", "MCP here is POST only: no stream, no session", {"Allow": "POST"})

    async def handle(
        self, request: web.Request, claims: Claims, record: AuditRecord
    ) -> tuple[web.StreamResponse, BrokerError | None]:
        """One POST: the answer, and the refusal it carries if any (answered 200 or 202 but audited as one)."""
        message: Message | None = None
        try:
            self._check_headers(request)
            limit = self._body_limit(claims)
            async with bounded(self.large if _may_be_large(request, limit) else None, LARGE_WAIT, "large requests"):
                data = await self._read(request, limit)
                message = _message(await self._parse(data))
                record.method = f"mcp:{message.method}" if message.method in AUDITED else "mcp:-"
                _check_version(request)
                if message.id is None:  # a notification (notifications/initialized, cancelled): nothing to do
                    return web.Response(status=202), None
                result, refusal = await self._answer(message, claims, record, request, len(data))
            return self.reply({"jsonrpc": "2.0", "id": message.id, "result": result}, 200, None), refusal
        except BrokerError as e:  # an RpcError, or the broker too busy for a large body
            failed = e if isinstance(e, RpcError) else RpcError(SERVER_ERROR, e.status, e.code, e.message)
            request_id = message.id if message is not None else failed.request_id
            error = {"code": failed.rpc, "message": failed.message, "data": failed.body()}
            return self.reply({"jsonrpc": "2.0", "id": request_id, "error": error}, failed.status, None), failed

    def _check_headers(self, request: web.Request) -> None:
        # DNS rebinding: a web page's script reaching the broker under a name of its own. The only origin the broker
        # would serve a page from is its own address, as the sandbox dialled it.
        origin = request.headers.get("Origin")
        if origin is not None and origin != _own_origin(request):
            raise RpcError(INVALID_REQUEST, 403, "bad_origin", "requests from a web origin are refused")
        if SESSION_HEADER in request.headers:
            raise RpcError(INVALID_REQUEST, 404, "unknown_session", "no such session: this server issues none")
        if not _accepts_json(request.headers.get("Accept", "*/*")):
            raise RpcError(INVALID_REQUEST, 406, "not_acceptable", "answers are application/json; accept it")
        if request.content_type != "application/json":
            raise RpcError(INVALID_REQUEST, 415, "unsupported_media_type", "send Content-Type: application/json")

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

    async def _answer(
        self, message: Message, claims: Claims, record: AuditRecord, request: web.Request, size: int
    ) -> tuple[dict[str, Any], BrokerError | None]:
        """The result of a request, and the tool's refusal when it is a tool error."""
        params = message.params
        if message.method == "initialize":
            return _initialized(params), None
        if message.method == "ping":
            return {}, None
        if message.method == "tools/list":
            if "cursor" in params:  # every listing is one page: no cursor was ever handed out
                raise RpcError(INVALID_PARAMS, 200, "invalid_params", "unknown cursor")
            return {"tools": [_tool(t) for t in self.broker.granted_tools(claims)]}, None
        if message.method == "tools/call":
            return await self._call(params, claims, record, request, size)
        raise RpcError(METHOD_NOT_FOUND, 200, "unknown_method", "no such method; known: " + ", ".join(sorted(METHODS)))

    async def _call(
        self, params: dict[str, Any], claims: Claims, record: AuditRecord, request: web.Request, size: int
    ) -> tuple[dict[str, Any], BrokerError | None]:
        name, arguments = params.get("name"), params.get("arguments", {})
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise RpcError(INVALID_PARAMS, 200, "invalid_params", "tools/call takes a name and an arguments object")
        # An unknown tool is a protocol error in MCP (a refusal of the tool's own is a tool error).
        if name not in (tools := self.broker.all_tools()):
            known = ", ".join(tools)
            raise RpcError(INVALID_PARAMS, 200, "unknown_tool", f"no such tool; known: {known}")
        record.method = name
        try:
            _, body, _ = await self.broker.invoke(
                name, claims, record, _arguments(arguments, size), request.headers.get("Idempotency-Key")
            )
        except BrokerError as e:
            return self._content(e.body(), error=True), e
        return self._content(body, error=False), None

    def _content(self, body: dict[str, Any], error: bool) -> dict[str, Any]:
        """The REST answer as a tool result: as text (for any client) and as structured content. Redacted before
        it is encoded: an escaped credential in the text would not be found afterwards."""
        body = self.broker.redactor.value(body)
        return {"content": [{"type": "text", "text": json.dumps(body)}], "structuredContent": body, "isError": error}


def _check_version(request: web.Request) -> None:
    """Absent (a client of a version without the header), or one we speak; 400 otherwise, as the spec says."""
    version = request.headers.get(VERSION_HEADER)
    if version is not None and version not in VERSIONS:
        raise RpcError(
            INVALID_REQUEST, 400, "unsupported_protocol_version",
            f"{VERSION_HEADER} must be one of {', '.join(VERSIONS)}", {"supported": list(VERSIONS)},
        )  # fmt: skip


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
        "protocolVersion": asked if asked in VERSIONS else LATEST,  # the client's if we speak it, else our newest
        "capabilities": {"tools": {"listChanged": False}},
        "serverInfo": SERVER_INFO,
        "instructions": INSTRUCTIONS,
    }


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


def _own_origin(request: web.Request) -> str | None:
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if not sockname:
        return None
    host, port = sockname[0], sockname[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _accepts_json(accept: str) -> bool:
    types = {part.split(";", 1)[0].strip().lower() for part in accept.split(",")}
    return bool(types & {"application/json", "application/*", "*/*"})
