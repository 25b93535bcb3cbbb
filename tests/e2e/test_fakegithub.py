"""The fake GitHub API proves itself from the gateway namespace: App JWT → installation token → pull request, and
every refusal the broker must cope with, each with GitHub's status and message."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import subprocess
import time
from functools import partial
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from airlock.verify.fakeca import FakeCA
from airlock.verify.fakegit import IDENTITY
from airlock.verify.fakegithub_client import GITHUB_IP, FakeGitHub
from airlock.verify.topology import FakeNet, Topology

from netclient import Reply, github_request, in_netns

APP_PR = "/repos/acme/app/pulls"
NARROW = {"repositories": ["app"], "permissions": {"pull_requests": "write"}}
JWT_UNDECODABLE = "A JSON web token could not be decoded"
JWT_BAD_EXP = (
    "'Expiration time' claim ('exp') must be a numeric value representing the future time at which the assertion "
    "expires"
)
JWT_EXP_TOO_FAR = "'Expiration time' claim ('exp') is too far in the future"
JWT_BAD_IAT = "'Issued at' claim ('iat') must be an Integer representing the time that the assertion was issued"


@pytest.fixture
def gh(topology: Topology, fake_github: FakeGitHub, test_ca: FakeCA) -> Any:
    """call(method, path, token=None, scheme="token", body=None, ...) from inside gw."""
    topology.assert_route_inside(topology.gw, GITHUB_IP)

    def call(method: str, path: str, token: str | None = None, **kw: Any) -> Reply:
        return in_netns(topology.gw, partial(github_request, test_ca.ca_cert, method, path, token, **kw))

    return call


def installation_token(gh: Any, fake_github: FakeGitHub, body: dict[str, Any] | None = None) -> str:
    reply = gh("POST", "/app/installations/777/access_tokens", fake_github.app_jwt(), scheme="Bearer", body=body)
    assert reply.status == 201, reply.body
    return reply.json()["token"]


def pr_body(head: str = "agent/feature-1", base: str = "main", **extra: Any) -> dict[str, Any]:
    return {"title": f"Agent work on {head}", "head": head, "base": base, "body": "Done by the agent.", **extra}


def hs256(payload: dict[str, Any], secret: bytes) -> str:
    """HS256 by hand, so even a PEM public key can be the HMAC secret (the classic algorithm-confusion forgery)."""

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    signing_input = f"{b64(json.dumps({'alg': 'HS256', 'typ': 'JWT'}).encode())}.{b64(json.dumps(payload).encode())}"
    return f"{signing_input}.{b64(hmac.new(secret, signing_input.encode(), hashlib.sha256).digest())}"


def assert_error(reply: Reply, status: int, message: str) -> dict[str, Any]:
    assert reply.status == status, (reply.status, reply.body, reply.error)
    data = reply.json()
    assert data["message"] == message
    assert data["documentation_url"].startswith("https://docs.github.com/")
    assert data["status"] == str(status)
    return data


# ------------------------------------------------------------------------------------------- the happy path


def test_app_flow_creates_pull_request(gh: Any, fake_github: FakeGitHub, token_shape: str) -> None:
    app_jwt = fake_github.app_jwt()
    installation = gh("GET", "/repos/acme/app/installation", app_jwt, scheme="Bearer")
    assert installation.status == 200, installation.body
    assert installation.json()["id"] == fake_github.installation_id == 777
    assert installation.json()["account"]["login"] == "acme"

    minted = gh("POST", "/app/installations/777/access_tokens", app_jwt, scheme="Bearer", body=NARROW)
    assert minted.status == 201, minted.body
    grant = minted.json()
    token = grant["token"]
    assert token.startswith("ghs_")
    if token_shape == "classic":
        assert len(token) == 40
    else:  # a JWT after the prefix: header, claims, a 256-byte RS256 signature
        assert 500 < len(token) < 560 and len(token.split(".")[2]) == 342
    assert grant["permissions"] == {"metadata": "read", "pull_requests": "write"}
    assert grant["repository_selection"] == "selected"
    assert [r["full_name"] for r in grant["repositories"]] == ["acme/app"]
    expires = time.mktime(time.strptime(grant["expires_at"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    assert abs(expires - (time.time() + 3600)) < 60

    created = gh("POST", APP_PR, token, body=pr_body(draft=True))
    assert created.status == 201, created.body
    pr = created.json()
    assert pr["number"] == 1
    assert pr["html_url"] == "https://github.test/acme/app/pull/1"
    assert pr["url"] == "https://api.github.test/repos/acme/app/pulls/1"
    assert created.headers["Location"] == pr["url"]
    assert created.headers["Content-Type"] == "application/json; charset=utf-8"
    assert (pr["state"], pr["title"], pr["draft"]) == ("open", "Agent work on agent/feature-1", True)
    assert (pr["head"]["ref"], pr["head"]["label"], pr["base"]["ref"]) == (
        "agent/feature-1",
        "acme:agent/feature-1",
        "main",
    )
    assert pr["user"]["login"] == "airlock-app[bot]" and pr["user"]["type"] == "Bot"

    again = gh("POST", APP_PR, token, body=pr_body())
    data = assert_error(again, 422, "Validation Failed")
    assert data["errors"][0]["message"] == "A pull request already exists for acme:agent/feature-1."

    found = gh("GET", f"{APP_PR}?head=acme:agent/feature-1&base=main&state=open", token)
    assert found.status == 200, found.body
    assert [p["number"] for p in found.json()] == [1]
    assert gh("GET", f"{APP_PR}/1", token).json()["html_url"] == pr["html_url"]

    # What GitHub saw: the App JWT on the App endpoints, the installation token on the repository ones.
    calls = fake_github.calls()
    assert [(c["method"], c["path"], c["status"]) for c in calls] == [
        ("GET", "/repos/acme/app/installation", 200),
        ("POST", "/app/installations/777/access_tokens", 201),
        ("POST", APP_PR, 201),
        ("POST", APP_PR, 422),
        ("GET", APP_PR, 200),
        ("GET", f"{APP_PR}/1", 200),
    ]
    assert [(c["auth_scheme"], c["credential"]) for c in calls[:2]] == [("bearer", "app_jwt")] * 2
    assert {c["token"] for c in calls[:2]} == {app_jwt}
    assert all((c["auth_scheme"], c["credential"], c["token"]) == ("token", "installation", token) for c in calls[2:])
    assert calls[1]["body"] == NARROW
    assert calls[2]["body"]["head"] == "agent/feature-1"
    assert calls[4]["query"] == {"head": "acme:agent/feature-1", "base": "main", "state": "open"}
    assert calls[2]["user_agent"] == "airlock-e2e" and calls[2]["api_version"] == "2022-11-28"
    (issued,) = fake_github.tokens()
    assert (issued["token"], issued["repositories"], issued["permissions"]) == (token, ["app"], grant["permissions"])
    (created_pr,) = fake_github.prs()
    assert (created_pr["repo"], created_pr["number"], created_pr["token"]) == ("acme/app", 1, token)
    assert fake_github.connections() == len(calls)  # one connection per request (Connection: close)


def test_list_filter_needs_owner_prefix(gh: Any, fake_github: FakeGitHub) -> None:
    token = installation_token(gh, fake_github, NARROW)
    for head in ("agent/feature-1", "agent/feature-2"):
        assert gh("POST", APP_PR, token, body=pr_body(head)).status == 201
    assert gh("POST", APP_PR, token, body=pr_body("agent/feature-1", "release")).status == 201  # other base: fine

    def numbers(query: str) -> list[int]:
        reply = gh("GET", f"{APP_PR}?{query}", token)
        assert reply.status == 200, reply.body
        return [p["number"] for p in reply.json()]

    assert numbers("head=acme:agent/feature-2") == [2]
    assert numbers("head=acme:agent/feature-1&base=main") == [1]
    assert numbers("head=agent/feature-2") == [3, 2, 1]  # GitHub silently ignores a bare branch name
    assert numbers("head=someone:agent/feature-2") == []
    assert numbers("base=release&direction=asc") == [3]
    closed = gh("PATCH", f"{APP_PR}/1", token, body={"state": "closed"})
    assert closed.status == 200 and closed.json()["state"] == "closed"
    assert numbers("head=acme:agent/feature-1&base=main") == []
    assert numbers("head=acme:agent/feature-1&base=main&state=closed") == [1]
    assert gh("POST", APP_PR, token, body=pr_body()).json()["number"] == 4  # a closed PR no longer blocks


def test_bearer_scheme_and_static_token(gh: Any, fake_github: FakeGitHub) -> None:
    token = installation_token(gh, fake_github)  # not narrowed: every repo, every installation permission
    assert gh("POST", "/repos/acme/other/pulls", token, scheme="Bearer", body=pr_body()).status == 201
    assert fake_github.tokens()[0]["repositories"] is None
    static = fake_github.static_token
    assert static and fake_github.static_token_path and fake_github.static_token_path.read_text().strip() == static
    reply = gh("POST", APP_PR, static, body=pr_body("agent/feature-2"))
    assert reply.status == 201, reply.body
    assert reply.json()["user"]["login"] == "acme-ci"
    basic = base64.b64encode(f"x-access-token:{token}".encode()).decode()
    assert gh("GET", APP_PR, basic, scheme="Basic").status == 200
    calls = fake_github.calls("/repos/")
    assert [(c["auth_scheme"], c["credential"], c["token"]) for c in calls] == [
        ("bearer", "installation", token),
        ("token", "static", static),
        ("basic", "installation", token),
    ]
    assert [p["credential"] for p in fake_github.prs()] == ["installation", "static"]


# ------------------------------------------------------------------------------------------- App JWT checks


def _claims(**kw: Any) -> dict[str, Any]:
    now = int(time.time())
    claims = {"iat": now - 60, "exp": now + 540, "iss": "4242"}
    claims.update(kw)
    return {k: v for k, v in claims.items() if v is not None}


def forged_jwt(case: str, fake_github: FakeGitHub) -> str:
    key = fake_github.app_key_path.read_text()  # type: ignore[union-attr]
    now = int(time.time())
    if case == "expired":
        return jwt.encode(_claims(iat=now - 700, exp=now - 100), key, algorithm="RS256")
    if case == "exp too far":
        return jwt.encode(_claims(iat=now, exp=now + 3600), key, algorithm="RS256")
    if case == "lifetime over 10 min":
        return jwt.encode(_claims(iat=now - 120, exp=now + 540), key, algorithm="RS256")
    if case == "iat in the future":
        return jwt.encode(_claims(iat=now + 300, exp=now + 500), key, algorithm="RS256")
    if case == "no exp":
        return jwt.encode(_claims(exp=None), key, algorithm="RS256")
    if case == "other key":
        other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        return jwt.encode(_claims(), other, algorithm="RS256")
    if case == "other app":
        return jwt.encode(_claims(iss="4243"), key, algorithm="RS256")
    if case == "iss not numeric":
        return jwt.encode(_claims(iss="airlock"), key, algorithm="RS256")
    if case == "no iss":
        return jwt.encode(_claims(iss=None), key, algorithm="RS256")
    if case == "HS256":
        return jwt.encode(_claims(), "a-shared-secret-of-some-length-32b", algorithm="HS256")
    if case == "HS256 with the public key":
        public = (
            serialization.load_pem_private_key(key.encode(), None)
            .public_key()
            .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        return hs256(_claims(), public)
    if case == "alg none":
        return jwt.encode(_claims(), None, algorithm="none")
    if case == "tampered":
        head, payload, sig = fake_github.app_jwt().split(".")
        claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
        claims["exp"] += 1
        forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
        return f"{head}.{forged}.{sig}"
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("expired", JWT_BAD_EXP),
        ("no exp", JWT_BAD_EXP),
        ("exp too far", JWT_EXP_TOO_FAR),
        ("lifetime over 10 min", JWT_EXP_TOO_FAR),
        ("iat in the future", JWT_BAD_IAT),
        ("other key", JWT_UNDECODABLE),
        ("other app", JWT_UNDECODABLE),
        ("iss not numeric", "'Issuer' claim ('iss') must be an Integer"),
        ("no iss", "Missing 'issuer' claim ('iss') in assertion"),
        ("HS256", JWT_UNDECODABLE),
        ("HS256 with the public key", JWT_UNDECODABLE),
        ("alg none", JWT_UNDECODABLE),
        ("tampered", JWT_UNDECODABLE),
    ],
)
def test_bad_app_jwt_is_401(gh: Any, fake_github: FakeGitHub, case: str, message: str) -> None:
    token = forged_jwt(case, fake_github)
    assert_error(gh("POST", "/app/installations/777/access_tokens", token, scheme="Bearer", body=NARROW), 401, message)
    assert_error(gh("GET", "/repos/acme/app/installation", token, scheme="Bearer"), 401, message)
    assert fake_github.tokens() == []


def test_app_endpoints_want_an_app_jwt(gh: Any, fake_github: FakeGitHub) -> None:
    path = "/app/installations/777/access_tokens"
    assert_error(gh("POST", path, body=NARROW), 401, JWT_UNDECODABLE)
    assert_error(gh("POST", path, "not-a-jwt", scheme="Bearer"), 401, JWT_UNDECODABLE)
    assert_error(gh("POST", path, fake_github.static_token, scheme="Bearer"), 401, JWT_UNDECODABLE)
    token = installation_token(gh, fake_github)
    assert_error(gh("POST", path, token, scheme="Bearer"), 401, JWT_UNDECODABLE)
    # iss as a number, exp exactly 10 minutes after iat: accepted.
    assert gh("GET", "/app", fake_github.app_jwt(iss=4242, lifetime=600, iat_offset=-1), scheme="Bearer").status == 200
    assert [t["token"] for t in fake_github.tokens()] == [token]


def test_token_narrowing_refusals(gh: Any, fake_github: FakeGitHub) -> None:
    app_jwt = fake_github.app_jwt()

    def mint(body: Any, installation: int = 777) -> Reply:
        return gh("POST", f"/app/installations/{installation}/access_tokens", app_jwt, scheme="Bearer", body=body)

    not_granted = "The permissions requested are not granted to this installation."
    unknown_repo = (
        "There is at least one repository that does not exist or is not accessible to the parent installation."
    )
    assert_error(mint({"permissions": {"administration": "write"}}), 422, not_granted)
    assert_error(mint({"permissions": {"metadata": "write"}}), 422, not_granted)
    assert_error(mint({"permissions": {"pull_requests": "admin"}}), 422, not_granted)
    assert_error(mint({"repositories": ["nope"]}), 422, unknown_repo)
    assert_error(mint({"repositories": ["acme/app"]}), 422, unknown_repo)  # names only, no owner
    assert_error(mint({"repository_ids": [1]}), 422, unknown_repo)
    assert_error(mint(NARROW, installation=778), 404, "Not Found")
    assert_error(mint(None, installation=778), 404, "Not Found")
    assert_error(gh("GET", "/repos/acme/nope/installation", app_jwt, scheme="Bearer"), 404, "Not Found")
    assert_error(gh("GET", "/repos/someone/app/installation", app_jwt, scheme="Bearer"), 404, "Not Found")
    assert fake_github.tokens() == []

    by_id = mint({"repository_ids": [100002], "permissions": {"contents": "read", "pull_requests": "read"}})
    assert by_id.status == 201, by_id.body
    assert [r["full_name"] for r in by_id.json()["repositories"]] == ["acme/other"]
    assert by_id.json()["permissions"] == {"metadata": "read", "contents": "read", "pull_requests": "read"}
    listed = gh("GET", "/installation/repositories", by_id.json()["token"])
    assert [r["full_name"] for r in listed.json()["repositories"]] == ["acme/other"]


# ------------------------------------------------------------------------------------------- token scope


def test_installation_token_scope(gh: Any, fake_github: FakeGitHub) -> None:
    token = installation_token(gh, fake_github, NARROW)
    assert_error(gh("POST", "/repos/acme/other/pulls", token, body=pr_body()), 404, "Not Found")
    assert_error(gh("GET", "/repos/acme/other/pulls", token), 404, "Not Found")
    assert_error(gh("POST", "/repos/someone/app/pulls", token, body=pr_body()), 404, "Not Found")

    read_only = installation_token(gh, fake_github, {"repositories": ["app"], "permissions": {"contents": "read"}})
    resource = "Resource not accessible by integration"
    assert_error(gh("POST", APP_PR, read_only, body=pr_body()), 403, resource)
    assert_error(gh("GET", APP_PR, read_only), 403, resource)
    pr_read = installation_token(gh, fake_github, {"repositories": ["app"], "permissions": {"pull_requests": "read"}})
    assert_error(gh("POST", APP_PR, pr_read, body=pr_body()), 403, resource)
    assert gh("GET", APP_PR, pr_read).status == 200

    assert_error(gh("POST", APP_PR, body=pr_body()), 401, "Requires authentication")
    assert_error(gh("POST", APP_PR, "ghs_" + "x" * 36, body=pr_body()), 401, "Bad credentials")
    assert_error(gh("POST", APP_PR, fake_github.app_jwt(), scheme="Bearer", body=pr_body()), 403, resource)
    assert fake_github.prs() == []

    revoke = gh("DELETE", "/installation/token", token)
    assert revoke.status == 204
    assert_error(gh("POST", APP_PR, token, body=pr_body()), 401, "Bad credentials")
    assert fake_github.expire_tokens() == 3
    assert_error(gh("GET", APP_PR, pr_read), 401, "Bad credentials")
    assert all(t["revoked"] == (t["token"] == token) for t in fake_github.tokens())
    assert fake_github.calls(APP_PR)[-1]["credential"] == "installation"


def test_pull_request_comments_and_check_runs_want_their_permissions(gh: Any, fake_github: FakeGitHub) -> None:
    writer = installation_token(gh, fake_github, NARROW)
    assert gh("POST", APP_PR, writer, body=pr_body()).status == 201
    fake_github.set(check_runs=[{"name": "build", "status": "completed", "conclusion": "failure"}])
    resource = "Resource not accessible by integration"

    def token(**permissions: str) -> str:
        return installation_token(gh, fake_github, {"repositories": ["app"], "permissions": permissions})

    reader = token(pull_requests="read")
    first = gh("GET", f"{APP_PR}/1", reader).json()
    assert (first["mergeable"], first["mergeable_state"], len(first["head"]["sha"])) == (True, "clean", 40)
    comment = {"body": "Looks good."}
    assert_error(gh("POST", "/repos/acme/app/issues/1/comments", reader, body=comment), 403, resource)
    for permissions in ({"pull_requests": "write"}, {"issues": "write"}):  # either does, as on GitHub
        posted = gh("POST", "/repos/acme/app/issues/1/comments", token(**permissions), body=comment)
        assert posted.status == 201, posted.body
        assert posted.json()["html_url"].startswith("https://github.test/acme/app/pull/1#issuecomment-")
    assert_error(gh("POST", "/repos/acme/app/issues/2/comments", writer, body=comment), 404, "Not Found")
    assert [c["body"] for c in gh("GET", "/repos/acme/app/issues/1/comments", reader).json()] == ["Looks good."] * 2
    assert [(c["number"], c["permissions"]) for c in fake_github.comments()] == [
        (1, {"metadata": "read", "pull_requests": "write"}), (1, {"metadata": "read", "issues": "write"}),
    ]  # fmt: skip

    runs = f"/repos/acme/app/commits/{first['head']['sha']}/check-runs"
    assert_error(gh("GET", runs, reader), 403, resource)
    listed = gh("GET", runs, token(checks="read")).json()
    assert listed["total_count"] == 1
    assert [(r["name"], r["conclusion"]) for r in listed["check_runs"]] == [("build", "failure")]
    elsewhere = installation_token(gh, fake_github, {"repositories": ["other"], "permissions": {"checks": "read"}})
    assert_error(gh("GET", runs, elsewhere), 404, "Not Found")


def test_short_token_ttl(gh: Any, fake_github: FakeGitHub) -> None:
    fake_github.set(token_ttl=1)
    reply = gh("POST", "/app/installations/777/access_tokens", fake_github.app_jwt(), scheme="Bearer", body=NARROW)
    token = reply.json()["token"]
    assert gh("GET", APP_PR, token).status == 200
    time.sleep(1.2)
    assert_error(gh("GET", APP_PR, token), 401, "Bad credentials")


# ------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("body", "errors"),
    [
        (
            {"head": "agent/feature-1", "base": "main"},
            [{"resource": "PullRequest", "code": "missing_field", "field": "title"}],
        ),
        ({"title": "t", "base": "main"}, [{"resource": "PullRequest", "code": "missing_field", "field": "head"}]),
        (pr_body("feature/nope"), [{"resource": "PullRequest", "field": "head", "code": "invalid"}]),
        (pr_body("agent/feature-1", "develop"), [{"resource": "PullRequest", "field": "base", "code": "invalid"}]),
        (pr_body("evil:agent/feature-1"), [{"resource": "PullRequest", "field": "head", "code": "invalid"}]),
        (
            pr_body("agent/no-commits"),
            [{"resource": "PullRequest", "code": "custom", "message": "No commits between main and agent/no-commits"}],
        ),
        (
            pr_body("main"),
            [{"resource": "PullRequest", "code": "custom", "message": "No commits between main and main"}],
        ),
    ],
)
def test_create_validation(
    gh: Any, fake_github: FakeGitHub, body: dict[str, Any], errors: list[dict[str, Any]]
) -> None:
    token = installation_token(gh, fake_github, NARROW)
    data = assert_error(gh("POST", APP_PR, token, body=body), 422, "Validation Failed")
    assert data["errors"] == errors
    assert fake_github.prs() == []


def test_owner_prefixed_head_and_bad_bodies(gh: Any, fake_github: FakeGitHub) -> None:
    token = installation_token(gh, fake_github, NARROW)
    reply = gh("POST", APP_PR, token, body=pr_body("acme:agent/feature-2"))
    assert reply.status == 201 and reply.json()["head"]["ref"] == "agent/feature-2"
    assert_error(gh("POST", APP_PR, token, raw_body=b"{not json"), 400, "Problems parsing JSON")
    assert_error(gh("POST", APP_PR, token, body=["a list"]), 400, "Body should be a JSON object")
    typed = assert_error(
        gh("POST", APP_PR, token, body=pr_body(draft="yes")),
        422,
        "Invalid request.\n\nFor 'properties/draft', \"yes\" is not a boolean.",
    )
    assert "errors" not in typed
    no_ua = gh("GET", APP_PR, token, headers={"User-Agent": None})
    assert no_ua.status == 403 and b"User-Agent" in no_ua.body
    assert gh("GET", APP_PR, token, headers={"X-GitHub-Api-Version": "2021-01-01"}).status == 400
    assert_error(gh("GET", "/repos/acme/app/nothing-here", token), 404, "Not Found")


# ------------------------------------------------------------------------------------------- failure modes


def test_hang_mode(gh: Any, fake_github: FakeGitHub) -> None:
    token = installation_token(gh, fake_github, NARROW)
    fake_github.set(hang=True)
    started = time.monotonic()
    reply = gh("POST", APP_PR, token, body=pr_body(), timeout=1.5)
    assert reply.status == 0 and reply.error and "timed out" in reply.error
    assert time.monotonic() - started < 5
    deadline = time.monotonic() + 3
    while not (hung := fake_github.calls(APP_PR)[-1]).get("aborted") and time.monotonic() < deadline:
        time.sleep(0.05)  # the server cancels the handler once it sees the client gone
    assert hung["hung"] and hung["aborted"] and hung["status"] is None and hung["token"] == token
    assert fake_github.prs() == []
    fake_github.set(hang=False)
    assert gh("POST", APP_PR, token, body=pr_body()).status == 201  # the server is not wedged


def test_hang_repo_and_hang_after_create(gh: Any, fake_github: FakeGitHub) -> None:
    token = installation_token(gh, fake_github)
    assert gh("POST", "/repos/acme/hang/pulls", token, body=pr_body(), timeout=1).status == 0
    assert fake_github.prs() == []
    fake_github.set(hang=True, hang_after_create=True)
    assert gh("POST", APP_PR, token, body=pr_body(), timeout=1).status == 0
    # The client timed out, yet the PR exists: what a broker retry then runs into.
    (pr,) = fake_github.prs()
    assert pr["number"] == 1
    fake_github.set(hang=False)
    assert gh("POST", APP_PR, token, body=pr_body()).json()["errors"][0]["message"].startswith("A pull request already")
    fake_github.set(hang_seconds=0.2)
    assert gh("POST", "/repos/acme/hang/pulls", token, body=pr_body(), timeout=5).status == 201


def test_fail_status(gh: Any, fake_github: FakeGitHub) -> None:
    token = installation_token(gh, fake_github, NARROW)
    fake_github.set(fail_status=500)
    assert_error(gh("POST", APP_PR, token, body=pr_body()), 500, "Server Error")
    fake_github.set(fail_status=503)
    assert_error(gh("POST", APP_PR, token, body=pr_body()), 503, "Service Unavailable")
    fake_github.set(fail_status=None, token_fail_status=429)
    limited = gh("POST", "/app/installations/777/access_tokens", fake_github.app_jwt(), scheme="Bearer", body=NARROW)
    assert_error(limited, 429, "API rate limit exceeded for installation ID 777.")
    assert limited.headers["Retry-After"] == "60" and limited.headers["X-RateLimit-Remaining"] == "0"
    assert fake_github.prs() == [] and len(fake_github.tokens()) == 1


# ------------------------------------------------------------------------------------------- harness


def test_coexists_with_fakenet(topology: Topology, fakenet: FakeNet, fake_github: FakeGitHub, test_ca: FakeCA) -> None:
    assert topology.dns_query(topology.gw, "api.github.test").values() == [GITHUB_IP]
    topology.assert_route_inside(topology.gw, GITHUB_IP)
    # The test leaf covers the name and the address; fakegithub, not fakenet, owns 192.0.2.20:443.
    for url in ("https://api.github.test/app", f"https://{GITHUB_IP}/app"):
        res = topology.curl(
            topology.gw, "--cacert", str(test_ca.ca_cert), "--resolve", f"api.github.test:443:{GITHUB_IP}", url
        )
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["message"] == JWT_UNDECODABLE
    assert fakenet.connections(GITHUB_IP, 443) == 0
    assert fake_github.connections() == 2
    assert [c["user_agent"].split("/")[0] for c in fake_github.calls()] == ["curl", "curl"]
    # Every other port of the address is still fakenet's.
    res = topology.curl(topology.gw, f"http://{GITHUB_IP}/p")
    assert res.stdout == f"fakenet {GITHUB_IP}:80 host={GITHUB_IP} path=/p\n"


def test_reset_and_settings(gh: Any, fake_github: FakeGitHub) -> None:
    token = installation_token(gh, fake_github, NARROW)
    gh("POST", APP_PR, token, body=pr_body())
    fake_github.set(hang=True, fail_status=500)
    stats = fake_github.stats()
    assert len(stats["calls"]) == 2 and len(stats["prs"]) == 1 and len(stats["tokens"]) == 1
    fake_github.reset()
    stats = fake_github.stats()
    assert (stats["calls"], stats["prs"], stats["tokens"], stats["connections"]) == ([], [], [], 0)
    assert stats["settings"]["hang"] is False and stats["settings"]["fail_status"] is None
    assert_error(gh("GET", APP_PR, token), 401, "Bad credentials")  # tokens are forgotten too
    with pytest.raises(RuntimeError, match="unknown settings"):
        fake_github.set(hang_forever=True)


# ------------------------------------------------------------------------------------------- git smart HTTP

GIT_URL = "https://github.test/acme"


@pytest.fixture
def git_gw(topology: Topology, test_ca: FakeCA, tmp_path: Path) -> Any:
    """git(*args, token=None) in the gateway namespace against the fake's git host, with a clean environment."""
    topology.assert_route_inside(topology.gw, GITHUB_IP)

    def run(*args: str, token: str | None = None, cwd: Path = tmp_path) -> subprocess.CompletedProcess[str]:
        config = ["-c", f"http.sslCAInfo={test_ca.ca_cert}", "-c", f"http.curloptResolve=github.test:443:{GITHUB_IP}"]
        if token is not None:
            basic = base64.b64encode(f"x-access-token:{token}".encode()).decode()
            config += ["-c", f"http.extraHeader=Authorization: Basic {basic}"]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GIT_CONFIG_NOSYSTEM": "1",
               "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_TERMINAL_PROMPT": "0", **IDENTITY}  # fmt: skip
        return topology.run(topology.gw, ["git", *config, *args], cwd=cwd, env=env)

    return run


