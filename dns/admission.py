"""Who the sandbox DNS server answers at all, and how much: the limits a query meets before it is judged.

- the asking address names the sandbox (the live policy's registry); an address of no sandbox is answered REFUSED
  and audited, a few times per interval, then counted into one summary line and not answered (a flood of them
  costs neither a task nor an audit line each);
- queries per second per sandbox (a token bucket; bursts of twice the rate absorbed): beyond, no answer at all
  (no amplification);
- queries waiting on upstream at once per sandbox: beyond, SERVFAIL without asking (a silent upstream would
  otherwise hold a socket per distinct name at the full query rate);
- open TCP connections per sandbox: beyond, closed at once.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from airlock.audit import AuditRecord, AuditThrottle
from airlock.policy import LivePolicy, ReasonCode, Sandbox, TokenBuckets

STRANGER = "query from an address that belongs to no sandbox"
NO_SANDBOX = "-"  # what the audit and the TCP count name the sources that are no sandbox


@dataclass
class DnsSettings:
    rate_per_second: float = 100.0  # per sandbox; bursts of twice that are absorbed
    answer_timeout: float = 4.0  # the whole upstream exchange; then SERVFAIL
    max_tcp_per_sandbox: int = 16  # open TCP connections; more are closed at once (no exhausting the gateway)
    max_inflight_per_sandbox: int = 32  # queries waiting on upstream at once; more get SERVFAIL, nothing is asked
    tcp_timeout: float = 10.0  # to receive each TCP query, and to hand over each reply
    # How long a query for a name a person is asked about (`on_unlisted: ask`) is held: below the ~5 s after which
    # stub resolvers give up and retry. Undecided by then: SERVFAIL, the entry stays pending, and the retry (or the
    # proxy request that comes next) waits on it again.
    approval_hold: float = 2.0
    # Why the audit log cannot be written, or None: while it cannot, every query is SERVFAIL (fail closed).
    audit_failure: Callable[[], str | None] = field(default=lambda: None)


class Overloaded(Exception):
    """The sandbox already has max_inflight_per_sandbox queries waiting on upstream."""


class Admission:
    def __init__(
        self,
        live: LivePolicy,
        settings: DnsSettings,
        emit: Callable[[AuditRecord], None],
        stats: Counter[str] | None = None,
    ) -> None:
        self.live, self.settings = live, settings
        self.stats: Counter[str] = stats if stats is not None else Counter()
        rate = settings.rate_per_second
        self._buckets = TokenBuckets(rate, max(1, int(rate * 2)))
        self.strangers = AuditThrottle(emit)
        self._inflight: Counter[str] = Counter()  # per sandbox id: queries waiting on upstream
        self._tcp: Counter[str] = Counter()  # per sandbox id (NO_SANDBOX for the rest): open TCP connections

    def admit(self, client: str, now: float | None = None) -> Sandbox | Literal[False] | None:
        """The asking sandbox; None for an address of no sandbox, whose query is still answered (REFUSED) and
        audited; False to drop the query unanswered: over its sandbox's rate, or one more from addresses of no
        sandbox beyond their few audit lines per interval (counted into one summary line instead)."""
        sandbox = self.live.current.registry.identify(client)
        now = time.monotonic() if now is None else now
        if sandbox is None:
            if self.strangers.admit("dns", NO_SANDBOX, STRANGER, ReasonCode.UNKNOWN_SANDBOX, client, now):
                return None
            self.stats["dropped_unknown_source"] += 1
            return False
        if not self._buckets.take(sandbox.id, now):
            self.stats["rate_limited"] += 1
            return False
        return sandbox

    @contextlib.contextmanager
    def upstream(self, sandbox: str) -> Iterator[None]:
        """Hold one of the sandbox's places for a query waiting on upstream; Overloaded when none is left."""
        if self._inflight[sandbox] >= self.settings.max_inflight_per_sandbox:
            self.stats["over_inflight_limit"] += 1
            raise Overloaded
        self._inflight[sandbox] += 1
        try:
            yield
        finally:
            self._inflight[sandbox] -= 1

    def open_tcp(self, client: str) -> str | None:
        """Count a new TCP connection from `client`: the owner to pass to close_tcp(), or None when its sandbox
        (or the sources of no sandbox, together) already has max_tcp_per_sandbox open."""
        sandbox = self.live.current.registry.identify(client)
        owner = sandbox.id if sandbox is not None else NO_SANDBOX
        if self._tcp[owner] >= self.settings.max_tcp_per_sandbox:
            self.stats["tcp_over_limit"] += 1
            return None
        self._tcp[owner] += 1
        return owner

    def close_tcp(self, owner: str) -> None:
        self._tcp[owner] -= 1

    def tcp_connections(self, owner: str) -> int:
        return self._tcp[owner]

    def flush(self) -> None:
        """Write the summary lines still open (at shutdown)."""
        self.strangers.flush()
