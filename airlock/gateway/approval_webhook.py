"""The approvals webhook: each new pending request posted as JSON to an operator's URL."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("airlock.approvals")

WEBHOOK_TIMEOUT = 5.0
WEBHOOK_IN_FLIGHT = 8  # posts under way at once; beyond, a pending request is not posted (logged)


class Webhook:
    """Posts each new pending request as JSON to an operator's URL: best effort, bounded in time and in number,
    never awaited by the request that is held."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._tasks: set[asyncio.Task[None]] = set()

    def post(self, payload: dict[str, Any]) -> None:
        if len(self._tasks) >= WEBHOOK_IN_FLIGHT:
            log.warning("approval webhook: %d posts under way, approval %s not posted", len(self._tasks), payload["id"])
            return
        task = asyncio.ensure_future(self._post(payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, payload: dict[str, Any]) -> None:
        import aiohttp

        try:
            timeout = aiohttp.ClientTimeout(total=WEBHOOK_TIMEOUT)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(self.url, json=payload) as reply,
            ):
                if reply.status >= 300:
                    log.warning(
                        "approval webhook %s answered %d for approval %s", self.url, reply.status, payload["id"]
                    )
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            log.warning(
                "approval webhook %s failed for approval %s: %s", self.url, payload["id"], e or type(e).__name__
            )

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
