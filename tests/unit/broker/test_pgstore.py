"""The PostgreSQL store as replicas share it, on a real server of the test run's own (tests/pg.py): a revocation on
one replica is in force on another within a second (notified, or read by polling), a live replica's claim is not
another's to take, a waiter is woken by the outcome, the schema is migrated once and a newer one refused (by
`airlock broker` in one line), the password taken from a file or libpq's environment (a URL with one refused), and
a server that goes away and comes back is followed without reopening the store."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import psycopg
import pytest

from airlock.broker import pgstore
from airlock.broker.pgstore import FRESHNESS_SECONDS, PostgresStore
from airlock.broker.store import Claimed, Held, Settled, StoreError
from airlock.gateway.broker_runtime import open_state
from airlock.gateway.config import BrokerConfig

from pg import PostgresServer

pytestmark = pytest.mark.postgres

type Replicas = Callable[[], Awaitable[PostgresStore]]


@pytest.fixture
async def replica(postgres_database: str) -> AsyncIterator[Replicas]:
    """Opens a replica's store on the test's database (each its own pool, connection and liveness lock)."""
    opened: list[PostgresStore] = []

    async def open_replica() -> PostgresStore:
        opened.append(await PostgresStore.open(postgres_database))
        return opened[-1]

    yield open_replica
    for store in opened:
        await store.close()


async def until(check: Callable[[], Awaitable[bool]], within: float) -> float:
    """Seconds until `check()` holds; AssertionError past `within`."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < within, f"not within {within} s"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def test_a_revocation_on_one_replica_is_in_force_on_another_within_a_second(
    replica: Replicas, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No polling, and a copy that never goes stale in the test's time: only the notification can tell A.
    monkeypatch.setattr(pgstore, "POLL_SECONDS", 30.0)
    monkeypatch.setattr(pgstore, "FRESHNESS_SECONDS", 30.0)
    a, b = await replica(), await replica()
    issued = int(time.time())
    assert not await a.is_revoked("jti-1", "sbx-1", issued)
    await b.revoke_token("jti-1", issued + 60)
    assert await b.is_revoked("jti-1", "sbx-1", issued)  # at once where it was made
    await until(lambda: a.is_revoked("jti-1", "sbx-1", issued), 1.0)
    await a.revoke_sandbox("sbx-2")
    await until(lambda: b.is_revoked("jti-9", "sbx-2", issued), 1.0)


async def test_a_revocation_whose_notification_was_lost_is_read_by_polling(
    replica: Replicas, postgres_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pgstore, "FRESHNESS_SECONDS", 30.0)  # the poll tells it, not a read of a stale copy
    a = await replica()
    issued = int(time.time())
    with psycopg.connect(postgres_database, autocommit=True) as conn:  # a row without its NOTIFY
        conn.execute("INSERT INTO revocation (jti, revoked_at, expires_at) VALUES ('jti-1', 0, %s)", (issued + 60,))
    await until(lambda: a.is_revoked("jti-1", "sbx-1", issued), 1.0)


async def test_a_live_replicas_claim_is_not_abandoned_and_a_dead_ones_is(replica: Replicas) -> None:
    a, b = await replica(), await replica()
    assert await a.claim("sbx-1", "key-1", "h") == Claimed()
    held = await b.claim("sbx-1", "key-1", "h")
    assert held == Held("h", a.owner, abandoned=False)
    assert not await b.take_over("sbx-1", "key-1", "") and not await b.take_over("sbx-1", "key-1", b.owner)
    await a.close()  # its connections close: PostgreSQL drops its liveness lock (once its backend has ended)

    async def abandoned() -> bool:
        return await b.claim("sbx-1", "key-1", "h") == Held("h", a.owner, abandoned=True)

    await until(abandoned, 5.0)
    assert await b.take_over("sbx-1", "key-1", a.owner)


async def test_a_waiter_is_woken_by_the_outcome(replica: Replicas) -> None:
    a, b = await replica(), await replica()
    assert await a.claim("sbx-1", "key-1", "h") == Claimed()
    waiting = asyncio.ensure_future(b.outcome_changed("sbx-1", "key-1", 5.0))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    await a.settle("sbx-1", "key-1", 201, {"number": 1})
    await asyncio.wait_for(waiting, 5)
    assert time.monotonic() - started < 2.0  # woken by the outcome, not at the end of its 5 s
    assert await b.claim("sbx-1", "key-1", "h") == Settled("h", 201, {"number": 1})


async def test_replicas_opening_together_migrate_once(postgres_database: str) -> None:
    stores = await asyncio.gather(*(PostgresStore.open(postgres_database) for _ in range(4)))
    try:
        with psycopg.connect(postgres_database) as conn:
            assert conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall() == [(1,), (2,), (3,)]
        assert len({s.replica for s in stores}) == 4
    finally:
        for store in stores:
            await store.close()


