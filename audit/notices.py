"""Denials told as they happen, one line each (`airlock run` writes them to its stderr): what was refused, why, and
the rule that would allow it — read off the audit record, so the line says what the audit line says.

A sandbox retrying in a loop, or asking for a thousand names, must not bury the terminal: the same target refused
for the same reason is told once per interval (then how many more times it was refused), and at most `burst` lines
are told per interval in all (then how many were not). Only targets that were told are remembered, so the memory
this takes is bounded by `burst` whatever the sandbox does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .record import AuditRecord

INTERVAL = 10.0
BURST = 20
# `report`: a profile in report mode let it through; it is told because the rules alone would have denied it.
_VERBS = {"deny": "denied", "report": "would deny (report mode, allowed)"}
# Audited, never told: a DNS query for a single-label name (a program asking for its machine's own name, which the
# sandbox's /etc/hosts answers, then trying DNS as well) is no denial the user could act on.
_UNTOLD = frozenset({("dns", "single_label")})

type Schedule = Callable[[float, Callable[[], None]], Any]


@dataclass
class _Told:
    start: float
    repeated: int = 0


class DenialNotices:
    def __init__(
        self,
        write: Callable[[str], None],
        interval: float = INTERVAL,
        burst: int = BURST,
        clock: Callable[[], float] = time.monotonic,
        schedule: Schedule | None = None,
    ) -> None:
        self.write, self.interval, self.burst, self.clock = write, interval, burst, clock
        self._schedule = schedule
        self._told: dict[tuple[str, str], _Told] = {}  # (target, code) → when it was told, and repeats since
        self._window = float("-inf")  # start of the interval whose lines count against `burst`
        self._lines = 0
        self._untold = 0  # denials past `burst` in this interval

    def observe(self, record: AuditRecord) -> None:
        if record.decision == "allow" or record.kind == "policy":  # `report` is told: it is what would be denied
            return
        if (record.kind, record.code) in _UNTOLD:
            return
        now = self.clock()
        target = _target(record)
        key = (target, record.code)
        if (told := self._told.get(key)) is not None:
            told.repeated += 1
            return
        if now - self._window >= self.interval:
            self._window, self._lines = now, 0
        if self._lines >= self.burst:
            if not self._untold:
                self._later(self._window + self.interval - now, self._tell_untold)
            self._untold += 1
            return
        self._lines += 1
        self._told[key] = _Told(now)
        self._later(self.interval, lambda: self._tell_repeats(key))
        verb = _VERBS.get(record.decision, "failed")
        hint = f" · to allow: {record.hint}" if record.hint else ""
        self.write(f"airlock: {verb} {target} — {record.reason}{hint}")

    def flush(self) -> None:
        """Tell every count still open (at the end of the run)."""
        for key in list(self._told):
            self._tell_repeats(key)
        self._tell_untold()

    def _later(self, delay: float, callback: Callable[[], None]) -> None:
        schedule = self._schedule or asyncio.get_running_loop().call_later
        schedule(max(delay, 0.0), callback)

    def _tell_repeats(self, key: tuple[str, str]) -> None:
        told = self._told.pop(key, None)
        if told is not None and told.repeated:
            times = "time" if told.repeated == 1 else "times"
            self.write(f"airlock: denied {key[0]} {told.repeated} more {times} in {self.interval:g} s (same reason)")

    def _tell_untold(self) -> None:
        if self._untold:
            denials = "denial" if self._untold == 1 else "denials"
            self.write(
                f"airlock: {self._untold} more {denials} in {self.interval:g} s not shown one by one "
                "(--audit FILE records each)"
            )
            self._untold = 0


def _target(record: AuditRecord) -> str:
    """What was refused, as the user would name it."""
    if record.kind == "broker":
        return f"broker call {record.method or record.path or '-'}"
    if record.kind == "dns":
        return f"DNS {record.method or 'query'} {record.host}"
    if record.host == "-":
        return "a connection"
    host = f"[{record.host}]" if ":" in record.host else record.host
    return host if record.port is None else f"{host}:{record.port}"
