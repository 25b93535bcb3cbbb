"""Read-only git over HTTPS through the proxy, where an inspected rule says `inject: [{github: {permissions: ...}}]`:
an installation token for the one repository a request names, minted only if a live token of the sandbox grants
something on that repository, with the rule's permissions (the loader allows read levels only)."""

from __future__ import annotations

import time
from collections.abc import Mapping

from .github import GitHubClient
from .store import BrokerStore
from .store_deadline import StoreDeadline
from .tokens import Claims


class GitReadTokens:
    """The broker tokens issued to each sandbox (their claims, until they expire), and the GitHub tokens they let
    the proxy inject for reading a granted repository."""

    def __init__(self, github: GitHubClient, state: StoreDeadline, store: BrokerStore) -> None:
        self.github, self.state, self.store = github, state, store
        self._issued: dict[str, list[Claims]] = {}

    def remember(self, claims: Claims) -> None:
        now = time.time()
        live = [c for c in self._issued.get(claims.sandbox, []) if c.expires_at > now]
        self._issued[claims.sandbox] = [*live, claims]

    async def token(self, sandbox: str, repo: str, permissions: Mapping[str, str]) -> str | None:
        """A token for `repo` alone with `permissions`, if a live, unrevoked token of `sandbox` grants a tool on
        it; None otherwise (the request then goes without one, and GitHub hides a private repository)."""
        now = time.time()
        for claims in self._issued.get(sandbox, []):
            if claims.expires_at <= now or not any(g.repo.lower() == repo.lower() for g in claims.grants if g.repo):
                continue
            if await self.state(self.store.is_revoked(claims.jti, sandbox, claims.issued_at)):
                continue
            return await self.github.repo_token(repo, dict(permissions))
        return None
