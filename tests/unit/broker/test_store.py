"""Broker state in SQLite: revocations and idempotency records survive a restart; a broken store raises StoreError."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from airlock.broker.store import SqliteStore, StoreError

pytestmark = pytest.mark.tmpfs  # its stores (SQLite) on tmpfs: no fsync waits on a shared disk


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "broker.sqlite3"


@pytest.fixture
def store(db_path: Path) -> Iterator[SqliteStore]:
    store = SqliteStore(db_path)
    yield store
    store.close()


def test_fresh_store_revokes_nothing(store: SqliteStore) -> None:
    assert not store.is_revoked("jti-1", "sbx-1", int(time.time()))
    assert store.idempotent_get("sbx-1", "key") is None


def test_revoke_by_jti(store: SqliteStore) -> None:
    now = int(time.time())
    store.revoke_token("jti-1", now + 60)
    assert store.is_revoked("jti-1", "sbx-1", now)
    assert store.is_revoked("jti-1", "sbx-other", now)  # a jti is revoked whoever presents it
    assert not store.is_revoked("jti-2", "sbx-1", now)
    store.revoke_token("jti-1", now + 120)  # revoking twice is fine
    assert store.is_revoked("jti-1", "sbx-1", now)


SANDBOX_CASES = [
    pytest.param(-3600, True, id="issued-long-before"),
    pytest.param(-1, True, id="issued-just-before"),
    pytest.param(0, True, id="issued-same-second"),
    pytest.param(2, False, id="issued-after"),
    pytest.param(3600, False, id="issued-long-after"),
]


@pytest.mark.parametrize(("issued_offset", "revoked"), SANDBOX_CASES)
def test_revoke_by_sandbox_covers_tokens_issued_until_then(
    store: SqliteStore, issued_offset: int, revoked: bool
) -> None:
    now = int(time.time())  # before revoking: whole seconds round down, so `now` is never after the revocation
    store.revoke_sandbox("sbx-1")
    assert store.is_revoked("jti-x", "sbx-1", now + issued_offset) is revoked
    assert not store.is_revoked("jti-x", "sbx-2", now + issued_offset)


def test_revoking_a_sandbox_again_moves_the_cutoff(store: SqliteStore, db_path: Path) -> None:
    store.revoke_sandbox("sbx-1")
    with sqlite3.connect(db_path) as db:  # pretend the first revocation was an hour ago
        db.execute("UPDATE revoked_sandbox SET revoked_at = revoked_at - 3600")
    issued = int(time.time()) - 60
    assert not store.is_revoked("jti-x", "sbx-1", issued)
    store.revoke_sandbox("sbx-1")
    assert store.is_revoked("jti-x", "sbx-1", issued)


def test_revocations_survive_restart(db_path: Path) -> None:
    now = int(time.time())
    first = SqliteStore(db_path)
    first.revoke_token("jti-1", now + 60)
    first.revoke_sandbox("sbx-2")
    first.close()
    second = SqliteStore(db_path)
    try:
        assert second.is_revoked("jti-1", "sbx-1", now)
        assert second.is_revoked("jti-9", "sbx-2", now)
        assert not second.is_revoked("jti-9", "sbx-1", now)
    finally:
        second.close()


def test_idempotency_round_trip(store: SqliteStore) -> None:
    body = {"number": 7, "url": "https://example.test/pulls/7", "existing": False, "nested": {"a": [1, None]}}
    store.idempotent_put("sbx-1", "key-1", "hash-1", 201, body)
    assert store.idempotent_get("sbx-1", "key-1") == ("hash-1", 201, body)
    assert store.idempotent_get("sbx-2", "key-1") is None  # scoped per sandbox
    assert store.idempotent_get("sbx-1", "key-2") is None
    store.idempotent_put("sbx-1", "key-1", "hash-2", 200, {"number": 8})
    assert store.idempotent_get("sbx-1", "key-1") == ("hash-2", 200, {"number": 8})


def test_idempotency_survives_restart(db_path: Path) -> None:
    first = SqliteStore(db_path)
    first.idempotent_put("sbx-1", "key-1", "hash-1", 201, {"number": 1})
    first.close()
    second = SqliteStore(db_path)
    try:
        assert second.idempotent_get("sbx-1", "key-1") == ("hash-1", 201, {"number": 1})
    finally:
        second.close()


def test_uses_wal(store: SqliteStore, db_path: Path) -> None:
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


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.revoke_token("j", 1),
        lambda s: s.revoke_sandbox("sbx-1"),
        lambda s: s.is_revoked("j", "sbx-1", 0),
        lambda s: s.idempotent_get("sbx-1", "k"),
        lambda s: s.idempotent_put("sbx-1", "k", "h", 201, {}),
    ],
    ids=["revoke_token", "revoke_sandbox", "is_revoked", "idempotent_get", "idempotent_put"],
)
def test_every_operation_on_a_broken_store_raises_store_error(db_path: Path, call) -> None:
    store = SqliteStore(db_path)
    store.close()  # any sqlite error after opening (closed, corrupted, disk gone) must surface as StoreError
    with pytest.raises(StoreError):
        call(store)


def test_database_corrupted_while_open_raises_store_error(db_path: Path) -> None:
    store = SqliteStore(db_path)
    try:
        store.revoke_token("jti-1", 1)
        with sqlite3.connect(db_path) as db:
            db.execute("DROP TABLE revoked_token")
        with pytest.raises(StoreError):
            store.is_revoked("jti-1", "sbx-1", 0)
    finally:
        store.close()


def test_reads_go_on_while_a_write_waits_for_a_lock(db_path: Path) -> None:
    store = SqliteStore(db_path, busy_timeout=3)
    store.revoke_token("jti-1", int(time.time()) + 60)
    writer_done = threading.Event()

    def write() -> None:
        store.revoke_sandbox("sbx-1")  # waits for the lock held below
        writer_done.set()

    try:
        with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as holder:
            holder.execute("BEGIN EXCLUSIVE")
            writer = threading.Thread(target=write)
            writer.start()
            time.sleep(0.2)  # the writer is inside SQLite's busy wait by now
            started = time.monotonic()
            assert store.is_revoked("jti-1", "sbx-1", 0)  # another thread, its own connection: not queued
            assert time.monotonic() - started < 0.5
            assert not writer_done.is_set()
            holder.execute("ROLLBACK")
        writer.join(5)
        assert writer_done.is_set() and store.is_revoked("jti-9", "sbx-1", 0)
    finally:
        store.close()


def test_a_closed_store_refuses_every_thread(db_path: Path) -> None:
    store = SqliteStore(db_path)
    store.close()
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(errors, lambda: store.is_revoked("j", "s", 0)))
    thread.start()
    thread.join()
    assert [type(e) for e in errors] == [StoreError]  # a thread that never had a connection opens none


def _capture(errors: list[BaseException], action: Callable[[], object]) -> None:
    try:
        action()
    except BaseException as e:
        errors.append(e)