async def test_a_replica_that_ended_is_forgotten_by_the_next_to_start(
    replica: Replicas, postgres_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await replica(), await replica()
    await a.close()  # ended: its liveness lock is gone; b lives
    started = time.time()
    monkeypatch.setattr(time, "time", lambda: started + 61)  # both started over a minute ago
    c = await replica()
    with psycopg.connect(postgres_database) as conn:
        rows = conn.execute("SELECT id FROM broker_replica ORDER BY id").fetchall()
    assert rows == [(b.replica,), (c.replica,)]


async def test_a_schema_newer_than_this_airlock_is_refused(postgres_database: str) -> None:
    await (await PostgresStore.open(postgres_database)).close()
    with psycopg.connect(postgres_database, autocommit=True) as conn:
        conn.execute("INSERT INTO schema_version VALUES (99)")
    with pytest.raises(StoreError, match=r"schema version 99, newer than this airlock's \(3\)"):
        await PostgresStore.open(postgres_database)


def test_a_schema_newer_than_this_airlock_stops_airlock_broker_in_one_line(
    postgres_database: str, tmp_path: Path
) -> None:
    with psycopg.connect(postgres_database, autocommit=True) as conn:
        conn.execute("CREATE TABLE schema_version (version integer NOT NULL); INSERT INTO schema_version VALUES (99)")
    done = subprocess.run(
        [sys.executable, "-m", "airlock", "broker", "--listen", "127.0.0.1", "--port", "0", "--state-dir",
         str(tmp_path / "state"), "--store", postgres_database],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.strip().splitlines() == [
        f"airlock: broker could not start: the broker's database {postgres_database} has schema version 99, newer "
        "than this airlock's (3): run the airlock that wrote it, or a newer one"
    ]


async def test_the_password_is_read_from_the_file_or_libpqs_environment(
    postgres_server: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `--store-password-file` and PGPASSWORD/PGPASSFILE give reaches a server that asks for a password; the
    URL carries none, and no error says the password."""
    url = await asyncio.to_thread(postgres_server.password_database, "airlock_pw", "s3cret-pw")
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "no-pgpass"))
    (tmp_path / "right").write_text("s3cret-pw\n")
    (tmp_path / "wrong").write_text("not-the-password\n")

    async def opened(password_file: str | None = None) -> None:
        store, call_log = await open_state(BrokerConfig(store=url, store_password_file=password_file), tmp_path)
        assert call_log is store and await store.calls() == []
        await store.close()

    for given in (None, str(tmp_path / "wrong")):
        with pytest.raises(StoreError, match="password") as refused:
            await opened(given)
        assert len(str(refused.value).splitlines()) == 1 and "not-the-password" not in str(refused.value)
    await opened(str(tmp_path / "right"))
    monkeypatch.setenv("PGPASSWORD", "s3cret-pw")
    await opened()
    monkeypatch.delenv("PGPASSWORD")
    (tmp_path / "pgpass").write_text("*:*:*:airlock_pw:s3cret-pw\n")
    (tmp_path / "pgpass").chmod(0o600)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "pgpass"))
    await opened()


async def test_a_url_with_a_password_is_refused(postgres_database: str) -> None:
    with pytest.raises(StoreError, match="the URL holds a password; give it with --store-password-file"):
        await PostgresStore.open(postgres_database.replace("postgres@", "postgres:hunter2@"))


async def test_an_unreachable_server_is_one_error_at_start(tmp_path: object) -> None:
    with pytest.raises(StoreError, match="cannot reach the broker's database"):
        await PostgresStore.open(f"postgresql://postgres@/nowhere?host={tmp_path}")


async def test_a_server_that_goes_away_is_refused_then_followed_again(
    replica: Replicas, postgres_server: PostgresServer
) -> None:
    a = await replica()
    issued = int(time.time())
    await a.revoke_token("jti-1", issued + 60)
    await asyncio.to_thread(postgres_server.stop, "immediate")
    try:
        await asyncio.sleep(FRESHNESS_SECONDS + 0.2)
        with pytest.raises(StoreError):
            await a.is_revoked("jti-2", "sbx-1", issued)  # no fresh copy of the revocations: refused
        with pytest.raises(StoreError):
            await a.claim("sbx-1", "key-1", "h")
    finally:
        await asyncio.to_thread(postgres_server.start_again)

    async def answers() -> bool:
        try:
            return await a.claim("sbx-1", "key-1", "h") == Claimed()
        except StoreError:
            return False

    await until(answers, 15.0)
    assert await a.is_revoked("jti-1", "sbx-1", issued) and not await a.is_revoked("jti-2", "sbx-1", issued)
