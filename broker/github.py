"""The broker's GitHub client: the real credential lives here and never leaves.

App mode mints an App JWT (RS256, 10 minutes at most), exchanges it for an installation token narrowed to the
one repository and the permission the tool needs, and caches that token until shortly before it expires.
Static mode uses a token read from a file or an environment variable of the gateway host.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Self

import aiohttp
import jwt
from jwt.algorithms import RSAAlgorithm

from .redact import Redactor, clip
from .shapes import (
    BOOL,
    COUNT,
    CREDENTIAL,
    MAYBE_BOOL,
    OBJECT_ID,
    POSITIVE_INT,
    TEXT,
    TIMESTAMP,
    WEB_URL,
    Shape,
    ShapeError,
    conforming,
    loads,
    one_of,
)

PR_PERMISSIONS = {"pull_requests": "write"}
READ_PULLS = {"pull_requests": "read"}
READ_CHECKS = {"checks": "read"}
# A pull request's conversation is an issue's: GitHub takes `issues: write` or `pull_requests: write` for its
# comments. The latter is the token the broker already holds for pull requests, and gives no power over plain issues.
COMMENT_PERMISSIONS = PR_PERMISSIONS
READ_CONTENTS = {"contents": "read"}
WRITE_CONTENTS = {"contents": "write"}
TOKEN_REFRESH_MARGIN = 300  # seconds before expiry when a cached installation token is replaced
ACCEPT = "application/vnd.github+json"
# A pull request is some 30 KB; the lookup of an existing one lists a few. Reading stops past this.
MAX_UPSTREAM_BYTES = 1024 * 1024
MAX_UPSTREAM_DEPTH = 32  # GitHub's objects nest 5 or 6 deep
MAX_MESSAGE = 1000  # characters of GitHub's error text passed on (an App JWT echoed back fits, redacted)

# What the broker reads of GitHub's answers; anything else in them is ignored.
PULL_REQUEST: Shape = {
    "number": POSITIVE_INT, "url": WEB_URL, "html_url": WEB_URL, "state": TEXT, "draft": BOOL,
    "head": {"ref": TEXT}, "base": {"ref": TEXT},
}  # fmt: skip
PULL_STATUS: Shape = {
    **PULL_REQUEST, "merged": BOOL, "mergeable": MAYBE_BOOL, "head": {"ref": TEXT, "sha": OBJECT_ID},
}  # fmt: skip
CHECK_RUNS: Shape = {"total_count": COUNT}  # and `check_runs`, a list of CHECK_RUN
CHECK_RUN: Shape = {
    "name": TEXT,
    "status": one_of("queued", "in_progress", "completed", "waiting", "requested", "pending"),
    "conclusion": one_of(
        None, "success", "failure", "neutral", "cancelled", "skipped", "timed_out", "action_required", "stale",
        "startup_failure",
    ),
}  # fmt: skip
# Conclusions that keep a pull request from being green.
FAILING = frozenset({"failure", "timed_out", "cancelled", "action_required", "startup_failure"})
CHECK_RUNS_PAGE = 100  # GitHub's largest page; one is read (`complete` says whether it held them all)
COMMENT: Shape = {"id": POSITIVE_INT, "html_url": WEB_URL}
INSTALLATION: Shape = {"id": POSITIVE_INT}
ACCESS_TOKEN: Shape = {"token": CREDENTIAL, "expires_at": TIMESTAMP}


class UpstreamError(Exception):
    """GitHub refused or failed; `status` is what the broker answers, `message` is redacted by whoever shows it."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _invalid(error: ShapeError | ValueError) -> UpstreamError:
    return UpstreamError(502, "upstream_invalid", f"GitHub's answer is not what the API promises: {error}")


