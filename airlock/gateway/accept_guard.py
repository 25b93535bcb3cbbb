"""Accepting connections when the process runs out of file descriptors (or memory), which a flood of sandbox
connections can cause: asyncio then reports every failed accept() with a traceback, and (before Python 3.15) its
accept loop turns the failures into a busy loop. Both are mended here, for every listener of the gateway's loop;
nothing of it changes which connections are served, only how a shortage is waited out and told."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from typing import Any

log = logging.getLogger("airlock.gateway")

FD_REPORT_INTERVAL = 10.0
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class DescriptorShortage:
    """The event loop's exception handler, but for accept() failing for lack of descriptors (asyncio then pauses
    that listener for a second, and reports each failure with a traceback): one line per interval instead, which
    says what it means."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.previous = loop.get_exception_handler()
        self.failures = 0
        self.reported = float("-inf")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        if context.get("message") != self.MESSAGE:
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.failures += 1
        now = time.monotonic()
        if now - self.reported >= FD_REPORT_INTERVAL:
            error = context.get("exception")
            why = getattr(error, "strerror", None) or error
            log.error(
                "out of file descriptors or memory (%s): new connections wait in the kernel until some close "
                "(%d accept failures since the last report)",
                why,
                self.failures,
            )
            self.failures, self.reported = 0, now


class _ListenerView:
    """A listening socket as asyncio's accept loop sees it: once accept() has failed for lack of descriptors (or
    memory), the next accept() of the same wakeup finds nothing waiting instead of failing again."""

    __slots__ = ("short", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.short = sock, False

    def accept(self) -> tuple[socket.socket, Any]:
        if self.short:
            raise BlockingIOError
        try:
            return self.sock.accept()
        except OSError as e:
            self.short = e.errno in RESOURCE_ERRNOS
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def one_retry_per_shortage(loop: asyncio.AbstractEventLoop) -> None:
    """Python before 3.15 (gh-151615): when accept() fails for lack of file descriptors, asyncio's accept loop
    goes on calling it for the rest of its batch of 100, and every failure schedules its own retry of the listener
    a second later; the retries compound into a busy loop. Stop each batch at its first such failure, as the fix
    upstream does: then a listener short of descriptors tries once a second. Called before any listener starts,
    since a listener keeps the accept function it started with."""
    accept = getattr(loop, "_accept_connection", None)
    if accept is None or getattr(accept, "airlock", False):
        return  # not asyncio's selector loop, or done already

    def accept_connection(protocol_factory: Any, sock: Any, *args: Any, **kwargs: Any) -> None:
        listener = sock.sock if isinstance(sock, _ListenerView) else sock  # a retry passes the view back
        accept(protocol_factory, _ListenerView(listener), *args, **kwargs)

    accept_connection.airlock = True  # type: ignore[attr-defined]
    loop._accept_connection = accept_connection  # type: ignore[attr-defined]
