"""The broker's HTTP surfaces.

- Sandbox-facing (through the fence, on the gateway's sandbox address): `GET /v1/tools` (the tools this token
  may call, with their input schemas, limits and grant scopes) and `POST /v1/tools/<name>` (create_pull_request,
  push_branch). Every path, an unknown one too, needs the sandbox token, presented from that sandbox's network.
  The broker checks the token, validates the input against the tool's JSON Schema (400 `invalid_input`, with the
  field's path), checks the grant, and acts with its own credential. Responses carry results, never credentials.
- Admin (loopback or a unix socket the sandboxes cannot reach): mint and revoke tokens, rotate keys, JWKS.

Every answer, error or not, is JSON; errors are `{error, message}` (and `path` for invalid input) with a stable
code and honest statuses: 400 a body beyond the parser's limits (nesting) or an input its schema refuses, 401
token invalid/expired/revoked, 403 outside the grant, a protected branch or wrong sandbox, 404 an unknown tool,
409 a push that is not a fast-forward, 413 too large, 422 validation (also of a bundle), 429 rate limit (per
token; and per source address for failed authentications, checked before any token is looked at), 502/504
upstream (also an answer of the wrong shape), 503 broker state unavailable or too busy, 504 a tool out of time,
500 `internal_error` for a bug (one log line, no traceback to anyone).

Whatever leaves the broker (bodies, headers, idempotency records, audit lines, the call store, log lines) goes
through one redactor that knows every credential the GitHub client has held.

The state store is synchronous (SQLite); its calls run on a few threads of the broker's own, never on the event
loop, so a locked or slow database delays only the broker calls that need it, never the proxy or DNS.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import math
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from aiohttp import web
from aiohttp.typedefs import Handler

from airlock.audit import AuditRecord
from airlock.policy import ReasonCode, TokenBuckets

from .github import GitHubClient, PullRequest, UpstreamError
from .gitpush import Pusher, PushError, PushLimits
from .grants import Grant, GrantError, valid_branch, valid_repo, validated
from .redact import Redactor
from .shapes import JsonLimitError, loads
from .store import BrokerStore, StoreError
from .tokens import Claims, TokenAuthority, TokenError
from .tools import MAX_BODY, MAX_TITLE, TOOLS, ToolSpec

log = logging.getLogger("airlock.broker")

__all__ = ["MAX_BODY", "MAX_REQUEST_BYTES", "MAX_TITLE", "Broker", "BrokerError", "BrokerSettings"]

MAX_REQUEST_BYTES = 128 * 1024  # every body but push_branch's
MAX_REQUEST_DEPTH = 8  # the deepest request, a token's grants, nests 3 deep
BODY_OVERHEAD = 64 * 1024  # a push_branch body: the base64 bundle and this much for the rest of the JSON
THREADED_BODY = 1024 * 1024  # bodies larger than this are parsed and decoded off the event loop
CLAIMS = web.RequestKey("claims", Claims)
RECORD = web.RequestKey("record", AuditRecord)
STATE_THREADS = 4  # each with its own SQLite connection: reads go on while a write waits for a lock
STATE_DEADLINE = 10.0  # seconds a call waits for the state store (queued or busy) before it is refused (503)
UNKNOWN_SANDBOX = "-"  # what the audit record names a source address no sandbox owns
AUTH_FAILURES = (401, 403)  # what `_authenticate` refuses with, as opposed to 503 (its state unreadable)


@dataclass
class BrokerSettings:
    calls_per_minute: int = 30  # per token
    burst: int = 10
    # Per source address. Refusing a token is cheap but not free (a signature check, an audit line): past this,
    # a source gets 429 without anything being verified until its budget refills.
    failed_auths_per_second: float = 2.0
    failed_auth_burst: int = 20

    def __post_init__(self) -> None:
        if min(self.calls_per_minute, self.burst, self.failed_auths_per_second, self.failed_auth_burst) <= 0:
            raise ValueError("broker rate limits must be positive")


class BrokerError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}
        self.details = details or {}  # further fields of the error body, e.g. the path of a bad input


@dataclass
class _Inflight:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # calls holding or waiting for the lock


@dataclass(frozen=True)
class _Call:
    request: web.Request
    claims: Claims
    record: AuditRecord
    input: dict[str, Any]  # validated against the tool's schema


type Result = tuple[int, dict[str, Any], dict[str, str]]  # status, body, headers


@dataclass(frozen=True)
class _Tool:
    spec: ToolSpec
    run: Callable[[_Call], Awaitable[Result]]
    max_request_bytes: int
    limits: Mapping[str, int | float]
    slots: asyncio.Semaphore | None = None  # calls of this tool in progress at once, broker-wide
    slot_wait: float = 0.0  # seconds a call waits for a slot before 503


class Broker:
    def __init__(
        self,
        authority: TokenAuthority,
        store: BrokerStore,
        identify: Callable[[str], str | None],
        github: GitHubClient | None,
        emit: Callable[[AuditRecord], None],
        settings: BrokerSettings | None = None,
        pusher: Pusher | None = None,
        serves: Callable[[], list[str]] | None = None,
    ) -> None:
        self.authority = authority
        self.store = store
        self.identify = identify  # client address → sandbox id (from the gateway's registry)
        self.serves = serves  # the ids of the sandboxes the gateway serves; None: any id may be given a token
        self.github = github
        self.emit = emit
        self.pusher = pusher
        self.settings = settings or BrokerSettings()
        self._limiter = TokenBuckets(self.settings.calls_per_minute / 60, self.settings.burst)
        self._failures = TokenBuckets(self.settings.failed_auths_per_second, self.settings.failed_auth_burst)
        self._inflight: dict[tuple[str, ...], _Inflight] = {}
        self.redactor = github.redactor if github is not None else Redactor()
        self._state_threads = ThreadPoolExecutor(STATE_THREADS, thread_name_prefix="airlock-broker-state")
        self.tools = self._tools()

    def _tools(self) -> dict[str, _Tool]:
        per_minute = {"calls_per_minute": self.settings.calls_per_minute}
        push = self.pusher.limits if self.pusher is not None else PushLimits()
        push_request = 4 * -(-push.max_bundle_bytes // 3) + BODY_OVERHEAD
        tools = [
            _Tool(
                TOOLS["create_pull_request"], self._create_pull_request, MAX_REQUEST_BYTES,
                per_minute | {"max_request_bytes": MAX_REQUEST_BYTES, "max_title": MAX_TITLE, "max_body": MAX_BODY},
            ),
            _Tool(
                TOOLS["push_branch"], self._push_branch, push_request,
                per_minute | {
                    "max_request_bytes": push_request, "max_bundle_bytes": push.max_bundle_bytes,
                    "max_objects": push.max_objects, "timeout_seconds": push.timeout,
                    "concurrent_pushes": push.concurrent,
                },
                asyncio.Semaphore(push.concurrent), push.timeout,
            ),
        ]  # fmt: skip
        return {tool.spec.name: tool for tool in tools}

    def close(self) -> None:
        """Stop the state threads (after the listeners: no call is left to need them)."""
        self._state_threads.shutdown(wait=True, cancel_futures=True)

    # --- sandbox-facing -----------------------------------------------------------------------------------------

    def sandbox_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[self._json_errors, self._sandbox_calls])
        app.router.add_get("/v1/tools", self.list_tools)
        app.router.add_post("/v1/tools/{name}", self.call_tool)
        return app

    @web.middleware
    async def _sandbox_calls(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every sandbox request, whatever its path: audited, authenticated, rate limited, recorded."""
        started = time.monotonic()
        client = request.remote or "-"
        sandbox = self.identify(client) or UNKNOWN_SANDBOX
        # Every ending below sets the decision, reason and code; the code is the one the caller's body carries.
        record = AuditRecord("broker", sandbox, client, "-", None, "deny", "", ReasonCode.INTERNAL_ERROR)
        record.method, record.path = _call_name(request), request.path
        try:
            claims = await self._authenticate_limited(request, record)
            if not self._limiter.take(claims.jti, time.monotonic()):
                raise BrokerError(429, "rate_limited", f"more than {self.settings.calls_per_minute} calls a minute")
            request[CLAIMS], request[RECORD] = claims, record
            response: web.StreamResponse = await handler(request)
            record.decision, record.code, record.extra["status"] = "allow", ReasonCode.ALLOWED, response.status
            return response
        except BrokerError as e:
            record.decision = "error" if e.status >= 500 else "deny"
            record.reason, record.code, record.extra["status"] = e.message, e.code, e.status
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
            await self._record_call(record)

    async def list_tools(self, request: web.Request) -> web.Response:
        grants = request[CLAIMS].grants
        granted = {g.tool for g in grants}
        return self._reply({"tools": [_listing(t, grants) for t in self.tools.values() if t.spec.name in granted]})

    async def call_tool(self, request: web.Request) -> web.Response:
        claims, record = request[CLAIMS], request[RECORD]
        tool = self.tools.get(request.match_info["name"])
        if tool is None:
            raise BrokerError(404, "unknown_tool", f"no such tool; known: {', '.join(self.tools)}")
        if not any(g.tool == tool.spec.name for g in claims.grants):
            raise BrokerError(403, "outside_grant", f"this token has no grant for {tool.spec.name}")
        async with self._slot(tool):
            body = await _json_object(request, tool.max_request_bytes)
            if problem := tool.spec.problem(body):
                path, what = problem
                raise BrokerError(400, "invalid_input", f"{path or 'the input'} {what}", details={"path": path})
            status, result, headers = await tool.run(_Call(request, claims, record, body))
        return self._reply(result, status, headers)

    @contextlib.asynccontextmanager
    async def _slot(self, tool: _Tool) -> AsyncIterator[None]:
        if tool.slots is None:
            yield
            return
        try:
            async with asyncio.timeout(tool.slot_wait):
                await tool.slots.acquire()
        except TimeoutError:
            raise BrokerError(503, "busy", f"too many {tool.spec.name} calls in progress; try again") from None
        try:
            yield
        finally:
            tool.slots.release()

    def _reply(self, body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
        """Every JSON answer of the broker, error or not, leaves through here: redacted, headers too."""
        headers = {name: self.redactor.text(value) for name, value in (headers or {}).items()}
        return web.json_response(self.redactor.value(body), status=status, headers=headers)

    async def _record_call(self, record: AuditRecord) -> None:
        # Only calls whose token verified (they carry its jti): otherwise whoever reaches the port could fill the
        # disk, one row per request. The audit line above has every call.
        if "jti" not in record.extra:
            return
        try:
            await self._store(lambda: self.store.record_call(json.loads(record.to_json())))
        except BrokerError:
            log.error("could not record a brokered call (request %s); the audit log has it", record.request_id)

    async def _create_pull_request(self, call: _Call) -> Result:
        claims, record = call.claims, call.record
        fields = _pull_request_fields(call.input)
        repo = fields.pop("repo")
        record.host = repo
        record.extra.update(head=fields["head"], base=fields["base"])
        grant = _covering_grant(claims.grants, repo, fields["base"], fields["head"])
        if self.github is None:
            raise BrokerError(503, "not_configured", "the broker has no GitHub credential configured")
        scope = claims.sandbox
        request_hash = hashlib.sha256(json.dumps([repo, fields], sort_keys=True).encode()).hexdigest()
        # Without a key, the same token asking the same thing twice is the same call.
        key = call.request.headers.get("Idempotency-Key") or f"jti:{claims.jti}:{request_hash}"
        async with self._one_at_a_time((scope, key)):
            previous = await self._idempotent(scope, key, request_hash)
            if previous is not None:
                record.reason = "replayed idempotent result"
                status, body = previous
                return status, body, _location(body)
            try:
                # The grant's spelling, not the caller's: GitHub sees one name per repository (one cached token).
                pull, existed = await self.github.create_pull_request(grant.repo, fields)
            except UpstreamError as e:
                raise BrokerError(e.status, e.code, e.message) from None
            body = self.redactor.value(_pull_summary(pull, existed))
            record.extra["number"] = pull.number
            record.reason = "existing pull request" if existed else "created"
            status = 200 if existed else 201
            await self._store(lambda: self.store.idempotent_put(scope, key, request_hash, status, body))
        return status, body, _location(body)

    async def _push_branch(self, call: _Call) -> Result:
        record = call.record
        repo, branch = call.input["repo"], call.input["branch"]
        record.host = repo
        record.extra["branch"] = branch
        grant = _push_grant(call.claims.grants, repo, branch)
        data, digest = await _decoded_bundle(call.input["bundle"])
        record.extra.update(bundle_sha256=digest, bundle_bytes=len(data))  # the bundle itself is never kept
        if self.pusher is None:
            raise BrokerError(503, "not_configured", "the broker has no GitHub credential (or no git) for pushes")
        # One push at a time per branch, across sandboxes: the second sees what the first left upstream.
        async with self._one_at_a_time(("push_branch", grant.repo.lower(), branch)):
            try:
                pushed = await self.pusher.push(grant.repo, branch, data)
            except PushError as e:
                raise BrokerError(e.status, e.code, e.message) from None
        record.extra.update(sha=pushed.sha, ref=pushed.ref, previous=pushed.previous)
        record.reason = "unchanged" if pushed.previous == pushed.sha else "pushed"
        return 200, {"sha": pushed.sha, "ref": pushed.ref, "previous": pushed.previous}, {}

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, key: tuple[str, ...]) -> AsyncIterator[None]:
        """Serialise the calls with one key (an idempotency key, a branch); the entry goes when no call holds or
        awaits it."""
        entry = self._inflight.setdefault(key, _Inflight())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._inflight[key]

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
            raise BrokerError(401, "missing_token", "send the sandbox token as 'Authorization: Bearer <token>'")
        try:
            claims = self.authority.verify(token.strip())
        except TokenError as e:
            raise BrokerError(401, "invalid_token", str(e)) from None
        record.extra["jti"] = claims.jti
        if record.sandbox == UNKNOWN_SANDBOX:
            # Checked on its own: a token minted for a sandbox named "-" must not match an unknown source.
            raise BrokerError(403, "unknown_sandbox", "requests must come from a sandbox's own network")
        if record.sandbox != claims.sandbox:
            # A token is usable only from the network of the sandbox it was minted for.
            raise BrokerError(403, "wrong_sandbox", "this token belongs to another sandbox")
        if await self._store(lambda: self.store.is_revoked(claims.jti, claims.sandbox, claims.issued_at)):
            raise BrokerError(401, "revoked_token", "token has been revoked")
        return claims

    async def _idempotent(self, scope: str, key: str, request_hash: str) -> tuple[int, dict[str, Any]] | None:
        previous = await self._store(lambda: self.store.idempotent_get(scope, key))
        if previous is None:
            return None
        stored_hash, status, body = previous
        if stored_hash != request_hash:
            raise BrokerError(422, "idempotency_conflict", "Idempotency-Key was used before with other arguments")
        return status, body

    async def _store(self, action: Callable[[], Any]) -> Any:
        """`action` (a store call) on a state thread; any failure, or no answer in time, is 503 (fail closed)."""
        try:
            async with asyncio.timeout(STATE_DEADLINE):
                return await asyncio.get_running_loop().run_in_executor(self._state_threads, action)
        except (StoreError, TimeoutError, RuntimeError) as e:  # RuntimeError: the threads are shut down
            log.error("broker state unavailable: %s", str(e) or f"no answer within {STATE_DEADLINE:g}s")
            raise BrokerError(503, "state_unavailable", "broker state is unavailable; refusing to act") from None

    @web.middleware
    async def _json_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except BrokerError as e:
            return self._reply({"error": e.code, "message": e.message, **e.details}, e.status, e.headers)
        except web.HTTPException as e:
            return self._reply({"error": "http_error", "message": e.reason}, e.status)
        except Exception as e:  # a bug: one redacted line for the operator, a stable code for the client
            where = traceback.extract_tb(e.__traceback__)[-1]
            log.error(
                "broker: unexpected %s at %s:%s: %s",
                type(e).__name__, where.filename, where.lineno, self.redactor.text(str(e))[:300],
            )  # fmt: skip
            return self._reply({"error": "internal_error", "message": "the broker failed; see its log"}, 500)

    # --- admin --------------------------------------------------------------------------------------------------

    def admin_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[self._json_errors])
        app.router.add_post("/v1/tokens", self.issue_token)
        app.router.add_post("/v1/revocations", self.revoke)
        app.router.add_post("/v1/keys/rotate", self.rotate_keys)
        app.router.add_get("/v1/jwks", self.jwks)
        return app

    def mint(self, sandbox: str, grants: list[Grant], ttl: int | None = None) -> tuple[str, Claims]:
        try:
            return self.authority.mint(sandbox, grants, ttl)
        except TokenError as e:
            raise BrokerError(422, "invalid_request", str(e)) from None

    async def issue(self, sandbox: str, grants: list[Grant], ttl: int | None = None) -> tuple[str, Claims]:
        """Mint a token and remember its id until it expires (so that a revocation can tell it from a typo)."""
        token, claims = self.mint(sandbox, grants, ttl)
        await self._store(lambda: self.store.record_issued(claims.jti, sandbox, claims.expires_at))
        return token, claims

    async def issue_token(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
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
        token, claims = await self.issue(sandbox, grants, ttl)
        return self._reply({"token": token, "jti": claims.jti, "sandbox": sandbox, "expires_at": claims.expires_at})

    async def revoke(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        # Revoked whether known or not (fail closed); `known` tells the caller whether the id was one of ours.
        if isinstance(body.get("jti"), str):
            until = int(time.time()) + self.authority.keys.max_ttl
            known = await self._store(lambda: self.store.was_issued(body["jti"]))
            await self._store(lambda: self.store.revoke_token(body["jti"], until))
            return self._reply({"revoked": {"jti": body["jti"]}, "known": known})
        if isinstance(body.get("sandbox"), str):
            await self._store(lambda: self.store.revoke_sandbox(body["sandbox"]))
            known = self.serves is None or body["sandbox"] in self.serves()
            return self._reply({"revoked": {"sandbox": body["sandbox"]}, "known": known})
        raise BrokerError(422, "invalid_request", "give jti or sandbox")

    async def rotate_keys(self, request: web.Request) -> web.Response:
        return self._reply({"kid": self.authority.keys.rotate()})

    async def jwks(self, request: web.Request) -> web.Response:
        return self._reply(self.authority.keys.jwks())


async def _json_object(request: web.Request, limit: int = MAX_REQUEST_BYTES) -> dict[str, Any]:
    """The body as a JSON object. Its size is capped before and while it is read, and its nesting before it is
    parsed: the parser recurses, and is linear in everything else."""
    data = await _body(request, limit)
    if len(data) > THREADED_BODY:  # megabytes of bundle: scanned and parsed while the loop serves others
        return await asyncio.to_thread(_parsed_object, data)
    return _parsed_object(data)


async def _body(request: web.Request, limit: int) -> bytes:
    too_large = BrokerError(413, "too_large", f"request bodies are limited to {limit} bytes")
    if (request.content_length or 0) > limit:
        raise too_large  # refused unread
    data = bytearray()
    async for chunk in request.content.iter_chunked(64 * 1024):
        data += chunk
        if len(data) > limit:
            raise too_large
    return bytes(data)


def _parsed_object(data: bytes) -> dict[str, Any]:
    try:
        body = loads(data, MAX_REQUEST_DEPTH)
    except JsonLimitError:
        raise BrokerError(400, "too_deep", f"JSON bodies nest at most {MAX_REQUEST_DEPTH} levels deep") from None
    except ValueError:  # UnicodeDecodeError, and too many digits in a number, are ValueErrors too
        raise BrokerError(422, "invalid_json", "the request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise BrokerError(422, "invalid_json", "the request body must be a JSON object")
    return body


def _pull_request_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The pull request's fields from an input its schema accepted, checked further."""
    repo, head, base, title = (body[k] for k in ("repo", "head", "base", "title"))
    text, draft = body.get("body", ""), body.get("draft", False)
    try:
        validated("create_pull_request", repo, (base,), head)
    except GrantError as e:
        raise BrokerError(422, "invalid_request", str(e)) from None
    if not (valid_branch(head) and valid_branch(base)):
        raise BrokerError(422, "invalid_request", "head and base must be branch names")
    if not title.strip():
        raise BrokerError(422, "invalid_request", "title must not be blank")
    return {"repo": repo, "head": head, "base": base, "title": title, "body": text, "draft": draft}


def _push_grant(grants: tuple[Grant, ...], repo: str, branch: str) -> Grant:
    """The grant that lets `branch` be pushed, else 422 (not a branch name), 403 outside the grants, or 403 when
    any push grant on the repository protects the branch."""
    if not valid_repo(repo):
        raise BrokerError(422, "invalid_request", f"repository must be owner/name, got {repo!r}")
    if not valid_branch(branch):
        raise BrokerError(422, "invalid_request", "branch must be a branch name")
    pushes = [g for g in grants if g.tool == "push_branch"]
    refusals = [g.permits_push(repo, branch) for g in pushes]
    if None not in refusals:
        raise BrokerError(403, "outside_grant", (refusals[0] if refusals else None) or "no grant for push_branch")
    on_repo = [g for g in pushes if g.repo.lower() == repo.lower()]
    if pattern := next((p for g in on_repo if (p := g.protects(branch))), None):
        raise BrokerError(403, "protected_branch", f"branch {branch!r} is protected ({pattern!r})")
    return pushes[refusals.index(None)]


async def _decoded_bundle(text: str) -> tuple[bytes, str]:
    """The bundle's bytes and their sha256 (megabytes: off the event loop)."""

    def decode() -> tuple[bytes, str]:
        data = base64.b64decode(text, validate=True)
        return data, hashlib.sha256(data).hexdigest()

    try:
        return await asyncio.to_thread(decode) if len(text) > THREADED_BODY else decode()
    except binascii.Error:
        raise BrokerError(400, "invalid_input", "/bundle must be base64", details={"path": "/bundle"}) from None


def _call_name(request: web.Request) -> str:
    """What the audit calls a sandbox request: the tool's name, list_tools, or "-" for anything else."""
    if request.method == "GET" and request.path == "/v1/tools":
        return "list_tools"
    name = request.match_info.get("name")
    return name if name in TOOLS else "-"


def _listing(tool: _Tool, grants: tuple[Grant, ...]) -> dict[str, Any]:
    scopes = [g.scope() for g in grants if g.tool == tool.spec.name]
    return {
        "name": tool.spec.name, "description": tool.spec.description, "input_schema": tool.spec.input_schema,
        "limits": tool.limits, "grant": {"scopes": scopes},
    }  # fmt: skip


def _covering_grant(grants: tuple[Grant, ...], repo: str, base: str, head: str) -> Grant:
    """The first grant that covers the call, else 403 with why the first one does not."""
    refusals = [g.permits("create_pull_request", repo, base, head) for g in grants]
    if None in refusals:
        return grants[refusals.index(None)]
    raise BrokerError(403, "outside_grant", (refusals[0] if refusals else None) or "no grant")


def _all_strings(values: list[Any]) -> TypeGuard[list[str]]:
    return all(isinstance(value, str) for value in values)


def _pull_summary(pull: PullRequest, existed: bool) -> dict[str, Any]:
    """Only what the agent needs; nothing GitHub returned about tokens or installations."""
    return {
        "number": pull.number, "url": pull.url, "html_url": pull.html_url, "state": pull.state, "draft": pull.draft,
        "head": pull.head, "base": pull.base, "existing": existed,
    }  # fmt: skip


def _location(body: dict[str, Any]) -> dict[str, str]:
    return {"Location": str(body["url"])} if body.get("url") and not body.get("existing") else {}
