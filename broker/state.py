"""The broker's state store, called off the event loop.

The store is synchronous (SQLite); its calls run on a few threads of the broker's own, never on the event loop,
so a locked or slow database delays only the broker calls that need it, never the proxy or DNS. Any failure, or
no answer in time, is 503: the broker refuses to act on state it cannot read (fail closed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .errors import BrokerError
from .store import BrokerStore, StoreError

log = logging.getLogger("airlock.broker")

STATE_THREADS = 4  # each with its own SQLite connection: reads go on while a write waits for a lock
STATE_DEADLINE = 10.0  # seconds a call waits for the state store (queued or busy) before it is refused (503)

T = TypeVar("T")


class State:
    def __init__(self, store: BrokerStore) -> None:
        self.store = store
        self._threads = ThreadPoolExecutor(STATE_THREADS, thread_name_prefix="airlock-broker-state")

    async def __call__(self, action: Callable[[], T]) -> T:
        """`action` (a store call) on a state thread, else 503."""
        try:
            async with asyncio.timeout(STATE_DEADLINE):
                return await asyncio.get_running_loop().run_in_executor(self._threads, action)
        except (StoreError, TimeoutError, RuntimeError) as e:  # RuntimeError: the threads are shut down
            log.error("broker state unavailable: %s", str(e) or f"no answer within {STATE_DEADLINE:g}s")
            raise BrokerError(503, "state_unavailable", "broker state is unavailable; refusing to act") from None

    def close(self) -> None:
        """Stop the threads (after the listeners: no call is left to need them)."""
        self._threads.shutdown(wait=True, cancel_futures=True)
