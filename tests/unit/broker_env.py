"""The broker's test environment: a running Broker (sandbox and admin apps on 127.0.0.1) in front of a fake GitHub on
127.0.0.1, and the App key and credentials it uses; the `make` fixture builds one per test.

The fake GitHub is a small aiohttp app that checks what GitHub would check (App JWT shape, narrowing, credentials)
and records every call, so each test can also say how many times GitHub was reached. Only loopback is used.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import jwt.algorithms
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from airlock.audit import AuditRecord
from airlock.broker.calllog import CallLog
from airlock.broker.github import AppCredential, Credential, GitHubClient, StaticCredential
from airlock.broker.service import Broker, BrokerSettings
from airlock.broker.store import SqliteStore, StoreError
from airlock.broker.tokens import KeyRing, TokenAuthority

LOOPBACK = "127.0.0.1"
SANDBOX = "sbx-1"
PATH = "/v1/tools/create_pull_request"
APP_ID = "4242"
INSTALLATION_ID = 777
STATIC_SECRET = "ghp_SECRETstatic0123456789abcdefABCDEF"
INSTALLATION_PREFIX = "ghs_INSTALLATIONsecret"
GRANT = {"tool": "create_pull_request", "repo": "acme/app", "base": ["main", "release/*"], "head": "agent/*"}
FIELDS = {"repo": "acme/app", "head": "agent/fix-1", "base": "main", "title": "Fix the thing", "body": "Details"}


# --- a fake GitHub ----------------------------------------------------------------------------------------------


class FakeGitHub:
    """Just enough of the REST API. `mode` makes POST /pulls misbehave: "create", "hang", "error", "echo" (an error
    repeating the credential sent), "echo-everywhere" (created, or listed, with every credential GitHub has seen in
    every text field). `answers` replaces an endpoint's answer after its credential check: {"create_pull" |
    "list_pulls" | "get_pull" | "check_runs" | "comment" | "installation" | "access_token": (status, JSON value or
    raw bytes)}. The pull request, check-run and comment endpoints check the installation token's narrowing as
    GitHub does (404 for a repository it does not cover, 403 without the permission); `check_runs` is what every
    commit's check runs are."""

    def __init__(self, app_public_key: Any) -> None:
        self.app_public_key = app_public_key
        self.calls: list[dict[str, Any]] = []
        self.problems: list[str] = []  # what GitHub would have refused; every test asserts this stays empty
        self.app_jwts: list[tuple[dict[str, Any], dict[str, Any], str]] = []
        self.tokens_issued: list[str] = []
        self.rejected: set[str] = set()  # installation tokens revoked upstream: answered 401 "Bad credentials"
        self.pulls: list[tuple[str, dict[str, Any]]] = []  # (owner/repo, pull)
        self.mode = "create"
        self.token_mode = "issue"  # or "echo": the access-token call fails, echoing the App JWT
        self.token_shape = "classic"  # or "jwt": installation tokens of some 520 characters, as GitHub's since 2026
        self.pull_delay = 0.0
        self.expires_at: Any = "in an hour"  # or what the access-token answer says instead
        self.release = asyncio.Event()
        self.base_url = ""
        self.answers: dict[str, tuple[int, Any]] = {}
        self.narrowing: dict[str, dict[str, Any]] = {}  # installation token → the access-token request's body
        self.check_runs: list[dict[str, Any]] = []
        self.comments: list[tuple[str, int, dict[str, Any]]] = []  # (owner/repo, issue number, comment)

    def secrets_seen(self) -> str:
        """Every credential this GitHub has been sent or has issued, glued together."""
        return "".join([STATIC_SECRET, *self.tokens_issued, *(token for _, _, token in self.app_jwts)])

    async def answer(self, request: web.Request, endpoint: str) -> web.StreamResponse | None:
        """The replacement answer set for `endpoint`: a JSON value with its Content-Length, raw bytes chunked."""
        if endpoint not in self.answers:
            return None
        status, body = self.answers[endpoint]
        if not isinstance(body, bytes):
            return web.json_response(body, status=status)
        response = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(body), 65536):
            await response.write(body[start : start + 65536])
        await response.write_eof()
        return response

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/repos/{owner}/{repo}/installation", self.installation)
        app.router.add_post("/app/installations/{id}/access_tokens", self.access_token)
        app.router.add_post("/repos/{owner}/{repo}/pulls", self.create_pull)
        app.router.add_get("/repos/{owner}/{repo}/pulls", self.list_pulls)
        app.router.add_get("/repos/{owner}/{repo}/pulls/{number}", self.get_pull)
        app.router.add_get("/repos/{owner}/{repo}/commits/{sha}/check-runs", self.list_check_runs)
        app.router.add_post("/repos/{owner}/{repo}/issues/{number}/comments", self.create_comment)
        return app

    def count(self, method: str, path_part: str) -> int:
        return sum(1 for c in self.calls if c["method"] == method and path_part in c["path"])

    @property
    def pull_posts(self) -> int:
        return self.count("POST", "/pulls")

    async def _record(self, request: web.Request) -> dict[str, Any]:
        text = await request.text()
        call = {
            "method": request.method,
            "path": request.path,
            "query": dict(request.query),
            "auth": request.headers.get("Authorization", ""),
            "json": json.loads(text) if text else None,
        }
        self.calls.append(call)
        if request.headers.get("User-Agent") is None or request.headers.get("Accept") != "application/vnd.github+json":
            self.problems.append(f"{request.path}: missing User-Agent or Accept")
        return call

    def _check_app_jwt(self, call: dict[str, Any]) -> bool:
        scheme, _, token = call["auth"].partition(" ")
        if scheme != "Bearer":
            self.problems.append(f"{call['path']}: App JWT must be sent as Bearer, got {scheme!r}")
            return False
        try:
            header = jwt.get_unverified_header(token)
            claims = jwt.decode(token, self.app_public_key, algorithms=["RS256"])
        except jwt.PyJWTError as e:
            self.problems.append(f"{call['path']}: bad App JWT: {e}")
            return False
        self.app_jwts.append((header, claims, token))
        now = time.time()
        if header.get("alg") != "RS256" or claims.get("iss") != APP_ID:
            self.problems.append(f"App JWT header/iss wrong: {header} {claims}")
        if not claims["iat"] <= now - 30 or not claims["exp"] <= claims["iat"] + 600 or not claims["exp"] > now:
            self.problems.append(f"App JWT times wrong: {claims}")
        return True

    def _installation_token_ok(self, call: dict[str, Any]) -> bool:
        scheme, _, token = call["auth"].partition(" ")
        issued = token == STATIC_SECRET or token in self.tokens_issued
        return scheme == "token" and issued and token not in self.rejected

    async def installation(self, request: web.Request) -> web.Response:
        call = await self._record(request)
        if not self._check_app_jwt(call):
            return web.json_response({"message": "A JSON web token could not be decoded"}, status=401)
        answer = await self.answer(request, "installation")
        return answer or web.json_response({"id": INSTALLATION_ID, "app_id": int(APP_ID)})

    async def access_token(self, request: web.Request) -> web.Response:
        call = await self._record(request)
        if not self._check_app_jwt(call):
            return web.json_response({"message": "A JSON web token could not be decoded"}, status=401)
        if self.token_mode == "echo":
            return web.json_response({"message": f"Forbidden for {call['auth']}"}, status=403)
        if answer := await self.answer(request, "access_token"):
            return answer
        if request.match_info["id"] != str(INSTALLATION_ID):
            return web.json_response({"message": "Not Found"}, status=404)
        token = f"{INSTALLATION_PREFIX}{len(self.tokens_issued):04d}xyz"
        if self.token_shape == "jwt":  # the prefix, then a JWT's header, claims and RS256 signature
            token += "." + ".".join(base64.urlsafe_b64encode(os.urandom(n)).decode().rstrip("=") for n in (27, 90, 256))
        self.tokens_issued.append(token)
        self.narrowing[token] = call["json"] or {}
        expires = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        expires = expires if self.expires_at == "in an hour" else self.expires_at
        permissions = (call["json"] or {}).get("permissions")
        return web.json_response({"token": token, "expires_at": expires, "permissions": permissions}, status=201)

    def _pull(self, owner: str, repo: str, fields: dict[str, Any]) -> dict[str, Any]:
        number = len(self.pulls) + 1
        url = f"{self.base_url}/repos/{owner}/{repo}/pulls/{number}"
        return {
            "number": number, "url": url, "html_url": f"https://github.test/{owner}/{repo}/pull/{number}",
            "state": "open", "draft": fields.get("draft", False), "title": fields.get("title"),
            "head": {"ref": fields["head"], "label": f"{owner}:{fields['head']}", "sha": head_sha(fields["head"])},
            "base": {"ref": fields["base"]}, "user": {"login": "airlock-app[bot]"}, "_links": {"self": {"href": url}},
            "node_id": "PR_secretish", "merged": False, "mergeable": None, "mergeable_state": "unknown",
        }  # fmt: skip

    def _narrowed(self, request: web.Request, call: dict[str, Any], permissions: dict[str, str]) -> web.Response | None:
        """GitHub's refusal when the call's installation token does not cover the repository or lacks one of
        `permissions` (name → least level; any one of them will do), else None. The static token covers all."""
        if not self._installation_token_ok(call):
            return web.json_response({"message": "Bad credentials"}, status=401)
        token = call["auth"].partition(" ")[2]
        if token == STATIC_SECRET:
            return None
        narrowing = self.narrowing.get(token, {})
        if request.match_info["repo"] not in narrowing.get("repositories", [request.match_info["repo"]]):
            self.problems.append(f"{call['path']}: the token does not cover the repository")
            return web.json_response({"message": "Not Found"}, status=404)
        held = narrowing.get("permissions", {})
        if not any(held.get(name) in (level, "write") for name, level in permissions.items()):
            self.problems.append(f"{call['path']}: the token holds {held}, not one of {permissions}")
            return web.json_response({"message": "Resource not accessible by integration"}, status=403)
        return None

    def _find_pull(self, request: web.Request) -> dict[str, Any] | None:
        here = f"{request.match_info['owner']}/{request.match_info['repo']}"
        number = request.match_info["number"]
        return next((p for where, p in self.pulls if where == here and str(p["number"]) == number), None)

    async def get_pull(self, request: web.Request) -> web.StreamResponse:
        call = await self._record(request)
        if refusal := self._narrowed(request, call, {"pull_requests": "read"}):
            return refusal
        if answer := await self.answer(request, "get_pull"):
            return answer
        pull = self._find_pull(request)
        if pull is None:
            return web.json_response({"message": "Not Found"}, status=404)
        pull |= {"mergeable": True, "mergeable_state": "clean"}  # GitHub has computed it by now
        if self.mode == "echo-everywhere":
            echoed = self._echoing(pull)
            echoed["head"]["sha"] = pull["head"]["sha"]
            return web.json_response(echoed)
        return web.json_response(pull)

    async def list_check_runs(self, request: web.Request) -> web.StreamResponse:
        call = await self._record(request)
        if refusal := self._narrowed(request, call, {"checks": "read"}):
            return refusal
        if answer := await self.answer(request, "check_runs"):
            return answer
        page = int(call["query"].get("per_page", 30))
        runs = [run | {"head_sha": request.match_info["sha"], "id": n} for n, run in enumerate(self.check_runs, 1)]
        if self.mode == "echo-everywhere":
            runs = [run | {"name": f"{run['name']}{self.secrets_seen()}"} for run in runs]
        return web.json_response({"total_count": len(runs), "check_runs": runs[:page]})

    async def create_comment(self, request: web.Request) -> web.StreamResponse:
        call = await self._record(request)
        if refusal := self._narrowed(request, call, {"issues": "write", "pull_requests": "write"}):
            return refusal
        if answer := await self.answer(request, "comment"):
            return answer
        pull = self._find_pull(request)
        if pull is None:
            return web.json_response({"message": "Not Found"}, status=404)
        here, number = f"{request.match_info['owner']}/{request.match_info['repo']}", pull["number"]
        comment_id = 9000 + len(self.comments)
        comment = {
            "id": comment_id, "body": call["json"]["body"], "user": {"login": "airlock-app[bot]"},
            "url": f"{self.base_url}/repos/{here}/issues/comments/{comment_id}",
            "html_url": f"https://github.test/{here}/pull/{number}#issuecomment-{comment_id}",
        }  # fmt: skip
        self.comments.append((here, number, comment))
        return web.json_response(comment, status=201)

    def _echoing(self, pull: dict[str, Any]) -> dict[str, Any]:
        """`pull` with every credential seen glued into each text field the broker passes on (still valid URLs)."""
        seen = self.secrets_seen()
        return pull | {
            "url": f"{pull['url']}?t={seen}", "html_url": f"{pull['html_url']}#x{seen}x", "state": f"open{seen}",
            "head": {"ref": f"{seen}{pull['head']['ref']}"}, "base": {"ref": f"{pull['base']['ref']}{seen}"},
        }  # fmt: skip

    async def create_pull(self, request: web.Request) -> web.Response:
        call = await self._record(request)
        if not self._installation_token_ok(call):
            return web.json_response({"message": "Bad credentials"}, status=401)
        if self.pull_delay:
            await asyncio.sleep(self.pull_delay)
        if self.mode == "hang":
            await self.release.wait()
        if self.mode == "error":
            return web.json_response({"message": "Server Error"}, status=500)
        if self.mode == "echo":  # a hostile or buggy upstream repeating the credential it was sent
            seen = self.secrets_seen()
            errors = [{"message": f"rejected {call['auth']}"}, {"message": f"known: x{seen}x"}]
            return web.json_response({"message": f"Bad request from {call['auth']}", "errors": errors}, status=400)
        if answer := await self.answer(request, "create_pull"):
            return answer
        owner, repo, fields = request.match_info["owner"], request.match_info["repo"], call["json"]
        if fields["head"].startswith("agent/no-commits"):
            message = f"No commits between main and {fields['head']}"
            errors = [{"resource": "PullRequest", "code": "custom", "message": message}]
            return web.json_response({"message": "Validation Failed", "errors": errors}, status=422)
        for where, pull in self.pulls:
            if (where, pull["head"]["ref"], pull["base"]["ref"]) == (f"{owner}/{repo}", fields["head"], fields["base"]):
                message = f"A pull request already exists for {owner}:{fields['head']}."
                errors = [{"resource": "PullRequest", "code": "custom", "message": message}]
                return web.json_response({"message": "Validation Failed", "errors": errors}, status=422)
        pull = self._pull(owner, repo, fields)
        self.pulls.append((f"{owner}/{repo}", pull))
        if self.mode == "echo-everywhere":
            pull = self._echoing(pull)
        return web.json_response(pull, status=201, headers={"Location": pull["url"]})

    async def list_pulls(self, request: web.Request) -> web.Response:
        call = await self._record(request)
        if not self._installation_token_ok(call):
            return web.json_response({"message": "Bad credentials"}, status=401)
        query = call["query"]
        owner, _, head = query.get("head", "").partition(":")
        here = f"{request.match_info['owner']}/{request.match_info['repo']}"
        found = [
            p for where, p in self.pulls
            if where == here and owner == request.match_info["owner"] and p["head"]["ref"] == head
            and p["base"]["ref"] == query.get("base", p["base"]["ref"])
        ]  # fmt: skip
        if answer := await self.answer(request, "list_pulls"):
            return answer
        if self.mode == "echo-everywhere":  # the listed one still matches head and base: the echo is around them
            found = [p | {k: v for k, v in self._echoing(p).items() if k not in ("head", "base")} for p in found]
        return web.json_response(found)


