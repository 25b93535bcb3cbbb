"""What a launch imports in a thread while its sandbox is built (`preload_proxy()`): the gateway's own machinery
(DNS server, audit, admin listener, reloads), then aiohttp (the admin listener), then mitmproxy and the airlock
addon (about 300 ms: proxy layers, QUIC, pyOpenSSL, pyparsing). What the launcher does meanwhile (the namespace,
link and fence) waits on subprocesses and the kernel, not on this process; its own imports before that are the
checks' and the settings' alone (`airlock.gateway.config`). A launcher has the thread run at a lower CPU priority
until its command has started (`preload_proxy(background=True)`, `foreground()`): on a machine of two CPUs the
import would otherwise take a CPU from what the sandbox's start waits for (ip, nft, bubblewrap, the watchdog's
interpreter, the launcher's own thread), and it gets every CPU nobody else wants anyway.

Kept apart from `airlock.gateway.core` so that starting the import needs none of it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from airlock.gateway.errors import GatewayError
from airlock.gateway.startup.collection import paused_collection
from airlock.gateway.startup.switching import prompt_switching

_preload: _Preload | None = None
_preload_lock = threading.Lock()
BACKGROUND_NICENESS = 10  # added to the import thread's niceness in the background (Linux: per thread)


@dataclass(frozen=True)
class _Preload:
    """The imports of preload_proxy()'s thread the gateway waits for, in their order: aiohttp, then mitmproxy and
    the addon."""

    admin: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)
    proxy: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


def preload_proxy(*, background: bool = False) -> concurrent.futures.Future[None]:
    """Import the gateway, the admin listener's aiohttp, then mitmproxy and the airlock addon, in a thread, once per
    process; the future says when aiohttp, mitmproxy and the addon are in (`preload_admin()`'s, when aiohttp is).
    With `background`, a thread this call starts runs `BACKGROUND_NICENESS` nicer until `foreground()`.

    Not a daemon thread: the interpreter must not finalize while an extension module initializes in another thread
    (that can crash it, SIGSEGV), so a process that ends sooner waits for the import. `airlock run` ends its process
    at once instead (`proxy_loading()`): by then its sandbox is gone, and no proxy will be needed."""
    return _preloading(background).proxy


def foreground() -> None:
    """The import's thread at its usual CPU priority again (if `preload_proxy(background=True)` lowered it)."""
    _priority.restore()


def preload_admin() -> concurrent.futures.Future[None]:
    """The first part of preload_proxy()'s import (started if it was not): aiohttp, for the admin listener."""
    return _preloading().admin


def _preloading(background: bool = False) -> _Preload:
    global _preload
    with _preload_lock:
        if _preload is None:
            _preload = _Preload()
            if background:
                _priority.lower()
            threading.Thread(target=_import_late, args=(_preload,), name="airlock-proxy-import").start()
        return _preload


def proxy_loading() -> bool:
    """Whether preload_proxy()'s import is under way in this process."""
    return _preload is not None and not _preload.proxy.done()


class _Priority:
    """The import thread's CPU priority: lowered while asked (`lower()` until `restore()`, from any thread). The
    thread names itself at its start and unnames itself as it ends, under the lock both take: a thread id is never
    acted on once the thread is gone (the kernel may give the number to another task). Only performance is at stake:
    a kernel that refuses (raising a priority again takes root) leaves the priority as it is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wanted = False
        self._thread: int | None = None  # the import thread's id while it runs
        self._usual = 0  # its niceness at its start
        self._lowered = False

    def lower(self) -> None:
        with self._lock:
            self._wanted = True
            self._apply()

    def restore(self) -> None:
        with self._lock:
            self._wanted = False
            self._apply()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The import thread's life, in that thread."""
        with self._lock:
            self._thread = threading.get_native_id()
            with contextlib.suppress(OSError):
                self._usual = os.getpriority(os.PRIO_PROCESS, self._thread)
            self._apply()
        try:
            yield
        finally:
            with self._lock:
                self._thread = None

    def _apply(self) -> None:
        if self._thread is None or self._lowered == self._wanted:
            return
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, self._thread, self._usual + (BACKGROUND_NICENESS if self._wanted else 0))
            self._lowered = self._wanted


_priority = _Priority()


def _import_late(preload: _Preload) -> None:
    with _priority.running():
        _import_all(preload)


def _import_all(preload: _Preload) -> None:
    for done in (preload.admin, preload.proxy):
        done.set_running_or_notify_cancel()  # running: a waiter that gives up cannot cancel it for everyone else
    # Meanwhile the other threads mostly wait on subprocesses, and each wakes to find this one holding the GIL: let
    # them have it at once rather than after the default 5 ms. The imports make objects that stay: no collection
    # walks them meanwhile (airlock/gateway/startup/collection.py).
    with prompt_switching(), paused_collection():
        # The gateway's own modules first: the launcher needs them next, once the namespace exists. It imports them
        # itself then (waiting for this import if it is still under way), and so hears of any failure. Imported here,
        # in the function, because the gateway imports this module to start the thread.
        with contextlib.suppress(Exception):
            import airlock.gateway.core
        # aiohttp next: the admin listener is served before the proxy (`Gateway._serve_loaded`).
        with _settling(preload.admin):
            import aiohttp.web  # noqa: F401
        with _settling(preload.proxy):
            import airlock.gateway.startup.mitm
            import airlock.proxy.addon  # noqa: F401


@contextlib.contextmanager
def _settling(done: concurrent.futures.Future[None]) -> Iterator[None]:
    """`done` settled by the imports of the block: their failure (any, an extension's too) or their success."""
    try:
        yield
    except BaseException as e:
        done.set_exception(e)
    else:
        done.set_result(None)


async def loaded(loading: concurrent.futures.Future[None], what: str) -> None:
    """Once preload_proxy()'s `loading` is done; GatewayError naming `what` if its import failed."""
    try:
        await asyncio.wrap_future(loading)
    except Exception as e:
        raise GatewayError(f"{what} could not be loaded: {type(e).__name__}: {e}") from e
