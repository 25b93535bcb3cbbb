"""`--scope policy` approvals: the approved rule written into the policy file, which is then put in force."""

from __future__ import annotations

import asyncio
import inspect
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from airlock.errors import AirlockError
from airlock.gateway.errors import ApprovalError
from airlock.policy import Policy, PolicyError, load_policy
from airlock.policy.held_requests import Pending


class PolicyWriter:
    """`--scope policy`: the rule written into the policy file, its comments and layout kept (the round trip of
    `airlock policy suggest --merge`), the file checked and replaced whole, then put in force."""

    def __init__(self, path: str, reload: Callable[[Policy], Awaitable[None] | None]) -> None:
        """`reload` puts the written policy in force (awaited when it returns an awaitable: proxy workers')."""
        self.path, self.reload = path, reload
        self._lock = asyncio.Lock()  # one edit of the file at a time

    async def add(self, entry: Pending, by: str) -> str:
        target, ports = entry.target.rule()
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        comment = f"approved by {by} at {when} (approval {entry.id}, sandbox {entry.target.sandbox})"
        async with self._lock:
            try:
                policy = await asyncio.to_thread(self._write, entry.profile, target, ports, comment)
                if inspect.isawaitable(put := self.reload(policy)):  # audits the reload (kind policy), or its refusal
                    await put
            except (PolicyError, AirlockError, OSError) as e:
                raise ApprovalError(409, "policy_not_written", f"{self.path}: {e}") from None
        return f"{{host: {target}, ports: {ports}}}" if "/" not in target else f"{{cidr: {target}, ports: {ports}}}"

    def _write(self, profile: str, target: str, ports: list[int], comment: str) -> Policy:
        from airlock.policy.edit import Suggestion, render

        path = Path(self.path)
        text = render([Suggestion(profile, target, ports, comment)], merge=path)
        real = path.resolve()  # a symlinked policy file stays a symlink: its target is rewritten
        before = real.stat()
        fd, temporary = tempfile.mkstemp(prefix=f".{real.name}.", dir=real.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
                # The file stays its owner's, as it was: owner and group first (a chown clears set-id bits), mode.
                os.fchown(out.fileno(), before.st_uid, before.st_gid)
                os.fchmod(out.fileno(), before.st_mode & 0o7777)
            os.replace(temporary, real)  # readers (a file watch, a SIGHUP) see the old file or the new, whole
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return load_policy(path)
