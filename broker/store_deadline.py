"""The broker's calls of its state store, bounded in time and failing closed.

Every store is async (SQLite's calls run on threads of its own, PostgreSQL's on its connection pool), so a locked
file or a slow database delays only the broker calls that need it, never the proxy or DNS. Any failure, or no
answer in time, is 503 `store_unavailable`: the broker refuses to act on state it cannot read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from .errors import BrokerError
from .store import BrokerStore, StoreError

log = logging.getLogger("airlock.broker")

STATE_DEADLINE = 10.0  # seconds a call waits for the state store (queued or busy) before it is refused (503)

T = TypeVar("T")


def unavailable() -> BrokerError:
    return BrokerError(503, "store_unavailable", "broker state is unavailable; refusing to act")


class StoreDeadline:
    """Each store call within STATE_DEADLINE; a failure, or no answer in time, is 503 `store_unavailable`."""

    def __init__(self, store: BrokerStore) -> None:
        self.store = store

    async def __call__(self, action: Awaitable[T]) -> T:
        """`action` (a store call), else 503."""
        try:
            async with asyncio.timeout(STATE_DEADLINE):
                return await action
        except (StoreError, TimeoutError) as e:
            log.error("broker state unavailable: %s", str(e) or f"no answer within {STATE_DEADLINE:g}s")
            raise unavailable() from None
