"""Audit lines for refusals that come in floods, shared by the sandbox DNS server and the proxy.

A query or connection from an address of no sandbox, or one beyond a sandbox's connection cap, is refused at once;
writing one audit line (and, for DNS, spawning one task) for each would let a flood cost the gateway more than the
refusal saves. Each kind of refusal gets `burst` lines one by one per interval; the rest are counted, and one
summary line at the end of the interval says how many there were and from which clients.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from .record import AuditRecord, Kind

MAX_CLIENTS = 32  # distinct clients named in one summary line
REFUSAL_LINES = 10  # refusals of one kind audited one by one per interval, by default


@dataclass
class _Window:
    start: float
    audited: int = 0
    suppressed: int = 0
    clients: Counter[str] = field(default_factory=Counter)


class AuditThrottle:
    def __init__(self, emit: Callable[[AuditRecord], None], interval: float = 10.0, burst: int = REFUSAL_LINES) -> None:
        self.emit, self.interval, self.burst = emit, interval, burst
        # one window per kind of refusal: (kind, sandbox, reason, code), a handful per sandbox
        self._windows: dict[tuple[Kind, str, str, str], _Window] = {}

    def admit(self, kind: Kind, sandbox: str, reason: str, code: str, client: str, now: float | None = None) -> bool:
        """May this refusal have its own audit line (and any work that goes with it)? If not, it is counted into
        the summary line of its kind, written when the interval ends. `reason` must not vary per event."""
        now = time.monotonic() if now is None else now
        key = (kind, sandbox, reason, code)
        window = self._windows.get(key)
        if window is None or (not window.suppressed and now - window.start >= self.interval):
            window = self._windows[key] = _Window(now)
        if window.audited < self.burst:
            window.audited += 1
            return True
        if not window.suppressed:
            asyncio.get_running_loop().call_later(window.start + self.interval - now, self._summarize, key)
        window.suppressed += 1
        if client in window.clients or len(window.clients) < MAX_CLIENTS:
            window.clients[client] += 1
        return False

    def _summarize(self, key: tuple[Kind, str, str, str]) -> None:
        window = self._windows.pop(key, None)
        if window is None or not window.suppressed:
            return  # already written by flush()
        kind, sandbox, reason, code = key
        record = AuditRecord(
            kind, sandbox, "-", "-", None, "deny",
            f"{window.suppressed} more in the last {self.interval:g} s, not audited one by one: {reason}", code,
        )  # fmt: skip
        record.extra = {"suppressed": window.suppressed, "clients": dict(window.clients.most_common())}
        self.emit(record)

    def flush(self) -> None:
        """Write the summaries of every interval still open (at shutdown)."""
        for key in [k for k, w in self._windows.items() if w.suppressed]:
            self._summarize(key)
