"""The broker's GitHub client: the real credential lives here and never leaves.

App mode mints an App JWT (RS256, 10 minutes at most), exchanges it for an installation token narrowed to the
one repository and the permission the tool needs, and caches that token until shortly before it expires.
Static mode uses a token read from a file or an environment variable of the gateway host.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import jwt

PR_PERMISSIONS = {"pull_requests": "write"}
TOKEN_REFRESH_MARGIN = 300  # seconds before expiry when a cached installation token is replaced
ACCEPT = "application/vnd.github+json"


class UpstreamError(Exception):
    """GitHub refused or failed; `status` is what the broker answers, `message` is safe to show."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(frozen=True)
class AppCredential:
    app_id: str
    private_key: str  # PEM
    installation_id: int | None = None  # None: looked up per repository


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
        self._tokens: dict[str, tuple[str, float]] = {}  # _token_key(repo) → (installation token, expires at)
        self._token_locks: dict[str, asyncio.Lock] = {}
        self._app_jwts: dict[str, float] = {}  # App JWTs still valid (→ expiry): a credential too, so redacted

    def secrets(self) -> list[str]:
        """Every credential value this client holds, so callers can make sure none is ever echoed."""
        if isinstance(self.credential, StaticCredential):
            return [self.credential.token]
        return [token for token, _ in self._tokens.values()] + list(self._app_jwts)

    async def create_pull_request(self, repo: str, fields: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """The pull request (created, or the one that already existed) and whether it already existed."""
        token = await self._repo_token(repo)
        status, body = await self._call("POST", f"/repos/{repo}/pulls", token, fields)
        if status == 401 and isinstance(self.credential, AppCredential):
            # The cached installation token was revoked or expired early upstream: mint a fresh one, once.
            self._tokens.pop(_token_key(repo), None)
            token = await self._repo_token(repo)
            status, body = await self._call("POST", f"/repos/{repo}/pulls", token, fields)
        if status == 201:
            return body, False
        if status == 422 and _already_exists(body):
            owner = repo.split("/")[0]
            query = {"head": f"{owner}:{fields['head']}", "base": fields["base"], "state": "open"}
            status, found = await self._call("GET", f"/repos/{repo}/pulls", token, params=query)
            if status == 200 and isinstance(found, list) and found:
                return found[0], True
            raise UpstreamError(502, "upstream_error", "GitHub says the pull request exists but did not list it")
        raise _translate(status, body)

    async def _repo_token(self, repo: str) -> str:
        if isinstance(self.credential, StaticCredential):
            return self.credential.token
        key = _token_key(repo)
        lock = self._token_locks.setdefault(key, asyncio.Lock())
        async with lock:
            cached = self._tokens.get(key)
            if cached is not None and cached[1] - TOKEN_REFRESH_MARGIN > time.time():
                return cached[0]
            token, expires = await self._installation_token(repo)
            self._tokens[key] = (token, expires)
            return token

    async def _installation_token(self, repo: str) -> tuple[str, float]:
        assert isinstance(self.credential, AppCredential)
        app_jwt = self._app_jwt()
        installation = self.credential.installation_id
        if installation is None:
            status, body = await self._call("GET", f"/repos/{repo}/installation", app_jwt, bearer=True)
            if status != 200 or not isinstance(body, dict) or "id" not in body:
                raise _translate(status, body, f"the GitHub App is not installed on {repo}")
            installation = int(body["id"])
        narrowing = {"repositories": [repo.split("/", 1)[1]], "permissions": PR_PERMISSIONS}
        path = f"/app/installations/{installation}/access_tokens"
        status, body = await self._call("POST", path, app_jwt, narrowing, bearer=True)
        if status != 201 or not isinstance(body, dict) or "token" not in body:
            raise _translate(status, body, "GitHub did not issue an installation token")
        return str(body["token"]), _expiry(body.get("expires_at"))

    def _app_jwt(self) -> str:
        assert isinstance(self.credential, AppCredential)
        now = int(time.time())
        # iat 60 s in the past absorbs clock drift; GitHub refuses an exp more than 10 minutes out.
        payload = {"iat": now - 60, "exp": now + 540, "iss": self.credential.app_id}
        token = jwt.encode(payload, self.credential.private_key, algorithm="RS256")
        self._app_jwts = {t: exp for t, exp in self._app_jwts.items() if exp > now} | {token: now + 540}
        return token

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
                    text = await response.text()
                    try:
                        return response.status, json.loads(text) if text else None
                    except ValueError:
                        return response.status, {"message": text[:200]}
        except TimeoutError:
            raise UpstreamError(504, "upstream_timeout", f"GitHub did not answer within {self.timeout:g}s") from None
        except aiohttp.ClientError as e:
            raise UpstreamError(
                502, "upstream_unreachable", f"GitHub is unreachable: {type(e).__name__}: {e}"
            ) from None


def _token_key(repo: str) -> str:
    """GitHub's repository names are case-insensitive: one installation token per repository, however spelled."""
    return repo.lower()


def _expiry(value: Any) -> float:
    """GitHub's `expires_at`; one we cannot read means "use once, do not cache" rather than a crash (500)."""
    try:
        expires = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    return (expires if expires.tzinfo else expires.replace(tzinfo=UTC)).timestamp()


def _already_exists(body: Any) -> bool:
    errors = body.get("errors", []) if isinstance(body, dict) else []
    return any("already exists" in str(e.get("message", "")) for e in errors if isinstance(e, dict))


def _translate(status: int, body: Any, context: str | None = None) -> UpstreamError:
    message = str(body.get("message", "")) if isinstance(body, dict) else ""
    errors = body.get("errors", []) if isinstance(body, dict) else []
    details = "; ".join(str(e.get("message") or e.get("code", "")) for e in errors if isinstance(e, dict))
    text = f"GitHub answered {status} {message}" + (f" ({details})" if details else "")
    text = f"{context}: {text}" if context else text
    if status == 422:
        return UpstreamError(422, "upstream_validation", text)
    return UpstreamError(502, "upstream_error", text)