@dataclass(frozen=True, slots=True)
class PullRequest:
    number: int
    url: str
    html_url: str
    state: str
    draft: bool
    head: str
    base: str

    @classmethod
    def from_api(cls, value: Any, what: str) -> Self:
        try:
            pull = conforming(value, PULL_REQUEST, what)
        except ShapeError as e:
            raise _invalid(e) from None
        return cls(
            pull["number"], pull["url"], pull["html_url"], pull["state"], pull["draft"],
            pull["head"]["ref"], pull["base"]["ref"],
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class PullStatus:
    pull: PullRequest
    merged: bool
    mergeable: bool | None  # None: GitHub has not computed it yet
    head_sha: str


@dataclass(frozen=True, slots=True)
class Checks:
    """The check runs of a commit, summarised."""

    total: int  # as GitHub counts them
    counts: dict[str, int]  # by conclusion; "pending" for runs not completed
    failing: tuple[str, ...]  # names of the runs whose conclusion is in FAILING
    complete: bool  # False when there were more runs than one page holds


@dataclass(frozen=True, slots=True)
class Comment:
    id: int
    html_url: str


@dataclass(frozen=True)
class AppCredential:
    app_id: str
    private_key: str  # PEM
    installation_id: int | None = None  # None: looked up per repository

    @functools.cached_property  # the instance's own dict, which a frozen dataclass leaves writable
    def signing_key(self) -> Any:
        """The private key, parsed as PyJWT parses it (so it fails as it would) but once: for a 2048-bit RSA key
        that is some 50 ms of CPU on the event loop, which every App JWT used to spend again."""
        return RSAAlgorithm(RSAAlgorithm.SHA256).prepare_key(self.private_key)


@dataclass(frozen=True)
class StaticCredential:
    token: str


type Credential = AppCredential | StaticCredential


class GitHubClient:
    def __init__(self, api: str, credential: Credential, session: aiohttp.ClientSession, timeout: float = 10.0) -> None:
        self.api = api.rstrip("/")
        self.credential = credential
        self.session = session
        self.timeout = timeout
        self._tokens: dict[str, tuple[str, float]] = {}  # _token_key(…) → (installation token, expires at)
        self._token_locks: dict[str, asyncio.Lock] = {}
        # Every credential this client holds or has held, for whatever lets text out of the process.
        self.redactor = Redactor()
        if isinstance(credential, StaticCredential):
            self.redactor.hold(credential.token)

    async def create_pull_request(self, repo: str, fields: dict[str, Any]) -> tuple[PullRequest, bool]:
        """The pull request (created, or the one that already existed) and whether it already existed."""
        status, body = await self._repo_call("POST", f"/repos/{repo}/pulls", repo, PR_PERMISSIONS, fields)
        if status == 201:
            return PullRequest.from_api(body, "the created pull request"), False
        if status == 422 and _already_exists(body):
            return await self._existing(repo, fields), True
        raise _translate(status, body)

    async def pull_request(self, repo: str, number: int) -> PullStatus:
        status, body = await self._repo_call("GET", f"/repos/{repo}/pulls/{number}", repo, READ_PULLS)
        if status != 200:
            raise _translate(status, body, f"reading pull request #{number}")
        pull = self._conforming(body, PULL_STATUS, "the pull request")
        return PullStatus(
            PullRequest.from_api(pull, "the pull request"), pull["merged"], pull["mergeable"], pull["head"]["sha"]
        )

    async def check_runs(self, repo: str, sha: str) -> Checks:
        """The latest check runs of commit `sha`, summarised (the first CHECK_RUNS_PAGE of them)."""
        query = {"per_page": str(CHECK_RUNS_PAGE), "filter": "latest"}
        path = f"/repos/{repo}/commits/{sha}/check-runs"
        status, body = await self._repo_call("GET", path, repo, READ_CHECKS, params=query)
        if status != 200:
            raise _translate(status, body, "reading the check runs")
        total = self._conforming(body, CHECK_RUNS, "the check runs")["total_count"]
        listed = body.get("check_runs")
        if not isinstance(listed, list) or len(listed) > CHECK_RUNS_PAGE:
            raise _invalid(ShapeError(f"check_runs is not a list of at most {CHECK_RUNS_PAGE}"))
        runs = [self._conforming(run, CHECK_RUN, "a check run") for run in listed]
        counts: dict[str, int] = {}
        for run in runs:
            outcome = run["conclusion"] if run["status"] == "completed" and run["conclusion"] else "pending"
            counts[outcome] = counts.get(outcome, 0) + 1
        failing = tuple(run["name"] for run in runs if run["status"] == "completed" and run["conclusion"] in FAILING)
        return Checks(max(total, len(runs)), counts, failing, total <= len(runs))

    async def comment(self, repo: str, number: int, text: str) -> Comment:
        """A comment on pull request `number` (GitHub keeps a pull request's conversation as its issue's)."""
        path = f"/repos/{repo}/issues/{number}/comments"
        status, body = await self._repo_call("POST", path, repo, COMMENT_PERMISSIONS, {"body": text})
        if status != 201:
            raise _translate(status, body, f"commenting on pull request #{number}")
        comment = self._conforming(body, COMMENT, "the comment")
        return Comment(comment["id"], comment["html_url"])

    async def _existing(self, repo: str, fields: dict[str, Any]) -> PullRequest:
        """The open pull request from `fields`' head to its base, which GitHub said exists."""
        pull = await self.open_pull_request(repo, fields["head"], fields["base"])
        if pull is None:
            raise UpstreamError(502, "upstream_invalid", "GitHub says the pull request exists but did not list it")
        return pull

    async def open_pull_request(self, repo: str, head: str, base: str) -> PullRequest | None:
        """The open pull request from `head` to `base` (GitHub holds at most one), if there is one."""
        owner = repo.split("/")[0]
        query = {"head": f"{owner}:{head}", "base": base, "state": "open"}
        status, found = await self._repo_call("GET", f"/repos/{repo}/pulls", repo, PR_PERMISSIONS, params=query)
        if status != 200:
            raise _translate(status, found, "listing the open pull requests")
        if not isinstance(found, list):
            raise _invalid(ShapeError("the list of pull requests is not a list"))
        pulls = [PullRequest.from_api(item, "a listed pull request") for item in found]
        return next((pull for pull in pulls if (pull.head, pull.base) == (head, base)), None)

    async def repo_token(self, repo: str, permissions: dict[str, str]) -> str:
        """A credential for `repo` alone with exactly `permissions` (App mode; the static token is what it is)."""
        if isinstance(self.credential, StaticCredential):
            return self.credential.token
        key = _token_key(repo, permissions)
        lock = self._token_locks.setdefault(key, asyncio.Lock())
        async with lock:
            cached = self._tokens.get(key)
            if cached is not None and cached[1] - TOKEN_REFRESH_MARGIN > time.time():
                return cached[0]
            token, expires = await self._installation_token(repo, permissions)
            self._tokens[key] = (token, expires)
            return token

    def forget_token(self, repo: str, permissions: dict[str, str], refused: str) -> bool:
        """Drop the installation token GitHub refused (unless a call running alongside has already replaced it);
        False when there is nothing better to try."""
        if isinstance(self.credential, StaticCredential):
            return False
        key = _token_key(repo, permissions)
        if self._tokens.get(key, ("",))[0] == refused:
            del self._tokens[key]
        return True

    async def _installation_token(self, repo: str, permissions: dict[str, str]) -> tuple[str, float]:
        assert isinstance(self.credential, AppCredential)
        app_jwt = self._app_jwt()
        installation = self.credential.installation_id
        if installation is None:
            status, body = await self._call("GET", f"/repos/{repo}/installation", app_jwt, bearer=True)
            if status != 200:
                raise _translate(status, body, f"the GitHub App is not installed on {repo}")
            installation = self._conforming(body, INSTALLATION, "the installation")["id"]
        narrowing = {"repositories": [repo.split("/", 1)[1]], "permissions": permissions}
        path = f"/app/installations/{installation}/access_tokens"
        status, body = await self._call("POST", path, app_jwt, narrowing, bearer=True)
        if isinstance(body, dict) and isinstance(body.get("token"), str):
            self.redactor.hold(body["token"])  # whatever comes next, it reached this process
        if status != 201:
            raise _translate(status, body, "GitHub did not issue an installation token")
        issued = self._conforming(body, ACCESS_TOKEN, "the installation token")
        return issued["token"], _expiry(issued["expires_at"])

    async def _repo_call(
        self,
        method: str,
        path: str,
        repo: str,
        permissions: dict[str, str],
        payload: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """A call about `repo` with its installation token for `permissions`; a token GitHub refuses (revoked or
        expired early upstream) is replaced once."""
        token = await self.repo_token(repo, permissions)
        status, body = await self._call(method, path, token, payload, params)
        if status == 401 and self.forget_token(repo, permissions, token):
            token = await self.repo_token(repo, permissions)
            status, body = await self._call(method, path, token, payload, params)
        return status, body

    def _conforming(self, value: Any, shape: Shape, what: str) -> dict[str, Any]:
        try:
            return conforming(value, shape, what)
        except ShapeError as e:
            raise _invalid(e) from None

    def _app_jwt(self) -> str:
        assert isinstance(self.credential, AppCredential)
        now = int(time.time())
        # iat 60 s in the past absorbs clock drift; GitHub refuses an exp more than 10 minutes out.
        payload = {"iat": now - 60, "exp": now + 540, "iss": self.credential.app_id}
        return self.redactor.hold(jwt.encode(payload, self.credential.signing_key, algorithm="RS256"))

    async def _call(
        self,
        method: str,
        path: str,
        token: str,
        payload: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        bearer: bool = False,
    ) -> tuple[int, Any]:
        headers = {
            "Accept": ACCEPT,
            "Authorization": f"Bearer {token}" if bearer else f"token {token}",
            "X-GitHub-Api-Version": "2022-11-28",
            "User-Agent": "airlock-broker",
        }
        try:
            async with asyncio.timeout(self.timeout):
                async with self.session.request(
                    method, self.api + path, json=payload, params=params, headers=headers
                ) as response:
                    return response.status, _decoded(response.status, await _read_capped(response))
        except TimeoutError:
            raise UpstreamError(504, "upstream_timeout", f"GitHub did not answer within {self.timeout:g}s") from None
        except aiohttp.ClientError as e:
            raise UpstreamError(
                502, "upstream_unreachable", f"GitHub is unreachable: {type(e).__name__}: {e}"
            ) from None


def _token_key(repo: str, permissions: dict[str, str]) -> str:
    """GitHub's repository names are case-insensitive: one installation token per repository, however spelled,
    and per set of permissions."""
    return " ".join([repo.lower(), *(f"{name}:{level}" for name, level in sorted(permissions.items()))])


async def _read_capped(response: aiohttp.ClientResponse) -> bytes:
    """The body (decompressed), refused as soon as it is larger than MAX_UPSTREAM_BYTES."""
    if (response.content_length or 0) > MAX_UPSTREAM_BYTES:
        raise UpstreamError(502, "upstream_invalid", f"GitHub's answer is larger than {MAX_UPSTREAM_BYTES} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > MAX_UPSTREAM_BYTES:
            raise UpstreamError(502, "upstream_invalid", f"GitHub's answer is larger than {MAX_UPSTREAM_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _decoded(status: int, data: bytes) -> Any:
    """The JSON value of a body. An error answer that is not JSON keeps its start as the message; a success
    answer that is not JSON is not one."""
    if not data:
        return None
    try:
        return loads(data, MAX_UPSTREAM_DEPTH)
    except ValueError as e:
        if 200 <= status < 300:
            raise _invalid(ValueError(f"not JSON the broker reads ({clip(str(e), MAX_MESSAGE)})")) from None
        return {"message": data.decode("utf-8", "replace")}  # clipped where it is shown


def _expiry(value: str) -> float:
    """GitHub's `expires_at` (checked to be ISO 8601); without a zone, UTC."""
    expires = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return (expires if expires.tzinfo else expires.replace(tzinfo=UTC)).timestamp()


def _errors(body: Any) -> list[dict[str, Any]]:
    """The objects in an error answer's `errors` list, however little of it there is."""
    errors = body.get("errors") if isinstance(body, dict) else None
    return [e for e in errors if isinstance(e, dict)] if isinstance(errors, list) else []


def _already_exists(body: Any) -> bool:
    return any("already exists" in str(e.get("message", "")) for e in _errors(body))


def _translate(status: int, body: Any, context: str | None = None) -> UpstreamError:
    message = clip(str(body.get("message", "")), MAX_MESSAGE) if isinstance(body, dict) else ""
    details = clip("; ".join(str(e.get("message") or e.get("code", "")) for e in _errors(body)), MAX_MESSAGE)
    text = f"GitHub answered {status} {message}" + (f" ({details})" if details else "")
    text = f"{context}: {text}" if context else text
    if status == 422:
        return UpstreamError(422, "upstream_validation", text)
    return UpstreamError(502, "upstream_error", text)
