"""Approvals at run time: the futures held requests await, their deadlines and the webhook (the policy file a
`--scope policy` approval writes: `approval_writer`; the admin routes a person answers through: `approval_routes`).

The bookkeeping (what may be asked, the pending table, grants) is the policy core's (policy/held_requests.py). Here a
pending entry has one future, which every request for the same target awaits (shielded: a request that gives up
never cancels the others' answer); the loop's timer ends it at the profile's `ask_timeout`, as a denial.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import shlex
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airlock.audit import AuditRecord
from airlock.gateway.approval_writer import PolicyWriter
from airlock.gateway.auditing import tell
from airlock.gateway.errors import ApprovalError
from airlock.policy import Decision, Sandbox, Snapshot, is_ip
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
    askable,
    denied,
    refused_full,
    still_pending,
    timed_out,
)
from airlock.runs import airlock_command

if TYPE_CHECKING:
    pass

log = logging.getLogger("airlock.approvals")

WEBHOOK_TIMEOUT = 5.0
WEBHOOK_IN_FLIGHT = 8  # posts under way at once; beyond, a pending request is not posted (logged)
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
    ) -> None:
        self.emit, self.writer = emit, writer
        self.admin = admin  # the admin listener a person answers through: the command each request tells names it
        self.table = table or PendingTable()
        self.grants = Grants()
        self.webhook = Webhook(webhook) if webhook else None
        self._futures: dict[str, asyncio.Future[Ruling]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}

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
        profile = live.profile(sandbox)
        own = live.own.among([ipaddress.ip_address(host)]) if is_ip(host) else frozenset()
        if not askable(profile, host, port, decision, own):
            return decision
        loop = asyncio.get_running_loop()
        if (grant := self.grants.find(sandbox.id, host, port, loop.time())) is not None:
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

    def _open(self, entry: Pending, timeout: float) -> asyncio.Future[Ruling]:
        loop = asyncio.get_running_loop()
        future = self._futures[entry.id] = loop.create_future()
        self._timers[entry.id] = loop.call_at(entry.deadline, self._expire, entry.id, timeout)
        tell(self.announcement(entry, timeout))
        if self.webhook is not None:
            self.webhook.post(describe(entry, time.time() - loop.time()))
        return future

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

    def pending(self) -> list[dict[str, Any]]:
        offset = time.time() - asyncio.get_running_loop().time()
        return [describe(entry, offset) for entry in self.table.pending()]

    async def approve(self, approval_id: str, scope: object, ttl: object, by: str) -> dict[str, Any]:
        if (problem := answer_problem(scope, ttl)) is not None:
            raise ApprovalError(422, "invalid_request", problem)
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
        assert scope in ("once", "sandbox", "policy")
        released = 0
        if self.table.pop(approval_id) is not None:  # else it timed out while the policy was written: that stays
            released = entry.waiting
            self._settle(entry, Ruling(scope, by, entry.id), extra)
        return {"id": entry.id, "scope": scope, "target": str(entry.target), "released": released, **extra}

    def deny(self, approval_id: str, by: str) -> dict[str, Any]:
        entry = self._entry(approval_id)
        self.table.pop(approval_id)
        self._settle(entry, Ruling(None, by, entry.id))
        return {"id": entry.id, "target": str(entry.target), "released": entry.waiting}

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
        self._timers.clear()
        self._futures.clear()
        if self.webhook is not None:
            await self.webhook.close()


def _new_id() -> str:
    """Unguessable (96 bits): whoever can list the pending approvals can answer them, nobody else can name one. Hex,
    so that an id never starts with '-' (a command line would read it as an option)."""
    return secrets.token_hex(12)


def describe(entry: Pending, wall_offset: float) -> dict[str, Any]:
    """A pending entry as the admin listener lists it and the webhook posts it (times in Unix seconds)."""
    target = entry.target
    return {
        "id": entry.id, "sandbox": target.sandbox, "profile": entry.profile, "kind": entry.kind,
        "host": target.host, "port": target.port, "target": str(target), "client": entry.client,
        "asked_at": round(entry.asked + wall_offset, 3), "expires_at": round(entry.deadline + wall_offset, 3),
        "waiting": entry.waiting,
    }  # fmt: skip


class Webhook:
    """Posts each new pending request as JSON to an operator's URL: best effort, bounded in time and in number,
    never awaited by the request that is held."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._tasks: set[asyncio.Task[None]] = set()

    def post(self, payload: dict[str, Any]) -> None:
        if len(self._tasks) >= WEBHOOK_IN_FLIGHT:
            log.warning("approval webhook: %d posts under way, approval %s not posted", len(self._tasks), payload["id"])
            return
        task = asyncio.ensure_future(self._post(payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, payload: dict[str, Any]) -> None:
        import aiohttp

        try:
            timeout = aiohttp.ClientTimeout(total=WEBHOOK_TIMEOUT)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(self.url, json=payload) as reply,
            ):
                if reply.status >= 300:
                    log.warning(
                        "approval webhook %s answered %d for approval %s", self.url, reply.status, payload["id"]
                    )
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            log.warning(
                "approval webhook %s failed for approval %s: %s", self.url, payload["id"], e or type(e).__name__
            )

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
