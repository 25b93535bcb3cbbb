"""The broker's HTTP surfaces end to end on 127.0.0.1: sandbox app → Broker → real GitHubClient → a fake GitHub
(broker_env.py), each test saying also how many times GitHub was reached. Only loopback is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import jwt.algorithms
import pytest

from airlock.broker.bodies import MAX_REQUEST_BYTES
from airlock.broker.github import AppCredential, Credential
from airlock.broker.service import BrokerSettings
from airlock.broker.store import Claimed, SqliteStore, StoreError
from airlock.broker.tool_schemas import MAX_BODY, MAX_TITLE

from broker_env import (
    APP_ID,
    FIELDS,
    GRANT,
    INSTALLATION_ID,
    LOOPBACK,
    PATH,
    SANDBOX,
    STATIC_SECRET,
    Factory,
    Harness,
    Reply,
    identify_as,
)

pytestmark = pytest.mark.tmpfs  # its stores (SQLite) on tmpfs: no fsync waits on a shared disk

# What only a SQLite file does (a lock another connection holds, the store's own threads): those tests take no
# PostgreSQL run.
sqlite_only = pytest.mark.parametrize("broker_database", [None], ids=["sqlite"])


# --- creating pull requests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("credential", ["static", "app", "app-lookup"])
async def test_creates_pull_request(make: Factory, credential: str) -> None:
    h = await make(credential=credential)
    token = await h.token()
    reply = await h.pr(token, {"draft": True})
    assert reply.status == 201, reply.body
    assert reply.body == {
        "number": 1, "url": f"{h.github.base_url}/repos/acme/app/pulls/1",
        "html_url": "https://github.test/acme/app/pull/1", "state": "open", "draft": True,
        "head": "agent/fix-1", "base": "main", "existing": False,
    }  # fmt: skip
    assert reply.headers["Location"] == reply.body["url"]
    (post,) = [c for c in h.github.calls if c["method"] == "POST" and c["path"] == "/repos/acme/app/pulls"]
    assert post["json"] == {
        "head": "agent/fix-1", "base": "main", "title": "Fix the thing", "body": "Details", "draft": True,
    }  # fmt: skip
    expected_secret = STATIC_SECRET if credential == "static" else h.github.tokens_issued[0]
    assert post["auth"] == f"token {expected_secret}"
    (record,) = h.audit
    assert (record.kind, record.sandbox, record.client, record.host) == ("broker", SANDBOX, LOOPBACK, "acme/app")
    assert (record.decision, record.reason, record.code, record.extra["status"]) == ("allow", "created", "allowed", 201)
    assert record.extra["number"] == 1
    assert record.extra["head"] == "agent/fix-1" and record.extra["base"] == "main"
    (call,) = await h.brokered_calls()
    assert (call["tool"], call["sandbox"], call["status"], call["error"]) == ("create_pull_request", SANDBOX, 201, None)
    assert call["input"] == FIELDS | {"draft": True} and call["result"]["number"] == 1
    await h.assert_no_secrets()
    h.assert_github_happy()


async def test_app_mode_jwt_and_narrowed_installation_token(make: Factory) -> None:
    h = await make(credential="app-lookup")
    reply = await h.pr(await h.token())
    assert reply.status == 201
    h.assert_github_happy()  # the fake checked RS256, iss, iat <= now-30, exp <= iat+600
    assert [(c["method"], c["path"]) for c in h.github.calls] == [
        ("GET", "/repos/acme/app/installation"),
        ("POST", f"/app/installations/{INSTALLATION_ID}/access_tokens"),
        ("POST", "/repos/acme/app/pulls"),
    ]
    assert len(h.github.app_jwts) == 2
    for header, claims, _ in h.github.app_jwts:
        assert header["alg"] == "RS256" and claims["iss"] == APP_ID
        assert claims["iat"] <= time.time() - 30 and claims["exp"] - claims["iat"] <= 600
    narrowing = h.github.calls[1]["json"]
    assert narrowing == {"repositories": ["app"], "permissions": {"pull_requests": "write"}}


async def test_installation_token_is_cached(make: Factory) -> None:
    h = await make(credential="app-lookup")
    token = await h.token()
    for n in range(3):
        reply = await h.pr(token, {"head": f"agent/fix-{n}"})
        assert reply.status == 201, reply.body
    assert h.github.count("POST", "/access_tokens") == 1
    assert h.github.count("GET", "/installation") == 1
    assert h.github.pull_posts == 3
    assert {c["auth"] for c in h.github.calls if c["path"].endswith("/pulls")} == {f"token {h.github.tokens_issued[0]}"}
    await h.assert_no_secrets()


EXPIRIES = [
    pytest.param("2020-01-01T00:00:00Z", 2, id="already-expired-means-use-once"),
    pytest.param("2999-01-01T00:00:00", 1, id="no-timezone-read-as-utc"),
]


@pytest.mark.parametrize(("expires_at", "token_calls"), EXPIRIES)
async def test_token_expiry_decides_caching(make: Factory, expires_at: Any, token_calls: int) -> None:
    h = await make(credential="app")
    h.github.expires_at = expires_at
    token = await h.token()
    for head in ("agent/a", "agent/b"):
        reply = await h.pr(token, {"head": head})
        assert reply.status == 201, reply.body
    assert h.github.count("POST", "/access_tokens") == token_calls
    await h.assert_no_secrets()


@pytest.mark.parametrize(
    "expires_at", [None, "soon", 12345, ["2999-01-01"]], ids=["missing", "garbage", "number", "list"]
)
async def test_unreadable_token_expiry_is_502(make: Factory, expires_at: Any) -> None:
    h = await make(credential="app")
    h.github.expires_at = expires_at
    reply = await h.pr(await h.token())
    assert (reply.status, reply.body["error"]) == (502, "upstream_invalid"), reply.body
    assert "expires_at" in reply.body["message"]
    assert h.github.pull_posts == 0  # the token of a malformed answer is never used
    assert (h.audit[-1].decision, h.audit[-1].code, h.audit[-1].extra["status"]) == ("error", "upstream_invalid", 502)
    await h.assert_no_secrets()


async def test_installation_token_is_per_repository(make: Factory) -> None:
    h = await make(credential="app")
    grants = [GRANT, GRANT | {"repo": "acme/other"}]
    token = await h.token(grants=grants)
    assert (await h.pr(token)).status == 201
    assert (await h.pr(token, {"repo": "acme/other"})).status == 201
    narrowings = [c["json"]["repositories"] for c in h.github.calls if c["path"].endswith("/access_tokens")]
    assert narrowings == [["app"], ["other"]]


async def test_the_app_key_is_parsed_once_however_many_app_jwts_are_made(
    make: Factory, credentials: dict[str, Credential], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsing a 2048-bit RSA key takes some 50 ms on the event loop: each App JWT after the first reuses it."""
    parsed: list[bytes] = []
    load = jwt.algorithms.load_pem_private_key

    def counted(data: bytes, *args: Any, **kwargs: Any) -> Any:
        parsed.append(data)
        return load(data, *args, **kwargs)

    monkeypatch.setattr(jwt.algorithms, "load_pem_private_key", counted)
    shared = credentials["app"]
    assert isinstance(shared, AppCredential)
    h = await make(credential=AppCredential(APP_ID, shared.private_key, INSTALLATION_ID))  # its key not parsed yet
    token = await h.token(grants=[GRANT, GRANT | {"repo": "acme/other"}])
    assert (await h.pr(token)).status == 201
    assert (await h.pr(token, {"repo": "acme/other"})).status == 201
    assert len(h.github.app_jwts) == 2 and len(parsed) == 1
    h.assert_github_happy()


SPELLINGS = ["acme/app", "ACME/app", "Acme/App", "acme/APP", "ACME/APP"]


@pytest.mark.parametrize("credential", ["app", "app-lookup"])
@pytest.mark.parametrize("granted", ["acme/app", "Acme/App"])
async def test_one_installation_token_however_the_repository_is_spelled(
    make: Factory, credential: str, granted: str
) -> None:
    h = await make(credential=credential)
    token = await h.token(grants=[GRANT | {"repo": granted}])
    for n, spelling in enumerate(SPELLINGS):
        reply = await h.pr(token, {"repo": spelling, "head": f"agent/case-{n}"})
        assert reply.status == 201, reply.body
    assert h.github.count("POST", "/access_tokens") == 1
    assert h.github.count("GET", "/installation") == (1 if credential == "app-lookup" else 0)
    # GitHub only ever sees the grant's spelling, whatever the sandbox sent.
    narrowings = [c["json"]["repositories"] for c in h.github.calls if c["path"].endswith("/access_tokens")]
    assert narrowings == [[granted.split("/")[1]]]
    assert {c["path"] for c in h.github.calls if c["path"].endswith("/pulls")} == {f"/repos/{granted}/pulls"}
    await h.assert_no_secrets()


