"""A faithful fake of the GitHub REST API (v3) for the broker: App JWT → installation token → pull requests.

Run inside the `<prefix>-net` namespace (see airlock.verify.fakegithub_client.FakeGitHub):

    python -P -m airlock.verify.fakegithub --control /path/ctl.sock --cert leaf.crt --key leaf.key \
        --listen 192.0.2.20 --port 443 --app-id 4242 --app-public-key app.pub.pem --installation-id 777 \
        --owner acme [--static-token ghp_...]

What it models, as GitHub does it (status codes, error bodies {"message", "documentation_url", "status"}):
- App authentication: `Authorization: Bearer <JWT>` signed RS256 with the App's key; iss = app id, iat at most 60 s
  ahead, exp in the future and at most 10 minutes after both iat and now. Endpoints: GET /app,
  GET /app/installations/{id}, POST /app/installations/{id}/access_tokens (narrowed by repositories,
  repository_ids and permissions; 422 beyond what the installation has), GET /repos/{owner}/{repo}/installation.
- Installation tokens (ghs_…, one hour; `token_shape` "classic": 40 characters, or "jwt": some 520, a JWT after
  the prefix, as GitHub issues them since 2026-04-27) and an optional static token (a classic PAT: every repo, every
  permission), as `token X`, `Bearer X` or Basic auth. A repo the token does not cover is 404 (GitHub hides it), a
  missing permission 403 "Resource not accessible by integration". GET /installation/repositories,
  DELETE /installation/token (revoke).
- Pull requests on the owner's repos `app`, `other` and `hang`: POST/GET /repos/{owner}/{repo}/pulls,
  GET/PATCH /repos/{owner}/{repo}/pulls/{number} (`mergeable` is null until the first GET computes it). Their
  conversation: POST/GET /repos/{owner}/{repo}/issues/{number}/comments (`issues: write` or `pull_requests: write`
  to post, as GitHub takes for a pull request's number). Check runs: GET
  /repos/{owner}/{repo}/commits/{ref}/check-runs (`checks: read`; every commit has the runs of the `check_runs`
  setting, paged with per_page/page). Branches: main, release and every agent/* (agent/no-commits has
  no commits ahead of anything). The list's `head` filter needs `owner:branch`; a bare branch is silently ignored,
  as on GitHub. Creating on `hang` (or with the `hang` setting) sleeps `hang_seconds` (60) before answering.
- No User-Agent: 403 (GitHub requires one); an unsupported X-GitHub-Api-Version: 400.
- Git smart HTTP on the web host (https://github.test/{owner}/{repo}.git, `git http-backend` behind it, see
  airlock.verify.fakegit): Basic auth (any user, the token as password) or `token`/`Bearer`; no credential 401 with a
  Basic challenge, a repo the token does not cover 404, fetching needs `contents: read`, pushing `contents: write` (403
  otherwise). Every push is recorded with the credential that made it and the refs after it.

Every request is recorded (method, path, query, auth scheme, the raw credential and what it is, body, status). The
control socket speaks one JSON object per line: {"cmd": "ping" | "stats" | "reset" | "set" | "expire_tokens"};
"set" takes the settings in DEFAULTS as further keys; "reset" also resets every git repository to its base
commit. Prints READY on stdout once listening.

One module past 500 lines on purpose: it is one server process (`python -m airlock.verify.fakegithub`) whose
routes share one `State`, so every endpoint the broker calls, with GitHub's own errors, reads in one place; its git
side is fakegit.py and its client fakegithub_client.py."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import itertools
import json
import secrets
import ssl
import string
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import jwt
from aiohttp import web

from airlock.verify.control import Commands, listening_socket, serve_until_signalled, start_control
from airlock.verify.fakegit import Repos, http_backend

API_URL = "https://api.github.test"
WEB_HOST = "github.test"
WEB_URL = f"https://{WEB_HOST}"
DOCS = "https://docs.github.com/rest"
API_VERSIONS = ("2022-11-28",)
APP_SLUG = "airlock-app"
BOT_LOGIN = f"{APP_SLUG}[bot]"
PAT_LOGIN = "acme-ci"  # whose classic PAT --static-token stands for
REPOS = {"app": 100001, "other": 100002, "hang": 100003}  # name -> id; all private, default branch main
HANG_REPOS = ("hang",)
BRANCHES = ("main", "release", "agent/feature-1", "agent/feature-2", "agent/no-commits")
BRANCH_PREFIX = "agent/"  # every agent/* branch exists too, with commits ahead of main
NO_COMMITS = ("agent/no-commits",)
INSTALLATION_PERMISSIONS = {
    "pull_requests": "write", "contents": "write", "metadata": "read", "issues": "write", "checks": "read",
}  # fmt: skip
LEVELS = {"read": 1, "write": 2, "admin": 3}
TOKEN_ALPHABET = string.ascii_letters + string.digits
JWT_MAX_LIFETIME = 600
JWT_IAT_SKEW = 60
DEFAULTS: dict[str, Any] = {
    "hang": False,  # every create-PR call hangs (as on the `hang` repo)
    "hang_after_create": False,  # ...after the PR was created: the client times out, yet the PR exists
    "hang_seconds": 60.0,
    "fail_status": None,  # create-PR calls answer this status (5xx: server error; 403/429: rate limited)
    "token_fail_status": None,  # the same for installation-token requests
    "token_ttl": 3600,  # lifetime of installation tokens issued from now on, in seconds
    "token_shape": "classic",  # of installation tokens issued from now on: "classic" (ghs_ + 36) or "jwt" (~520)
    "check_runs": [],  # every commit's check runs: [{"name", "status", "conclusion"}]
}
MAX_CALLS = 10_000
MAX_BODY = 64 * 1024 * 1024  # a git push of a large bundle
GIT_SERVICES = {"git-upload-pack": ("contents", "read"), "git-receive-pack": ("contents", "write")}

JWT_UNDECODABLE = "A JSON web token could not be decoded"
JWT_NO_ISS = "Missing 'issuer' claim ('iss') in assertion"
JWT_BAD_ISS = "'Issuer' claim ('iss') must be an Integer"
JWT_BAD_IAT = "'Issued at' claim ('iat') must be an Integer representing the time that the assertion was issued"
JWT_BAD_EXP = (
    "'Expiration time' claim ('exp') must be a numeric value representing the future time at which the assertion "
    "expires"
)
JWT_EXP_TOO_FAR = "'Expiration time' claim ('exp') is too far in the future"
NOT_ACCESSIBLE = "Resource not accessible by integration"
UNKNOWN_REPOS = "There is at least one repository that does not exist or is not accessible to the parent installation."
NO_USER_AGENT = (
    "Request forbidden by administrative rules. Please make sure your request has a User-Agent header "
    "(https://docs.github.com/en/rest/overview/resources-in-the-rest-api#user-agent-required). "
    "Check https://developer.github.com for other possible causes.\n"
)


def log(msg: str) -> None:
    print(f"fakegithub: {msg}", file=sys.stderr, flush=True)


def iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def sha(*parts: str) -> str:
    return hashlib.sha1("/".join(parts).encode()).hexdigest()


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        errors: list[dict[str, Any]] | None = None,
        docs: str = DOCS,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.errors, self.docs = status, message, errors, docs
        self.headers = headers or {}

    def response(self) -> web.Response:
        body: dict[str, Any] = {"message": self.message}
        if self.errors is not None:
            body["errors"] = self.errors
        body["documentation_url"] = self.docs
        body["status"] = str(self.status)  # GitHub sends it as a string
        return json_response(body, self.status, self.headers)


def not_found(docs: str = DOCS) -> ApiError:
    return ApiError(404, "Not Found", docs=docs)


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(data).encode(),
        content_type="application/json",
        charset="utf-8",
        headers=headers,
    )


# --------------------------------------------------------------------------------------------------- state


@dataclass
class Token:
    token: str
    kind: str  # "installation" | "static"
    permissions: dict[str, str]
    repositories: list[str] | None  # None: every repo of the owner
    expires_at: float | None  # None: never (the static token)
    issued_at: float = field(default_factory=time.time)
    installation_id: int | None = None
    revoked: bool = False

    @property
    def login(self) -> str:
        return BOT_LOGIN if self.kind == "installation" else PAT_LOGIN

    def valid(self) -> bool:
        return not self.revoked and (self.expires_at is None or time.time() < self.expires_at)

    def covers(self, repo: str) -> bool:
        return self.repositories is None or repo in self.repositories

    def allows(self, permission: str, level: str) -> bool:
        return LEVELS.get(self.permissions.get(permission, ""), 0) >= LEVELS[level]

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["expires_at_iso"] = iso(self.expires_at) if self.expires_at else None
        out["repository_selection"] = "all" if self.repositories is None else "selected"
        return out


@dataclass
class State:
    owner: str
    app_id: int
    client_id: str | None
    public_key: str
    installation_id: int
    static_token: str | None
    repos: Repos
    calls: list[dict[str, Any]] = field(default_factory=list)
    tokens: dict[str, Token] = field(default_factory=dict)
    prs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # repo -> PR objects, numbered from 1
    pr_log: list[dict[str, Any]] = field(default_factory=list)
    comments: list[dict[str, Any]] = field(default_factory=list)  # on pull requests, with who posted them
    pushes: list[dict[str, Any]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=lambda: dict(DEFAULTS))
    connections: int = 0
    call_ids: itertools.count[int] = field(default_factory=itertools.count)

    def reset(self) -> None:
        self.calls.clear()
        self.tokens.clear()
        self.prs.clear()
        self.pr_log.clear()
        self.comments.clear()
        self.pushes.clear()
        self.settings = dict(DEFAULTS)
        self.connections = 0
        self.repos.reset()

    def snapshot(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "prs": self.pr_log,
            "comments": self.comments,
            "tokens": [t.describe() for t in self.tokens.values()],
            "git": self.repos.info(),
            "pushes": self.pushes,
            "connections": self.connections,
            "settings": self.settings,
        }

    def lookup(self, value: str | None) -> Token | None:
        if not value:
            return None
        if self.static_token and secrets.compare_digest(value.encode(), self.static_token.encode()):
            return Token(value, "static", {p: "admin" for p in INSTALLATION_PERMISSIONS}, None, None, 0.0)
        return self.tokens.get(value)

    def classify(self, value: str | None) -> str | None:
        if not value:
            return None
        if looks_like_jwt(value):
            return "app_jwt"
        token = self.lookup(value)
        return token.kind if token else "unknown"

    def canonical_repo(self, owner: str, repo: str) -> str | None:
        """The repo's canonical name when `owner/repo` exists (names are case-insensitive, as on GitHub)."""
        if owner.lower() != self.owner.lower():
            return None
        return next((name for name in REPOS if name == repo.lower()), None)


