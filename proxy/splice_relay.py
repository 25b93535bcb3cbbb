"""The kernel relay of passed-through tunnels: one thread moves both directions of every spliced tunnel with
splice(2) through a pipe per direction (socket → pipe → socket: the bytes never reach Python), waiting in epoll.

It owns duplicates of the two sockets' descriptors, so that whatever asyncio does with its own (close them, at
the end) can never make this thread read or write a descriptor that has since been reused for something else.
A tunnel ends when both directions reached their end (each end passed on as a half-close), when it moved no byte
for the idle timeout, when the event loop ends it, or at any error (both sockets shut down: fail closed). Its end
is handed back to the event loop (`on_end`, with the bytes each way) exactly once."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("airlock.proxy")

PIPE_SIZE = 256 * 1024  # the pipe of each direction: the most a splice moves at once
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
DEFAULT_PIPE_PAGES = 16  # a new pipe's size (64 KiB with 4 KiB pages) until F_SETPIPE_SZ changes it
DEFAULT_PIPE_USER_PAGES_SOFT = 16384  # the kernel's default, when /proc does not say
CHUNKS_PER_TURN = 16  # splices of one direction before the others get their turn
IDLE_SCAN = 0.5  # seconds between looks for idle tunnels
STOP_WAIT = 5.0  # seconds `stop` waits for the thread to have closed every tunnel
_SPLICE = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, which Python names only from 3.10 on some builds
_CAP_SYS_ADMIN, _CAP_SYS_RESOURCE = 21, 24
_ENDED = {errno.ENOTCONN, errno.ECONNRESET, errno.EPIPE}  # the socket is past where a shutdown matters


@dataclass
class Direction:
    """One way through a tunnel: bytes read from `src` into the pipe, then from the pipe into `dst`."""

    src: int
    dst: int
    pipe_r: int
    pipe_w: int
    moved: int = 0  # bytes read from src
    pending: int = 0  # bytes in the pipe, not yet written to dst
    eof: bool = False  # src has ended; dst was half-closed once the pipe was empty
    shut: bool = False

    @property
    def finished(self) -> bool:
        return self.shut

    def pump(self) -> bool:
        """Move what can move now without blocking; whether anything moved (OSError on a broken socket)."""
        moved = False
        for _ in range(CHUNKS_PER_TURN):
            while self.pending:
                try:
                    n = os.splice(self.pipe_r, self.dst, self.pending, flags=_SPLICE)
                except BlockingIOError:
                    return moved  # dst is full: wait until it is writable
                self.pending -= n
            if self.eof:
                if not self.shut:
                    self.shut = True
                    socket_shutdown(self.dst, socket.SHUT_WR)
                return moved
            try:
                n = os.splice(self.src, self.pipe_w, PIPE_SIZE, flags=_SPLICE)
            except BlockingIOError:
                return moved  # nothing to read now
            if n == 0:
                self.eof = True
                continue
            self.pending, self.moved, moved = n, self.moved + n, True
        return moved

    @property
    def wants_read(self) -> bool:
        return not self.eof and not self.pending

    @property
    def wants_write(self) -> bool:
        return self.pending > 0


@dataclass(eq=False)
class SplicedTunnel:
    """The two sockets of one tunnel (descriptors this relay owns) and a pipe for each direction."""

    client: int
    server: int
    on_end: Callable[[SplicedTunnel], None]  # called in the relay thread, once, after every descriptor is closed
    budget: PipeBudget
    upstream: Direction = field(init=False)  # client → server
    downstream: Direction = field(init=False)  # server → client
    last_moved: float = field(default_factory=time.monotonic)
    error: str | None = None  # why it ended early (idle, ended by the gateway, a socket error)
    ended: bool = False
    pages: int = 0  # of the budget's, held by the two pipes

    def __post_init__(self) -> None:
        r, w, self.pages = self.budget.pipe()
        self.upstream = Direction(self.client, self.server, r, w)
        try:
            r, w, pages = self.budget.pipe()
        except OSError:
            _close(self.upstream.pipe_r, self.upstream.pipe_w)
            self.budget.release(self.pages)
            raise
        self.downstream = Direction(self.server, self.client, r, w)
        self.pages += pages

    @classmethod
    def of(cls, client: int, server: int, on_end: Callable[[SplicedTunnel], None], budget: PipeBudget) -> SplicedTunnel:
        """Own duplicates of both sockets' descriptors and two pipes (OSError when the open-file limit leaves no
        descriptors, NoPipeRoom when the pipe quota no pipes)."""
        client_fd = os.dup(client)
        try:
            server_fd = os.dup(server)
        except OSError:
            os.close(client_fd)
            raise
        try:
            for fd in (client_fd, server_fd):
                os.set_blocking(fd, False)  # splice(2) waits on a blocking socket whatever its flags say
            return cls(client_fd, server_fd, on_end, budget)
        except OSError:
            _close(client_fd, server_fd)
            raise

    @property
    def sent(self) -> int:
        return self.upstream.moved

    @property
    def received(self) -> int:
        return self.downstream.moved

    @property
    def finished(self) -> bool:
        return self.upstream.finished and self.downstream.finished

    def interest(self, fd: int) -> int:
        """The epoll events this tunnel waits for on one of its sockets."""
        outgoing, incoming = (self.upstream, self.downstream) if fd == self.client else (self.downstream, self.upstream)
        # EPOLLPRI: TCP urgent data, at whose mark splice(2) stops for good while EPOLLIN stays set (a spin).
        reading = select.EPOLLIN | select.EPOLLPRI if outgoing.wants_read else 0
        return reading | (select.EPOLLOUT if incoming.wants_write else 0)

    def close(self) -> None:
        """Both sockets shut down (the peers see the end, whatever asyncio's descriptors still hold) and closed."""
        for fd in (self.client, self.server):
            with contextlib.suppress(OSError):
                socket_shutdown(fd, socket.SHUT_RDWR)
        _close(
            self.client, self.server, self.upstream.pipe_r, self.upstream.pipe_w, self.downstream.pipe_r,
            self.downstream.pipe_w,
        )  # fmt: skip
        self.budget.release(self.pages)
        self.pages = 0


class PipeBudget:
    """How large the relay's pipes may be. The kernel charges every pipe's pages to its user: past
    /proc/sys/fs/pipe-user-pages-soft (16,384 pages by default) an unprivileged user's new pipes get two pages and
    F_SETPIPE_SZ is refused, so a relay on such pipes would splice 8 KiB at a time. Large pipes (PIPE_SIZE) while
    the relay's own pages stay under half that limit, the kernel's default size under three quarters, and past it
    no new pipe (NoPipeRoom: mitmproxy relays that tunnel). A gateway with CAP_SYS_RESOURCE or CAP_SYS_ADMIN (root)
    is not held to the limit. Pipes are made on the event loop and closed by the relay thread: counted under a
    lock."""

    def __init__(self, soft_pages: int | None) -> None:
        self.soft_pages = soft_pages  # None: no limit applies to this process
        self.pages = 0  # of the pipes made here and not yet closed
        self._lock = threading.Lock()

    @classmethod
    def of_this_process(cls) -> PipeBudget:
        if _privileged():
            return cls(None)
        try:
            soft = int(Path("/proc/sys/fs/pipe-user-pages-soft").read_text())
        except (OSError, ValueError):
            soft = DEFAULT_PIPE_USER_PAGES_SOFT
        return cls(soft or None)  # 0: the kernel has no soft limit

    def pipe(self) -> tuple[int, int, int]:
        """A non-blocking pipe as large as the budget allows: read end, write end, the pages it holds."""
        with self._lock:
            large, default = PIPE_SIZE // PAGE_SIZE, DEFAULT_PIPE_PAGES
            if self.soft_pages is None or self.pages + large <= self.soft_pages // 2:
                want = large
            elif self.pages + default <= self.soft_pages * 3 // 4:
                want = default
            else:
                raise NoPipeRoom(f"the kernel relay's pipes hold {self.pages} pages of this user's pipe quota")
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            pages = default
            if want != default:
                with contextlib.suppress(OSError):  # the default size serves as well, only with more splices
                    pages = fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_SIZE) // PAGE_SIZE
            self.pages += pages
            return r, w, pages

    def release(self, pages: int) -> None:
        with self._lock:
            self.pages -= pages


