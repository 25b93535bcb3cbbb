"""The broker's sandbox-facing listener, kept from using up what the gateway shares with the proxy and DNS: at most
so many open connections per source address (`CappedConnections`), and aiohttp's reports of malformed requests
logged one short line each, at a bounded rate (`HTTP_LOG`)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from airlock.policy import TokenBuckets

log = logging.getLogger("airlock.broker")


class _ProtocolErrors(logging.Filter):
    """aiohttp logs each malformed request (before any handler runs) with its traceback: whoever reaches the port
    could fill the log. One line each instead, naming the error's type only (its text quotes the request, whose
    headers may hold a token); 20 at once, then one a second, with a count of those left out."""

    def __init__(self) -> None:
        super().__init__()
        self._budget = TokenBuckets(1.0, 20)
        self._left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._budget.take("-", time.monotonic()):
            self._left_out += 1
            return False
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            message = f"{message}: {type(record.exc_info[1]).__name__}"
        if self._left_out:
            message, self._left_out = f"{message} ({self._left_out} more left out)", 0
        record.msg, record.args, record.exc_info, record.exc_text = message, None, None, None
        return True


HTTP_LOG = logging.getLogger("airlock.broker.http")  # the broker listeners' own aiohttp messages
HTTP_LOG.addFilter(_ProtocolErrors())


class CappedConnections:
    """aiohttp's protocol factory, with at most `per_client` open connections per source address: a sandbox
    holding more would use up the gateway's file descriptors, which the proxy and DNS need too. Beyond the cap a
    connection is closed at once, and logged once per 10 s with a count."""

    def __init__(self, make: Callable[[], asyncio.Protocol], per_client: int) -> None:
        self._make, self._per_client = make, per_client
        self.open: collections.Counter[str] = collections.Counter()
        self._refused, self._said = 0, 0.0

    def __call__(self) -> asyncio.Protocol:
        return _Counted(self._make(), self)

    def admit(self, client: str) -> bool:
        if self.open[client] < self._per_client:
            self.open[client] += 1
            return True
        self._refused += 1
        if (now := time.monotonic()) - self._said >= 10:
            log.warning(
                "broker: %d connection(s) refused in the last 10 s, %s holding %d already (the cap per address)",
                self._refused, client, self._per_client,
            )  # fmt: skip
            self._refused, self._said = 0, now
        return False

    def release(self, client: str) -> None:
        self.open[client] -= 1
        if not self.open[client]:
            del self.open[client]


class _Counted(asyncio.Protocol):
    """One connection of a CappedConnections: aiohttp's protocol behind it (its slots forbid wrapping in place)."""

    def __init__(self, inner: asyncio.Protocol, cap: CappedConnections) -> None:
        self._inner, self._cap, self._client = inner, cap, ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        client = str((transport.get_extra_info("peername") or ("?",))[0])
        if not self._cap.admit(client):
            if isinstance(transport, asyncio.WriteTransport):
                transport.abort()  # connection_lost follows, the inner protocol never started
            else:
                transport.close()
            return
        self._client = client
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._client:
            self._cap.release(self._client)
            self._client = ""
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()