async def test_installation_token_cache_ignores_case_also_when_a_token_is_rejected(make: Factory) -> None:
    h = await make(credential="app")
    client = h.broker.github
    assert client is not None
    fields = {"head": "agent/a", "base": "main", "title": "t", "body": "", "draft": False}
    await client.create_pull_request("acme/app", fields)
    h.github.rejected.add(h.github.tokens_issued[0])
    _, existed = await client.create_pull_request("ACME/APP", fields | {"head": "agent/b"})  # replaced once
    assert existed is False
    await client.create_pull_request("Acme/App", fields | {"head": "agent/c"})  # the replacement is cached
    assert h.github.count("POST", "/access_tokens") == 2
    assert len(h.github.pulls) == 3


async def test_existing_pull_request_is_returned(make: Factory) -> None:
    h = await make()
    first = await h.pr(await h.token())
    assert first.status == 201
    reply = await h.pr(await h.token())  # another token: not an idempotent replay, GitHub answers 422 "exists"
    assert reply.status == 200, reply.body
    assert reply.body["existing"] is True and reply.body["number"] == first.body["number"]
    assert "Location" not in reply.headers
    (listing,) = [c for c in h.github.calls if c["method"] == "GET"]
    assert listing["path"] == "/repos/acme/app/pulls"
    assert listing["query"] == {"head": "acme:agent/fix-1", "base": "main", "state": "open"}
    assert h.audit[-1].reason == "existing pull request"


async def test_no_commits_is_422(make: Factory) -> None:
    h = await make()
    reply = await h.pr(await h.token(), {"head": "agent/no-commits"})
    assert reply.status == 422
    assert reply.body["error"] == "upstream_validation"
    assert "No commits between" in reply.body["message"]
    assert h.audit[-1].decision == "deny"


async def test_upstream_hang_is_504_within_timeout(make: Factory) -> None:
    h = await make(timeout=0.5)
    h.github.mode = "hang"
    token = await h.token()
    started = time.monotonic()
    reply = await h.pr(token)
    assert reply.status == 504 and reply.body["error"] == "upstream_timeout"
    assert time.monotonic() - started < 3
    assert h.audit[-1].decision == "error"


async def test_upstream_500_is_502(make: Factory) -> None:
    h = await make()
    h.github.mode = "error"
    reply = await h.pr(await h.token())
    assert reply.status == 502 and reply.body["error"] == "upstream_error"
    assert h.audit[-1].decision == "error"


async def test_upstream_unreachable_is_502(make: Factory) -> None:
    with contextlib.closing(__import__("socket").socket()) as sock:
        sock.bind((LOOPBACK, 0))
        closed_port = sock.getsockname()[1]  # bound but not listening: connections are refused
        h = await make(api=f"http://{LOOPBACK}:{closed_port}")
        reply = await h.pr(await h.token())
    assert reply.status == 502 and reply.body["error"] == "upstream_unreachable"


async def test_without_credential_is_503(make: Factory) -> None:
    h = await make(credential=None)
    reply = await h.pr(await h.token())
    assert reply.status == 503 and reply.body["error"] == "not_configured"


# --- upstream answers of the wrong shape: 502, never a 500 ------------------------------------------------------

VALID_PULL = {
    "number": 7, "url": "https://api.github.test/repos/acme/app/pulls/7", "html_url": "https://github.test/acme/app/pull/7",
    "state": "open", "draft": False, "head": {"ref": "agent/fix-1"}, "base": {"ref": "main"},
}  # fmt: skip
HUGE = 2 * 1024 * 1024


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def without(value: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in value.items() if k != key}


BAD_PULLS = [
    pytest.param([], id="list"),
    pytest.param("a pull request", id="string"),
    pytest.param({}, id="empty-object"),
    pytest.param(b"<html>created</html>", id="not-json"),
    pytest.param(b"", id="empty-body"),
    pytest.param(b'{"number": 7, "url": "\xff"}', id="not-utf8"),
    pytest.param(nested(20_000), id="20000-nested-arrays"),
    pytest.param(VALID_PULL | {"labels": json.loads(nested(40))}, id="deep-extra-field"),
    pytest.param(b'{"x": "' + b"a" * HUGE + b'"}', id="huge-chunked"),
    pytest.param(VALID_PULL | {"body": "a" * HUGE}, id="huge-with-length"),
    pytest.param(without(VALID_PULL, "number"), id="number-missing"),
    pytest.param(VALID_PULL | {"number": "7"}, id="number-string"),
    pytest.param(VALID_PULL | {"number": True}, id="number-bool"),
    pytest.param(VALID_PULL | {"number": 7.5}, id="number-float"),
    pytest.param(VALID_PULL | {"number": -1}, id="number-negative"),
    pytest.param(without(VALID_PULL, "html_url"), id="html-url-missing"),
    pytest.param(VALID_PULL | {"html_url": 7}, id="html-url-number"),
    pytest.param(VALID_PULL | {"url": "javascript:alert(1)"}, id="url-not-http"),
    pytest.param(VALID_PULL | {"url": "https://x.test/7\r\nSet-Cookie: a=b"}, id="url-header-injection"),
    pytest.param(VALID_PULL | {"url": "https://x.test/" + "a" * 5000}, id="url-too-long"),
    pytest.param(without(VALID_PULL, "head"), id="head-missing"),
    pytest.param(VALID_PULL | {"head": "agent/fix-1"}, id="head-not-object"),
    pytest.param(VALID_PULL | {"head": {"ref": 5}}, id="head-ref-number"),
    pytest.param(VALID_PULL | {"draft": "no"}, id="draft-string"),
    pytest.param(VALID_PULL | {"state": ""}, id="state-empty"),
]
BAD_INSTALLATIONS = [
    pytest.param({"id": "abc"}, id="id-not-numeric"),
    pytest.param({"id": "777"}, id="id-numeric-string"),
    pytest.param({"app_id": 4242}, id="id-missing"),
    pytest.param({"id": True}, id="id-bool"),
    pytest.param({"id": 7.5}, id="id-float"),
    pytest.param({"id": -777}, id="id-negative"),
    pytest.param([{"id": 777}], id="list"),
    pytest.param(b"installed!", id="not-json"),
]
EXPIRES = "2999-01-01T00:00:00Z"
BAD_ACCESS_TOKENS = [
    pytest.param({"expires_at": EXPIRES}, id="token-missing"),
    pytest.param({"token": 5, "expires_at": EXPIRES}, id="token-number"),
    pytest.param({"token": "", "expires_at": EXPIRES}, id="token-empty"),
    pytest.param({"token": "ghs_a\r\nX-Evil: 1", "expires_at": EXPIRES}, id="token-header-injection"),
    pytest.param({"token": "ghs a b", "expires_at": EXPIRES}, id="token-with-spaces"),
    pytest.param({"token": "ghs_" + "a" * 5000, "expires_at": EXPIRES}, id="token-too-long"),
    pytest.param({"token": "ghs_ok"}, id="expiry-missing"),
    pytest.param([], id="list"),
    pytest.param(b"here is your token", id="not-json"),
]
BAD_LISTINGS = [
    pytest.param({}, id="object"),
    pytest.param("pulls", id="string"),
    pytest.param(b"<html>", id="not-json"),
    pytest.param([], id="empty"),
    pytest.param([{"foo": 1}], id="item-not-a-pull"),
    pytest.param([without(VALID_PULL, "html_url")], id="item-without-html-url"),
    pytest.param([VALID_PULL | {"number": "7"}], id="item-number-string"),
    pytest.param([VALID_PULL | {"head": {"ref": "agent/other"}}], id="item-for-another-head"),
    pytest.param(nested(20_000), id="20000-nested-arrays"),
]