def contents_token(gh: Any, fake_github: FakeGitHub, level: str, repo: str = "app") -> str:
    return installation_token(gh, fake_github, {"repositories": [repo], "permissions": {"contents": level}})


def test_git_without_a_token_is_401(git_gw: Any, fake_github: FakeGitHub) -> None:
    result = git_gw("ls-remote", f"{GIT_URL}/app.git")
    assert result.returncode != 0 and "could not read Username" in result.stderr, result.stderr
    assert [(c["path"], c["status"]) for c in fake_github.calls()] == [("/acme/app.git/info/refs", 401)]


def test_git_read_token_fetches_but_cannot_push(git_gw: Any, gh: Any, fake_github: FakeGitHub, tmp_path: Path):
    token = contents_token(gh, fake_github, "read")
    cloned = git_gw("clone", "-q", f"{GIT_URL}/app.git", "clone", token=token)
    assert cloned.returncode == 0, cloned.stderr
    clone = tmp_path / "clone"
    assert (clone / "README.md").read_text() == "# acme/app\n"
    assert git_gw("log", "--format=%s", cwd=clone).stdout.split("\n")[0] == "Initial commit"
    (clone / "x").write_text("x\n")
    git_gw("add", "x", cwd=clone)
    git_gw("commit", "-qm", "x", cwd=clone)
    pushed = git_gw("push", "origin", "HEAD:refs/heads/agent/x", token=token, cwd=clone)
    assert pushed.returncode != 0 and "403" in pushed.stderr, pushed.stderr
    assert fake_github.pushes() == []
    assert set(fake_github.git()["app"]["refs"]) == {"refs/heads/main"}