def head_sha(branch: str) -> str:
    return hashlib.sha1(branch.encode()).hexdigest()


# --- the harness ------------------------------------------------------------------------------------------------


class FlakyStore:
    """A store whose named operations raise StoreError, as a broken disk would."""

    def __init__(self, inner: SqliteStore) -> None:
        self.inner = inner
        self.failing: set[str] = set()
        self.wrapped: dict[str, Callable[..., Any]] = {}  # named operations replaced (e.g. to watch them)

    def __getattr__(self, name: str) -> Any:
        if name in self.failing:

            async def fail(*args: Any, **kwargs: Any) -> Any:
                raise StoreError(f"{name}: disk on fire")

            return fail
        return self.wrapped.get(name) or getattr(self.inner, name)


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]


@dataclass
class Harness:
    broker: Broker
    sandbox: TestClient
    admin: TestClient
    github: FakeGitHub
    store: FlakyStore
    state: Path
    audit: list[AuditRecord]
    call_log: CallLog
    seen: list[str] = field(default_factory=list)  # every response the sandbox or admin saw, headers included
    static_secret: str | None = None
    database: str | None = None  # the PostgreSQL store's URL; None: SQLite, in `state`

    async def _reply(self, response: aiohttp.ClientResponse) -> Reply:
        text = await response.text()
        headers = dict(response.headers)
        self.seen += [text, json.dumps(headers)]
        try:
            body = json.loads(text) if text else None
        except ValueError:
            body = text
        return Reply(response.status, body, headers)

    async def admin_post(self, path: str, body: Any = None, data: bytes | None = None) -> Reply:
        payload = data if data is not None else json.dumps(body).encode()
        async with self.admin.post(path, data=payload, headers={"Content-Type": "application/json"}) as response:
            return await self._reply(response)

    async def token(self, sandbox: str = SANDBOX, grants: list[Any] | None = None, ttl: int | None = None) -> str:
        body: dict[str, Any] = {"sandbox": sandbox, "grants": [GRANT] if grants is None else grants}
        if ttl is not None:
            body["ttl"] = ttl
        reply = await self.admin_post("/v1/tokens", body)
        assert reply.status == 200, reply.body
        return reply.body["token"]

    async def pr(
        self,
        token: str | None,
        fields: dict[str, Any] | None = None,
        *,
        key: str | None = None,
        data: bytes | None = None,
        auth: str | None = None,
    ) -> Reply:
        headers = {"Content-Type": "application/json"}
        if auth is not None:
            headers["Authorization"] = auth
        elif token is not None:
            headers["Authorization"] = f"Bearer {token}"
        if key is not None:
            headers["Idempotency-Key"] = key
        payload = data if data is not None else json.dumps(FIELDS | (fields or {})).encode()
        async with self.sandbox.post(PATH, data=payload, headers=headers) as response:
            return await self._reply(response)

    def forge(self, **claims: Any) -> str:
        """A token signed by the broker's own key with claims of the test's choosing."""
        key = self.broker.authority.keys.active()
        assert key is not None
        now = int(time.time())
        payload = {
            "iss": "airlock", "aud": "airlock-broker", "sub": SANDBOX, "iat": now, "nbf": now, "exp": now + 300,
            "jti": "forged-jti", "grants": [GRANT],
        } | claims  # fmt: skip
        return jwt.encode(payload, key.private, algorithm="EdDSA", headers={"kid": key.kid})

    def secrets(self) -> list[str]:
        values = [*self.github.tokens_issued, *(token for _, _, token in self.github.app_jwts)]
        return values + ([self.static_secret] if self.static_secret else [])

    async def move_sandbox_revocations_back(self, seconds: int) -> None:
        """Every sandbox revocation made `seconds` earlier than it was (and read again by the store)."""
        if self.database is None:
            self.sql(f"UPDATE revoked_sandbox SET revoked_at = revoked_at - {seconds}")
            return
        # The replicas' copies hold every row they read: a revocation is changed by a new one, earlier.
        self.sql(f"INSERT INTO revocation (sandbox, revoked_at) SELECT sandbox, revoked_at - {seconds} FROM "
                 "revocation WHERE sandbox IS NOT NULL")  # fmt: skip
        self.sql("DELETE FROM revocation r WHERE sandbox IS NOT NULL AND revoked_at > (SELECT min(revoked_at) FROM "
                 "revocation WHERE sandbox = r.sandbox)")  # fmt: skip
        store = self.store.inner
        async with store._syncing, store.pool.connection() as conn:  # no read of the replica's own under way
            store._revocations.sandboxes.clear()
            store._revocations.seq = 0
            await store._sync(conn)

    async def brokered_calls(self) -> list[dict[str, Any]]:
        """The call log's rows, as `airlock tools log --json` prints them."""
        return [c.to_json() for c in await self.call_log.calls()]

    def idempotency_records(self) -> list[str]:
        """The recorded outcomes, as their text in the store."""
        return self.sql("SELECT body::text FROM idempotency WHERE body IS NOT NULL")

    def sql(self, statement: str) -> list[Any]:
        """The first column of what `statement` reads (or changes) in the broker's store, whichever it is."""
        if self.database is not None:
            import psycopg

            with psycopg.connect(self.database, autocommit=True) as db:
                cursor = db.execute(statement)  # type: ignore[arg-type]
                return [row[0] for row in cursor.fetchall()] if cursor.description else []
        with contextlib.closing(sqlite3.connect(self.state / "broker.sqlite3")) as db, db:
            return [row[0] for row in db.execute(statement.replace("::text", ""))]

    async def assert_no_secrets(self) -> None:
        calls = await self.brokered_calls()
        haystacks = self.seen + [r.to_json() for r in self.audit] + [json.dumps(c) for c in calls]
        haystacks += self.idempotency_records()
        secrets = self.secrets()
        assert secrets, "the test should have exercised a credential"
        for secret in secrets:
            for text in haystacks:
                assert secret not in text, f"credential leaked into: {text[:300]}"

    def assert_github_happy(self) -> None:
        assert self.github.problems == []


