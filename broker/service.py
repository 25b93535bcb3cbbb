"""The broker's HTTP surfaces.

- Sandbox-facing (through the fence, on the gateway's sandbox address): `GET /v1/tools` (the tools this token
  may call, with their input schemas, limits and grant scopes) and `POST /v1/tools/<name>` (create_pull_request,
  push_branch), and `POST /mcp`, the same tools over the Model Context Protocol (broker.mcp). Every path, an
  unknown one too, needs the sandbox token, presented from that sandbox's network.
  The broker checks the token, validates the input against the tool's JSON Schema (400 `invalid_input`, with the
  field's path), checks the grant, and acts with its own credential. Responses carry results, never credentials.
  The one path without a token: `GET /.well-known/jwks.json`, the public keys tokens are signed with.
- Admin (loopback or a unix socket the sandboxes cannot reach): mint and revoke tokens, rotate keys, JWKS.

A caller is bound to a sandbox by its source network (`identify`, the gateway's registry: a token works only from
the network of the sandbox it names) or, where the broker cannot tell sandboxes apart by network (a standalone
broker serving pods, `identify` None), by the networks the token itself names (`src`, checked against the peer
address: a token without them is refused). A token that names networks is held to them in either case.

Every answer, error or not, is JSON; errors are `{error, message}` (and `path` for invalid input) with a stable
code and honest statuses: 400 a body beyond the parser's limits (nesting) or an input its schema refuses, 401
token missing/invalid/expired/revoked/for another audience and 403 outside the grant (with their Bearer challenges,
broker.errors), 403 a protected branch or wrong sandbox, 404 an unknown tool, 409 a push that is not a
fast-forward, 413 too large, 422 validation (also of a bundle), 429 rate limit (per token: tool calls, and all
requests more generously; per source address for failed authentications, checked before any token is looked at),
502/504 upstream (also an answer of the wrong shape), 503 broker state unavailable or too busy, 504 a tool out of
time, 500 `internal_error` for a bug (one log line, no traceback to anyone). `/mcp` answers the same refusals as
JSON-RPC errors (broker.mcp).

Whatever leaves the broker (bodies, headers, idempotency records, audit lines, the call store, log lines) goes
through one redactor that knows every credential the GitHub client has held.

The call itself (tool, grant, slot, schema, run) is `Broker.invoke`, which any surface calls; the tools live in
broker.github_tools, the state store behind broker.store_deadline.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from airlock.audit import AuditRecord
from airlock.policy import ReasonCode, TokenBuckets

from .bodies import MAX_REQUEST_BYTES, json_object
from .calllog import CallRecorder, CallStore
from .calls import Call, KeyedLocks, Tool
from .declared import DeclaredTools
from .errors import BrokerError, Result, outside_grant, rate_limited, unauthorized
from .github import GitHubClient
from .github_tools import GitHubTools
from .gitpush import Pusher
from .gitread import GitReadTokens
from .grants import Grant, GrantError
from .mcp import McpSurface
from .redact import Redactor
from .store import BrokerStore
from .store_deadline import StoreDeadline
from .tokens import Claims, Network, TokenAuthority, TokenError

log = logging.getLogger("airlock.broker")

__all__ = ["Broker", "BrokerError", "BrokerSettings"]

CLAIMS = web.RequestKey("claims", Claims)
RECORD = web.RequestKey("record", AuditRecord)
# A refusal answered with a success status (an MCP tool error, a JSON-RPC error): audited as the refusal it is.
REFUSED = web.RequestKey("refused", BrokerError)
UNKNOWN_SANDBOX = "-"  # what the audit record names a source address no sandbox owns
INTERNAL_ERROR = BrokerError(500, "internal_error", "the broker failed; see its log")
AUTH_FAILURES = (401, 403)  # what `_authenticate` refuses with, as opposed to 503 (its state unreadable)
JWKS_PATH = "/.well-known/jwks.json"

type InputReader = Callable[[int], Awaitable[dict[str, Any]]]  # the call's input, read within a byte limit


@dataclass
class BrokerSettings:
    # Tool calls per token (REST `POST /v1/tools/<name>`, MCP `tools/call`): what reaches GitHub or a declared tool.
    calls_per_minute: int = 30
    burst: int = 10
    # Every request per token, tool calls and protocol messages alike (listings, MCP's discovery, handshake,
    # notifications, the 405 of a GET): generous, for clients that say a lot before their first call, but a bound
    # on what a sandbox can make the broker parse and audit.
    requests_per_minute: int = 600
    request_burst: int = 60
    # Per source address. Refusing a token is cheap but not free (a signature check, an audit line): past this,
    # a source gets 429 without anything being verified until its budget refills.
    failed_auths_per_second: float = 2.0
    failed_auth_burst: int = 20

    def __post_init__(self) -> None:
        limits = (self.calls_per_minute, self.burst, self.requests_per_minute, self.request_burst,
                  self.failed_auths_per_second, self.failed_auth_burst)  # fmt: skip
        if min(limits) <= 0:
            raise ValueError("broker rate limits must be positive")


class Broker:
    def __init__(
        self,
        authority: TokenAuthority,
        store: BrokerStore,
        identify: Callable[[str], str | None] | None,
        github: GitHubClient | None,
        emit: Callable[[AuditRecord], None],
        settings: BrokerSettings | None = None,
        pusher: Pusher | None = None,
        serves: Callable[[], list[str]] | None = None,
        call_log: CallStore | None = None,
        declared: DeclaredTools | None = None,
    ) -> None:
        self.authority = authority
        self.store = store
        self.identify = identify  # client address → sandbox id (the gateway's registry); None: the token's `src`
        self.serves = serves  # the ids of the sandboxes the gateway serves; None: any id may be given a token
        self.github = github
        self.emit = emit
        self.settings = settings or BrokerSettings()
        self._calls = TokenBuckets(self.settings.calls_per_minute / 60, self.settings.burst)
        self._requests = TokenBuckets(self.settings.requests_per_minute / 60, self.settings.request_burst)
        self._failures = TokenBuckets(self.settings.failed_auths_per_second, self.settings.failed_auth_burst)
        self.locks = KeyedLocks()
        self.redactor = github.redactor if github is not None else Redactor()
        self.state = StoreDeadline(store)
        # Every tool call, in the operator's record; None only where nothing reads it (tests, benchmarks).
        self.calls = CallRecorder(call_log, self.state, self.redactor) if call_log is not None else None
        github_tools = GitHubTools(github, pusher, self.state, self.locks, self.redactor)
        self.tools: dict[str, Tool] = {t.name: t for t in github_tools.tools(self.settings.calls_per_minute)}
        self.mcp = McpSurface(self, self._reply)
        self.declared = declared  # the policy's declared tools, beside the built-in ones
        # What the proxy injects for git reads of granted repositories (inspected rules with a github source).
        self.git_read = GitReadTokens(github, self.state, store) if github is not None else None
        for secret in declared.runtime.secrets.values() if declared is not None else ():
            self.redactor.hold(secret)

    def all_tools(self) -> dict[str, Tool]:
        """Built-in and declared tools, by name (the declared ones as the policy in force declares them)."""
        return self.tools | dict(self.declared.tools()) if self.declared is not None else self.tools

    async def invoke(
        self,
        name: str,
        claims: Claims,
        record: AuditRecord,
        read_input: InputReader,
        idempotency_key: str | None = None,
    ) -> Result:
        """One call of a tool by an authenticated caller: known tool, granted, a slot free, the input within the
        tool's size limit and accepted by its schema, recorded in the call log; then the tool runs."""
        started = time.monotonic()
        call_id: int | None = None
        try:
            tool = self._granted_tool(name, claims)
            self._spend(self._calls, claims, "this token's tool calls", self.settings.calls_per_minute)
            async with tool.slot():
                body = await read_input(tool.max_request_bytes)
                if problem := tool.spec.problem(body):
                    path, what = problem
                    raise BrokerError(400, "invalid_input", f"{path or 'the input'} {what}", details={"path": path})
                call = Call(claims, record, body, idempotency_key)
                if self.calls is not None:
                    call_id = await self.calls.begin(tool.spec, call)
                status, result, headers = await tool.run(call)
        except BrokerError as e:
            if self.calls is not None:
                if call_id is None:
                    await self.calls.refused(name, claims, record, e, started)
                else:
                    await self.calls.end(call_id, e.status, None, e, started)
            raise
        except Exception:  # a bug: the row says so (the error itself goes to the log by _json_errors)
            if self.calls is not None and call_id is not None:
                await self.calls.end(call_id, 500, None, INTERNAL_ERROR, started)
            raise
        if self.calls is not None and call_id is not None:
            await self.calls.end(call_id, status, result, None, started)
        return status, result, headers

    def _granted_tool(self, name: str, claims: Claims) -> Tool:
        """The tool called, refused when there is no such tool or the caller's token grants no call of it."""
        tools = self.all_tools()
        tool = tools.get(name)
        if tool is None:
            raise BrokerError(404, "unknown_tool", f"no such tool; known: {', '.join(tools)}")
        if not any(g.tool == tool.name for g in claims.grants):
            raise outside_grant(f"this token has no grant for {tool.name}", tool.name)
        return tool

    def granted_tools(self, claims: Claims) -> list[dict[str, Any]]:
        granted = {g.tool for g in claims.grants}
        return [t.listing(claims.grants) for t in self.all_tools().values() if t.name in granted]

    # --- sandbox-facing -----------------------------------------------------------------------------------------

    def sandbox_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[self._json_errors, self._sandbox_calls])
        app.router.add_get("/v1/tools", self.list_tools)
        app.router.add_post("/v1/tools/{name}", self.call_tool)
        app.router.add_post("/mcp", self.call_mcp)
        app.router.add_get(JWKS_PATH, self.jwks)
        app.router.add_get("/mcp", self.mcp.not_allowed, allow_head=False)
        app.router.add_delete("/mcp", self.mcp.not_allowed)
        return app

    @web.middleware
    async def _sandbox_calls(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every sandbox request, whatever its path: audited, authenticated, rate limited, recorded (but the public
        keys: anyone may read them)."""
        if request.path == JWKS_PATH and request.method == "GET":
            return await handler(request)
        started = time.monotonic()
        client = request.remote or "-"
        sandbox = (self.identify(client) if self.identify is not None else None) or UNKNOWN_SANDBOX
        # Every ending below sets the decision, reason and code; the code is the one the caller's body carries.
        record = AuditRecord("broker", sandbox, client, "-", None, "deny", "", ReasonCode.INTERNAL_ERROR)
        record.method, record.path = _call_name(request, self.all_tools()), request.path
        try:
            claims = await self._authenticate_limited(request, record)
            self._spend(self._requests, claims, "this token's requests", self.settings.requests_per_minute)
            request[CLAIMS], request[RECORD] = claims, record
            response: web.StreamResponse = await handler(request)
            if (refused := request.get(REFUSED)) is not None:
                _refusal(record, refused, response.status)
            else:
                record.decision, record.code, record.extra["status"] = "allow", ReasonCode.ALLOWED, response.status
            return response
        except BrokerError as e:
            _refusal(record, e, e.status)
            raise
        except web.HTTPException as e:  # aiohttp's own 404/405: no such route
            record.reason, record.extra["status"] = e.reason, e.status
            raise
        except Exception as e:  # a bug: audited as an error like any other ending, answered by _json_errors
            record.decision, record.reason, record.extra["status"] = "error", f"internal error: {type(e).__name__}", 500
            record.code = ReasonCode.INTERNAL_ERROR
            raise
        finally:
            record.duration_ms = round((time.monotonic() - started) * 1000, 3)
            self.emit(self.redactor.record(record))

    def _spend(self, buckets: TokenBuckets, claims: Claims, what: str, per_minute: int) -> None:
        now = time.monotonic()
        if not buckets.take(claims.jti, now):
            raise rate_limited(what, per_minute, buckets.burst, buckets.wait(claims.jti, now))

    async def list_tools(self, request: web.Request) -> web.Response:
        return self._reply({"tools": self.granted_tools(request[CLAIMS])})

    async def call_tool(self, request: web.Request) -> web.Response:
        status, result, headers = await self.invoke(
            request.match_info["name"],
            request[CLAIMS],
            request[RECORD],
            lambda limit: json_object(request, limit),
            request.headers.get("Idempotency-Key"),
        )
        return self._reply(result, status, headers)

    async def call_mcp(self, request: web.Request) -> web.StreamResponse:
        response, refused = await self.mcp.handle(request, request[CLAIMS], request[RECORD])
        if refused is not None:
            request[REFUSED] = refused
        return response

    def _reply(self, body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
        """Every JSON answer of the broker, error or not, leaves through here: redacted, headers too."""
        headers = {name: self.redactor.text(value) for name, value in (headers or {}).items()}
        return web.json_response(self.redactor.value(body), status=status, headers=headers)

    async def _authenticate_limited(self, request: web.Request, record: AuditRecord) -> Claims:
        """`_authenticate`, with its refusals limited per source address; past the limit nothing is verified."""
        wait = self._failures.wait(record.client, time.monotonic())
        if wait > 0:
            raise BrokerError(
                429,
                "auth_rate_limited",
                "too many failed authentications from this address",
                {"Retry-After": str(math.ceil(wait))},
            )
        try:
            return await self._authenticate(request, record)
        except BrokerError as e:
            if e.status in AUTH_FAILURES:
                self._failures.take(record.client, time.monotonic())
            raise

    async def _authenticate(self, request: web.Request, record: AuditRecord) -> Claims:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized("missing_token", "send the sandbox token as 'Authorization: Bearer <token>'")
        try:
            claims = self.authority.verify(token.strip())
        except TokenError as e:
            raise unauthorized("invalid_token", str(e)) from None
        record.extra["jti"] = claims.jti
        if claims.sources and not _from(record.client, claims.sources):
            raise BrokerError(403, "wrong_source", "this token may not be used from this address")
        if self.identify is None:  # bound by the token's own networks alone
            if not claims.sources:
                raise BrokerError(
                    403, "unbound_token", "this broker takes tokens bound to a source network only (minted with src)"
                )
            record.sandbox = claims.sandbox
        elif record.sandbox == UNKNOWN_SANDBOX:
            # Checked on its own: a token minted for a sandbox named "-" must not match an unknown source.
            raise BrokerError(403, "unknown_sandbox", "requests must come from a sandbox's own network")
        if record.sandbox != claims.sandbox:
            # A token is usable only from the network of the sandbox it was minted for.
            raise BrokerError(403, "wrong_sandbox", "this token belongs to another sandbox")
        if await self.state(self.store.is_revoked(claims.jti, claims.sandbox, claims.issued_at)):
            raise unauthorized("revoked_token", "token has been revoked")
        return claims

    @web.middleware
    async def _json_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except BrokerError as e:
            if request.path == "/mcp":  # refused before the message was read (the token, the rate, the method)
                return self.mcp.refusal(e)
            return self._reply(e.body(), e.status, e.headers)
        except web.HTTPException as e:
            return self._reply({"error": "http_error", "message": e.reason}, e.status)
        except Exception as e:  # a bug: one redacted line for the operator, a stable code for the client
            where = traceback.extract_tb(e.__traceback__)[-1]
            log.error(
                "broker: unexpected %s at %s:%s: %s",
                type(e).__name__, where.filename, where.lineno, self.redactor.text(str(e))[:300],
            )  # fmt: skip
            return self._reply(INTERNAL_ERROR.body(), 500)

    # --- admin --------------------------------------------------------------------------------------------------

    def admin_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[self._json_errors])
        app.router.add_post("/v1/tokens", self.issue_token)
        app.router.add_post("/v1/revocations", self.revoke)
        app.router.add_post("/v1/keys/rotate", self.rotate_keys)
        app.router.add_get("/v1/jwks", self.jwks)
        return app

    def mint(
        self, sandbox: str, grants: list[Grant], ttl: int | None = None, sources: Sequence[str] = ()
    ) -> tuple[str, Claims]:
        declared = list(self.declared.tools()) if self.declared is not None else []
        if unknown := [g.tool for g in grants if g.declared and g.tool not in declared]:
            known = ", ".join(declared) or "none"
            message = f"grant for {unknown[0]!r}: the policy declares no such tool (declared: {known})"
            raise BrokerError(422, "unknown_tool", message)
        try:
            return self.authority.mint(sandbox, grants, ttl, sources)
        except TokenError as e:
            raise BrokerError(422, "invalid_request", str(e)) from None

    async def issue(
        self, sandbox: str, grants: list[Grant], ttl: int | None = None, sources: Sequence[str] = ()
    ) -> tuple[str, Claims]:
        """Mint a token and remember its id until it expires (so that a revocation can tell it from a typo)."""
        token, claims = self.mint(sandbox, grants, ttl, sources)
        await self.state(self.store.record_issued(claims.jti, sandbox, claims.expires_at))
        if self.git_read is not None:
            self.git_read.remember(claims)
        return token, claims

    async def issue_token(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        sandbox = body.get("sandbox")
        if not isinstance(sandbox, str) or not sandbox:
            raise BrokerError(422, "invalid_request", "sandbox is required")
        if self.serves is not None and sandbox not in (served := self.serves()):
            # Its token would be refused at once: the broker binds a token to the sandbox its caller comes from.
            known = ", ".join(served) or "none"
            raise BrokerError(
                422, "unknown_sandbox", f"this gateway serves no sandbox {sandbox!r} (it serves: {known})"
            )
        raw_grants = body.get("grants", [])
        if not isinstance(raw_grants, list):  # a string or object would be iterated, a number would raise
            raise BrokerError(422, "invalid_request", "grants must be a list of grant objects")
        try:
            grants = [Grant.from_claim(g) for g in raw_grants]
        except GrantError as e:
            raise BrokerError(422, "invalid_request", str(e)) from None
        ttl = body.get("ttl")
        if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool)):  # true is not 1 second
            raise BrokerError(422, "invalid_request", "ttl must be whole seconds")
        sources = body.get("sources") or []
        if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
            raise BrokerError(422, "invalid_request", "sources must be a list of networks (CIDR text)")
        token, claims = await self.issue(sandbox, grants, ttl, sources)
        answer = {"token": token, "jti": claims.jti, "sandbox": sandbox, "expires_at": claims.expires_at}
        if claims.sources:
            answer["sources"] = [str(n) for n in claims.sources]
        return self._reply(answer)

    async def revoke(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        # Revoked whether known or not (fail closed); `known` tells the caller whether the id was one of ours.
        if isinstance(body.get("jti"), str):
            until = int(time.time()) + self.authority.keys.max_ttl
            known = await self.state(self.store.was_issued(body["jti"]))
            await self.state(self.store.revoke_token(body["jti"], until))
            return self._reply({"revoked": {"jti": body["jti"]}, "known": known})
        if isinstance(body.get("sandbox"), str):
            await self.state(self.store.revoke_sandbox(body["sandbox"]))
            known = self.serves is None or body["sandbox"] in self.serves()
            return self._reply({"revoked": {"sandbox": body["sandbox"]}, "known": known})
        raise BrokerError(422, "invalid_request", "give jti or sandbox")

    async def rotate_keys(self, request: web.Request) -> web.Response:
        try:
            return self._reply({"kid": self.authority.keys.rotate()})
        except TokenError as e:
            raise BrokerError(409, "keys_from_files", str(e)) from None

    async def jwks(self, request: web.Request) -> web.Response:
        return self._reply(self.authority.keys.jwks())


def _refusal(record: AuditRecord, e: BrokerError, status: int) -> None:
    record.decision = "allow" if e.quiet else "error" if e.status >= 500 else "deny"
    record.reason, record.code, record.extra["status"] = e.message, e.code, status


def _from(client: str, networks: tuple[Network, ...]) -> bool:
    try:
        address = ipaddress.ip_address(client)
    except ValueError:  # no address (a unix socket): not from any network
        return False
    return any(address in network for network in networks)


def _call_name(request: web.Request, tools: Mapping[str, Tool]) -> str:
    """What the audit calls a sandbox request: the tool's name, list_tools, "mcp" (made precise once the message is
    read: "mcp:initialize", the tool's name), or "-" for anything else."""
    if request.method == "GET" and request.path == "/v1/tools":
        return "list_tools"
    if request.path == "/mcp":
        return "mcp"
    name = request.match_info.get("name")
    return name if name is not None and name in tools else "-"