STATE = web.AppKey("state", State)


def looks_like_jwt(value: str) -> bool:
    return value.count(".") == 2 and value.startswith("eyJ")


def branch_exists(ref: str) -> bool:
    return ref in BRANCHES or (ref.startswith(BRANCH_PREFIX) and len(ref) > len(BRANCH_PREFIX))


# --------------------------------------------------------------------------------------------------- objects


def user_object(login: str) -> dict[str, Any]:
    bot = login.endswith("[bot]")
    uid = 41898282 if bot else 5001
    return {
        "login": login,
        "id": uid,
        "node_id": base64.b64encode(f"04:User{uid}".encode()).decode(),
        "avatar_url": f"https://avatars.githubusercontent.test/u/{uid}?v=4",
        "url": f"{API_URL}/users/{login}",
        "html_url": f"{WEB_URL}/{'apps/' + login.removesuffix('[bot]') if bot else login}",
        "type": "Bot" if bot else "User",
        "site_admin": False,
    }


def owner_object(owner: str) -> dict[str, Any]:
    return {
        "login": owner,
        "id": 90001,
        "node_id": "O_kgDOAAFfkQ",
        "avatar_url": "https://avatars.githubusercontent.test/u/90001?v=4",
        "url": f"{API_URL}/orgs/{owner}",
        "html_url": f"{WEB_URL}/{owner}",
        "type": "Organization",
        "site_admin": False,
    }


