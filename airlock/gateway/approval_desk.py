"""Approvals at run time: the futures held requests await and their deadlines (the policy file a `--scope policy`
approval writes: `approval_writer`; the webhook: `approval_webhook`; the admin routes a person answers through:
`approval_routes`; approvals as listed and as the fleet's store shares them: `approval_shared`).

The bookkeeping (what may be asked, the pending table, grants) is the policy core's (policy/held_requests.py). Here a
pending entry has one future, which every request for the same target awaits (shielded: a request that gives up
never cancels the others' answer); the loop's timer ends it at the profile's `ask_timeout`, as a denial.

Gateways that share a broker store (a fleet on PostgreSQL, `SharedApprovals`) share their approvals too: a request
held on one is listed by every replica and may be answered on any; the answer reaches the replica that holds it,
which releases its requests, and a sandbox-scope grant is in force on every replica. A policy-scope answer writes a
policy file, which is the replica's own: it is given where the request is held.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shlex
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from airlock.audit import AuditRecord
from airlock.gateway.approval_shared import SharedApprovals, listed, listed_remote
from airlock.gateway.approval_webhook import Webhook
from airlock.gateway.approval_writer import PolicyWriter
from airlock.gateway.auditing import tell
from airlock.gateway.errors import ApprovalError
from airlock.policy import Decision, Sandbox, Snapshot
from airlock.policy.held_requests import (
    Full,
    Grant,
    Grants,
    Pending,
    PendingTable,
    Scope,
    Target,
    answer_problem,
    approved,
    denied,
    may_ask,
    refused_full,
    still_pending,
    timed_out,
)
from airlock.runs import airlock_command

log = logging.getLogger("airlock.approvals")

REMOTE_RELEASE_WAIT = 2.0  # seconds an answer given here waits for the replica holding the request to say it released
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True, slots=True)
class Ruling:
    """A pending entry's end: a person's answer (scope None: denied), or the deadline (`by` None)."""

    scope: Scope | None
    by: str | None
    approval: str
    timeout: float = 0.0

    def decision(self, hint: str | None) -> Decision:
        if self.by is None:
            return timed_out(self.timeout, self.approval, hint)
        if self.scope is None:
            return denied(self.by, self.approval, hint)
        return approved(self.by, self.scope, self.approval)


class Approvals:
    """The gateway's one approvals desk: proxy and DNS await `decide`; the admin routes call `approve`/`deny`."""

    def __init__(
        self,
        emit: Callable[[AuditRecord], None],
        webhook: str | None = None,
        writer: PolicyWriter | None = None,
        table: PendingTable | None = None,
        admin: str | None = None,
        shared: Callable[[], SharedApprovals | None] = lambda: None,
    ) -> None:
        self.emit, self.writer = emit, writer
        self.shared = shared  # the fleet's approvals, asked each time (the store they live in opens with the broker)
        self.admin = admin  # the admin listener a person answers through: the command each request tells names it
        self.table = table or PendingTable()
        self.grants = Grants()
        self.webhook = Webhook(webhook) if webhook else None
        self._futures: dict[str, asyncio.Future[Ruling]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._following: dict[str, asyncio.Task[None]] = {}  # pending entries, for an answer given on another replica
        self._tasks: set[asyncio.Task[None]] = set()  # writes to the shared store, under way

    async def decide(
        self,
        live: Snapshot,
        sandbox: Sandbox,
        host: str,
        port: int | None,
        decision: Decision,
        kind: str,
        client: str,
        hold: float | None = None,
    ) -> Decision:
        if not may_ask(live, sandbox, host, port, decision):
            return decision
        profile = live.profile(sandbox)
        loop = asyncio.get_running_loop()
        if (grant := self.grants.find(sandbox.id, host, port, loop.time())) is not None:
            return grant.decision()
        if (grant := await self._shared_grant(sandbox.id, host, port)) is not None:
            return grant.decision()
        target = Target(sandbox.id, host, port)
        entry = self.table.ask(target, profile.name, kind, client, loop.time(), profile.ask_timeout, _new_id)
        if isinstance(entry, Full):
            return refused_full(entry, decision.hint)
        future = self._futures.get(entry.id) or self._open(entry, profile.ask_timeout)
        try:
            ruling = await asyncio.wait_for(asyncio.shield(future), hold)
        except TimeoutError:
            return still_pending(hold or 0.0, entry.id, decision.hint)
        finally:
            self.table.leave(entry)
        return ruling.decision(decision.hint)

    async def _shared_grant(self, sandbox: str, host: str, port: int | None) -> Grant | None:
        """A sandbox-scope grant another replica of the fleet made, if one is in force."""
        shared = self.shared()
        if shared is None:
            return None
        loop, offset = asyncio.get_running_loop(), time.time() - asyncio.get_running_loop().time()
        found = Grants()
        for grant_port, until, by, approval in await shared.grants(sandbox, host):
            found.add(Grant(Target(sandbox, host, grant_port), None if until is None else until - offset, by, approval))
        return found.find(sandbox, host, port, loop.time())

    def _open(self, entry: Pending, timeout: float) -> asyncio.Future[Ruling]:
        loop = asyncio.get_running_loop()
        future = self._futures[entry.id] = loop.create_future()
        self._timers[entry.id] = loop.call_at(entry.deadline, self._expire, entry.id, timeout)
        tell(self.announcement(entry, timeout))
        described = listed(entry, time.time() - loop.time())
        if self.webhook is not None:
            self.webhook.post(described)
        if (shared := self.shared()) is not None:
            self._following[entry.id] = asyncio.create_task(self._follow(entry, described, shared))
        return future

    async def _follow(self, entry: Pending, described: dict[str, Any], shared: SharedApprovals) -> None:
        """Enter the held request in the fleet's store, then wait for an answer given on any replica."""
        await shared.hold(described)
        scope, by, ttl = await shared.decision(entry.id)
        self._following.pop(entry.id, None)
        if self.table.pop(entry.id) is None:  # answered here, or timed out, meanwhile
            return
        extra: dict[str, object] = {"answered_on": "another replica"}
        if scope == "sandbox":
            until = None if ttl is None else asyncio.get_running_loop().time() + float(ttl)
            self.grants.add(Grant(entry.target, until, by, entry.id))
            extra["ttl"] = ttl
        released = entry.waiting
        self._settle(entry, Ruling(scope if scope in ("once", "sandbox") else None, by, entry.id), extra)  # type: ignore[arg-type]
        await shared.answered(entry.id, released)

    def _forget(self, approval_id: str, released: int = 0) -> None:
        """The entry ends here: stop following it, and say so in the fleet's store."""
        if (follower := self._following.pop(approval_id, None)) is not None:
            follower.cancel()
            if (shared := self.shared()) is not None:
                task = asyncio.create_task(shared.answered(approval_id, released))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def announcement(self, entry: Pending, timeout: float) -> str:
        """The line that asks a person, with the command that answers as it is to be typed (this airlock, through
        sudo when run so, and the admin listener of this gateway: a paste that reaches another would fail)."""
        where = f" --admin {shlex.quote(self.admin)}" if self.admin else ""
        target = entry.target
        return (
            f"airlock: sandbox {target.sandbox} asks for {target} ({entry.kind}), held {timeout:g} s for an answer: "
            f"{airlock_command()} approvals approve {entry.id}{where} (or deny)"
        )

    def _expire(self, approval_id: str, timeout: float) -> None:
        entry = self.table.pop(approval_id)
        if entry is not None:
            self._settle(entry, Ruling(None, None, approval_id, timeout))

    def _settle(self, entry: Pending, ruling: Ruling, extra: dict[str, object] | None = None) -> None:
        """End a pending entry: its waiters get the ruling, and the ruling its audit line (kind `approval`)."""
        if (timer := self._timers.pop(entry.id, None)) is not None:
            timer.cancel()
        self._forget(entry.id, entry.waiting)
        future = self._futures.pop(entry.id, None)
        if future is not None and not future.done():
            future.set_result(ruling)
        decision = ruling.decision(None)
        target = entry.target
        record = AuditRecord(
            "approval", target.sandbox, entry.client, target.host, target.port,
            "allow" if decision.allow else "deny", decision.reason, decision.code,
        )  # fmt: skip
        record.method = entry.kind
        record.extra = {
            "approval": entry.id, "by": ruling.by, "scope": ruling.scope, "waiting": entry.waiting,
            "asks": entry.asks, **(extra or {}),
        }  # fmt: skip
        self.emit(record)

    async def pending(self) -> list[dict[str, Any]]:
        """The requests held here, then those the fleet's other replicas hold."""
        offset = time.time() - asyncio.get_running_loop().time()
        here = [listed(entry, offset) for entry in self.table.pending()]
        shared = self.shared()
        elsewhere = [] if shared is None else [listed_remote(p) for p in await shared.pending()]
        ids = {p["id"] for p in here}
        return here + [p for p in elsewhere if p["id"] not in ids]

    async def approve(self, approval_id: str, scope: object, ttl: object, by: str) -> dict[str, Any]:
        if (problem := answer_problem(scope, ttl)) is not None:
            raise ApprovalError(422, "invalid_request", problem)
        if self.table.get(approval_id) is None and (shared := self.shared()) is not None:
            return await self._approve_elsewhere(shared, approval_id, scope, ttl, by)
        entry = self._entry(approval_id)
        extra: dict[str, object] = {}
        if scope == "policy":
            if self.writer is None:
                raise ApprovalError(409, "no_policy_file", "the gateway runs no policy file of its own to write")
            extra["rule"] = await self.writer.add(entry, by)
        elif scope == "sandbox":
            until = None if ttl is None else asyncio.get_running_loop().time() + float(ttl)  # type: ignore[arg-type]
            self.grants.add(Grant(entry.target, until, by, entry.id))
            extra["ttl"] = ttl
            await self._share_grant(entry.target, ttl, by, entry.id)
        assert scope in ("once", "sandbox", "policy")
        released = 0
        if self.table.pop(approval_id) is not None:  # else it timed out while the policy was written: that stays
            released = entry.waiting
            self._settle(entry, Ruling(scope, by, entry.id), extra)
            await self._shared_writes()
        return {"id": entry.id, "scope": scope, "target": str(entry.target), "released": released, **extra}

    async def _share_grant(self, target: Target, ttl: object, by: str, approval: str) -> None:
        if (shared := self.shared()) is not None:
            until = None if ttl is None else time.time() + float(ttl)  # type: ignore[arg-type]
            await shared.add_grant(target.sandbox, target.host, target.port, until, by, approval)

    async def _approve_elsewhere(
        self, shared: SharedApprovals, approval_id: str, scope: object, ttl: object, by: str
    ) -> dict[str, Any]:
        """An answer to a request another replica of the fleet holds: written for it, its release awaited."""
        held = await shared.entry(approval_id)
        if held is None:
            raise ApprovalError(404, "not_found", f"no pending approval {approval_id!r} (answered, or timed out)")
        target = Target(held["sandbox"], held["host"], held["port"])
        if scope == "policy":
            raise ApprovalError(
                409, "held_elsewhere",
                f"approval {approval_id} is held by another replica; --scope policy writes the policy file of the "
                "replica that holds it: answer there, or give --scope once or sandbox",
            )  # fmt: skip
        if scope == "sandbox":
            await self._share_grant(target, ttl, by, approval_id)
        if not await shared.decide(approval_id, str(scope) if scope else None, by, ttl):  # type: ignore[arg-type]
            raise ApprovalError(404, "not_found", f"no pending approval {approval_id!r} (answered, or timed out)")
        released = await shared.released(approval_id, REMOTE_RELEASE_WAIT)
        answer: dict[str, Any] = {"id": approval_id, "target": str(target), "released": released}
        if scope is not None:
            answer["scope"] = scope
        if scope == "sandbox":
            answer["ttl"] = ttl
        return answer

    async def deny(self, approval_id: str, by: str) -> dict[str, Any]:
        if self.table.get(approval_id) is None and (shared := self.shared()) is not None:
            return await self._approve_elsewhere(shared, approval_id, None, None, by)
        entry = self._entry(approval_id)
        self.table.pop(approval_id)
        self._settle(entry, Ruling(None, by, entry.id))
        await self._shared_writes()
        return {"id": entry.id, "target": str(entry.target), "released": entry.waiting}

    async def _shared_writes(self) -> None:
        """An answer given here is out of the fleet's list before the person is told it is done."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _entry(self, approval_id: str) -> Pending:
        entry = self.table.get(approval_id)
        if entry is None:
            raise ApprovalError(404, "not_found", f"no pending approval {approval_id!r} (answered, or timed out)")
        return entry

    async def close(self) -> None:
        """The gateway stops: held requests end (their connections close with the proxy), nothing is posted."""
        for timer in self._timers.values():
            timer.cancel()
        for future in self._futures.values():
            future.cancel()
        for task in [*self._following.values(), *self._tasks]:
            task.cancel()
        self._timers.clear()
        self._futures.clear()
        self._following.clear()
        if self.webhook is not None:
            await self.webhook.close()


def _new_id() -> str:
    """Unguessable (96 bits): whoever can list the pending approvals can answer them, nobody else can name one. Hex,
    so that an id never starts with '-' (a command line would read it as an option)."""
    return secrets.token_hex(12)
