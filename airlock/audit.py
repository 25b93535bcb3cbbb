"""Audit sink: one JSON line per decision, to a file and/or stdout.

Lines are buffered and written out by `flush()`, which the gateway calls every 100 ms and on shutdown: one
write per batch instead of one per DNS query. A gateway killed with SIGKILL can lose the last 100 ms of lines.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

from airlock.policy import AuditRecord, RepeatedDecisions

FLUSH_LINES = 512


class AuditLog:
    def __init__(self, path: str | Path | None = None, stdout: bool = False) -> None:
        self._streams: list[TextIO] = []
        self._owned: list[TextIO] = []
        self._pending: list[str] = []
        if path is not None:
            # O_NOFOLLOW: a symlink planted where the log goes must not make the gateway append to another file.
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o640)
            stream = open(fd, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            self._streams.append(stream)
            self._owned.append(stream)
        if stdout:
            self._streams.append(sys.stdout)

    def emit(self, record: AuditRecord | RepeatedDecisions) -> None:
        if not self._streams:
            return
        self._pending.append(record.to_json())
        if len(self._pending) >= FLUSH_LINES:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        text = "\n".join(self._pending) + "\n"
        self._pending.clear()
        for stream in self._streams:
            stream.write(text)
            stream.flush()

    def close(self) -> None:
        self.flush()
        for stream in self._owned:
            stream.close()
        self._owned.clear()
        self._streams.clear()