class NoPipeRoom(OSError):
    pass


class SpliceRelay:
    """The one thread that relays every spliced tunnel; `add`, `end` and `stop` may be called from any thread."""

    def __init__(self, idle_timeout: float) -> None:
        self.idle_timeout = idle_timeout
        self._commands: queue.SimpleQueue[tuple[str, SplicedTunnel | None]] = queue.SimpleQueue()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            self._epoll = select.epoll()
        except OSError:
            os.close(self._wake)
            raise
        self._epoll.register(self._wake, select.EPOLLIN)
        self._by_fd: dict[int, SplicedTunnel] = {}
        self._registered: dict[int, int] = {}  # fd → the events epoll waits for on it
        self._lock = threading.Lock()  # a command is either taken by the thread, or refused once it has stopped
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="airlock splice relay", daemon=True)
        try:
            self._thread.start()
        except RuntimeError:
            self._epoll.close()
            os.close(self._wake)
            raise

    @property
    def running(self) -> bool:
        return not self._stopped

    def add(self, tunnel: SplicedTunnel) -> None:
        """Relay this tunnel (RelayStopped if the relay has stopped: the caller still owns the tunnel)."""
        self._send("add", tunnel)

    def end(self, tunnel: SplicedTunnel) -> None:
        """End a tunnel now (its `on_end` follows); nothing if it has ended already."""
        self._send("end", tunnel)

    def stop(self) -> None:
        """End every tunnel, then the thread (waited for up to STOP_WAIT seconds: call it off the event loop)."""
        if self._thread.is_alive():
            self._send("stop", None)
            self._thread.join(STOP_WAIT)

    def _send(self, command: str, tunnel: SplicedTunnel | None) -> None:
        with self._lock:
            if self._stopped:
                if command == "add":
                    raise RelayStopped("the splice relay has stopped")
                return
            self._commands.put((command, tunnel))
            os.eventfd_write(self._wake, 1)

    def _run(self) -> None:
        scanned = time.monotonic()
        try:
            while True:
                for fd, events in self._epoll.poll(IDLE_SCAN):
                    if fd == self._wake:
                        if not self._take_commands():
                            return
                    elif (tunnel := self._by_fd.get(fd)) is None:
                        continue
                    elif events & select.EPOLLPRI:  # no TLS or SSH peer sends it; the kernel relay cannot pass it on
                        self._finish(tunnel, URGENT_DATA)
                    else:
                        self._pump(tunnel)
                if (now := time.monotonic()) - scanned >= IDLE_SCAN:
                    scanned = now
                    self._end_idle(now)
        except Exception:
            log.exception("splice relay failed: closing every spliced tunnel")
        finally:
            self._close_all()

    def _close_all(self) -> None:
        """Every tunnel it relays or was handed ended, then no more taken."""
        with self._lock:
            self._stopped = True
        while True:
            try:
                _, tunnel = self._commands.get_nowait()
            except queue.Empty:
                break
            if tunnel is not None and tunnel.client not in self._by_fd and not tunnel.ended:
                self._by_fd[tunnel.client] = tunnel
        for tunnel in list({id(t): t for t in self._by_fd.values()}.values()):
            with contextlib.suppress(Exception):  # each one is closed, whatever another's end raises
                self._finish(tunnel, "the relay stopped")
        self._epoll.close()
        os.close(self._wake)

    def _take_commands(self) -> bool:
        """Run what other threads asked for; False once asked to stop."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._wake)
        while True:
            try:
                command, tunnel = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command == "stop":
                return False
            assert tunnel is not None
            if command == "add":
                self._by_fd[tunnel.client] = self._by_fd[tunnel.server] = tunnel
                self._pump(tunnel)
            elif self._by_fd.get(tunnel.client) is tunnel:
                # Only a tunnel this relay holds: one of a relay that failed is that relay's to close (it may be
                # closing it now), and its descriptors' numbers may already be another tunnel's here.
                self._finish(tunnel, "ended by the gateway")

    def _pump(self, tunnel: SplicedTunnel) -> None:
        try:
            moved = tunnel.upstream.pump() | tunnel.downstream.pump()
        except OSError as e:
            self._finish(tunnel, f"socket error: {e.strerror or e}")
            return
        if moved:
            tunnel.last_moved = time.monotonic()
        if tunnel.finished:
            self._finish(tunnel, None)
            return
        for fd in (tunnel.client, tunnel.server):
            self._watch(fd, tunnel.interest(fd))

    def _watch(self, fd: int, events: int) -> None:
        """Wait for `events` on fd; for none, not at all (epoll would report a hung-up socket again and again)."""
        if self._registered.get(fd, 0) == events:
            return
        if not events:
            self._epoll.unregister(fd)
            del self._registered[fd]
        elif fd in self._registered:
            self._epoll.modify(fd, events)
            self._registered[fd] = events
        else:
            self._epoll.register(fd, events)
            self._registered[fd] = events

    def _end_idle(self, now: float) -> None:
        for tunnel in {*self._by_fd.values()}:  # each once (it is there under both of its sockets)
            if now - tunnel.last_moved >= self.idle_timeout:
                self._finish(tunnel, "idle timeout")

    def _finish(self, tunnel: SplicedTunnel, error: str | None) -> None:
        tunnel.ended, tunnel.error = True, error
        for fd in (tunnel.client, tunnel.server):
            self._by_fd.pop(fd, None)
            if self._registered.pop(fd, None) is not None:
                self._epoll.unregister(fd)
        tunnel.close()
        tunnel.on_end(tunnel)


URGENT_DATA = "TCP urgent data, which the kernel relay does not pass on: the tunnel is closed"


class RelayStopped(RuntimeError):
    pass


def socket_shutdown(fd: int, how: int) -> None:
    """shutdown(2) on a raw descriptor; a socket the peer already reset is ended all the same."""
    # Family, type and protocol given: a socket object made from a bare descriptor asks the kernel for each (three
    # getsockopt calls); shutdown(2) needs none of them, and the object is let go at once.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0, fileno=fd)
    try:
        sock.shutdown(how)
    except OSError as e:
        if e.errno not in _ENDED:
            raise
    finally:
        sock.detach()


def _privileged() -> bool:
    """CAP_SYS_RESOURCE or CAP_SYS_ADMIN in this process's effective set: the pipe quota does not apply."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            effective = int(line.split()[1], 16)
            return bool(effective & (1 << _CAP_SYS_RESOURCE | 1 << _CAP_SYS_ADMIN))
    return False


def _close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
