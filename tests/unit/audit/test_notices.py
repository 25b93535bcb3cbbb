"""`airlock run`'s denial lines: one per denial as it happens, the audit record's reason and hint, de-duplicated
per target and reason, rate-limited in all, with counts for what was not told."""

from __future__ import annotations

from collections.abc import Callable

from airlock.audit import AuditRecord
from airlock.audit.notices import DenialNotices
from airlock.policy import ReasonCode


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, Callable[[], None]]] = []

    def schedule(self, delay: float, callback: Callable[[], None]) -> None:
        self.timers.append((self.now + delay, callback))

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = sorted((t for t in self.timers if t[0] <= self.now), key=lambda t: t[0])
        self.timers = [t for t in self.timers if t[0] > self.now]
        for _, callback in due:
            callback()


def _notices(burst: int = 20) -> tuple[DenialNotices, list[str], Clock]:
    lines: list[str] = []
    clock = Clock()
    return DenialNotices(lines.append, 10.0, burst, lambda: clock.now, clock.schedule), lines, clock


def _denied(host: str, port: int | None = 443, kind: str = "connect") -> AuditRecord:
    reason = f"{host}:{port} is not in the allowlist"
    record = AuditRecord(kind, "sbx", "10.0.0.2", host, port, "deny", reason, ReasonCode.NOT_ALLOWLISTED)  # type: ignore[arg-type]
    record.hint = f"allow: [{{host: {host}, ports: [{port}]}}]"
    return record


def test_a_denial_is_one_line_with_the_records_reason_and_hint() -> None:
    notices, lines, _ = _notices()
    notices.observe(_denied("example.com"))
    assert lines == [
        "airlock: denied example.com:443 — example.com:443 is not in the allowlist "
        "· to allow: allow: [{host: example.com, ports: [443]}]"
    ]


def test_allowed_lines_and_policy_lines_are_not_told() -> None:
    notices, lines, _ = _notices()
    notices.observe(AuditRecord("http", "sbx", "c", "a.test", 80, "allow", "allowed", ReasonCode.ALLOWED))
    notices.observe(AuditRecord("policy", "-", "-", "-", None, "deny", "refused", ReasonCode.POLICY_REFUSED))
    assert lines == []


def test_a_dns_query_for_a_single_label_name_is_not_told_a_request_for_one_is_without_a_hint() -> None:
    notices, lines, _ = _notices()
    reason = "vm is a single-label name, which the gateway never resolves (a sandbox has its own in /etc/hosts)"
    for kind, port in (("dns", None), ("http", 80)):
        notices.observe(AuditRecord(kind, "sbx", "c", "vm", port, "deny", reason, ReasonCode.SINGLE_LABEL))
    assert lines == [f"airlock: denied vm:80 — {reason}"]


def test_the_same_denial_is_told_once_per_interval_then_counted() -> None:
    notices, lines, clock = _notices()
    for _ in range(5):
        notices.observe(_denied("example.com"))
        clock.advance(1)
    assert len(lines) == 1
    clock.advance(6)  # the interval ends: the count of repeats
    assert lines[1] == "airlock: denied example.com:443 4 more times in 10 s (same reason)"
    notices.observe(_denied("example.com"))  # a new interval: told again
    assert len(lines) == 3 and lines[2].startswith("airlock: denied example.com:443 — ")


def test_another_port_or_another_reason_is_another_line() -> None:
    notices, lines, _ = _notices()
    notices.observe(_denied("example.com"))
    notices.observe(_denied("example.com", 80))
    metadata = _denied("169.254.169.254", 80)
    metadata.code, metadata.hint = ReasonCode.METADATA, None
    notices.observe(metadata)
    assert len(lines) == 3 and "to allow" not in lines[2]


def test_a_flood_of_distinct_denials_is_cut_at_the_burst_and_counted() -> None:
    notices, lines, clock = _notices(burst=3)
    for i in range(100):
        notices.observe(_denied(f"x{i}.exfil.test", kind="dns"))
    assert len(lines) == 3
    clock.advance(10)
    assert lines[-1] == "airlock: 97 more denials in 10 s not shown one by one (--audit FILE records each)"
    notices.observe(_denied("later.test"))
    assert lines[-1].startswith("airlock: denied later.test:443")


def test_flush_tells_the_counts_still_open() -> None:
    notices, lines, _ = _notices(burst=1)
    notices.observe(_denied("a.test"))
    notices.observe(_denied("a.test"))
    notices.observe(_denied("b.test"))
    notices.flush()
    assert lines[1:] == [
        "airlock: denied a.test:443 1 more time in 10 s (same reason)",
        "airlock: 1 more denial in 10 s not shown one by one (--audit FILE records each)",
    ]


def test_targets_are_named_as_the_user_would() -> None:
    notices, lines, _ = _notices()
    dns = _denied("evil.test", None, "dns")
    dns.method = "AAAA"
    notices.observe(dns)
    notices.observe(_denied("2001:db8::1", 443))
    broker = AuditRecord("broker", "sbx", "c", "-", None, "deny", "token expired", "invalid_token")
    broker.method = "create_pull_request"
    notices.observe(broker)
    assert [line.split(" — ")[0] for line in lines] == [
        "airlock: denied DNS AAAA evil.test",
        "airlock: denied [2001:db8::1]:443",
        "airlock: denied broker call create_pull_request",
    ]