def repo_object(owner: str, name: str) -> dict[str, Any]:
    full = f"{owner}/{name}"
    return {
        "id": REPOS[name],
        "node_id": base64.b64encode(f"010:Repository{REPOS[name]}".encode()).decode(),
        "name": name,
        "full_name": full,
        "private": True,
        "owner": owner_object(owner),
        "html_url": f"{WEB_URL}/{full}",
        "description": None,
        "fork": False,
        "url": f"{API_URL}/repos/{full}",
        "pulls_url": f"{API_URL}/repos/{full}/pulls{{/number}}",
        "default_branch": "main",
        "visibility": "private",
    }


def app_object(state: State) -> dict[str, Any]:
    return {
        "id": state.app_id,
        "client_id": state.client_id,
        "slug": APP_SLUG,
        "node_id": "A_kwDOAAFfkc4AAQ",
        "owner": owner_object(state.owner),
        "name": APP_SLUG,
        "description": "airlock credential broker (fake)",
        "external_url": f"{WEB_URL}/{state.owner}",
        "html_url": f"{WEB_URL}/apps/{APP_SLUG}",
        "created_at": "2024-01-01T00:00:00Z",
        "updated_at": "2024-01-01T00:00:00Z",
        "permissions": INSTALLATION_PERMISSIONS,
        "events": ["pull_request"],
        "installations_count": 1,
    }


def installation_object(state: State) -> dict[str, Any]:
    iid = state.installation_id
    return {
        "id": iid,
        "account": owner_object(state.owner),
        "repository_selection": "all",
        "access_tokens_url": f"{API_URL}/app/installations/{iid}/access_tokens",
        "repositories_url": f"{API_URL}/installation/repositories",
        "html_url": f"{WEB_URL}/organizations/{state.owner}/settings/installations/{iid}",
        "app_id": state.app_id,
        "app_slug": APP_SLUG,
        "target_id": 90001,
        "target_type": "Organization",
        "permissions": INSTALLATION_PERMISSIONS,
        "events": ["pull_request"],
        "created_at": "2024-01-01T00:00:00Z",
        "updated_at": "2024-01-01T00:00:00Z",
        "single_file_name": None,
        "has_multiple_single_files": False,
        "single_file_paths": [],
        "suspended_by": None,
        "suspended_at": None,
    }


def branch_object(owner: str, repo: str, ref: str, login: str) -> dict[str, Any]:
    return {
        "label": f"{owner}:{ref}",
        "ref": ref,
        "sha": sha(owner, repo, ref),
        "user": owner_object(owner),
        "repo": repo_object(owner, repo),
    }


def pr_object(owner: str, repo: str, number: int, fields: dict[str, Any], login: str) -> dict[str, Any]:
    full = f"{owner}/{repo}"
    api, html = f"{API_URL}/repos/{full}/pulls/{number}", f"{WEB_URL}/{full}/pull/{number}"
    now = iso(time.time())
    return {
        "url": api,
        "id": 2_000_000 + REPOS[repo] * 1000 + number,
        "node_id": base64.b64encode(f"011:PullRequest{REPOS[repo]}{number}".encode()).decode(),
        "html_url": html,
        "diff_url": f"{html}.diff",
        "patch_url": f"{html}.patch",
        "issue_url": f"{API_URL}/repos/{full}/issues/{number}",
        "commits_url": f"{api}/commits",
        "review_comments_url": f"{api}/comments",
        "comments_url": f"{API_URL}/repos/{full}/issues/{number}/comments",
        "statuses_url": f"{API_URL}/repos/{full}/statuses/{sha(owner, repo, fields['head'])}",
        "number": number,
        "state": "open",
        "locked": False,
        "title": fields["title"],
        "user": user_object(login),
        "body": fields.get("body"),
        "labels": [],
        "milestone": None,
        "active_lock_reason": None,
        "created_at": now,
        "updated_at": now,
        "closed_at": None,
        "merged_at": None,
        "merge_commit_sha": None,
        "assignee": None,
        "assignees": [],
        "requested_reviewers": [],
        "requested_teams": [],
        "head": branch_object(owner, repo, fields["head"], login),
        "base": branch_object(owner, repo, fields["base"], login),
        "_links": {
            "self": {"href": api},
            "html": {"href": html},
            "issue": {"href": f"{API_URL}/repos/{full}/issues/{number}"},
            "comments": {"href": f"{API_URL}/repos/{full}/issues/{number}/comments"},
            "review_comments": {"href": f"{api}/comments"},
            "commits": {"href": f"{api}/commits"},
        },
        "author_association": "NONE" if login.endswith("[bot]") else "MEMBER",
        "auto_merge": None,
        "draft": bool(fields.get("draft", False)),
        "merged": False,
        "mergeable": None,
        "rebaseable": None,
        "mergeable_state": "unknown",
        "merged_by": None,
        "comments": 0,
        "review_comments": 0,
        "maintainer_can_modify": bool(fields.get("maintainer_can_modify", False)),
        "commits": 1,
        "additions": 1,
        "deletions": 0,
        "changed_files": 1,
    }


# --------------------------------------------------------------------------------------------------- auth


def credential(request: web.Request) -> tuple[str | None, str | None]:
    """(scheme, credential) from the Authorization header; Basic auth's password is the token (git's style)."""
    header = request.headers.get("Authorization")
    if header is None:
        return None, None
    scheme, _, value = header.strip().partition(" ")
    scheme, value = scheme.lower(), value.strip()
    if scheme == "basic":
        try:
            value = base64.b64decode(value, validate=True).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            value = ""
    return scheme, value or None