def test_git_token_for_one_repository_cannot_touch_another(git_gw: Any, gh: Any, fake_github: FakeGitHub) -> None:
    token = contents_token(gh, fake_github, "write")
    assert git_gw("ls-remote", f"{GIT_URL}/app.git", token=token).returncode == 0
    other = git_gw("ls-remote", f"{GIT_URL}/other.git", token=token)
    assert other.returncode != 0 and "Repository not found" in other.stderr, other.stderr
    assert fake_github.calls("/acme/other.git")[-1]["status"] == 404
    assert git_gw("ls-remote", f"{GIT_URL}/app.git", token="ghs_" + "x" * 36).returncode != 0  # unknown token


def test_git_write_token_pushes_and_the_refs_are_recorded(
    git_gw: Any, gh: Any, fake_github: FakeGitHub, tmp_path: Path
) -> None:
    token = contents_token(gh, fake_github, "write")
    assert git_gw("clone", "-q", f"{GIT_URL}/app.git", "clone", token=token).returncode == 0
    clone = tmp_path / "clone"
    (clone / "x").write_text("x\n")
    git_gw("add", "x", cwd=clone)
    git_gw("commit", "-qm", "x", cwd=clone)
    pushed = git_gw("push", "-q", "origin", "HEAD:refs/heads/agent/x", token=token, cwd=clone)
    assert pushed.returncode == 0, pushed.stderr
    sha = git_gw("rev-parse", "HEAD", cwd=clone).stdout.strip()
    (push,) = fake_github.pushes()
    assert (push["repo"], push["credential"], push["repositories"]) == ("acme/app", "installation", ["app"])
    assert push["permissions"] == {"contents": "write", "metadata": "read"}
    assert push["refs"]["refs/heads/agent/x"] == fake_github.git()["app"]["refs"]["refs/heads/agent/x"] == sha
    # The API host serves no git, as on GitHub.
    api = git_gw("ls-remote", "https://api.github.test/acme/app.git", token=token)
    assert api.returncode != 0