Factory = Callable[..., Awaitable[Harness]]


@pytest.fixture(scope="module")
def app_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def credentials(app_key: rsa.RSAPrivateKey) -> dict[str, Credential]:
    """The broker's GitHub credential of each kind, shared by the module's tests: immutable, and an App
    credential parses its key once (some 50 ms), not once per test."""
    pem = app_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    return {
        "static": StaticCredential(STATIC_SECRET),
        "app": AppCredential(APP_ID, pem, INSTALLATION_ID),
        "app-lookup": AppCredential(APP_ID, pem, None),
    }


def identify_as(sandbox: str | None) -> Callable[[str], str | None]:
    return lambda client: sandbox if client == LOOPBACK else None


@pytest.fixture
def broker_database() -> str | None:
    """The PostgreSQL database the harness's brokers keep their state in; None: a SQLite file each (the default;
    broker/test_service.py runs its suite on both)."""
    return None


@pytest.fixture
async def make(
    tmp_path: Path, app_key: rsa.RSAPrivateKey, credentials: dict[str, Credential], broker_database: str | None
) -> AsyncIterator[Factory]:
    """Builds a running broker (sandbox + admin apps on 127.0.0.1) in front of a fake GitHub on 127.0.0.1."""
    async with contextlib.AsyncExitStack() as stack:
        fake = FakeGitHub(app_key.public_key())
        github_server = TestServer(fake.app(), host=LOOPBACK)
        await github_server.start_server()
        stack.push_async_callback(github_server.close)
        stack.callback(fake.release.set)  # runs before the server closes: no handler is left hanging
        fake.base_url = str(github_server.make_url("")).rstrip("/")
        session = aiohttp.ClientSession()
        stack.push_async_callback(session.close)

        async def factory(
            credential: str | Credential | None = "static",  # a kind of `credentials`, or one of the test's
            identify: Callable[[str], str | None] | None = None,
            settings: BrokerSettings | None = None,
            timeout: float = 5.0,
            api: str | None = None,
            state: Path = tmp_path / "state",
            busy_timeout: float = 5.0,
            serves: list[str] | None = None,
        ) -> Harness:
            github = None
            if credential is not None:
                chosen = credentials[credential] if isinstance(credential, str) else credential
                github = GitHubClient(api or fake.base_url, chosen, session, timeout=timeout)
            identify = identify or identify_as(SANDBOX)
            inner: Any
            if broker_database is None:
                inner = SqliteStore(state / "broker.sqlite3", busy_timeout)
                call_log: Any = CallLog.in_directory(state / "calls")
                stack.push_async_callback(call_log.close)
            else:
                from airlock.broker.pgstore import PostgresStore

                inner = call_log = await PostgresStore.open(broker_database)
            stack.push_async_callback(inner.close)
            store = FlakyStore(inner)
            audit: list[AuditRecord] = []
            authority = TokenAuthority(KeyRing(state / "keys", 3600), default_ttl=600)
            served = None if serves is None else lambda: serves
            broker = Broker(
                authority,
                store,
                identify,
                github,
                audit.append,
                settings,
                serves=served,
                call_log=call_log,  # type: ignore[arg-type]
            )
            sandbox = TestClient(TestServer(broker.sandbox_app(), host=LOOPBACK))
            admin = TestClient(TestServer(broker.admin_app(), host=LOOPBACK))
            for client in (sandbox, admin):
                await client.start_server()
                stack.push_async_callback(client.close)
            static = STATIC_SECRET if credential == "static" else None
            return Harness(
                broker, sandbox, admin, fake, store, state, audit, call_log, static_secret=static,
                database=broker_database,
            )  # fmt: skip

        yield factory