def _integer(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer()


def verify_app_jwt(state: State, value: str | None) -> dict[str, Any]:
    """The claims of a valid App JWT, else ApiError 401 with GitHub's message for what is wrong."""
    claims = _signed_claims(state, value)
    now = time.time()
    iat: Any = claims.get("iat")
    exp: Any = claims.get("exp")
    if not _integer(iat) or iat > now + JWT_IAT_SKEW:
        raise ApiError(401, JWT_BAD_IAT)
    if not _integer(exp) or exp <= now:
        raise ApiError(401, JWT_BAD_EXP)
    if exp - iat > JWT_MAX_LIFETIME or exp - now > JWT_MAX_LIFETIME:
        raise ApiError(401, JWT_EXP_TOO_FAR)
    return claims


def _signed_claims(state: State, value: str | None) -> dict[str, Any]:
    """The claims of a JWT this App signed (its issuer checked first, as GitHub looks the key up by it)."""
    if not value or not looks_like_jwt(value):
        raise ApiError(401, JWT_UNDECODABLE)
    try:
        header = jwt.get_unverified_header(value)
        claims: dict[str, Any] = jwt.decode(value, options={"verify_signature": False})
    except jwt.PyJWTError:
        raise ApiError(401, JWT_UNDECODABLE) from None
    if header.get("alg") != "RS256":
        raise ApiError(401, JWT_UNDECODABLE)
    iss = claims.get("iss")
    if iss is None:
        raise ApiError(401, JWT_NO_ISS)
    if state.client_id is not None and iss == state.client_id:
        pass  # GitHub also accepts the App's client ID as issuer
    elif isinstance(iss, bool) or not (isinstance(iss, int) or (isinstance(iss, str) and iss.isdigit())):
        raise ApiError(401, JWT_BAD_ISS)
    elif int(iss) != state.app_id:
        raise ApiError(401, JWT_UNDECODABLE)  # GitHub looks the key up by iss: another app's key never verifies
    try:
        # Only the signature here; GitHub's own claim checks (and messages) follow.
        skip: jwt.types.Options = {
            "verify_exp": False, "verify_iat": False, "verify_nbf": False, "verify_aud": False, "verify_iss": False,
            "verify_sub": False, "verify_jti": False,
        }  # fmt: skip
        jwt.decode(value, state.public_key, algorithms=["RS256"], options=skip)
    except jwt.PyJWTError:
        raise ApiError(401, JWT_UNDECODABLE) from None
    return claims


def repo_token(request: web.Request, permission: str, level: str, docs: str, *alternatives: str) -> tuple[str, Token]:
    """Authorise a repository call: (canonical repo name, token). Order as on GitHub: 401, 404, 403. Any of
    `alternatives` (further permissions) at `level` will do as well."""
    state = request.app[STATE]
    owner, repo = request.match_info["owner"], request.match_info["repo"]
    scheme, value = credential(request)
    if scheme is None:
        raise ApiError(401, "Requires authentication", docs=docs)
    if scheme not in ("token", "bearer", "basic"):
        raise ApiError(401, "Bad credentials")
    if value and looks_like_jwt(value):
        verify_app_jwt(state, value)
        raise ApiError(403, NOT_ACCESSIBLE, docs=docs)  # the App itself is no repository actor
    token = state.lookup(value)
    if token is None or not token.valid():
        raise ApiError(401, "Bad credentials")
    name = state.canonical_repo(owner, repo)
    if name is None or not token.covers(name):
        raise not_found(docs)
    if not any(token.allows(p, level) for p in (permission, *alternatives)):
        raise ApiError(403, NOT_ACCESSIBLE, docs=docs)
    return name, token


def installation_token(request: web.Request, docs: str) -> Token:
    state = request.app[STATE]
    scheme, value = credential(request)
    if scheme is None:
        raise ApiError(401, "Requires authentication", docs=docs)
    token = state.lookup(value) if value and not looks_like_jwt(value) else None
    if token is None or not token.valid():
        raise ApiError(401, "Bad credentials")
    if token.kind != "installation":
        raise ApiError(
            403, "You must authenticate with an installation access token in order to use this endpoint.", docs=docs
        )
    return token


def app_jwt(request: web.Request) -> dict[str, Any]:
    state = request.app[STATE]
    scheme, value = credential(request)
    if scheme not in ("bearer", "token"):
        raise ApiError(401, JWT_UNDECODABLE)
    return verify_app_jwt(state, value)


# --------------------------------------------------------------------------------------------------- bodies


async def json_object(request: web.Request, docs: str, optional: bool = False) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip() and optional:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise ApiError(400, "Problems parsing JSON", docs=docs) from None
    if not isinstance(body, dict):
        raise ApiError(400, "Body should be a JSON object", docs=docs)
    return body


def check_types(body: dict[str, Any], schema: dict[str, tuple[type | None, ...]], docs: str) -> None:
    names = {str: "string", bool: "boolean", int: "integer", list: "array", dict: "object", type(None): "null"}
    for name, allowed in schema.items():
        if name not in body:
            continue
        value = body[name]
        kinds = tuple(type(None) if t is None else t for t in allowed)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            wanted = "/".join(names[k] for k in kinds)
            message = f"Invalid request.\n\nFor 'properties/{name}', {json.dumps(value)} is not a {wanted}."
            raise ApiError(422, message, docs=docs)


# --------------------------------------------------------------------------------------------------- handlers

DOC_TOKENS = "https://docs.github.com/rest/apps/apps#create-an-installation-access-token-for-an-app"
DOC_REPO_INSTALLATION = "https://docs.github.com/rest/apps/apps#get-a-repository-installation-for-the-authenticated-app"
DOC_CREATE_PR = "https://docs.github.com/rest/pulls/pulls#create-a-pull-request"
DOC_LIST_PRS = "https://docs.github.com/rest/pulls/pulls#list-pull-requests"
DOC_GET_PR = "https://docs.github.com/rest/pulls/pulls#get-a-pull-request"
DOC_UPDATE_PR = "https://docs.github.com/rest/pulls/pulls#update-a-pull-request"
DOC_COMMENTS = "https://docs.github.com/rest/issues/comments#create-an-issue-comment"
DOC_LIST_COMMENTS = "https://docs.github.com/rest/issues/comments#list-issue-comments"
DOC_CHECK_RUNS = "https://docs.github.com/rest/checks/runs#list-check-runs-for-a-git-reference"
DOC_INSTALLATION_REPOS = (
    "https://docs.github.com/rest/apps/installations#list-repositories-accessible-to-the-app-installation"
)
DOC_REVOKE = "https://docs.github.com/rest/apps/installations#revoke-an-installation-access-token"


async def get_app(request: web.Request) -> web.Response:
    app_jwt(request)
    return json_response(app_object(request.app[STATE]))


async def get_installation(request: web.Request) -> web.Response:
    state = request.app[STATE]
    app_jwt(request)
    if request.match_info["installation_id"] != str(state.installation_id):
        raise not_found("https://docs.github.com/rest/apps/apps#get-an-installation-for-the-authenticated-app")
    return json_response(installation_object(state))


async def create_access_token(request: web.Request) -> web.Response:
    state = request.app[STATE]
    app_jwt(request)
    if request.match_info["installation_id"] != str(state.installation_id):
        raise not_found(DOC_TOKENS)
    fail_if_set(state, "token_fail_status", DOC_TOKENS)
    body = await json_object(request, DOC_TOKENS, optional=True)
    check_types(body, {"repositories": (list,), "repository_ids": (list,), "permissions": (dict,)}, DOC_TOKENS)
    names = body.get("repositories") or []
    ids = body.get("repository_ids") or []
    selected: list[str] | None = None
    if names or ids:
        by_id = {rid: name for name, rid in REPOS.items()}
        wanted = [n.lower() if isinstance(n, str) else None for n in names]
        wanted += [by_id.get(i) if isinstance(i, int) else None for i in ids]
        if any(n not in REPOS for n in wanted):
            raise ApiError(422, UNKNOWN_REPOS, docs=DOC_TOKENS)
        selected = sorted(set(wanted), key=list(REPOS).index)  # type: ignore[arg-type]
    requested: dict[str, Any] = body.get("permissions") or {}
    if requested:
        for name, level in requested.items():
            granted = INSTALLATION_PERMISSIONS.get(name)
            if granted is None or not isinstance(level, str) or LEVELS.get(level, 99) > LEVELS[granted]:
                raise ApiError(422, "The permissions requested are not granted to this installation.", docs=DOC_TOKENS)
        permissions = {"metadata": "read", **requested}  # metadata read comes with every installation token
    else:
        permissions = dict(INSTALLATION_PERMISSIONS)
    expires = time.time() + float(state.settings["token_ttl"])
    value = new_installation_token(state.settings["token_shape"], state.installation_id, expires)
    state.tokens[value] = Token(
        value, "installation", permissions, selected, expires, installation_id=state.installation_id
    )
    answer: dict[str, Any] = {
        "token": value,
        "expires_at": iso(expires),
        "permissions": permissions,
        "repository_selection": "all" if selected is None else "selected",
    }
    if selected is not None:
        answer["repositories"] = [repo_object(state.owner, name) for name in selected]
    return json_response(answer, 201)


def new_installation_token(shape: str, installation_id: int, expires: float) -> str:
    """`ghs_` and 36 alphanumerics (classic), or `ghs_` and a JWT signed RS256 (its claims and a 256-byte signature
    make some 520 characters of base64url and dots)."""
    if shape == "classic":
        return "ghs_" + "".join(secrets.choice(TOKEN_ALPHABET) for _ in range(36))
    now = int(time.time())
    claims = {"iss": APP_SLUG, "sub": f"installation:{installation_id}", "jti": secrets.token_hex(8), "iat": now,
              "exp": int(expires)}  # fmt: skip
    parts = ({"alg": "RS256", "typ": "JWT"}, claims)
    encoded = [base64.urlsafe_b64encode(json.dumps(p, separators=(",", ":")).encode()) for p in parts]
    encoded.append(base64.urlsafe_b64encode(secrets.token_bytes(256)))
    return "ghs_" + ".".join(part.rstrip(b"=").decode() for part in encoded)


async def get_repo_installation(request: web.Request) -> web.Response:
    state = request.app[STATE]
    app_jwt(request)
    if state.canonical_repo(request.match_info["owner"], request.match_info["repo"]) is None:
        raise not_found(DOC_REPO_INSTALLATION)
    return json_response(installation_object(state))


async def list_installation_repos(request: web.Request) -> web.Response:
    state = request.app[STATE]
    token = installation_token(request, DOC_INSTALLATION_REPOS)
    names = list(REPOS) if token.repositories is None else token.repositories
    return json_response(
        {
            "total_count": len(names),
            "repository_selection": "all" if token.repositories is None else "selected",
            "repositories": [repo_object(state.owner, name) for name in names],
        }
    )


async def revoke_token(request: web.Request) -> web.Response:
    token = installation_token(request, DOC_REVOKE)
    token.revoked = True
    return web.Response(status=204)


def fail_if_set(state: State, setting: str, docs: str) -> None:
    status = state.settings[setting]
    if status is None:
        return
    status = int(status)
    if status in (403, 429):
        reset = int(time.time()) + 60
        headers = {"Retry-After": "60", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(reset)}
        message = f"API rate limit exceeded for installation ID {state.installation_id}."
        raise ApiError(status, message, docs=DOCS, headers=headers)
    raise ApiError(status, "Server Error" if status == 500 else HTTPStatus(status).phrase, docs=docs)


async def create_pull(request: web.Request) -> web.Response:
    state = request.app[STATE]
    repo, token = repo_token(request, "pull_requests", "write", DOC_CREATE_PR)
    owner = state.owner
    fail_if_set(state, "fail_status", DOC_CREATE_PR)
    hang = state.settings["hang"] or repo in HANG_REPOS
    if hang and not state.settings["hang_after_create"]:
        await hold(request)
    body = await json_object(request, DOC_CREATE_PR)
    schema: dict[str, tuple[type | None, ...]] = {
        "title": (str,),
        "head": (str,),
        "base": (str,),
        "body": (str, None),
        "draft": (bool,),
        "maintainer_can_modify": (bool,),
    }
    check_types(body, schema, DOC_CREATE_PR)
    missing = [name for name in ("title", "head", "base") if not body.get(name)]
    if missing:
        errors = [{"resource": "PullRequest", "code": "missing_field", "field": name} for name in missing]
        raise ApiError(422, "Validation Failed", errors, DOC_CREATE_PR)
    head_owner, _, head = body["head"].rpartition(":")
    base = body["base"]
    errors = []
    if (head_owner and head_owner.lower() != owner.lower()) or not branch_exists(head):  # owner:branch or branch
        errors.append({"resource": "PullRequest", "field": "head", "code": "invalid"})
    if not branch_exists(base):
        errors.append({"resource": "PullRequest", "field": "base", "code": "invalid"})
    if errors:
        raise ApiError(422, "Validation Failed", errors, DOC_CREATE_PR)
    if head in NO_COMMITS or head == base:
        custom = {"resource": "PullRequest", "code": "custom", "message": f"No commits between {base} and {head}"}
        raise ApiError(422, "Validation Failed", [custom], DOC_CREATE_PR)
    pulls = state.prs.setdefault(repo, [])
    if any(p["state"] == "open" and p["head"]["ref"] == head and p["base"]["ref"] == base for p in pulls):
        message = f"A pull request already exists for {owner}:{head}."
        custom = {"resource": "PullRequest", "code": "custom", "message": message}
        raise ApiError(422, "Validation Failed", [custom], DOC_CREATE_PR)
    fields = {**body, "head": head}
    pr = pr_object(owner, repo, len(pulls) + 1, fields, token.login)
    pr["head"]["sha"] = state.repos.refs(repo).get(f"refs/heads/{head}", pr["head"]["sha"])  # pushed: the real one
    pulls.append(pr)
    state.pr_log.append(
        {
            "repo": f"{owner}/{repo}",
            "number": pr["number"],
            "title": pr["title"],
            "head": head,
            "head_sha": pr["head"]["sha"],
            "base": base,
            "body": pr["body"],
            "draft": pr["draft"],
            "state": "open",
            "user": token.login,
            "token": token.token,
            "credential": token.kind,
            "html_url": pr["html_url"],
            "url": pr["url"],
        }
    )
    if hang:
        await hold(request)
    return json_response(pr, 201, {"Location": pr["url"]})


async def hold(request: web.Request) -> None:
    request["call"]["hung"] = True
    await asyncio.sleep(float(request.app[STATE].settings["hang_seconds"]))


async def list_pulls(request: web.Request) -> web.Response:
    state = request.app[STATE]
    repo, _ = repo_token(request, "pull_requests", "read", DOC_LIST_PRS)
    query = request.query
    wanted_state = query.get("state", "open")
    if wanted_state not in ("open", "closed", "all"):
        errors = [{"resource": "Issue", "field": "state", "code": "invalid"}]
        raise ApiError(422, "Validation Failed", errors, DOC_LIST_PRS)
    pulls = list(state.prs.get(repo, []))
    if wanted_state != "all":
        pulls = [p for p in pulls if p["state"] == wanted_state]
    head = query.get("head", "")
    if ":" in head:  # a bare branch name is silently ignored by GitHub: the filter needs owner:branch
        head_owner, _, ref = head.partition(":")
        pulls = [p for p in pulls if head_owner.lower() == state.owner.lower() and p["head"]["ref"] == ref]
    if "base" in query:
        pulls = [p for p in pulls if p["base"]["ref"] == query["base"]]
    if query.get("direction", "desc") == "desc":
        pulls.reverse()
    try:
        per_page = max(1, min(int(query.get("per_page", 30)), 100))
        page = max(1, int(query.get("page", 1)))
    except ValueError:
        per_page, page = 30, 1
    return json_response(pulls[(page - 1) * per_page : page * per_page])


def find_pull(request: web.Request, repo: str, docs: str) -> dict[str, Any]:
    pulls = request.app[STATE].prs.get(repo, [])
    number = request.match_info["number"]
    if not number.isdigit() or not 1 <= int(number) <= len(pulls):
        raise not_found(docs)
    return pulls[int(number) - 1]


async def get_pull(request: web.Request) -> web.Response:
    repo, _ = repo_token(request, "pull_requests", "read", DOC_GET_PR)
    pr = find_pull(request, repo, DOC_GET_PR)
    if pr["mergeable"] is None and pr["state"] == "open":  # GitHub computes it in the background
        pr.update(mergeable=True, mergeable_state="clean", rebaseable=True)
    return json_response(pr)


def comment_object(owner: str, repo: str, number: int, comment_id: int, body: str, login: str) -> dict[str, Any]:
    full, now = f"{owner}/{repo}", iso(time.time())
    return {
        "id": comment_id,
        "node_id": base64.b64encode(f"012:IssueComment{comment_id}".encode()).decode(),
        "url": f"{API_URL}/repos/{full}/issues/comments/{comment_id}",
        "html_url": f"{WEB_URL}/{full}/pull/{number}#issuecomment-{comment_id}",
        "issue_url": f"{API_URL}/repos/{full}/issues/{number}",
        "body": body,
        "user": user_object(login),
        "created_at": now,
        "updated_at": now,
        "author_association": "NONE" if login.endswith("[bot]") else "MEMBER",
    }


async def create_comment(request: web.Request) -> web.Response:
    state = request.app[STATE]
    # A pull request's number: GitHub takes either permission (a plain issue's would need `issues`).
    repo, token = repo_token(request, "issues", "write", DOC_COMMENTS, "pull_requests")
    pr = find_pull(request, repo, DOC_COMMENTS)
    body = await json_object(request, DOC_COMMENTS)
    check_types(body, {"body": (str,)}, DOC_COMMENTS)
    if not body.get("body"):
        missing = {"resource": "IssueComment", "code": "missing_field", "field": "body"}
        raise ApiError(422, "Validation Failed", [missing], DOC_COMMENTS)
    comment_id = 3_000_000 + len(state.comments) + 1
    comment = comment_object(state.owner, repo, pr["number"], comment_id, body["body"], token.login)
    pr["comments"] += 1
    state.comments.append(
        {"repo": f"{state.owner}/{repo}", "number": pr["number"], "id": comment_id, "body": body["body"],
         "user": token.login, "credential": token.kind, "permissions": token.permissions,
         "repositories": token.repositories, "comment": comment}
    )  # fmt: skip
    return json_response(comment, 201, {"Location": comment["url"]})


async def list_comments(request: web.Request) -> web.Response:
    state = request.app[STATE]
    repo, _ = repo_token(request, "issues", "read", DOC_LIST_COMMENTS, "pull_requests")
    pr = find_pull(request, repo, DOC_LIST_COMMENTS)
    here = f"{state.owner}/{repo}"
    return json_response([c["comment"] for c in state.comments if (c["repo"], c["number"]) == (here, pr["number"])])


async def list_check_runs(request: web.Request) -> web.Response:
    state = request.app[STATE]
    repo, _ = repo_token(request, "checks", "read", DOC_CHECK_RUNS)
    ref = request.match_info["ref"]
    refs = state.repos.refs(repo)
    commit = refs.get(f"refs/heads/{ref}", ref)
    if not (len(commit) == 40 and all(c in "0123456789abcdef" for c in commit)):
        raise ApiError(422, f"No commit found for SHA: {ref}", docs=DOC_CHECK_RUNS)
    try:
        per_page = max(1, min(int(request.query.get("per_page", 30)), 100))
        page = max(1, int(request.query.get("page", 1)))
    except ValueError:
        per_page, page = 30, 1
    runs = [
        {"id": 4_000_000 + n, "head_sha": commit, "name": run["name"], "status": run["status"],
         "conclusion": run.get("conclusion"), "html_url": f"{WEB_URL}/{state.owner}/{repo}/runs/{4_000_000 + n}",
         "app": {"slug": "github-actions"}}
        for n, run in enumerate(state.settings["check_runs"], 1)
    ]  # fmt: skip
    return json_response({"total_count": len(runs), "check_runs": runs[(page - 1) * per_page : page * per_page]})


async def update_pull(request: web.Request) -> web.Response:
    state = request.app[STATE]
    repo, _ = repo_token(request, "pull_requests", "write", DOC_UPDATE_PR)
    pr = find_pull(request, repo, DOC_UPDATE_PR)
    body = await json_object(request, DOC_UPDATE_PR)
    check_types(body, {"title": (str,), "body": (str, None), "state": (str,), "base": (str,)}, DOC_UPDATE_PR)
    if body.get("state", "open") not in ("open", "closed"):
        raise ApiError(422, "Validation Failed", [{"resource": "PullRequest", "field": "state", "code": "invalid"}])
    for name in ("title", "body", "state"):
        if name in body:
            pr[name] = body[name]
    pr["updated_at"] = iso(time.time())
    pr["closed_at"] = pr["updated_at"] if pr["state"] == "closed" else None
    for entry in state.pr_log:
        if entry["repo"] == f"{state.owner}/{repo}" and entry["number"] == pr["number"]:
            entry.update({k: pr[k] for k in ("title", "body", "state")})
    return json_response(pr)


# --------------------------------------------------------------------------------------------------- git


def git_text(status: int, text: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=text + "\n", headers=headers)


def git_token(request: web.Request) -> Token | web.Response:
    """The token of a git request, or GitHub's refusal (a Basic challenge, so git would ask for a password)."""
    state = request.app[STATE]
    scheme, value = credential(request)
    token = state.lookup(value) if value and not looks_like_jwt(value) else None
    if scheme not in ("basic", "token", "bearer") or token is None or not token.valid():
        return git_text(401, "Invalid username or token.", {"WWW-Authenticate": 'Basic realm="GitHub"'})
    return token


async def git_smart_http(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if request.host.partition(":")[0].lower() != WEB_HOST:
        raise not_found()  # git is served on the web host, not the API's
    owner, repo = request.match_info["owner"], request.match_info["repo"]
    service = request.match_info.get("service") or request.query.get("service", "")
    if service not in GIT_SERVICES:
        return git_text(403, "Dumb HTTP is not supported.")
    token = git_token(request)
    if isinstance(token, web.Response):
        return token
    name = state.canonical_repo(owner, repo)
    if name is None or not token.covers(name):
        return git_text(404, "Repository not found.")
    permission, level = GIT_SERVICES[service]
    if not token.allows(permission, level):
        return git_text(403, f"Permission to {state.owner}/{name}.git denied to {token.login}.")
    suffix = "info/refs" if request.path.endswith("/info/refs") else service
    sent = await request.read()
    status, headers, body = await http_backend(
        state.repos.root, f"/{state.owner}/{name}.git/{suffix}", request.method, request.query_string,
        sent, dict(request.headers), token.login, request.remote or "",
    )  # fmt: skip
    # A lone flush packet is git's probe before a large push, not a push.
    if service == "git-receive-pack" and request.method == "POST" and sent != b"0000":
        state.pushes.append(
            {"repo": f"{state.owner}/{name}", "status": status, "credential": token.kind, "token": token.token,
             "permissions": token.permissions, "repositories": token.repositories, "refs": state.repos.refs(name)}
        )  # fmt: skip
    return web.Response(status=status, body=body, headers=headers)


# --------------------------------------------------------------------------------------------------- plumbing

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def summarize_body(raw: bytes, content_type: str = "") -> Any:
    if not raw:
        return None
    if content_type.startswith("application/x-git"):
        return {"git_bytes": len(raw)}
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


@web.middleware
async def github_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    scheme, value = credential(request)
    call: dict[str, Any] = {
        "id": next(state.call_ids),
        "ts": time.time(),
        "method": request.method,
        "path": request.path,
        "query": dict(request.query),
        "auth_scheme": scheme,
        "token": value,
        "credential": state.classify(value),
        "user_agent": request.headers.get("User-Agent"),
        "accept": request.headers.get("Accept"),
        "api_version": request.headers.get("X-GitHub-Api-Version"),
        "host": request.headers.get("Host"),
        "client": request.remote,
        "body": summarize_body(await request.read(), request.content_type),
        "status": None,
        "hung": False,
        "response": None,
    }
    if len(state.calls) < MAX_CALLS:
        state.calls.append(call)
    request["call"] = call
    try:
        if not request.headers.get("User-Agent"):
            response: web.StreamResponse = web.Response(status=403, text=NO_USER_AGENT)
        elif (version := request.headers.get("X-GitHub-Api-Version")) and version not in API_VERSIONS:
            response = ApiError(400, f"API version {version!r} is not supported.").response()
        else:
            response = await handler(request)
    except ApiError as e:
        response = e.response()
    except web.HTTPException as e:  # aiohttp's own 404/405 for unknown routes: GitHub says 404 to both
        response = (not_found() if e.status in (404, 405) else ApiError(e.status, e.reason)).response()
    except asyncio.CancelledError:
        call["aborted"] = True  # the client went away (e.g. timed out on a hang)
        raise
    except Exception:
        log(f"{request.method} {request.path}: unexpected error\n{traceback.format_exc()}")
        response = ApiError(500, "Server Error").response()
    call["status"] = response.status
    if isinstance(response, web.Response):
        call["response"] = summarize_body(response.body, response.content_type)  # type: ignore[arg-type]
    response.headers.update(
        {
            "Server": "github.com",
            "X-GitHub-Media-Type": "github.v3; format=json",
            "X-GitHub-Api-Version-Selected": API_VERSIONS[0],
            "X-GitHub-Request-Id": secrets.token_hex(8).upper(),
            "X-RateLimit-Limit": "5000",
            "X-RateLimit-Resource": "core",
        }
    )
    response.headers.setdefault("X-RateLimit-Remaining", "4999")
    return response


def make_app(state: State) -> web.Application:
    app = web.Application(middlewares=[github_middleware], client_max_size=MAX_BODY)
    app[STATE] = state
    app.add_routes(
        [
            web.get("/app", get_app),
            web.get("/app/installations/{installation_id}", get_installation),
            web.post("/app/installations/{installation_id}/access_tokens", create_access_token),
            web.get("/repos/{owner}/{repo}/installation", get_repo_installation),
            web.get("/installation/repositories", list_installation_repos),
            web.delete("/installation/token", revoke_token),
            web.post("/repos/{owner}/{repo}/pulls", create_pull),
            web.get("/repos/{owner}/{repo}/pulls", list_pulls),
            web.get("/repos/{owner}/{repo}/pulls/{number}", get_pull),
            web.patch("/repos/{owner}/{repo}/pulls/{number}", update_pull),
            web.post("/repos/{owner}/{repo}/issues/{number}/comments", create_comment),
            web.get("/repos/{owner}/{repo}/issues/{number}/comments", list_comments),
            web.get("/repos/{owner}/{repo}/commits/{ref}/check-runs", list_check_runs),
            web.get("/{owner}/{repo}.git/info/refs", git_smart_http),
            web.post("/{owner}/{repo}.git/{service}", git_smart_http),
        ]
    )
    return app


def commands(state: State) -> Commands:
    """The control commands besides ping: {"cmd": "stats" | "reset" | "set" | "expire_tokens"}."""

    def answer(cmd: Any, request: dict[str, Any]) -> dict[str, Any] | None:
        if cmd == "stats":
            return state.snapshot()
        if cmd == "reset":
            state.reset()
            return {"ok": True}
        if cmd == "set":
            changes = {k: v for k, v in request.items() if k != "cmd"}
            unknown = sorted(set(changes) - set(DEFAULTS))
            if unknown:
                return {"error": f"unknown settings {unknown}; known: {sorted(DEFAULTS)}"}
            state.settings.update(changes)
            return {"ok": True, "settings": state.settings}
        if cmd == "expire_tokens":
            for token in state.tokens.values():
                token.expires_at = time.time() - 1
            return {"ok": True, "expired": len(state.tokens)}
        return None

    return answer


async def serve(args: argparse.Namespace) -> None:
    state = State(
        owner=args.owner,
        app_id=args.app_id,
        client_id=args.client_id,
        public_key=args.app_public_key.read_text(),
        installation_id=args.installation_id,
        static_token=args.static_token,
        repos=Repos(args.git_root, args.owner, REPOS),
    )
    state.repos.reset()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(args.cert, args.key)
    ctx.set_alpn_protocols(["http/1.1"])
    runner = web.AppRunner(make_app(state), access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    handler_factory = runner.server
    assert handler_factory is not None

    def protocol() -> Any:
        state.connections += 1  # counted at accept, so failed TLS handshakes count too
        return handler_factory()

    loop = asyncio.get_running_loop()
    sock = listening_socket(args.listen, args.port)
    server = await loop.create_server(protocol, sock=sock, ssl=ctx, ssl_handshake_timeout=10)
    ctl = await start_control(args.control, commands(state), log, json_default=str)

    await serve_until_signalled()

    server.close()
    ctl.close()
    with contextlib.suppress(Exception):
        await runner.cleanup()
    args.control.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", type=Path, required=True, help="unix socket path for the JSON control API")
    parser.add_argument("--cert", type=Path, required=True, help="TLS certificate (PEM) for api.github.test")
    parser.add_argument("--key", type=Path, required=True, help="TLS private key (PEM)")
    parser.add_argument("--listen", default="192.0.2.20", help="address to listen on")
    parser.add_argument("--port", type=int, default=443)
    parser.add_argument("--app-id", type=int, required=True, help="the GitHub App's id (the JWT's iss)")
    parser.add_argument("--client-id", default=None, help="the App's client ID, also accepted as iss")
    parser.add_argument("--app-public-key", type=Path, required=True, help="PEM file: the App key's public half")
    parser.add_argument("--installation-id", type=int, required=True, help="the App's installation on --owner")
    parser.add_argument("--owner", default="acme", help="the organisation that owns the repos")
    parser.add_argument("--static-token", default=None, help="a classic PAT accepted for every repo")
    parser.add_argument("--git-root", type=Path, required=True, help="directory for the bare git repositories")
    asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
