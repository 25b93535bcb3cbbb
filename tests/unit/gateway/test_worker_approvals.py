"""A proxy worker's requests held for a person by the supervisor's approvals desk, over a real channel pair: the
worker asks only what may be asked, the desk's decision releases it, no answer in time (or a malformed request) is
a denial, and the supervisor reads a worker's request strictly (JSON, never unpickled)."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from airlock.audit import AuditRecord
from airlock.gateway.approval_desk import Approvals
from airlock.gateway.worker_approvals import ApprovalRequest, ChannelAsker, WorkerApprovals
from airlock.gateway.worker_channel import JSON, PICKLED, Channel, channel_pair, read_message
from airlock.policy import Decision, LivePolicy, ReasonCode, Sandbox, SandboxRegistry, decide, parse_policy

ASKING = parse_policy(
    "version: 1\nprofiles:\n  default:\n    on_unlisted: ask\n    ask_timeout: 30\n    allow:\n"
    "      - host: allowed.test\n    deny:\n      - host: closed.test\n",
    "asks.yaml",
)
SANDBOX = Sandbox("sbx", "default", ipaddress.ip_network("10.9.0.0/24"))


@dataclass
class _Pair:
    asker: ChannelAsker
    desk: Approvals
    live: LivePolicy
    lines: list[AuditRecord]
    received: list[tuple[str, Any]]  # what the supervisor's end got, as it got it


@pytest.fixture
async def pair() -> AsyncIterator[_Pair]:
    loop = asyncio.get_running_loop()
    ours, theirs = channel_pair()
    live = LivePolicy(ASKING, SandboxRegistry([SANDBOX]))
    lines: list[AuditRecord] = []
    desk = Approvals(lines.append)
    bridge = WorkerApprovals(desk, live)
    received: list[tuple[str, Any]] = []
    held: set[asyncio.Task[None]] = set()

    def supervisor_receives(kind: str, body: Any) -> None:
        received.append((kind, body))
        if kind == "approval":
            bridge.hold(supervisor, ApprovalRequest.read(body), held)

    supervisor = Channel(ours, supervisor_receives, lambda: None, sends=PICKLED, receives=JSON)
    asker: ChannelAsker
    worker = Channel(theirs, lambda kind, body: asker.answered(body), lambda: None, sends=JSON, receives=PICKLED)
    asker = ChannelAsker(worker, margin=0.5)
    supervisor.attach(loop)
    worker.attach(loop)
    yield _Pair(asker, desk, live, lines, received)
    await desk.close()
    supervisor.close()
    worker.close()


async def _ask(pair: _Pair, host: str, port: int = 80) -> Decision:
    live = pair.live.current
    return await pair.asker.decide(live, SANDBOX, host, port, decide(live.profile(SANDBOX), host, port), "http", "c")


async def _pending(desk: Approvals, n: int = 1) -> list[dict[str, Any]]:
    async with asyncio.timeout(5):
        while len(pending := await desk.pending()) < n:
            await asyncio.sleep(0.01)
    return pending


async def test_a_workers_request_is_held_by_the_desk_and_released_with_the_answer(pair: _Pair) -> None:
    held = asyncio.ensure_future(_ask(pair, "evil.test"))
    [entry] = await _pending(pair.desk)
    assert (entry["sandbox"], entry["target"], entry["kind"]) == ("sbx", "evil.test:80", "http")
    assert not held.done()
    answer = await pair.desk.approve(entry["id"], "once", None, "alice")
    assert answer["released"] == 1
    decision = await asyncio.wait_for(held, 5)
    assert decision.allow and decision.code is ReasonCode.APPROVED and "approved by alice" in decision.reason
    denied = asyncio.ensure_future(_ask(pair, "evil.test"))
    [entry] = await _pending(pair.desk)
    await pair.desk.deny(entry["id"], "bob")
    decision = await asyncio.wait_for(denied, 5)
    assert not decision.allow and decision.code is ReasonCode.APPROVAL_DENIED
    assert [r.decision for r in pair.lines if r.kind == "approval"] == ["allow", "deny"]


async def test_what_may_not_be_asked_is_answered_in_the_worker_without_a_message(pair: _Pair) -> None:
    for host in ("closed.test", "169.254.169.254"):
        decision = await _ask(pair, host)
        assert not decision.allow and decision.code is not ReasonCode.APPROVAL_PENDING
    await asyncio.sleep(0.1)
    assert pair.received == [] and await pair.desk.pending() == []


async def test_no_answer_within_the_hold_is_a_denial(pair: _Pair) -> None:
    # The desk holds it for the profile's ask_timeout; the worker gives up after `hold` and the margin: denied.
    live = pair.live.current
    decision = decide(live.profile(SANDBOX), "evil.test", None)
    started = asyncio.get_running_loop().time()
    answer = await pair.asker.decide(live, SANDBOX, "evil.test", None, decision, "dns", "c", hold=0.2)
    assert not answer.allow and answer.code in (ReasonCode.APPROVAL_PENDING, ReasonCode.APPROVAL_TIMEOUT)
    assert asyncio.get_running_loop().time() - started < 2
    assert pair.asker.waiting == 0


async def test_a_lost_supervisor_is_a_denial() -> None:
    ours, theirs = channel_pair()
    worker = Channel(theirs, lambda kind, body: None, lambda: None, sends=JSON, receives=PICKLED)
    worker.attach(asyncio.get_running_loop())
    asker = ChannelAsker(worker, margin=0.2)
    live = LivePolicy(ASKING, SandboxRegistry([SANDBOX])).current
    unlisted = decide(live.profile(SANDBOX), "evil.test", 80)
    ours.close()  # nobody answers: no approval ever comes
    answer = await asker.decide(live, SANDBOX, "evil.test", 80, unlisted, "http", "c", hold=0.1)
    assert not answer.allow
    worker.close()
    assert await asker.decide(live, SANDBOX, "evil.test", 80, unlisted, "http", "c") is unlisted  # closed: denied


@pytest.mark.parametrize(
    "body",
    [
        {"ask": 1},
        [1, "sbx", "evil.test", 80, "r", "not_a_code", None, "http", "c", None],
        [1, "sbx", "evil.test", 70000, "r", "not_allowlisted", None, "http", "c", None],
        [True, "sbx", "evil.test", 80, "r", "not_allowlisted", None, "http", "c", None],
        [1, "sbx", ["evil.test"], 80, "r", "not_allowlisted", None, "http", "c", None],
        [1, "sbx", "evil.test", 80, "r", "not_allowlisted", None, "http", "c", -1],
    ],
)
def test_a_malformed_request_from_a_worker_is_refused(body: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        ApprovalRequest.read(body)


async def test_a_request_naming_a_sandbox_the_supervisor_does_not_know_stays_denied(pair: _Pair) -> None:
    bridge = WorkerApprovals(pair.desk, pair.live)
    ours, theirs = channel_pair()
    channel = Channel(ours, lambda kind, body: None, lambda: None)
    request = ApprovalRequest.read([7, "ghost", "evil.test", 80, "r", "not_allowlisted", None, "http", "c", None])
    await bridge.answer(channel, request)
    assert await pair.desk.pending() == []
    theirs.setblocking(False)
    kind, (ask, decision) = read_message(theirs)
    assert (kind, ask, decision.allow, decision.code) == ("approval", 7, False, ReasonCode.NOT_ALLOWLISTED)
    channel.close()
    theirs.close()
