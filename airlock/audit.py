"""Audit sink: one JSON line per decision, to a file and/or stdout, flushed as written."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from airlock.policy import AuditRecord


class AuditLog:
    def __init__(self, path: str | Path | None = None, stdout: bool = False) -> None:
        self._streams: list[TextIO] = []
        self._owned: list[TextIO] = []
        if path is not None:
            stream = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - closed in close()
            self._streams.append(stream)
            self._owned.append(stream)
        if stdout:
            self._streams.append(sys.stdout)

    def emit(self, record: AuditRecord) -> None:
        line = record.to_json() + "\n"
        for stream in self._streams:
            stream.write(line)
            stream.flush()

    def close(self) -> None:
        for stream in self._owned:
            stream.close()
        self._owned.clear()
        self._streams.clear()