def assert_quiet_log(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing logged a traceback or a RecursionError (aiohttp logs a handler's exception with its traceback)."""
    for record in caplog.records:
        assert record.exc_info is None, f"{record.name}: {record.getMessage()}"
        assert "RecursionError" not in record.getMessage() and "Traceback" not in record.getMessage()


def assert_upstream_invalid(h: Harness, reply: Reply, caplog: pytest.LogCaptureFixture) -> None:
    assert reply.status == 502, reply.body
    assert reply.headers["Content-Type"].startswith("application/json")
    assert reply.body["error"] == "upstream_invalid" and reply.body["message"].startswith("GitHub")
    assert (h.audit[-1].decision, h.audit[-1].extra["status"]) == ("error", 502)
    assert_quiet_log(caplog)


async def test_created_pull_request_with_only_the_fields_used_is_accepted(make: Factory) -> None:
    h = await make()
    h.github.answers["create_pull"] = (201, VALID_PULL)
    reply = await h.pr(await h.token())
    assert reply.status == 201, reply.body
    assert reply.body == {
        "number": 7, "url": VALID_PULL["url"], "html_url": VALID_PULL["html_url"], "state": "open", "draft": False,
        "head": "agent/fix-1", "base": "main", "existing": False,
    }  # fmt: skip


@pytest.mark.parametrize("answer", BAD_PULLS)
async def test_created_pull_request_of_the_wrong_shape_is_502(
    make: Factory, caplog: pytest.LogCaptureFixture, answer: Any
) -> None:
    h = await make()
    h.github.answers["create_pull"] = (201, answer)
    reply = await h.pr(await h.token(), key="op-1")
    assert_upstream_invalid(h, reply, caplog)
    assert h.idempotency_records() == []  # nothing half-read is remembered as the result


@pytest.mark.parametrize("answer", BAD_INSTALLATIONS)
async def test_installation_of_the_wrong_shape_is_502(
    make: Factory, caplog: pytest.LogCaptureFixture, answer: Any
) -> None:
    h = await make(credential="app-lookup")
    h.github.answers["installation"] = (200, answer)
    reply = await h.pr(await h.token())
    assert_upstream_invalid(h, reply, caplog)
    assert h.github.count("POST", "/access_tokens") == 0 and h.github.pull_posts == 0


@pytest.mark.parametrize("answer", BAD_ACCESS_TOKENS)
async def test_access_token_of_the_wrong_shape_is_502(
    make: Factory, caplog: pytest.LogCaptureFixture, answer: Any
) -> None:
    h = await make(credential="app")
    h.github.answers["access_token"] = (201, answer)
    reply = await h.pr(await h.token())
    assert_upstream_invalid(h, reply, caplog)
    assert h.github.pull_posts == 0


@pytest.mark.parametrize("answer", BAD_LISTINGS)
async def test_existing_pull_request_lookup_of_the_wrong_shape_is_502(
    make: Factory, caplog: pytest.LogCaptureFixture, answer: Any
) -> None:
    h = await make()
    assert (await h.pr(await h.token())).status == 201
    h.github.answers["list_pulls"] = (200, answer)
    reply = await h.pr(await h.token())  # another token: GitHub answers "already exists", then the listing
    assert_upstream_invalid(h, reply, caplog)
    assert h.github.count("GET", "/pulls") == 1


async def test_error_answers_that_are_not_json_keep_a_clipped_message(make: Factory) -> None:
    h = await make()
    h.github.answers["create_pull"] = (500, b"<html>" + b"Service Unavailable " * 40_000 + b"</html>")
    reply = await h.pr(await h.token())
    assert (reply.status, reply.body["error"]) == (502, "upstream_error")
    assert reply.body["message"].startswith("GitHub answered 500 <html>Service Unavailable")
    assert len(reply.body["message"]) < 1100


# --- tokens -----------------------------------------------------------------------------------------------------

AUTH_CASES = [
    pytest.param(None, "missing_token", id="no-header"),
    pytest.param("", "missing_token", id="empty-header"),
    pytest.param("Bearer", "missing_token", id="scheme-only"),
    pytest.param("Bearer    ", "missing_token", id="blank-token"),
    pytest.param("Basic dXNlcjpwYXNz", "missing_token", id="basic"),
    pytest.param("token {token}", "missing_token", id="github-scheme"),
    pytest.param("Bearer garbage", "invalid_token", id="garbage"),
    pytest.param("Bearer a.b.c", "invalid_token", id="three-junk-parts"),
    pytest.param("Bearer {token}x", "invalid_token", id="tampered"),
    pytest.param("Bearer {expired}", "invalid_token", id="expired"),
    pytest.param("Bearer {future}", "invalid_token", id="not-yet-valid"),
    pytest.param("Bearer {elsewhere}", "invalid_token", id="another-audience"),
    pytest.param("Bearer {revoked}", "revoked_token", id="revoked"),
]


@pytest.mark.parametrize(("auth", "code"), AUTH_CASES)
async def test_bad_tokens_are_401(make: Factory, auth: str | None, code: str) -> None:
    h = await make()
    now = int(time.time())
    revoked = await h.token()
    await h.admin_post("/v1/revocations", {"jti": jwt.decode(revoked, options={"verify_signature": False})["jti"]})
    values = {
        "token": await h.token(),
        "expired": h.forge(iat=now - 600, nbf=now - 600, exp=now - 60),
        "future": h.forge(nbf=now + 120),
        "elsewhere": h.forge(aud="https://api.github.com"),
        "revoked": revoked,
    }
    reply = await h.pr(None, auth=None if auth is None else auth.format(**values))
    assert reply.status == 401, reply.body
    assert reply.body["error"] == code
    # RFC 6750 §3: a request without a token is challenged without an error code, a bad token with invalid_token.
    challenge = 'Bearer realm="airlock-broker"'
    if code != "missing_token":
        challenge += f', error="invalid_token", error_description="{reply.body["message"]}"'
    assert reply.headers["WWW-Authenticate"] == challenge
    assert h.github.calls == []
    assert (h.audit[-1].decision, h.audit[-1].code, h.audit[-1].extra["status"]) == ("deny", code, 401)


async def test_bearer_scheme_is_case_insensitive(make: Factory) -> None:
    h = await make()
    assert (await h.pr(None, auth=f"bearer {await h.token()}")).status == 201


async def test_revoked_by_jti_is_401(make: Factory) -> None:
    h = await make()
    revoked, kept = await h.token(), await h.token()
    jti = jwt.decode(revoked, options={"verify_signature": False})["jti"]
    assert (await h.admin_post("/v1/revocations", {"jti": jti})).body == {"revoked": {"jti": jti}, "known": True}
    reply = await h.pr(revoked)
    assert reply.status == 401 and reply.body["error"] == "revoked_token"
    assert (await h.pr(kept)).status == 201
    assert h.github.pull_posts == 1


async def test_revoked_by_sandbox_is_401_for_tokens_issued_before(make: Factory) -> None:
    h = await make()
    token = await h.token()
    now = int(time.time())
    older = h.forge(iat=now - 60, nbf=now - 60)
    assert (await h.admin_post("/v1/revocations", {"sandbox": SANDBOX})).status == 200
    for revoked in (token, older):
        reply = await h.pr(revoked)
        assert reply.status == 401 and reply.body["error"] == "revoked_token"
    # A token minted after the revocation works (iat is whole seconds: move the revocation back instead of sleeping).
    await h.move_sandbox_revocations_back(10)
    assert (await h.pr(older)).status == 401
    assert (await h.pr(await h.token())).status == 201
    assert h.github.pull_posts == 1


async def test_revocation_survives_restart(make: Factory, tmp_path: Path) -> None:
    h = await make()
    token = await h.token()
    await h.admin_post("/v1/revocations", {"sandbox": SANDBOX})
    restarted = await make()  # same state directory: same keys, same store
    assert (await restarted.pr(token)).status == 401


async def test_token_from_another_sandbox_is_403(make: Factory) -> None:
    h = await make(identify=identify_as("sbx-2"))
    reply = await h.pr(await h.token(sandbox=SANDBOX))
    assert reply.status == 403 and reply.body["error"] == "wrong_sandbox"
    assert h.audit[-1].sandbox == "sbx-2"
    assert h.github.calls == []


async def test_unknown_source_is_403_even_with_a_token_for_the_placeholder(make: Factory) -> None:
    h = await make(identify=identify_as(None))
    for sandbox in (SANDBOX, "-"):  # "-" is what the audit record says for an unknown source
        reply = await h.pr(await h.token(sandbox=sandbox))
        assert reply.status == 403, reply.body
    assert h.github.calls == []


# --- grants and validation --------------------------------------------------------------------------------------

OUTSIDE_GRANT = [
    pytest.param({"repo": "acme/other"}, id="other-repo"),
    pytest.param({"repo": "evil/app"}, id="other-owner"),
    pytest.param({"base": "develop"}, id="other-base"),
    pytest.param({"base": "release"}, id="base-glob-needs-suffix"),
    pytest.param({"head": "feature/x"}, id="head-outside-pattern"),
    pytest.param({"head": "main"}, id="head-main"),
    pytest.param({"head": "release/1", "base": "release/1"}, id="head-equals-base"),
]


@pytest.mark.parametrize("fields", OUTSIDE_GRANT)
async def test_outside_grant_is_403(make: Factory, fields: dict[str, Any]) -> None:
    h = await make()
    grants = [GRANT, GRANT | {"base": ["release/*"], "head": "release/*"}]
    reply = await h.pr(await h.token(grants=grants), fields)
    assert reply.status == 403, reply.body
    assert reply.body["error"] == "outside_grant"
    assert h.github.calls == []
    assert (h.audit[-1].decision, h.audit[-1].code) == ("deny", "outside_grant") and h.audit[-1].reason


async def test_a_refusal_is_the_reason_of_the_grant_that_names_the_tool(make: Factory) -> None:
    """`--grant push_branch:… --grant create_pull_request:acme/app:base=main`, a pull request to release: the pull
    request grant's mismatch, not that the push grant is for another tool."""
    h = await make()
    push = {"tool": "push_branch", "repo": "acme/app", "head": "agent/*"}
    token = await h.token(grants=[push, GRANT | {"base": ["main"]}])
    reply = await h.pr(token, {"base": "release"})
    assert (reply.status, reply.body) == (
        403, {"error": "outside_grant", "message": "base branch 'release' is not one of ['main']"},
    )  # fmt: skip
    assert h.audit[-1].reason == "base branch 'release' is not one of ['main']"


WITHIN_GRANT = [
    pytest.param({"repo": "ACME/App"}, id="repo-case"),
    pytest.param({"base": "release/2.0"}, id="base-glob"),
    pytest.param({"head": "agent/deep/branch"}, id="head-nested"),
]


@pytest.mark.parametrize("fields", WITHIN_GRANT)
async def test_within_grant_is_201(make: Factory, fields: dict[str, Any]) -> None:
    h = await make()
    reply = await h.pr(await h.token(), fields)
    assert reply.status == 201, reply.body


async def test_any_of_several_grants_suffices(make: Factory) -> None:
    h = await make()
    token = await h.token(grants=[GRANT | {"repo": "acme/other"}, GRANT])
    assert (await h.pr(token)).status == 201


INVALID_REQUESTS = [
    pytest.param(b"{", 422, "invalid_json", None, id="truncated-json"),
    pytest.param(b"", 422, "invalid_json", None, id="empty-body"),
    pytest.param(b"[]", 422, "invalid_json", None, id="array"),
    pytest.param(b'"text"', 422, "invalid_json", None, id="string"),
    pytest.param(b"null", 422, "invalid_json", None, id="null"),
    pytest.param(b"\xff\xfe{}", 422, "invalid_json", None, id="not-utf8"),
    # What the tool's JSON Schema refuses: 400, with the field's path.
    pytest.param({"maintainer_can_modify": True}, 400, "invalid_input", "/maintainer_can_modify", id="unknown-field"),
    pytest.param({"title": None}, 400, "invalid_input", "/title", id="title-null"),
    pytest.param({"title": ""}, 400, "invalid_input", "/title", id="title-empty"),
    pytest.param({"title": "t" * (MAX_TITLE + 1)}, 400, "invalid_input", "/title", id="title-too-long"),
    pytest.param({"title": "x" + " " * 120_000}, 400, "invalid_input", "/title", id="title-padded-with-spaces"),
    pytest.param({"title": " " * MAX_TITLE + "x"}, 400, "invalid_input", "/title", id="title-after-spaces-too-long"),
    pytest.param({"body": "b" * (MAX_BODY + 1)}, 400, "invalid_input", "/body", id="body-too-long"),
    pytest.param({"body": None}, 400, "invalid_input", "/body", id="body-null"),
    pytest.param({"draft": "yes"}, 400, "invalid_input", "/draft", id="draft-string"),
    pytest.param({"repo": ["acme/app"]}, 400, "invalid_input", "/repo", id="repo-list"),
    pytest.param({"repo": "acme/app/../x"}, 400, "invalid_input", "/repo", id="repo-traversal"),
    pytest.param({"head": 1}, 400, "invalid_input", "/head", id="head-number"),
    pytest.param({"head": "agent/" + "x" * 250}, 400, "invalid_input", "/head", id="head-256-chars"),
    pytest.param({"base": ""}, 400, "invalid_input", "/base", id="base-empty"),
    # What the schema lets through and the broker's own rules refuse: 422.
    pytest.param({"title": "   \n"}, 422, "invalid_request", None, id="title-blank"),
    pytest.param({"repo": "acme/.."}, 422, "invalid_request", None, id="repo-dotdot"),
    pytest.param({"repo": "acme/app\n"}, 422, "invalid_request", None, id="repo-trailing-newline"),
    pytest.param({"head": "agent/*"}, 422, "invalid_request", None, id="head-pattern"),
    pytest.param({"head": "agent/a..b"}, 422, "invalid_request", None, id="head-dotdot"),
    pytest.param({"head": "agent/x\n"}, 422, "invalid_request", None, id="head-trailing-newline"),
    pytest.param({"head": "agent/x y"}, 422, "invalid_request", None, id="head-space"),
    pytest.param({"head": "agent/x\x00"}, 422, "invalid_request", None, id="head-nul"),
    pytest.param({"head": "agent/x."}, 422, "invalid_request", None, id="head-trailing-dot"),
    pytest.param({"head": "agent/x/"}, 422, "invalid_request", None, id="head-trailing-slash"),
    pytest.param({"head": "-agent/x"}, 422, "invalid_request", None, id="head-leading-dash"),
    pytest.param({"head": "agent/x@{1}"}, 422, "invalid_request", None, id="head-at-brace"),
    pytest.param({"base": "main*"}, 422, "invalid_request", None, id="base-pattern"),
]


@pytest.mark.parametrize(("request_body", "status", "code", "path"), INVALID_REQUESTS)
async def test_invalid_requests_are_refused(
    make: Factory, request_body: bytes | dict[str, Any], status: int, code: str, path: str | None
) -> None:
    h = await make()
    token = await h.token()
    if isinstance(request_body, bytes):
        reply = await h.pr(token, data=request_body)
    else:
        reply = await h.pr(token, request_body)
    assert (reply.status, reply.body["error"], reply.body.get("path")) == (status, code, path), reply.body
    assert h.github.calls == []
    if path is not None:  # the value is never quoted back (it may be megabytes, or a secret pasted by mistake)
        value = json.dumps(request_body[path[1:]]) if isinstance(request_body, dict) else ""
        assert len(value) < 8 or value not in reply.body["message"], reply.body


async def test_missing_title_is_400_with_its_path(make: Factory) -> None:
    h = await make()
    fields = {k: v for k, v in FIELDS.items() if k != "title"}
    reply = await h.pr(await h.token(), data=json.dumps(fields).encode())
    assert (reply.status, reply.body["error"], reply.body["path"]) == (400, "invalid_input", "/title")
    assert reply.body["message"] == "/title is required"


async def test_longest_allowed_fields_are_accepted(make: Factory) -> None:
    h = await make()
    reply = await h.pr(await h.token(), {"title": "t" * MAX_TITLE, "body": "b" * MAX_BODY})
    assert reply.status == 201, reply.body


async def test_oversized_request_is_413(make: Factory) -> None:
    h = await make()
    reply = await h.pr(await h.token(), {"body": "b" * (MAX_REQUEST_BYTES + 1)})
    assert reply.status == 413, reply.body
    assert reply.body["error"] == "too_large"
    assert h.github.calls == []


DEEP_REQUESTS = [
    pytest.param(nested(20_000), id="20000-nested-arrays"),
    pytest.param(b"[" * 20_000, id="20000-unclosed-arrays"),
    pytest.param(b'{"a":' * 20_000 + b"1" + b"}" * 20_000, id="20000-nested-objects"),
    pytest.param(json.dumps(FIELDS | {"title": json.loads(nested(8))}).encode(), id="9-deep"),
]


@pytest.mark.parametrize("data", DEEP_REQUESTS)
async def test_deeply_nested_request_is_400(make: Factory, caplog: pytest.LogCaptureFixture, data: bytes) -> None:
    h = await make()
    reply = await h.pr(await h.token(), data=data)
    assert (reply.status, reply.body["error"]) == (400, "too_deep"), reply.body
    assert h.github.calls == []
    assert (h.audit[-1].decision, h.audit[-1].extra["status"]) == ("deny", 400)
    assert_quiet_log(caplog)


async def test_nesting_limit_counts_structure_not_brackets_in_strings(make: Factory) -> None:
    h = await make()
    text = "[" * 20_000 + '\\"' + "{" * 20_000
    reply = await h.pr(await h.token(), {"body": text})
    assert reply.status == 201, reply.body
    reply = await h.pr(await h.token(), data=json.dumps(FIELDS | {"title": json.loads(nested(7))}).encode())
    assert (reply.status, reply.body["error"]) == (400, "invalid_input")  # 8 deep: parsed, then refused


async def test_admin_refuses_deep_nesting_too(make: Factory, caplog: pytest.LogCaptureFixture) -> None:
    h = await make()
    reply = await h.admin_post("/v1/tokens", data=nested(20_000))
    assert (reply.status, reply.body["error"]) == (400, "too_deep")
    ok = await h.admin_post("/v1/tokens", {"sandbox": SANDBOX, "grants": [GRANT], "note": json.loads(nested(7))})
    assert ok.status == 200, ok.body
    assert_quiet_log(caplog)


# --- idempotency ------------------------------------------------------------------------------------------------


async def test_idempotency_key_replays_the_same_response(make: Factory) -> None:
    h = await make()
    token = await h.token()
    first = await h.pr(token, key="op-1")
    second = await h.pr(token, key="op-1")
    assert first.status == second.status == 201
    assert first.body == second.body
    assert first.headers["Location"] == second.headers["Location"]
    assert h.github.pull_posts == 1
    assert h.audit[-1].reason == "replayed idempotent result"


async def test_idempotency_key_with_other_arguments_is_422(make: Factory) -> None:
    h = await make()
    token = await h.token()
    assert (await h.pr(token, key="op-1")).status == 201
    reply = await h.pr(token, {"title": "Something else"}, key="op-1")
    assert reply.status == 422 and reply.body["error"] == "idempotency_conflict"
    assert h.github.pull_posts == 1


async def test_idempotency_key_is_shared_by_the_sandboxs_tokens(make: Factory) -> None:
    h = await make()
    first = await h.pr(await h.token(), key="op-1")
    second = await h.pr(await h.token(), key="op-1")
    assert first.body == second.body and h.github.pull_posts == 1


async def test_same_token_same_arguments_without_key_is_one_call(make: Factory) -> None:
    h = await make()
    token = await h.token()
    first, second = await h.pr(token), await h.pr(token)
    assert first.status == second.status == 201 and first.body == second.body
    assert h.github.pull_posts == 1
    third = await h.pr(token, {"head": "agent/fix-2"})  # other arguments: another call
    assert third.status == 201 and third.body["number"] == 2
    assert h.github.pull_posts == 2


async def test_concurrent_identical_requests_make_one_call(make: Factory) -> None:
    h = await make()
    h.github.pull_delay = 0.3
    token = await h.token()
    replies = await asyncio.gather(*(h.pr(token, key="op-1") for _ in range(3)))
    assert [r.status for r in replies] == [201, 201, 201]
    assert len({json.dumps(r.body) for r in replies}) == 1
    assert h.github.pull_posts == 1


async def test_idempotency_survives_restart(make: Factory) -> None:
    h = await make()
    token = await h.token()
    first = await h.pr(token, key="op-1")
    restarted = await make()
    second = await restarted.pr(token, key="op-1")
    assert second.status == 201 and second.body == first.body
    assert h.github.pull_posts == 1  # the same fake GitHub behind both


async def test_failed_call_is_not_remembered(make: Factory) -> None:
    h = await make()
    h.github.mode = "error"
    token = await h.token()
    assert (await h.pr(token, key="op-1")).status == 502
    h.github.mode = "create"
    assert (await h.pr(token, key="op-1")).status == 201
    assert h.github.pull_posts == 2


ENDINGS = [
    pytest.param("create", {}, "op-1", None, 201, id="created"),
    pytest.param("create", {"title": "Other"}, "taken", None, 422, id="idempotency-conflict"),
    pytest.param("error", {}, "op-1", None, 502, id="upstream-error"),
    pytest.param("create", {"head": "agent/no-commits"}, "op-1", None, 422, id="upstream-validation"),
    pytest.param("create", {}, "op-1", "claim", 503, id="idempotency-claim-fails"),
    pytest.param("create", {}, "op-1", "settle", 503, id="idempotency-outcome-fails"),
]


async def leave_a_claim(h: Harness, key: str, fields: dict[str, Any] | None = None) -> None:
    """A claim of `key` left in the harness's store by a broker that died before it wrote the outcome."""
    token = await h.token()
    claims = h.broker.authority.verify(token)
    request_hash = hashlib.sha256(json.dumps(["acme/app", _pr_fields(fields)], sort_keys=True).encode()).hexdigest()
    dead = SqliteStore(h.state / "broker.sqlite3") if h.database is None else await open_postgres(h.database)
    assert isinstance(await dead.claim(claims.sandbox, key, request_hash), Claimed)
    await dead.close()


async def open_postgres(url: str) -> Any:
    from airlock.broker.pgstore import PostgresStore

    return await PostgresStore.open(url)


def _pr_fields(fields: dict[str, Any] | None) -> dict[str, Any]:
    merged = FIELDS | (fields or {})
    return {k: merged[k] for k in ("head", "base", "title", "body")} | {"draft": merged.get("draft", False)}


async def test_a_claim_left_by_a_dead_broker_is_resolved_by_asking_github(make: Factory) -> None:
    h = await make()
    token = await h.token()
    assert (await h.pr(token, key="op-0")).status == 201  # the pull request the dead broker's call made
    h.github.calls.clear()
    await leave_a_claim(h, "op-1")
    reply = await h.pr(token, key="op-1")
    assert reply.status == 201 and reply.body["number"] == 1, reply.body
    assert h.github.pull_posts == 0 and h.github.count("GET", "/pulls") == 1  # looked, never created again
    assert h.audit[-1].reason == "resolved an unfinished call"
    again = await h.pr(token, key="op-1")
    assert (again.status, again.body) == (201, reply.body)  # settled now: the outcome is replayed


async def test_a_claim_left_by_a_dead_broker_acts_when_github_has_nothing(make: Factory) -> None:
    h = await make()
    await leave_a_claim(h, "op-1")
    reply = await h.pr(await h.token(), key="op-1")
    assert reply.status == 201 and reply.body["existing"] is False
    assert h.github.count("GET", "/pulls") == 1 and h.github.pull_posts == 1 and len(h.github.pulls) == 1


@pytest.mark.parametrize(("mode", "fields", "key", "failing", "status"), ENDINGS)
async def test_idempotency_locks_are_dropped_however_calls_end(
    make: Factory, mode: str, fields: dict[str, Any], key: str, failing: str | None, status: int
) -> None:
    h = await make()
    token = await h.token()
    assert (await h.pr(token, {"head": "agent/earlier"}, key="taken")).status == 201
    h.github.mode, h.github.pull_delay = mode, 0.05  # the concurrent calls wait for the lock meanwhile
    if failing:
        h.store.failing.add(failing)
    replies = await asyncio.gather(*(h.pr(token, {"head": "agent/fix-1"} | fields, key=key) for _ in range(3)))
    assert [r.status for r in replies] == [status] * 3, [r.body for r in replies]
    assert h.broker.locks.entries == {}


# --- rate limit -------------------------------------------------------------------------------------------------


async def test_rate_limit_per_token(make: Factory) -> None:
    h = await make(settings=BrokerSettings(calls_per_minute=1, burst=2))
    token, other = await h.token(), await h.token()
    statuses = [(await h.pr(token, {"head": f"agent/r{n}"})).status for n in range(3)]
    assert statuses == [201, 201, 429]
    reply = await h.pr(token, {"head": "agent/r9"})
    assert reply.status == 429 and reply.body["error"] == "rate_limited" and reply.headers["Retry-After"] == "60"
    limit = "this token's tool calls are limited to 1 a minute, at most 2 at once; retry in 60 s"
    assert reply.body["message"] == limit
    assert (await h.pr(other, {"head": "agent/other"})).status == 201  # another token has its own bucket
    assert h.github.pull_posts == 3


FAILED_AUTHS = [
    pytest.param(None, 401, "missing_token", id="no-token"),
    pytest.param("Bearer x.y.z", 401, "invalid_token", id="garbage"),
    pytest.param("Bearer {expired}", 401, "invalid_token", id="expired"),
    pytest.param("Bearer {revoked}", 401, "revoked_token", id="revoked"),
    pytest.param("Bearer {other_sandbox}", 403, "wrong_sandbox", id="other-sandboxs-token"),
]


@pytest.mark.parametrize(("auth", "status", "code"), FAILED_AUTHS)
async def test_failed_authentications_are_limited_per_source(
    make: Factory, monkeypatch: pytest.MonkeyPatch, auth: str | None, status: int, code: str
) -> None:
    h = await make(settings=BrokerSettings(failed_auths_per_second=0.01, failed_auth_burst=3))
    valid, revoked = await h.token(), await h.token()
    jti = jwt.decode(revoked, options={"verify_signature": False})["jti"]
    assert (await h.admin_post("/v1/revocations", {"jti": jti})).status == 200
    now = int(time.time())
    values = {
        "expired": h.forge(iat=now - 600, nbf=now - 600, exp=now - 60),
        "revoked": revoked,
        "other_sandbox": await h.token(sandbox="sbx-2"),
    }
    verified: list[str] = []
    verify = h.broker.authority.verify
    monkeypatch.setattr(h.broker.authority, "verify", lambda token: verified.append(token) or verify(token))
    replies = [await h.pr(None, auth=None if auth is None else auth.format(**values)) for _ in range(5)]
    assert [(r.status, r.body["error"]) for r in replies] == [(status, code)] * 3 + [(429, "auth_rate_limited")] * 2
    assert 1 <= int(replies[-1].headers["Retry-After"]) <= 100  # one failure more every 100 s
    # Past the limit the address gets 429 even with a valid token, and no token is looked at.
    reply = await h.pr(valid)
    assert (reply.status, reply.body["error"]) == (429, "auth_rate_limited")
    assert len(verified) == (0 if auth is None else 3)
    assert h.github.calls == []
    # Every call is audited; none reached a tool, so the call log has none.
    assert [r.extra["status"] for r in h.audit] == [status] * 3 + [429] * 3
    assert (await h.brokered_calls()) == []


async def test_flood_of_bad_tokens_is_cut_short_and_not_stored(make: Factory) -> None:
    h = await make()  # default settings: a burst of 20 failures, then 2 a second
    replies = [await h.pr(None, auth="Bearer x.y.z") for _ in range(40)]
    statuses = [r.status for r in replies]
    assert statuses[:20] == [401] * 20 and statuses[-1] == 429
    assert statuses.count(401) <= 22  # at most a refill or two while the flood lasts
    assert {r.body["error"] for r in replies if r.status == 429} == {"auth_rate_limited"}
    assert len(h.audit) == 40 and (await h.brokered_calls()) == []


async def test_valid_tokens_do_not_spend_the_failure_budget(make: Factory) -> None:
    settings = BrokerSettings(calls_per_minute=600, burst=20, failed_auths_per_second=0.01, failed_auth_burst=3)
    h = await make(settings=settings)
    token = await h.token()

    async def call(n: int, valid: bool) -> int:
        return (await (h.pr(token, {"head": f"agent/ok-{n}"}) if valid else h.pr(None, auth="Bearer x.y.z"))).status

    valid = [True] * 10 + [False, True] * 2 + [False, False]
    statuses = [await call(n, v) for n, v in enumerate(valid)]
    assert statuses == [201] * 10 + [401, 201] * 2 + [401, 429]


async def test_failed_authentication_budget_refills(make: Factory) -> None:
    h = await make(settings=BrokerSettings(failed_auths_per_second=20, failed_auth_burst=1))
    token = await h.token()
    assert (await h.pr(None)).status == 401
    limited = await h.pr(token)
    assert limited.status == 429 and limited.headers["Retry-After"] == "1"  # whole seconds, rounded up
    await asyncio.sleep(0.1)
    assert (await h.pr(token)).status == 201


# --- broker state failures --------------------------------------------------------------------------------------

STORE_FAILURES = [
    pytest.param("is_revoked", 0, id="revocation-list"),
    pytest.param("claim", 0, id="idempotency-claim"),
    pytest.param("settle", 1, id="idempotency-outcome"),
]


@pytest.mark.parametrize(("operation", "upstream_calls"), STORE_FAILURES)
async def test_store_failure_is_503_never_success(make: Factory, operation: str, upstream_calls: int) -> None:
    h = await make()
    token = await h.token()
    h.store.failing.add(operation)
    reply = await h.pr(token, key="op-1")
    assert reply.status == 503, reply.body
    assert reply.body["error"] == "store_unavailable"
    assert h.github.pull_posts == upstream_calls
    assert h.audit[-1].decision == "error"


async def test_closed_store_is_503(make: Factory) -> None:
    h = await make()
    token = await h.token()
    await h.store.inner.close()
    reply = await h.pr(token)
    assert reply.status == 503 and reply.body["error"] == "store_unavailable"
    assert h.github.calls == []
    assert len(h.audit) == 1  # still audited, though nothing could be looked up


def break_call_log(h: Harness, monkeypatch: pytest.MonkeyPatch, operation: str) -> None:
    async def fail(*args: Any) -> Any:
        raise StoreError(f"{operation}: disk on fire")

    monkeypatch.setattr(h.call_log, operation, fail)


async def test_a_call_that_cannot_be_logged_is_refused_before_it_acts(
    make: Factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    h = await make()
    token = await h.token()
    break_call_log(h, monkeypatch, "begin")
    reply = await h.pr(token)
    assert (reply.status, reply.body["error"]) == (503, "store_unavailable")
    assert h.github.calls == []  # nothing done that the log does not hold
    assert (h.audit[-1].decision, h.audit[-1].code) == ("error", "store_unavailable")


async def test_a_log_that_fails_after_the_tool_acted_does_not_undo_the_pull_request(
    make: Factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The PR exists upstream by then: answered as made; the row stays without an ending, the audit has the rest.
    h = await make()
    token = await h.token()
    break_call_log(h, monkeypatch, "finish")
    reply = await h.pr(token)
    assert reply.status == 201
    assert h.audit[-1].decision == "allow"
    (call,) = await h.brokered_calls()
    assert call["status"] is None and call["input"]["head"] == "agent/fix-1"
    assert any("could not complete call" in r.getMessage() for r in caplog.records)


async def test_admin_revocation_with_broken_store_is_503(make: Factory) -> None:
    h = await make()
    h.store.failing.update({"revoke_token", "revoke_sandbox"})
    for body in ({"jti": "x"}, {"sandbox": SANDBOX}):
        reply = await h.admin_post("/v1/revocations", body)
        assert reply.status == 503 and reply.body["error"] == "store_unavailable"


@contextlib.contextmanager
def write_locked(path: Path) -> Iterator[None]:
    """Another connection holds the database's write lock (BEGIN EXCLUSIVE) until the block ends."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            db.execute("ROLLBACK")


class LoopWatch:
    """Measures the longest time the event loop went without running a 10 ms ticker."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.longest = max(self.longest, now - last)
            last = now

    def stop(self) -> float:
        self._task.cancel()
        return self.longest


@sqlite_only
async def test_a_locked_store_never_stalls_the_event_loop(make: Factory) -> None:
    h = await make()
    token = await h.token()
    with write_locked(h.state / "broker.sqlite3"):
        watch = LoopWatch()
        call = asyncio.create_task(h.pr(token, key="op-1"))
        # A store call that held the loop while it waited for the lock (up to its busy timeout, 5 s) would show as a
        # gap of seconds in the watch.
        await asyncio.sleep(0.3)
        assert not call.done()  # it waits for the lock, to claim its idempotency key...
        assert h.github.pull_posts == 0  # ...before GitHub is asked anything
    reply = await call
    assert watch.stop() < 0.5  # the loop (the proxy's and DNS's too) ran all along
    assert reply.status == 201, reply.body
    assert h.idempotency_records() and (await h.brokered_calls())


@sqlite_only
async def test_a_store_locked_longer_than_its_timeout_is_503(make: Factory, caplog: pytest.LogCaptureFixture) -> None:
    h = await make(busy_timeout=0.3)
    token = await h.token()
    with write_locked(h.state / "broker.sqlite3"):
        watch = LoopWatch()
        reply = await h.pr(token)
        revoked = await h.admin_post("/v1/revocations", {"jti": "some-jti"})
    assert watch.stop() < 0.2
    assert (reply.status, reply.body["error"]) == (503, "store_unavailable"), reply.body
    assert (revoked.status, revoked.body["error"]) == (503, "store_unavailable")
    assert (h.audit[-1].decision, h.audit[-1].extra["status"]) == ("error", 503)
    assert h.github.pull_posts == 0  # its idempotency key could not be claimed: GitHub was never asked
    assert any("broker state unavailable" in r.getMessage() for r in caplog.records)
    assert_quiet_log(caplog)


@sqlite_only
async def test_store_calls_never_run_on_the_event_loop_thread(make: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    h = await make()
    loop_thread = threading.get_ident()
    threads: list[int] = []
    for sqlite_file in (h.store.inner, h.call_log):  # every statement of either file goes through its `_run`
        run = sqlite_file._run
        monkeypatch.setattr(sqlite_file, "_run", lambda *a, _m=run: threads.append(threading.get_ident()) or _m(*a))
    assert (await h.pr(await h.token())).status == 201
    assert (await h.admin_post("/v1/revocations", {"jti": "j"})).status == 200
    # issued, revoked?, claim, creator recorded, settled, call begun and ended, was issued?, revoked
    assert len(threads) >= 9 and loop_thread not in threads


# --- credentials never leave ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("credential", "shape"), [("static", None), ("app", "classic"), ("app", "jwt")])
async def test_credential_echoed_by_upstream_is_redacted(make: Factory, credential: str, shape: str | None) -> None:
    h = await make(credential=credential)
    h.github.token_shape = shape or "classic"
    token = await h.token()
    assert (await h.pr(token, {"head": "agent/warm-up"})).status == 201  # App mode: caches the installation token
    h.github.mode = "echo"
    reply = await h.pr(token)
    assert reply.status == 502, reply.body
    assert "[redacted]" in reply.body["message"]
    assert "[redacted]" in h.audit[-1].reason
    assert shape is None or {len(t) > 500 for t in h.github.tokens_issued} == {shape == "jwt"}
    await h.assert_no_secrets()


async def test_app_jwt_echoed_by_upstream_is_redacted(make: Factory) -> None:
    h = await make(credential="app")
    h.github.token_mode = "echo"
    reply = await h.pr(await h.token())
    assert reply.status == 502, reply.body
    assert h.github.app_jwts, "the App JWT was sent"
    assert "[redacted]" in reply.body["message"]
    await h.assert_no_secrets()


@pytest.mark.parametrize("credential", ["static", "app-lookup"])
async def test_no_credential_in_any_response_or_record(make: Factory, credential: str) -> None:
    h = await make(credential=credential)
    token = await h.token()
    await h.pr(token)
    await h.pr(token)  # replay
    await h.pr(await h.token())  # existing
    await h.pr(token, {"head": "agent/no-commits"})
    await h.pr(token, {"repo": "acme/other"})
    await h.pr(None, auth="Bearer nope")
    await h.pr(token, data=b"{")
    await h.admin_post("/v1/keys/rotate", {})
    async with h.admin.get("/v1/jwks") as response:
        await h._reply(response)
    h.github.mode = "error"
    await h.pr(token, {"head": "agent/late"})
    await h.assert_no_secrets()
    # Nor does the sandbox token itself appear in what is audited (only its jti).
    for record in h.audit:
        assert token not in record.to_json()


@pytest.mark.parametrize("credential", ["static", "app"])
async def test_credentials_echoed_in_every_field_of_a_success_are_redacted(make: Factory, credential: str) -> None:
    h = await make(credential=credential)
    h.github.mode = "echo-everywhere"
    token = await h.token()
    created = await h.pr(token, key="op-1")
    assert created.status == 201, created.body
    replayed = await h.pr(token, key="op-1")
    existing = await h.pr(await h.token())  # "already exists": the listed pull request echoes them too
    assert (replayed.status, existing.status) == (201, 200), existing.body
    for reply in (created, replayed):
        for name in ("url", "html_url", "state", "head", "base"):
            assert "[redacted]" in reply.body[name], (name, reply.body[name])
        assert "[redacted]" in reply.headers["Location"] and reply.headers["Location"] == reply.body["url"]
    assert "[redacted]" in existing.body["url"] and "[redacted]" in existing.body["html_url"]
    assert h.idempotency_records() and all("[redacted]" in body for body in h.idempotency_records())
    await h.assert_no_secrets()


async def test_installation_tokens_replaced_after_a_401_stay_secret(make: Factory) -> None:
    h = await make(credential="app")
    token = await h.token()
    assert (await h.pr(token, {"head": "agent/warm-up"})).status == 201
    first = h.github.tokens_issued[0]
    h.github.rejected.add(first)  # GitHub says 401: the broker replaces the token it holds
    h.github.mode = "echo-everywhere"
    reply = await h.pr(token, key="after-401")
    assert reply.status == 201, reply.body
    assert len(h.github.tokens_issued) == 2
    h.github.mode = "echo"  # now an error that repeats every credential GitHub has seen
    failed = await h.pr(token, {"head": "agent/echo"})
    assert failed.status == 502 and "[redacted]" in failed.body["message"]
    for text in (json.dumps(reply.body), json.dumps(reply.headers), json.dumps(failed.body)):
        assert first not in text and h.github.tokens_issued[1] not in text
    await h.assert_no_secrets()


async def test_installation_tokens_replaced_at_refresh_stay_secret(make: Factory) -> None:
    h = await make(credential="app")
    h.github.expires_at = "2020-01-01T00:00:00Z"  # every token is past its refresh time at once: one per call
    token = await h.token()
    for n in range(3):
        assert (await h.pr(token, {"head": f"agent/refresh-{n}"})).status == 201
    h.github.mode = "echo-everywhere"
    assert (await h.pr(token, {"head": "agent/echo"})).status == 201
    assert len(h.github.tokens_issued) == 4
    await h.assert_no_secrets()


async def test_every_request_is_audited_once(make: Factory) -> None:
    h = await make()
    token = await h.token()
    replies = [await h.pr(token), await h.pr(None), await h.pr(token, {"repo": "acme/other"}), await h.pr(token)]
    assert len(h.audit) == len(replies)
    assert len(await h.brokered_calls()) == 3  # not the call without a token (see test_failed_authentications_…)
    assert [r.extra["status"] for r in h.audit] == [r.status for r in replies]
    assert [r.decision for r in h.audit] == ["allow", "deny", "deny", "allow"]
    jti = jwt.decode(token, options={"verify_signature": False})["jti"]
    assert h.audit[0].extra["jti"] == jti and "jti" not in h.audit[1].extra


# --- failures nobody planned for ----------------------------------------------------------------------------------


async def test_a_bug_is_a_json_500_with_one_redacted_log_line(
    make: Factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    h = await make()
    assert h.broker.github is not None

    async def broken(*args: Any) -> Any:
        raise KeyError(f"oops {STATIC_SECRET}")

    monkeypatch.setattr(h.broker.github, "create_pull_request", broken)
    reply = await h.pr(await h.token())
    assert reply.status == 500 and reply.body == {
        "error": "internal_error",
        "message": "the broker failed; see its log",
    }
    assert (h.audit[-1].decision, h.audit[-1].code, h.audit[-1].extra["status"]) == ("error", "internal_error", 500)
    (line,) = [r.getMessage() for r in caplog.records if "unexpected" in r.getMessage()]
    assert "KeyError" in line and "[redacted]" in line and STATIC_SECRET not in caplog.text
    assert_quiet_log(caplog)


async def test_a_bug_in_the_admin_app_is_a_json_500(
    make: Factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    h = await make()

    def broken() -> str:
        raise OSError("disk on fire")

    monkeypatch.setattr(h.broker.authority.keys, "rotate", broken)
    reply = await h.admin_post("/v1/keys/rotate", {})
    assert (reply.status, reply.body["error"]) == (500, "internal_error")
    assert_quiet_log(caplog)


async def test_unknown_routes_and_methods_are_json(make: Factory) -> None:
    h = await make()
    auth = {"Authorization": f"Bearer {await h.token()}"}
    async with h.sandbox.get("/nowhere", headers=auth) as response:
        assert (response.status, (await response.json())["error"]) == (404, "http_error")
    async with h.sandbox.put(PATH, headers=auth) as response:
        assert (response.status, (await response.json())["error"]) == (405, "http_error")
    async with h.sandbox.post("/v1/tools/delete_repository", headers=auth, json={}) as response:
        assert (response.status, (await response.json())["error"]) == (404, "unknown_tool")
    assert [(r.method, r.decision, r.extra["status"]) for r in h.audit] == [
        ("-", "deny", 404), ("-", "deny", 405), ("-", "deny", 404),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/nowhere"), ("PUT", PATH), ("GET", "/v1/tools"), ("POST", "/v1/tools/push_branch"),
     ("POST", "/v1/tools/delete_repository"), ("GET", "/v1/jwks"), ("POST", "/mcp"), ("GET", "/mcp")],
)  # fmt: skip
async def test_every_sandbox_path_needs_the_token_from_its_own_network(make: Factory, method: str, path: str) -> None:
    h = await make()
    async with h.sandbox.request(method, path, json={}) as response:
        assert (response.status, error_code(await response.json())) == (401, "missing_token")
        assert response.headers["WWW-Authenticate"] == 'Bearer realm="airlock-broker"'
    other = await make(identify=identify_as("sbx-2"), state=h.state)  # the same keys; this address is sbx-2's
    token = await h.token()  # minted for sbx-1
    async with other.sandbox.request(method, path, json={}, headers={"Authorization": f"Bearer {token}"}) as response:
        assert (response.status, error_code(await response.json())) == (403, "wrong_sandbox")


def error_code(body: dict[str, Any]) -> str:
    """The broker's code in a REST error, or in an MCP JSON-RPC one (/mcp answers JSON-RPC)."""
    return body["error"]["data"]["error"] if body.get("jsonrpc") else body["error"]


# --- admin ------------------------------------------------------------------------------------------------------


async def test_admin_issues_a_working_token(make: Factory) -> None:
    h = await make()
    reply = await h.admin_post("/v1/tokens", {"sandbox": SANDBOX, "grants": [GRANT], "ttl": 60})
    assert reply.status == 200
    assert set(reply.body) == {"token", "jti", "sandbox", "expires_at"}
    claims = h.broker.authority.verify(reply.body["token"])
    assert claims.jti == reply.body["jti"] and claims.sandbox == SANDBOX
    assert claims.expires_at == reply.body["expires_at"] and claims.expires_at - claims.issued_at == 60


BAD_ISSUES = [
    pytest.param({"grants": [GRANT]}, id="no-sandbox"),
    pytest.param({"sandbox": "", "grants": [GRANT]}, id="empty-sandbox"),
    pytest.param({"sandbox": 7, "grants": [GRANT]}, id="sandbox-number"),
    pytest.param({"sandbox": SANDBOX}, id="no-grants"),
    pytest.param({"sandbox": SANDBOX, "grants": []}, id="empty-grants"),
    pytest.param({"sandbox": SANDBOX, "grants": 5}, id="grants-number"),
    pytest.param({"sandbox": SANDBOX, "grants": "create_pull_request:acme/app"}, id="grants-string"),
    pytest.param({"sandbox": SANDBOX, "grants": {"tool": "create_pull_request"}}, id="grants-object"),
    pytest.param({"sandbox": SANDBOX, "grants": [GRANT | {"tool": "delete_repo"}]}, id="unknown-tool"),
    pytest.param({"sandbox": SANDBOX, "grants": [GRANT | {"repo": "acme"}]}, id="bad-repo"),
    pytest.param({"sandbox": SANDBOX, "grants": [GRANT | {"head": "*"}]}, id="head-star"),
    pytest.param({"sandbox": SANDBOX, "grants": [GRANT | {"base": [1]}]}, id="base-number"),
    pytest.param({"sandbox": SANDBOX, "grants": [GRANT], "ttl": 0}, id="ttl-zero"),
    pytest.param({"sandbox": SANDBOX, "grants": [GRANT], "ttl": -5}, id="ttl-negative"),
    pytest.param({"sandbox": SANDBOX, "grants": [GRANT], "ttl": 3601}, id="ttl-above-max"),
    pytest.param({"sandbox": SANDBOX, "grants": [GRANT], "ttl": "60"}, id="ttl-string"),
    pytest.param({"sandbox": SANDBOX, "grants": [GRANT], "ttl": 60.5}, id="ttl-float"),
    pytest.param({"sandbox": SANDBOX, "grants": [GRANT], "ttl": True}, id="ttl-bool"),
    pytest.param([], id="array"),
]


@pytest.mark.parametrize("body", BAD_ISSUES)
async def test_admin_refuses_bad_token_requests(make: Factory, body: Any) -> None:
    h = await make()
    reply = await h.admin_post("/v1/tokens", body)
    assert reply.status == 422, reply.body
    assert reply.body["error"] in {"invalid_request", "invalid_json"}


async def test_admin_invalid_json_is_422(make: Factory) -> None:
    h = await make()
    for path in ("/v1/tokens", "/v1/revocations"):
        reply = await h.admin_post(path, data=b"{nope")
        assert reply.status == 422 and reply.body["error"] == "invalid_json"


async def test_revoking_an_id_the_broker_never_issued_says_so_and_revokes_it_anyway(make: Factory) -> None:
    h = await make(serves=[SANDBOX])
    reply = await h.admin_post("/v1/revocations", {"jti": "no-such-jti"})
    assert reply.status == 200 and reply.body == {"revoked": {"jti": "no-such-jti"}, "known": False}
    assert await h.store.is_revoked("no-such-jti", SANDBOX, int(time.time()))  # fail closed: it can never be used
    reply = await h.admin_post("/v1/revocations", {"sandbox": "nobody-here"})
    assert reply.body == {"revoked": {"sandbox": "nobody-here"}, "known": False}
    reply = await h.admin_post("/v1/revocations", {"sandbox": SANDBOX})
    assert reply.body == {"revoked": {"sandbox": SANDBOX}, "known": True}


async def test_a_token_for_a_sandbox_the_gateway_does_not_serve_is_refused(make: Factory) -> None:
    h = await make(serves=[SANDBOX, "other"])
    reply = await h.admin_post("/v1/tokens", {"sandbox": "typo", "grants": [GRANT]})
    assert reply.status == 422 and reply.body["error"] == "unknown_sandbox"
    assert reply.body["message"] == "this gateway serves no sandbox 'typo' (it serves: sbx-1, other)"
    assert (await h.pr(await h.token())).status == 201  # a served one still gets its token


async def test_admin_revocation_needs_jti_or_sandbox(make: Factory) -> None:
    h = await make()
    for body in ({}, {"jti": 5}, {"sandbox": None}):
        reply = await h.admin_post("/v1/revocations", body)
        assert reply.status == 422 and reply.body["error"] == "invalid_request"


async def test_admin_jwks_and_rotation(make: Factory) -> None:
    h = await make()
    old_token = await h.token()
    old_kid = jwt.get_unverified_header(old_token)["kid"]
    async with h.admin.get("/v1/jwks") as response:
        jwks = (await h._reply(response)).body
    assert [k["kid"] for k in jwks["keys"]] == [old_kid]
    assert all("d" not in k for k in jwks["keys"])
    reply = await h.admin_post("/v1/keys/rotate", {})
    new_kid = reply.body["kid"]
    assert reply.status == 200 and new_kid != old_kid
    new_token = await h.token()
    assert jwt.get_unverified_header(new_token)["kid"] == new_kid
    async with h.admin.get("/v1/jwks") as response:
        jwks = (await h._reply(response)).body
    assert {k["kid"] for k in jwks["keys"]} == {old_kid, new_kid}
    assert (await h.pr(old_token)).status == 201  # old tokens live on until they expire
    assert (await h.pr(new_token, {"head": "agent/new"})).status == 201


async def test_admin_routes_are_not_on_the_sandbox_app(make: Factory) -> None:
    h = await make()
    auth = {"Authorization": f"Bearer {await h.token()}"}
    async with h.sandbox.post("/v1/tokens", json={"sandbox": SANDBOX, "grants": [GRANT]}, headers=auth) as response:
        assert response.status in (404, 405)
    async with h.sandbox.get("/v1/jwks", headers=auth) as response:
        assert response.status in (404, 405)
    async with h.sandbox.get(PATH, headers=auth) as response:
        assert response.status == 405
