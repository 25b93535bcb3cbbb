"""Audit sink: one JSON line per decision, to a file and/or stdout.

Lines are buffered and written out by `flush()`, which the gateway calls every 100 ms and on shutdown: one
write per batch instead of one per DNS query. A gateway killed with SIGKILL can lose the last 100 ms of lines.

A write that fails (disk full, file system gone read-only, a pipe nobody reads) makes `failure` say why, and the
gateway denies every new decision until a write succeeds again: nothing is allowed that cannot be audited. The
lines that could not be written wait (up to MAX_WAITING_BYTES) and go out first once writing works again. A file
that was removed or renamed away (log rotation) is noticed at the next write, and a new one is created at the path:
the lines that follow are never written into a file nobody can find.

The log's folder is held by a descriptor from the start, and a new file is only ever made in that folder, while it
is still the one at its path: a folder renamed away and replaced (by another folder, or a symlink to one) is never
followed — the lines go on into the file already open, and stderr says so once.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from .record import AuditRecord, RepeatedDecisions

FLUSH_LINES = 512
MAX_WAITING_BYTES = 32 << 20  # lines waiting while the log cannot be written; more are counted and dropped
REPORT_INTERVAL = 10.0  # while the log cannot be written, stderr is told again this often

log = logging.getLogger("airlock.audit")


class _Folder:
    """The folder of a log file, held by a descriptor, and the identity (device, inode) it had at its path."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        st = os.fstat(self.fd)
        self.identity = st.st_dev, st.st_ino

    def in_place(self) -> bool:
        """Whether the path still leads to this folder (not renamed away, nor replaced, nor a symlink on the way
        turned elsewhere)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity

    def open_log(self, name: str) -> int:
        # O_NOFOLLOW: a symlink planted where the log goes must not make the gateway append to another file.
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(name, flags, 0o640, dir_fd=self.fd)

    def close(self) -> None:
        os.close(self.fd)


class _Sink:
    """One destination: its file descriptor and the bytes it has not taken yet; a file's with its folder, held."""

    def __init__(self, name: str, fd: int, folder: _Folder | None = None) -> None:
        self.name, self.fd, self.folder = name, fd, folder
        self.waiting = bytearray()
        self.error: str | None = None
        self.stranded = False  # the folder is no longer at its path: the lines go on into the open file

    @classmethod
    def open(cls, path: str) -> _Sink:
        folder = _Folder(os.path.dirname(path) or ".")
        try:
            return cls(path, folder.open_log(os.path.basename(path)), folder)
        except BaseException:
            folder.close()
            raise

    def write(self, data: bytes) -> int:
        """Queue `data` (dropped when too much already waits: the count of lines lost) and write out what waits."""
        lost = 0
        if len(self.waiting) + len(data) > MAX_WAITING_BYTES:
            lost = data.count(b"\n")
        else:
            self.waiting += data
        try:
            if self.folder is not None:
                self._follow_path(self.folder)
            while self.waiting:
                written = os.write(self.fd, self.waiting)
                del self.waiting[:written]
        except OSError as e:
            self.error = e.strerror or type(e).__name__
        else:
            self.error = None
        return lost

    def _follow_path(self, folder: _Folder) -> None:
        """Reopen the path when the open file is no longer there (removed, or renamed away by log rotation)."""
        current = os.fstat(self.fd)
        try:
            named = os.stat(os.path.basename(self.name), dir_fd=folder.fd, follow_symlinks=False)
            if (named.st_dev, named.st_ino) == (current.st_dev, current.st_ino):
                return
        except FileNotFoundError:
            pass
        if self._stranded(folder):
            return
        fd = folder.open_log(os.path.basename(self.name))
        os.close(self.fd)
        self.fd = fd
        log.warning("audit log %s was removed or replaced: writing on in a new file at that path", self.name)

    def _stranded(self, folder: _Folder) -> bool:
        """Whether the folder was moved from its path (said once): then no file is made anew, in it or elsewhere."""
        if folder.in_place():
            self.stranded = False
            return False
        if not self.stranded:
            log.error(
                "audit log folder %s was moved or replaced: writing on to the file already open, never into a "
                "folder put in its place", folder.path,
            )  # fmt: skip
        self.stranded = True
        return True

    def reopen(self) -> None:
        """A new file descriptor for the path (the old one is closed); on failure the old one stays in use."""
        assert self.folder is not None
        if self._stranded(self.folder):
            return
        try:
            fd = self.folder.open_log(os.path.basename(self.name))
        except OSError as e:
            log.error("audit log %s not reopened (%s): writing on to the file already open", self.name, e.strerror)
            return
        os.close(self.fd)
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)
        if self.folder is not None:
            self.folder.close()


