"""Git reads (`inject: github`) across proxy workers: the read token an inspected git request to a GitHub host gets is
the broker's to mint, and the broker runs in the supervisor; a worker asks it over the channel.

The worker's side, `ChannelGitTokens`, is the addon's `GitTokens`: it sends `("git_token", [id, sandbox, repo,
permissions])` (JSON, like everything a worker sends) and awaits `("git_token", (id, token or None))`. No answer
within GIT_TOKEN_TIMEOUT is no token (the request goes without a credential, as one no grant names), and a worker
whose channel closed exits (`airlock.gateway.worker`): nothing is ever read with a token not minted for it.

The supervisor's side, `WorkerGitTokens`: `GitTokenRequest.read` reads the worker's message strictly (a malformed one
is a worker gone wrong, stopped by the pool), and `answer` asks the broker — which checks the sandbox's own grants —
and sends the token back (none: no broker, or no grant of that sandbox names the repository)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airlock.gateway.worker_channel import Channel, Questions

if TYPE_CHECKING:
    from airlock.proxy.shared import GitTokens

log = logging.getLogger("airlock.gateway")

GIT_TOKEN_TIMEOUT = 15.0  # seconds a worker waits for the broker's token (its GitHub call has --github-timeout)
MAX_FIELD = 512  # characters of a sandbox id, a repository or a permission's name


class ChannelGitTokens:
    """A worker's `GitTokens`: the supervisor's broker, over the channel."""

    def __init__(self, channel: Channel, timeout: float = GIT_TOKEN_TIMEOUT) -> None:
        self.channel, self.timeout = channel, timeout
        self.questions: Questions[str | None] = Questions(
            channel, "git_token", lambda answer: answer is None or isinstance(answer, str)
        )

    async def token(self, sandbox: str, repo: str, permissions: Mapping[str, str]) -> str | None:
        if not self.channel.open:
            return None
        try:
            return await self.questions.ask([sandbox, repo, dict(permissions)], self.timeout)
        except TimeoutError:
            log.warning("no git read token from the supervisor within %gs for %s: none sent", self.timeout, repo)
            return None

    def answered(self, body: Any) -> None:
        """The supervisor's `("git_token", (id, token or None))`."""
        self.questions.answered(body)

    @property
    def waiting(self) -> int:
        return self.questions.waiting


@dataclass(frozen=True, slots=True)
class GitTokenRequest:
    """What a worker asks the broker, as read from its message."""

    ask: int
    sandbox: str
    repo: str
    permissions: dict[str, str]

    @classmethod
    def read(cls, body: Any) -> GitTokenRequest:
        """TypeError or ValueError for anything but the message `ChannelGitTokens` sends."""
        if not isinstance(body, list) or len(body) != 4:
            raise TypeError("a git token request is a list of 4")
        ask, sandbox, repo, permissions = body
        if not (
            isinstance(ask, int) and not isinstance(ask, bool) and isinstance(sandbox, str) and isinstance(repo, str)
        ):
            raise TypeError("a git token request's id is an integer, its sandbox and repository text")
        if not 0 < len(sandbox) <= MAX_FIELD or repo.count("/") != 1 or not 2 < len(repo) <= MAX_FIELD:
            raise ValueError(f"sandbox {sandbox[:40]!r} or repository {repo[:40]!r}")
        if not isinstance(permissions, dict) or not permissions:
            raise TypeError("a git token request's permissions are a non-empty object")
        for name, level in permissions.items():
            if not (isinstance(name, str) and 0 < len(name) <= MAX_FIELD and level == "read"):
                raise ValueError(f"permission {str(name)[:40]!r}: {level!r} (only read)")
        return cls(ask, sandbox, repo, dict(permissions))


class WorkerGitTokens:
    """The supervisor's broker, as the workers ask it for git read tokens (`tokens`: None without a broker)."""

    def __init__(self, tokens: GitTokens | None) -> None:
        self.tokens = tokens

    def hold(self, channel: Channel, request: GitTokenRequest, held: set[asyncio.Task[None]]) -> None:
        """`answer` in a task of its own, kept in `held` until it ends (the pool cancels a lost worker's)."""
        task = asyncio.get_running_loop().create_task(self.answer(channel, request))
        held.add(task)
        task.add_done_callback(held.discard)

    async def answer(self, channel: Channel, request: GitTokenRequest) -> None:
        token = None
        if self.tokens is not None:
            try:
                token = await self.tokens.token(request.sandbox, request.repo, request.permissions)
            except Exception as e:  # the broker could not mint one: the request goes without, as a single gateway's
                log.error("git read token for %s (sandbox %s): %s: %s", request.repo, request.sandbox,
                          type(e).__name__, e)  # fmt: skip
        channel.send("git_token", (request.ask, token))
