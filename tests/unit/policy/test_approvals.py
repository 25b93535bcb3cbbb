"""The policy core of approvals (policy/held_requests.py), in tables: what may be asked, the pending table and its
bounds, grants and their expiry, a person's answer; and the loader's `on_unlisted` / `ask_timeout`."""

from __future__ import annotations

import ipaddress
import itertools

import pytest

from airlock.policy import PolicyError, decide, decide_name, parse_policy
from airlock.policy.held_requests import (
    Full,
    Grant,
    Grants,
    Pending,
    PendingTable,
    Target,
    answer_problem,
    askable,
)

POLICY = parse_policy(
    """
version: 1
profiles:
  default:
    on_unlisted: ask
    ask_timeout: 30
    allow:
      - host: listed.test
        ports: [443]
    deny:
      - host: closed.test
  quiet:
    allow:
      - host: listed.test
""",
    "p.yaml",
)
ASKS, QUIET = POLICY.profile("default"), POLICY.profile("quiet")
OWN = ipaddress.ip_address("198.51.100.1")


@pytest.mark.parametrize(
    ("profile", "host", "port", "expected"),
    [
        (ASKS, "new.test", 443, True),  # no rule lists it
        (ASKS, "new.test", None, True),  # a DNS query for it
        (ASKS, "203.0.113.7", 443, True),  # a public address no rule lists
        (ASKS, "listed.test", 22, False),  # a rule lists the host, for other ports: port_not_allowed
        (ASKS, "closed.test", 443, False),  # a deny rule's doing
        (ASKS, "closed.test", None, False),
        (ASKS, "169.254.169.254", 80, False),  # hard blocks: metadata, internal, the gateway's own, sandbox links
        (ASKS, "10.0.0.1", 443, False),
        (ASKS, "127.0.0.1", 443, False),
        (ASKS, str(OWN), 443, False),
        (ASKS, "10.231.0.1", 443, False),
        (ASKS, "::ffff:169.254.169.254", 443, False),
        (QUIET, "new.test", 443, False),  # the profile does not ask
    ],
)
def test_what_may_be_asked(profile, host: str, port: int | None, expected: bool) -> None:
    decision = decide(profile, host, port) if port is not None else decide_name(profile, host)
    assert not decision.allow
    assert askable(profile, host, port, decision, frozenset({OWN})) is expected


def test_the_loader_reads_on_unlisted_and_ask_timeout() -> None:
    assert (ASKS.on_unlisted, ASKS.ask_timeout) == ("ask", 30.0)
    assert (QUIET.on_unlisted, QUIET.ask_timeout) == ("deny", 60.0)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("on_unlisted: allow", "p.yaml:4: on_unlisted must be 'deny' or 'ask'"),
        ("on_unlisted: [ask]", "p.yaml:4: on_unlisted must be 'deny' or 'ask'"),
        ("ask_timeout: 0", "p.yaml:4: ask_timeout must be greater than 0 and at most 3600 seconds"),
        ("ask_timeout: 3601", "p.yaml:4: ask_timeout must be greater than 0 and at most 3600 seconds"),
        ("ask_timeout: -5", "p.yaml:4: ask_timeout must be a plain decimal number of seconds"),
        ("ask_timeout: 1m", "p.yaml:4: ask_timeout must be a plain decimal number of seconds"),
        ("ask_timeout: .inf", "p.yaml:4: ask_timeout must be a plain decimal number of seconds"),
    ],
)
def test_the_loader_refuses_bad_approval_settings(line: str, error: str) -> None:
    text = f"version: 1\nprofiles:\n  default:\n    {line}\n"
    with pytest.raises(PolicyError) as raised:
        parse_policy(text, "p.yaml")
    assert raised.value.errors == [error]


def test_asking_is_part_of_the_policy_hash() -> None:
    base = "version: 1\nprofiles:\n  default:\n    allow: [{host: a.test}]\n"
    asking = base + "    on_unlisted: ask\n"
    hashes = {parse_policy(text).hash for text in (base, asking, asking + "    ask_timeout: 5\n")}
    assert len(hashes) == 3
    assert parse_policy(base + "    on_unlisted: deny\n").hash == parse_policy(base).hash


def _table(**limits: int) -> tuple[PendingTable, itertools.count[int]]:
    return PendingTable(**limits), itertools.count()


def _ask(table: PendingTable, ids: itertools.count[int], sandbox: str, host: str, now: float = 0.0) -> Pending | Full:
    return table.ask(Target(sandbox, host, 443), "default", "connect", "10.0.0.2", now, 10.0, lambda: f"id{next(ids)}")


