"""Client for the fake GitHub (airlock.verify.fakegithub: its REST API and git smart HTTP) running in the topology's
`net` namespace, and the App key it is started with."""

from __future__ import annotations

import json
import secrets
import string
import sys
import time
from pathlib import Path
from typing import Any, Self

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from airlock.verify.control import ControlledFake
from airlock.verify.topology import Topology

GITHUB_IP = "192.0.2.20"
GITHUB_HOST = "api.github.test"
GITHUB_API = f"https://{GITHUB_HOST}"
GITHUB_WEB_HOST = "github.test"
GITHUB_WEB = f"https://{GITHUB_WEB_HOST}"
ACCEPT = "application/vnd.github+json"
API_VERSION = "2022-11-28"


def make_app_key(path: Path) -> str:
    """Write a fresh RSA-2048 GitHub App private key (PKCS#1 PEM, like the file GitHub hands out) to `path` with
    mode 0600; return the public key PEM the fake verifies JWTs with."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_bytes(pem)
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return public.decode()


class FakeGitHub(ControlledFake):
    """Client for airlock.verify.fakegithub. After start(): app_id, installation_id, owner, static_token (and, when
    the fixture made one, app_key_path / static_token_path) describe the App the broker is configured with."""

    name = "fakegithub"
    ip = GITHUB_IP
    port = 443
    host = GITHUB_HOST
    api_url = GITHUB_API
    web_url = GITHUB_WEB

    def __init__(
        self,
        cert: Path,
        key: Path,
        owner: str = "acme",
        static_token: str | None = None,
        app_key_path: Path | None = None,
    ) -> None:
        super().__init__(cert, key)
        self.owner = owner
        self.static_token = static_token
        self.static_token_path: Path | None = None
        self.app_key_path = app_key_path
        self.app_id: int | None = None
        self.installation_id: int | None = None

    def program(self) -> list[str]:
        # -P: the working directory (often a checkout, whose dns/ would shadow dnspython) stays off sys.path.
        return [sys.executable, "-P", "-m", "airlock.verify.fakegithub"]

    def start(
        self,
        topology: Topology | None,
        workdir: Path,
        app_id: int,
        app_public_key_pem: str | bytes,
        installation_id: int,
        timeout: float = 20,
        listen: tuple[str, int] | None = None,
    ) -> Self:
        """In the topology's `net` namespace on 192.0.2.20:443, or (topology None) here, on `listen`: then
        `api_url` is https://ADDRESS:PORT."""
        if listen is not None:
            self.ip, self.port = listen
            self.api_url = f"https://{self.ip}:{self.port}"
        self._prepare(workdir)
        self.app_id, self.installation_id = app_id, installation_id
        public_key = workdir / "app.public.pem"
        pem = app_public_key_pem.encode() if isinstance(app_public_key_pem, str) else app_public_key_pem
        public_key.write_bytes(pem)
        argv = [
            "--listen",
            self.ip,
            "--port",
            str(self.port),
            "--app-id",
            str(app_id),
            "--app-public-key",
            public_key,
            "--installation-id",
            str(installation_id),
            "--owner",
            self.owner,
            "--git-root",
            workdir / "git",
        ]
        if self.static_token:
            argv += ["--static-token", self.static_token]
        self._launch(topology, argv, timeout)
        return self

    # ------------------------------------------------------------------------------------------- control

    def stats(self) -> dict[str, Any]:
        """calls, prs, tokens (issued installation tokens), connections (TCP accepts) and settings."""
        return self._call("stats")

    def _records(self, name: str) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = self.stats()[name]
        return records

    def reset(self) -> None:
        """Forget calls, PRs and tokens; settings back to their defaults."""
        self._call("reset")

    def set(self, **settings: Any) -> dict[str, Any]:
        """Change behaviour: hang, hang_after_create, hang_seconds, fail_status, token_fail_status, token_ttl,
        check_runs."""
        settings_now: dict[str, Any] = self._call("set", **settings)["settings"]
        return settings_now

    def expire_tokens(self) -> int:
        """Make every installation token issued so far expired; returns how many."""
        return int(self._call("expire_tokens")["expired"])

    # ------------------------------------------------------------------------------------------- views

    def calls(self, path_prefix: str | None = None, method: str | None = None) -> list[dict[str, Any]]:
        """Recorded requests: method, path, query, auth_scheme, token (raw), credential (app_jwt | installation |
        static | unknown | None), body, status, response, hung, user_agent, accept, api_version, client."""
        return [
            c
            for c in self._records("calls")
            if (path_prefix is None or c["path"].startswith(path_prefix)) and (method is None or c["method"] == method)
        ]

    def prs(self) -> list[dict[str, Any]]:
        """PRs created: repo, number, title, head, base, body, draft, state, user, token, credential, html_url, url."""
        return self._records("prs")

    def comments(self) -> list[dict[str, Any]]:
        """Comments posted on pull requests: repo, number, id, body, user, credential, permissions, repositories."""
        return self._records("comments")

    def tokens(self) -> list[dict[str, Any]]:
        """Installation tokens issued: token, permissions, repositories (None = all), expires_at, revoked, ..."""
        return self._records("tokens")

    def connections(self) -> int:
        return int(self.stats()["connections"])

    def git(self) -> dict[str, dict[str, Any]]:
        """The bare repositories by name (app, other, hang): path, and refs (refname → sha)."""
        repos: dict[str, dict[str, Any]] = self.stats()["git"]
        return repos

    def pushes(self) -> list[dict[str, Any]]:
        """git pushes received: repo, status, credential, token, permissions, repositories, refs after."""
        return self._records("pushes")

    # ------------------------------------------------------------------------------------------- helpers

    def app_jwt(self, lifetime: int = 540, iat_offset: int = -60, **claims: Any) -> str:
        """An App JWT as the broker should mint it (iat 60 s back, exp iat + lifetime); claims override."""
        if self.app_key_path is None or self.app_id is None:
            raise RuntimeError("no App key: start the fake with app_key_path set")
        iat = int(time.time()) + iat_offset
        payload = {"iat": iat, "exp": iat + lifetime, "iss": str(self.app_id), **claims}
        # PyJWS, not jwt.encode: PyJWT refuses a numeric iss, which GitHub (and octokit) accept.
        return jwt.PyJWS().encode(json.dumps(payload).encode(), self.app_key_path.read_text(), algorithm="RS256")


def new_static_token() -> str:
    """A classic-PAT-shaped token: ghp_ and 36 alphanumerics."""
    return "ghp_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(36))
