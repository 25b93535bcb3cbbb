"""A brokered call, whichever surface it came through (REST or MCP): the tool it names, the token's claims, the
audit record being written for it, and its input once the tool's schema has accepted it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airlock.audit import AuditRecord

from .errors import BrokerError, Result

if TYPE_CHECKING:  # named in annotations only: the call log's readers need no jwt or jsonschema
    from .grants import Grant
    from .tokens import Claims
    from .tool_schemas import ToolSpec


@dataclass(frozen=True)
class Call:
    claims: Claims
    record: AuditRecord
    input: dict[str, Any]  # validated against the tool's schema
    idempotency_key: str | None = None  # the caller's, if it sent one


@dataclass(frozen=True)
class Tool:
    spec: ToolSpec
    run: Callable[[Call], Awaitable[Result]]
    max_request_bytes: int
    limits: Mapping[str, int | float]
    slots: asyncio.Semaphore | None = None  # calls of this tool in progress at once, broker-wide
    slot_wait: float = 0.0  # seconds a call waits for a slot before 503

    @property
    def name(self) -> str:
        return self.spec.name

    def listing(self, grants: tuple[Grant, ...]) -> dict[str, Any]:
        scopes = [g.scope() for g in grants if g.tool == self.name]
        return {
            "name": self.name, "description": self.spec.description, "input_schema": self.spec.input_schema,
            "limits": self.limits, "grant": {"scopes": scopes},
        }  # fmt: skip

    def slot(self) -> contextlib.AbstractAsyncContextManager[None]:
        return bounded(self.slots, self.slot_wait, f"{self.name} calls")


@contextlib.asynccontextmanager
async def bounded(slots: asyncio.Semaphore | None, wait: float, what: str) -> AsyncIterator[None]:
    """One of `slots` (none needed when None), waited for at most `wait` seconds; else 503 `busy`."""
    if slots is None:
        yield
        return
    try:
        async with asyncio.timeout(wait):
            await slots.acquire()
    except TimeoutError:
        raise BrokerError(503, "busy", f"too many {what} in progress; try again") from None
    try:
        yield
    finally:
        slots.release()


@dataclass
class _Entry:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # calls holding or waiting for the lock


class KeyedLocks:
    """Serialise the calls with one key (an idempotency key, a branch); an entry goes when no call holds or awaits
    it, so the table holds only keys in use."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, ...], _Entry] = {}

    @contextlib.asynccontextmanager
    async def one_at_a_time(self, key: tuple[str, ...]) -> AsyncIterator[None]:
        entry = self.entries.setdefault(key, _Entry())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self.entries[key]