class AuditLog:
    def __init__(self, path: str | Path | None = None, stdout: bool = False) -> None:
        self._sinks: list[_Sink] = []
        self._owned: list[_Sink] = []
        self._pending: list[str] = []
        self._lost = 0  # lines dropped since the log last could be written
        self._reported = 0.0  # when stderr was last told that the log cannot be written
        if path is not None:
            sink = _Sink.open(str(path))
            self._sinks.append(sink)
            self._owned.append(sink)
        if stdout:
            self._sinks.append(_Sink("stdout", sys.stdout.fileno()))
        self.failure: str | None = None  # why the log cannot be written now; None while it can
        # For the gateway's metrics: failed writes and dropped lines since start, and when nothing last waited.
        self.write_errors = 0
        self.lines_lost = 0
        self._current_at = time.monotonic()

    def emit(self, record: AuditRecord | RepeatedDecisions) -> None:
        if not self._sinks:
            return
        self._pending.append(record.to_json())
        if len(self._pending) >= FLUSH_LINES:
            self.flush()

    def emit_lines(self, lines: str) -> None:
        """Whole lines encoded elsewhere (a proxy worker's, newline-separated, no newline at the end): written
        with the next flush, each line whole, like this process's own."""
        if not self._sinks or not lines:
            return
        self._pending.append(lines)
        if len(self._pending) >= FLUSH_LINES:
            self.flush()

    def flush(self) -> None:
        if not self._pending and self.failure is None:
            self._current_at = time.monotonic()
            return
        data = ("\n".join(self._pending) + "\n").encode() if self._pending else b""
        self._pending.clear()
        for sink in self._sinks:
            lost = sink.write(data)
            self._lost += lost
            self.lines_lost += lost
            self.write_errors += sink.error is not None
        errors = [f"{s.name}: {s.error}" for s in self._sinks if s.error is not None]
        if not errors:
            self._current_at = time.monotonic()
        self._report(errors)

    @property
    def pending_lines(self) -> int:
        """Lines waiting for the next flush."""
        return len(self._pending)

    @property
    def waiting_bytes(self) -> int:
        """Bytes of lines a failed write left waiting (the most any destination holds)."""
        return max((len(sink.waiting) for sink in self._sinks), default=0)

    def lag(self) -> float:
        """Seconds since the log last held nothing unwritten: the oldest waiting line has waited at most this long."""
        if not self._pending and not self.waiting_bytes:
            return 0.0
        return time.monotonic() - self._current_at

    def _report(self, errors: list[str]) -> None:
        """Say it on stderr when the log stops or starts working again, and every REPORT_INTERVAL in between."""
        now = time.monotonic()
        if errors:
            failure = "; ".join(errors)
            waiting = max(len(s.waiting) for s in self._sinks)
            if self.failure is None or now - self._reported >= REPORT_INTERVAL:
                log.error(
                    "AUDIT LOG CANNOT BE WRITTEN (%s): every new request and DNS query is denied until it can; "
                    "%d bytes of lines waiting, %d lines lost",
                    failure, waiting, self._lost,
                )  # fmt: skip
                self._reported = now
            self.failure = failure
        elif self.failure is not None:
            log.warning(
                "audit log written again: requests and DNS queries are decided again (%d lines lost)", self._lost
            )
            self.failure, self._lost = None, 0

    def reopen(self) -> None:
        """Write out what waits, then open each file anew at its path: SIGUSR1, as log rotation sends it after
        moving the file away (`postrotate`). A file moved away is also noticed at the next write without it."""
        self.flush()
        for sink in self._owned:
            sink.reopen()

    def close(self) -> None:
        self.flush()
        if waiting := sum(len(sink.waiting) for sink in self._sinks):
            log.error("audit log closed with %d bytes of lines that could not be written", waiting)
        for sink in self._owned:
            sink.close()
        self._owned.clear()
        self._sinks.clear()
