"""Approvals shared by gateways whose brokers share a PostgreSQL store (a real server of the test run's): a request
held on replica B is listed by replica A's admin listener and answered there, and B releases it; a sandbox-scope
grant made on A lets B's next request through without asking; a policy-scope answer is refused where the request
is not held; and answers given on the replica that holds it still work."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from airlock.audit import AuditRecord
from airlock.broker.pgstore import PostgresStore
from airlock.cli.common import default_policy_path
from airlock.gateway import Gateway
from airlock.gateway.approval_desk import Approvals
from airlock.gateway.approval_routes import approval_routes
from airlock.gateway.config import BrokerConfig, GatewayConfig
from airlock.policy import Decision, Sandbox, decide, load_policy

from approvals_env import LIVE, POLICY, SANDBOX

pytestmark = pytest.mark.postgres


@dataclass
class Replica:
    """One gateway's approvals desk on the fleet's store, its admin routes served on loopback."""

    store: PostgresStore
    desk: Approvals
    audit: list[AuditRecord]
    server: web.AppRunner
    url: str


async def open_replica(url: str) -> Replica:
    store = await PostgresStore.open(url)
    audit: list[AuditRecord] = []
    desk = Approvals(audit.append, shared=lambda: store.approvals)
    app = web.Application()
    app.add_routes(approval_routes(desk))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return Replica(store, desk, audit, runner, f"http://127.0.0.1:{runner.addresses[0][1]}")


@pytest.fixture
async def replicas(postgres_database: str) -> AsyncIterator[tuple[Replica, Replica]]:
    made = [await open_replica(postgres_database) for _ in range(2)]
    try:
        yield made[0], made[1]
    finally:
        for replica in made:
            await replica.server.cleanup()
            await replica.desk.close()
            await replica.store.close()


def ask(replica: Replica, host: str = "new.test", port: int = 443) -> asyncio.Future[Decision]:
    decision = decide(POLICY.profile(), host, port)
    return asyncio.ensure_future(
        replica.desk.decide(LIVE.current, SANDBOX, host, port, decision, "connect", "10.9.0.2")
    )


async def listed(session: aiohttp.ClientSession, replica: Replica, within: float = 5.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + within
    while True:
        async with session.get(f"{replica.url}/v1/approvals") as reply:
            pending = (await reply.json())["pending"]
        if pending or time.monotonic() > deadline:
            return list(pending)
        await asyncio.sleep(0.05)


async def answer(
    session: aiohttp.ClientSession, replica: Replica, approval: str, action: str, **body: Any
) -> tuple[int, dict[str, Any]]:
    async with session.post(f"{replica.url}/v1/approvals/{approval}/{action}", json=body) as reply:
        return reply.status, await reply.json()


async def test_a_request_held_on_one_replica_is_approved_on_the_other(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    held = ask(b)
    async with aiohttp.ClientSession() as session:
        (pending,) = await listed(session, a)  # A lists what B holds
        holder = f"replica {b.store.replica}"
        assert (pending["target"], pending["sandbox"], pending["held_by"]) == ("new.test:443", "sbx", holder)
        status, body = await answer(session, a, pending["id"], "approve", scope="once")
        assert status == 200 and body["released"] == 1, body
    decision = await asyncio.wait_for(held, 5)
    assert decision.allow and "approved by loopback (scope once" in decision.reason
    (record,) = [r for r in b.audit if r.kind == "approval"]  # the holder audits the ruling
    assert record.decision == "allow" and record.extra["answered_on"] == "another replica"
    async with aiohttp.ClientSession() as session:
        assert await listed(session, a, within=0) == [] and await listed(session, b, within=0) == []


async def test_a_sandbox_grant_made_on_one_replica_is_in_force_on_the_other(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    held = ask(b)
    async with aiohttp.ClientSession() as session:
        (pending,) = await listed(session, a)
        status, body = await answer(session, a, pending["id"], "approve", scope="sandbox", ttl=60)
        assert status == 200, body
    assert (await asyncio.wait_for(held, 5)).allow
    again = await asyncio.wait_for(ask(a), 2)  # A itself, never asked: the grant is the fleet's
    assert again.allow and "for this sandbox" in again.reason
    other = ask(a, host="other.test")  # another target is asked as before
    await asyncio.sleep(0.3)
    assert not other.done() and len(a.desk.table.pending()) == 1
    other.cancel()


async def test_a_denial_on_one_replica_reaches_the_other(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    held = ask(b)
    async with aiohttp.ClientSession() as session:
        (pending,) = await listed(session, a)
        status, body = await answer(session, a, pending["id"], "deny")
        assert (status, body["released"]) == (200, 1), body
    decision = await asyncio.wait_for(held, 5)
    assert not decision.allow and decision.code == "approval_denied"


async def test_a_policy_answer_is_given_where_the_request_is_held(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    held = ask(b)
    async with aiohttp.ClientSession() as session:
        (pending,) = await listed(session, a)
        status, body = await answer(session, a, pending["id"], "approve", scope="policy")
        assert (status, body["error"]) == (409, "held_elsewhere"), body
        status, body = await answer(session, b, pending["id"], "approve", scope="once")  # the holder answers
        assert (status, body["released"]) == (200, 1)
    assert (await asyncio.wait_for(held, 5)).allow
    async with aiohttp.ClientSession() as session:
        assert await listed(session, a, within=0) == []  # the holder's own answer leaves the fleet's list too


async def test_a_gateway_on_the_fleets_store_shares_its_desk_through_its_brokers_store(
    postgres_database: str, tmp_path: Path
) -> None:
    """The desk a gateway builds is handed its broker's store as the provider of the fleet's approvals: none before
    the broker starts (its store is not open), the store's own once it runs, none again for a SQLite store."""
    policy = load_policy(default_policy_path())
    sandbox = Sandbox("sbx", policy.default_profile, ipaddress.ip_network("127.0.0.1/32"))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    broker = BrokerConfig(port=port, store=postgres_database, call_log=str(tmp_path / "calls"))
    config = GatewayConfig(
        policy, "127.0.0.1", proxy_port=0, sandboxes=[sandbox], upstream_dns=[("127.0.0.1", 53)],
        audit_path=str(tmp_path / "audit.jsonl"), state_dir=str(tmp_path / "state"), broker=broker,
    )  # fmt: skip
    for store, shared in ((postgres_database, True), (None, False)):
        gateway = Gateway(dataclasses.replace(config, broker=dataclasses.replace(broker, store=store)))
        assert gateway.parts.approvals.shared() is None
        await gateway.start()
        try:
            assert gateway.broker is not None
            provided = gateway.parts.approvals.shared()
            assert (provided is gateway.broker.store.approvals) and (provided is not None) is shared
        finally:
            await gateway.stop()
