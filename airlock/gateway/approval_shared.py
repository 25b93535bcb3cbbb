"""What approvals look like outside the desk (airlock/gateway/approval_desk.py): a pending entry as the admin listener
lists it and the webhook posts it, another replica's held request as it is listed here, and what the fleet's store
(a broker store on PostgreSQL) offers the desks of every replica (`SharedApprovals`)."""

from __future__ import annotations

from typing import Any, Protocol

from airlock.policy.held_requests import Pending, Target


class SharedApprovals(Protocol):
    """What gateways sharing a store share of their approvals (broker.pgstore.PostgresApprovals): best effort, never
    an opening — a grant that cannot be read is no grant."""

    async def hold(self, entry: dict[str, Any]) -> None: ...
    async def pending(self) -> list[dict[str, Any]]: ...
    async def entry(self, approval_id: str) -> dict[str, Any] | None: ...
    async def decide(self, approval_id: str, scope: str | None, by: str, ttl: float | None) -> bool: ...
    async def decision(self, approval_id: str) -> tuple[str | None, str, float | None]: ...
    async def answered(self, approval_id: str, released: int) -> None: ...
    async def released(self, approval_id: str, wait: float) -> int: ...
    async def add_grant(self, sandbox: str, host: str, port: int | None, until: float | None, by: str,
                        approval: str) -> None: ...  # fmt: skip
    async def grants(self, sandbox: str, host: str) -> list[tuple[int | None, float | None, str, str]]: ...


def listed(entry: Pending, wall_offset: float) -> dict[str, Any]:
    """A pending entry as the admin listener lists it and the webhook posts it (times in Unix seconds)."""
    target = entry.target
    return {
        "id": entry.id, "sandbox": target.sandbox, "profile": entry.profile, "kind": entry.kind,
        "host": target.host, "port": target.port, "target": str(target), "client": entry.client,
        "asked_at": round(entry.asked + wall_offset, 3), "expires_at": round(entry.deadline + wall_offset, 3),
        "waiting": entry.waiting,
    }  # fmt: skip


def listed_remote(held: dict[str, Any]) -> dict[str, Any]:
    """A request another replica holds, as the admin listener lists it (how many wait there is its own)."""
    target = Target(held["sandbox"], held["host"], held["port"])
    return {
        "id": held["id"], "sandbox": target.sandbox, "profile": held["profile"], "kind": held["kind"],
        "host": target.host, "port": target.port, "target": str(target), "client": held["client"],
        "asked_at": round(held["asked_at"], 3), "expires_at": round(held["expires_at"], 3), "waiting": 0,
        "held_by": f"replica {held['replica']}",
    }  # fmt: skip