def test_the_same_target_asked_twice_shares_one_entry() -> None:
    table, ids = _table()
    first, second = _ask(table, ids, "a", "x.test"), _ask(table, ids, "a", "x.test")
    assert isinstance(first, Pending) and first is second
    assert (first.waiting, first.asks) == (2, 2)
    table.leave(first)
    assert first.waiting == 1
    table.ask(Target("a", "x.test", 80), "default", "http", "-", 0.0, 10.0, lambda: "p80")
    other_sandbox = _ask(table, ids, "b", "x.test")
    assert {e.id for e in table.pending()} == {first.id, "p80", other_sandbox.id}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("limits", "asks", "expected"),
    [
        ({"per_sandbox": 2}, [("a", "1"), ("a", "2"), ("a", "3")], ["id0", "id1", "full"]),
        ({"per_sandbox": 2}, [("a", "1"), ("a", "2"), ("b", "3")], ["id0", "id1", "id2"]),
        ({"per_sandbox": 2}, [("a", "1"), ("a", "2"), ("a", "1")], ["id0", "id1", "id0"]),  # joins: no new entry
        ({"total": 2}, [("a", "1"), ("b", "2"), ("c", "3")], ["id0", "id1", "full"]),
        ({"per_sandbox": 0}, [("a", "1")], ["full"]),
    ],
)
def test_pending_requests_are_bounded(limits: dict[str, int], asks: list[tuple[str, str]], expected: list[str]) -> None:
    table, ids = _table(**limits)
    got = [_ask(table, ids, sandbox, f"{host}.test") for sandbox, host in asks]
    assert [entry.id if isinstance(entry, Pending) else "full" for entry in got] == expected


def test_entries_expire_at_their_deadline_and_leave_the_table() -> None:
    table, ids = _table()
    early = _ask(table, ids, "a", "early.test", now=0.0)
    late = _ask(table, ids, "a", "late.test", now=5.0)
    assert table.expired(9.9) == []
    assert table.expired(10.0) == [early]
    assert table.pending() == [late] and table.get(early.id) is None  # type: ignore[union-attr]
    again = _ask(table, ids, "a", "early.test", now=11.0)  # asked anew: a new entry with a new id
    assert isinstance(again, Pending) and again.id != early.id  # type: ignore[union-attr]
    assert table.pop(late.id) is late and table.pop(late.id) is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("granted_port", "until", "asked_port", "now", "found"),
    [
        (443, None, 443, 1e9, True),  # the sandbox's life
        (443, None, 80, 0.0, False),  # another port
        (443, 100.0, 443, 99.0, True),
        (443, 100.0, 443, 100.0, False),  # expired
        (443, None, None, 0.0, True),  # DNS may resolve a name granted on any port
        (8443, None, None, 0.0, True),
        (None, None, 443, 0.0, True),  # a DNS approval opens what {host: name} opens: the default port
        (None, None, 80, 0.0, False),
        (None, None, None, 0.0, True),
    ],
)
def test_grants(granted_port: int | None, until: float | None, asked_port: int | None, now: float, found: bool) -> None:
    grants = Grants()
    grants.add(Grant(Target("a", "x.test", granted_port), until, "root", "id0"))
    assert (grants.find("a", "x.test", asked_port, now) is not None) is found
    assert grants.find("b", "x.test", asked_port, now) is None  # another sandbox's grant never applies
    assert grants.find("a", "y.test", asked_port, now) is None


def test_an_expired_grant_is_forgotten() -> None:
    grants = Grants()
    grants.add(Grant(Target("a", "x.test", 443), 10.0, "root", "id0"))
    assert grants.find("a", "x.test", 443, 11.0) is None
    assert grants.find("a", "x.test", 443, 0.0) is None  # gone, not just out of date


@pytest.mark.parametrize(
    ("scope", "ttl", "problem"),
    [
        ("once", None, None),
        ("sandbox", None, None),
        ("sandbox", 3600, None),
        ("policy", None, None),
        ("forever", None, "scope must be one of once, sandbox, policy"),
        (None, None, "scope must be one of once, sandbox, policy"),
        ("once", 60, "ttl applies to scope sandbox only"),
        ("sandbox", 0, "ttl must be more than 0 and at most 604800 seconds"),
        ("sandbox", 10**9, "ttl must be more than 0 and at most 604800 seconds"),
        ("sandbox", True, "ttl must be a number of seconds"),
        ("sandbox", "1h", "ttl must be a number of seconds"),
        ("sandbox", float("nan"), "ttl must be a number of seconds"),
    ],
)
def test_answer_problems(scope: object, ttl: object, problem: str | None) -> None:
    assert answer_problem(scope, ttl) == problem


@pytest.mark.parametrize(
    ("target", "rule", "text"),
    [
        (Target("a", "x.test", 8443), ("x.test", [8443]), "x.test:8443"),
        (Target("a", "x.test", None), ("x.test", [443]), "x.test"),
        (Target("a", "203.0.113.7", 443), ("203.0.113.7/32", [443]), "203.0.113.7:443"),
        (Target("a", "2001:db8::1", 443), ("2001:db8::1/128", [443]), "[2001:db8::1]:443"),
    ],
)
def test_the_rule_a_policy_approval_writes(target: Target, rule: tuple[str, list[int]], text: str) -> None:
    assert target.rule() == rule
    assert str(target) == text
