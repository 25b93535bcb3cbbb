"""The broker's state store, each test against every store (SQLite, and PostgreSQL on a server of the test run's
own): revocations and idempotency outcomes survive a restart, an idempotency key is claimed by one caller and
settled once, a claim left behind is abandoned and taken over by one caller only, and a broken store raises
StoreError. Then what is SQLite's alone: WAL, files that are no database, a lock held elsewhere, the schema's
version."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from airlock.broker.store import (
    OUTCOME_KEEP_SECONDS,
    BrokerStore,
    Claimed,
    Held,
    Settled,
    SqliteStore,
    StoreError,
)

pytestmark = pytest.mark.tmpfs  # its stores (SQLite) on tmpfs: no fsync waits on a shared disk

type Opener = Callable[[], Awaitable[BrokerStore]]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "broker.sqlite3"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def open_store(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[Opener]:
    """Opens the store of this test (again, for a restart): one SQLite file, or one fresh PostgreSQL database."""
    opened: list[BrokerStore] = []
    if request.param == "sqlite":

        async def open_sqlite() -> BrokerStore:
            opened.append(SqliteStore(db_path))
            return opened[-1]

        opener: Opener = open_sqlite
    else:
        from airlock.broker.pgstore import PostgresStore

        url = request.getfixturevalue("postgres_database")

        async def open_postgres() -> BrokerStore:
            opened.append(await PostgresStore.open(url))
            return opened[-1]

        opener = open_postgres
    yield opener
    for store in opened:
        await store.close()


@pytest.fixture
async def store(open_store: Opener) -> BrokerStore:
    return await open_store()


async def test_fresh_store_revokes_nothing(store: BrokerStore) -> None:
    assert not await store.is_revoked("jti-1", "sbx-1", int(time.time()))
    assert not await store.was_issued("jti-1")
    assert await store.pull_request_creator("acme/app", 1) is None


async def test_revoke_by_jti(store: BrokerStore) -> None:
    now = int(time.time())
    await store.revoke_token("jti-1", now + 60)
    assert await store.is_revoked("jti-1", "sbx-1", now)
    assert await store.is_revoked("jti-1", "sbx-other", now)  # a jti is revoked whoever presents it
    assert not await store.is_revoked("jti-2", "sbx-1", now)
    await store.revoke_token("jti-1", now + 120)  # revoking twice is fine
    assert await store.is_revoked("jti-1", "sbx-1", now)


SANDBOX_CASES = [
    pytest.param(-3600, True, id="issued-long-before"),
    pytest.param(-1, True, id="issued-just-before"),
    pytest.param(0, True, id="issued-same-second"),
    pytest.param(2, False, id="issued-after"),
    pytest.param(3600, False, id="issued-long-after"),
]


@pytest.mark.parametrize(("issued_offset", "revoked"), SANDBOX_CASES)
async def test_revoke_by_sandbox_covers_tokens_issued_until_then(
    store: BrokerStore, issued_offset: int, revoked: bool
) -> None:
    now = int(time.time())  # before revoking: whole seconds round down, so `now` is never after the revocation
    await store.revoke_sandbox("sbx-1")
    assert await store.is_revoked("jti-x", "sbx-1", now + issued_offset) is revoked
    assert not await store.is_revoked("jti-x", "sbx-2", now + issued_offset)


async def test_revocations_survive_restart(open_store: Opener) -> None:
    now = int(time.time())
    first = await open_store()
    await first.revoke_token("jti-1", now + 60)
    await first.revoke_sandbox("sbx-2")
    await first.close()
    second = await open_store()
    assert await second.is_revoked("jti-1", "sbx-1", now)
    assert await second.is_revoked("jti-9", "sbx-2", now)
    assert not await second.is_revoked("jti-9", "sbx-1", now)


async def test_issued_tokens_are_remembered_until_they_expire(store: BrokerStore) -> None:
    await store.record_issued("jti-1", "sbx-1", int(time.time()) + 60)
    await store.record_issued("jti-old", "sbx-1", int(time.time()) - 1)
    await store.record_issued("jti-2", "sbx-1", int(time.time()) + 60)  # forgets the expired ones
    assert await store.was_issued("jti-1") and await store.was_issued("jti-2")
    assert not await store.was_issued("jti-old")


async def test_an_idempotency_key_is_claimed_once_and_settled_once(store: BrokerStore) -> None:
    body = {"number": 7, "url": "https://example.test/pulls/7", "existing": False, "nested": {"a": [1, None]}}
    assert await store.claim("sbx-1", "key-1", "hash-1") == Claimed()
    assert await store.claim("sbx-2", "key-1", "hash-1") == Claimed()  # scoped per sandbox
    held = await store.claim("sbx-1", "key-1", "hash-1")
    assert isinstance(held, Held) and (held.request_hash, held.owner) == ("hash-1", store.owner)
    assert held.abandoned  # this store's own claim, seen again: the call that made it is no longer acting
    await store.settle("sbx-1", "key-1", 201, body)
    assert await store.claim("sbx-1", "key-1", "hash-1") == Settled("hash-1", 201, body)
    assert await store.claim("sbx-1", "key-1", "hash-2") == Settled("hash-1", 201, body)  # the caller compares
    await store.settle("sbx-1", "key-1", 200, {"number": 8})  # no longer claimed: nothing changes
    assert await store.claim("sbx-1", "key-1", "hash-1") == Settled("hash-1", 201, body)


async def test_a_settled_outcome_is_forgotten_a_day_after_its_claim_and_a_held_claim_never(
    store: BrokerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert await store.claim("sbx-1", "settled", "h") == Claimed()
    await store.settle("sbx-1", "settled", 201, {"number": 1})
    assert await store.claim("sbx-1", "held", "h") == Claimed()  # never settled: its caller died, say
    assert await store.claim("sbx-1", "settled", "h") == Settled("h", 201, {"number": 1})
    later = time.time() + OUTCOME_KEEP_SECONDS + 120
    monkeypatch.setattr(time, "time", lambda: later)
    assert await store.claim("sbx-1", "another", "h") == Claimed()  # a claim looks for outcomes past their day
    assert await store.claim("sbx-1", "settled", "h2") == Claimed()  # forgotten: the key acts again
    assert isinstance(await store.claim("sbx-1", "held", "h"), Held)  # a claim is resolved, never forgotten


async def test_a_released_claim_may_be_claimed_again(store: BrokerStore) -> None:
    assert await store.claim("sbx-1", "key-1", "hash-1") == Claimed()
    await store.release("sbx-1", "key-1")
    assert await store.claim("sbx-1", "key-1", "hash-2") == Claimed()


async def test_an_abandoned_claim_is_taken_over_by_one_caller(open_store: Opener) -> None:
    dead = await open_store()
    assert await dead.claim("sbx-1", "key-1", "hash-1") == Claimed()
    owner = dead.owner
    await dead.close()  # the broker that claimed the key is gone, its outcome never written
    first, second = await open_store(), await open_store()
    held = await first.claim("sbx-1", "key-1", "hash-1")
    assert isinstance(held, Held) and held.owner == owner and held.abandoned
    taken = await asyncio.gather(first.take_over("sbx-1", "key-1", owner), second.take_over("sbx-1", "key-1", owner))
    assert sorted(taken) == [False, True]
    winner = first if taken[0] else second
    await winner.settle("sbx-1", "key-1", 201, {"number": 1})
    assert await second.claim("sbx-1", "key-1", "hash-1") == Settled("hash-1", 201, {"number": 1})


async def test_idempotency_outcomes_survive_restart(open_store: Opener) -> None:
    first = await open_store()
    await first.claim("sbx-1", "key-1", "hash-1")
    await first.settle("sbx-1", "key-1", 201, {"number": 1})
    await first.close()
    second = await open_store()
    assert await second.claim("sbx-1", "key-1", "hash-1") == Settled("hash-1", 201, {"number": 1})


async def test_a_pull_request_has_one_creator(store: BrokerStore) -> None:
    await store.record_pull_request("sbx-1", "Acme/App", 3)
    await store.record_pull_request("sbx-2", "acme/app", 3)  # a second record changes nothing
    assert await store.pull_request_creator("ACME/app", 3) == "sbx-1"
    assert await store.pull_request_creator("acme/app", 4) is None


OPERATIONS: list[Any] = [
    pytest.param(lambda s: s.revoke_token("j", 1), id="revoke_token"),
    pytest.param(lambda s: s.revoke_sandbox("sbx-1"), id="revoke_sandbox"),
    pytest.param(lambda s: s.is_revoked("j", "sbx-1", 0), id="is_revoked"),
    pytest.param(lambda s: s.claim("sbx-1", "k", "h"), id="claim"),
    pytest.param(lambda s: s.settle("sbx-1", "k", 201, {}), id="settle"),
    pytest.param(lambda s: s.record_issued("j", "sbx-1", 1), id="record_issued"),
]


@pytest.mark.parametrize("call", OPERATIONS)
async def test_every_operation_on_a_closed_store_raises_store_error(store: BrokerStore, call: Any) -> None:
    await store.close()  # any failure after opening (closed, corrupted, disk or server gone) is a StoreError
    with pytest.raises(StoreError):
        await call(store)


# --- SQLite's alone ---------------------------------------------------------------------------------------------


@pytest.fixture
async def sqlite_store(db_path: Path) -> AsyncIterator[SqliteStore]:
    store = SqliteStore(db_path)
    yield store
    await store.close()


async def test_revoking_a_sandbox_again_moves_the_cutoff(sqlite_store: SqliteStore, db_path: Path) -> None:
    await sqlite_store.revoke_sandbox("sbx-1")
    with sqlite3.connect(db_path) as db:  # pretend the first revocation was an hour ago
        db.execute("UPDATE revoked_sandbox SET revoked_at = revoked_at - 3600")
    issued = int(time.time()) - 60
    assert not await sqlite_store.is_revoked("jti-x", "sbx-1", issued)
    await sqlite_store.revoke_sandbox("sbx-1")
    assert await sqlite_store.is_revoked("jti-x", "sbx-1", issued)


async def test_uses_wal(sqlite_store: SqliteStore, db_path: Path) -> None:
    with sqlite3.connect(db_path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_corrupt_database_file_raises_store_error(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    db_path.write_bytes(b"this is not a database, just garbage\x00\xff" * 200)
    with pytest.raises(StoreError, match="cannot open broker state"):
        SqliteStore(db_path)


def test_parent_is_a_regular_file_raises_store_error(tmp_path: Path) -> None:
    (tmp_path / "not-a-dir").write_text("x")
    with pytest.raises(StoreError):
        SqliteStore(tmp_path / "not-a-dir" / "broker.sqlite3")


def test_path_is_a_directory_raises_store_error(tmp_path: Path) -> None:
    (tmp_path / "broker.sqlite3").mkdir()
    with pytest.raises(StoreError):
        SqliteStore(tmp_path / "broker.sqlite3")


def test_a_schema_newer_than_this_airlock_is_refused(db_path: Path) -> None:
    SqliteStore(db_path).close_now()
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(StoreError, match=r"schema version 99, newer than this airlock's \(2\)"):
        SqliteStore(db_path)


async def test_a_file_of_the_first_schema_keeps_its_outcomes(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(db_path)) as db:  # as the first airlock left it: no user_version
        db.executescript(
            "CREATE TABLE idempotency (scope TEXT NOT NULL, key TEXT NOT NULL, request_hash TEXT NOT NULL,"
            " status INTEGER NOT NULL, body TEXT NOT NULL, created REAL NOT NULL, PRIMARY KEY (scope, key));"
            f" INSERT INTO idempotency VALUES ('sbx-1', 'key-1', 'hash-1', 201, '{{\"number\": 1}}', {time.time()});"
        )  # an outcome of today's: a day later it would be forgotten
    store = SqliteStore(db_path)
    try:
        assert await store.claim("sbx-1", "key-1", "hash-1") == Settled("hash-1", 201, {"number": 1})
    finally:
        await store.close()


async def test_database_corrupted_while_open_raises_store_error(sqlite_store: SqliteStore, db_path: Path) -> None:
    await sqlite_store.revoke_token("jti-1", 1)
    with sqlite3.connect(db_path) as db:
        db.execute("DROP TABLE revoked_token")
    with pytest.raises(StoreError):
        await sqlite_store.is_revoked("jti-1", "sbx-1", 0)


async def test_reads_go_on_while_a_write_waits_for_a_lock(db_path: Path) -> None:
    store = SqliteStore(db_path, busy_timeout=3)
    await store.revoke_token("jti-1", int(time.time()) + 60)
    try:
        with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as holder:
            holder.execute("BEGIN EXCLUSIVE")
            writer = asyncio.ensure_future(store.revoke_sandbox("sbx-1"))  # waits for the lock held here
            await asyncio.sleep(0.2)  # the writer is inside SQLite's busy wait by now
            started = time.monotonic()
            assert await store.is_revoked("jti-1", "sbx-1", 0)  # another thread, its own connection: not queued
            assert time.monotonic() - started < 0.5
            assert not writer.done()
            holder.execute("ROLLBACK")
        await asyncio.wait_for(writer, 5)
        assert await store.is_revoked("jti-9", "sbx-1", 0)
    finally:
        await store.close()


def test_a_closed_store_refuses_every_thread(db_path: Path) -> None:
    store = SqliteStore(db_path)
    store.close_now()
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(errors, lambda: store._run("SELECT 1")))
    thread.start()
    thread.join()
    assert [type(e) for e in errors] == [StoreError]  # a thread that never had a connection opens none


def _capture(errors: list[BaseException], action: Callable[[], object]) -> None:
    try:
        action()
    except BaseException as e:
        errors.append(e)
