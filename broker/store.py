"""Broker state that must survive a restart: revocations, the tokens issued (until they expire), idempotency claims
and their outcomes, the pull requests each sandbox created. (The record of brokered calls is `CallStore`'s.)

`BrokerStore` is the interface, async; `SqliteStore` (one file, WAL, its calls on threads of its own) is the default
of one gateway, and `broker.pgstore.PostgresStore` the shared truth of a fleet of replicas. Any store failure raises
`StoreError`, and the broker answers 503: an unreadable revocation list must never read as "not revoked".

An idempotency key is *claimed* before its action runs and *settled* with the outcome after it (`claim`,
`settle`): the claim is atomic in every store, so of any number of calls with one key, across replicas, one acts
and the others wait for its outcome. A claim carries its owner (the broker process that made it); a claim whose
owner is gone (killed between claim and outcome) reads as abandoned, and the caller that takes it over
(`take_over`, atomic too) resolves it by asking upstream what exists before it acts.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

STORE_THREADS = 4  # each with its own SQLite connection: reads go on while a write waits for a lock
# A claim older than this is abandoned even if its owner lives (its outcome could not be written, say): longer than
# any action runs (GitHub's timeout, a few calls in a row).
CLAIM_STALE_SECONDS = 120.0
# A settled outcome is kept this long after its claim, then forgotten (else the table grows with every call): a key
# sent again after that acts again, as a new one would (GitHub still holds one open pull request per head and base).
OUTCOME_KEEP_SECONDS = 24 * 3600.0
PRUNE_EVERY_SECONDS = 60.0  # how often a store looks for outcomes past OUTCOME_KEEP_SECONDS (on a claim)


class StoreError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Claimed:
    """This caller holds the key now: it acts, then settles (or releases) it."""


@dataclass(frozen=True, slots=True)
class Settled:
    """The key's action ended with this outcome."""

    request_hash: str
    status: int
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Held:
    """Another call holds the key; `abandoned` when its owner is gone (or it is older than CLAIM_STALE_SECONDS)."""

    request_hash: str
    owner: str
    abandoned: bool


type ClaimState = Claimed | Settled | Held


class BrokerStore(Protocol):
    owner: str  # this broker process's name in the claims it makes
    approvals: (
        Any  # what gateways sharing the store share of their approvals (airlock.gateway.approval_desk); None: nothing
    )

    async def revoke_token(self, jti: str, expires_at: int) -> None: ...
    async def revoke_sandbox(self, sandbox: str) -> None: ...
    async def record_issued(self, jti: str, sandbox: str, expires_at: int) -> None: ...
    async def was_issued(self, jti: str) -> bool: ...
    async def is_revoked(self, jti: str, sandbox: str, issued_at: int) -> bool: ...
    async def claim(self, scope: str, key: str, request_hash: str) -> ClaimState: ...
    async def take_over(self, scope: str, key: str, owner: str) -> bool: ...
    async def settle(self, scope: str, key: str, status: int, body: dict[str, Any]) -> None: ...
    async def release(self, scope: str, key: str) -> None: ...
    async def outcome_changed(self, scope: str, key: str, timeout: float) -> None: ...
    async def record_pull_request(self, sandbox: str, repo: str, number: int) -> None: ...
    async def pull_request_creator(self, repo: str, number: int) -> str | None: ...
    async def close(self) -> None: ...


def new_owner() -> str:
    """A broker process's name in its claims: unique to this run of it."""
    return f"run-{secrets.token_hex(8)}"


# Each migration takes the schema from the version before to its own (1, 2, ...); PRAGMA user_version holds the
# version a file is at. Version 1 is the schema of the first airlock, made with IF NOT EXISTS: a file it made
# migrates from there.
_MIGRATIONS = (
    """
    CREATE TABLE IF NOT EXISTS revoked_token (jti TEXT PRIMARY KEY, expires_at INTEGER NOT NULL);
    CREATE TABLE IF NOT EXISTS revoked_sandbox (sandbox TEXT PRIMARY KEY, revoked_at REAL NOT NULL);
    CREATE TABLE IF NOT EXISTS issued_token (jti TEXT PRIMARY KEY, sandbox TEXT NOT NULL, expires_at INTEGER NOT NULL);
    CREATE TABLE IF NOT EXISTS idempotency (
        scope TEXT NOT NULL, key TEXT NOT NULL, request_hash TEXT NOT NULL, status INTEGER NOT NULL,
        body TEXT NOT NULL, created REAL NOT NULL, PRIMARY KEY (scope, key)
    );
    CREATE TABLE IF NOT EXISTS pull_request (
        repo TEXT NOT NULL, number INTEGER NOT NULL, sandbox TEXT NOT NULL, created REAL NOT NULL,
        PRIMARY KEY (repo, number)
    );
    """,
    # Claims: a row exists from before the action (owner set, no outcome) to after it (outcome set, no owner).
    """
    CREATE TABLE idempotency_claims (
        scope TEXT NOT NULL, key TEXT NOT NULL, request_hash TEXT NOT NULL, owner TEXT, claimed_at REAL NOT NULL,
        status INTEGER, body TEXT, PRIMARY KEY (scope, key)
    );
    INSERT INTO idempotency_claims SELECT scope, key, request_hash, NULL, created, status, body FROM idempotency;
    DROP TABLE idempotency;
    ALTER TABLE idempotency_claims RENAME TO idempotency;
    """,
)


class SqliteFile:
    """One SQLite database (WAL) with one connection per thread that calls (SQLite's rule: a connection is used by
    one thread at a time; with WAL, each thread's reads go on while another's write waits for a lock). Its calls
    run on threads of its own, never on the event loop: a locked or slow file delays only the calls that need it.
    A write waits `busy_timeout` seconds for a lock held elsewhere, then fails as StoreError. The schema is
    versioned (PRAGMA user_version): a file of a newer airlock is refused."""

    MIGRATIONS: tuple[str, ...] = ()
    WHAT = "broker state"

    def __init__(self, path: Path, busy_timeout: float = 5.0) -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        self._local = threading.local()
        self._lock = threading.Lock()  # guards the list of connections and `_closed`
        self._connections: list[sqlite3.Connection] = []
        self._closed = False
        self._threads = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="airlock-broker-state")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = self._connection()
            db.execute("PRAGMA journal_mode=WAL")  # kept in the file: every connection uses it
            self._migrate(db)
        except (sqlite3.Error, OSError) as e:
            self.close_now()
            raise StoreError(f"cannot open {self.WHAT} {path}: {e}") from e
        except StoreError:
            self.close_now()
            raise

    def _migrate(self, db: sqlite3.Connection) -> None:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > len(self.MIGRATIONS):
            raise StoreError(
                f"{self.WHAT} {self.path} has schema version {version}, newer than this airlock's "
                f"({len(self.MIGRATIONS)}): run the airlock that wrote it, or a newer one"
            )
        for number, script in enumerate(self.MIGRATIONS[version:], start=version + 1):
            db.executescript(f"BEGIN IMMEDIATE; {script}; PRAGMA user_version = {number}; COMMIT;")

    def _connection(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is not None:
            return db
        with self._lock:
            if self._closed:
                raise StoreError(f"{self.WHAT} {self.path} is closed")
            # check_same_thread off only so that close() may close every thread's connection at the end.
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=self.busy_timeout)
            self._connections.append(db)
        db.execute("PRAGMA synchronous=NORMAL")
        self._local.db = db
        return db

    def _run(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        """One statement, on the calling thread (a store thread: see `_call`)."""
        try:
            return self._connection().execute(sql, args).fetchall()
        except sqlite3.Error as e:
            raise StoreError(f"{self.WHAT} {self.path}: {e}") from e

    async def _call(self, action: Callable[[], T]) -> T:
        """`action` (statements through `_run`) on one of the store's threads."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._threads, action)
        except RuntimeError as e:  # the threads are shut down
            raise StoreError(f"{self.WHAT} {self.path} is closed") from e

    async def _sql(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        return await self._call(functools.partial(self._run, sql, args))

    def close_now(self) -> None:
        """Close every thread's connection (waiting for a call still running: a write waiting for a lock, at most
        its timeout); any call afterwards raises StoreError."""
        self._threads.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._closed = True
            for db in self._connections:
                db.close()
            self._connections.clear()

    async def close(self) -> None:
        await asyncio.to_thread(self.close_now)


class SqliteStore(SqliteFile):
    MIGRATIONS = _MIGRATIONS

    def __init__(self, path: Path, busy_timeout: float = 5.0) -> None:
        super().__init__(path, busy_timeout)
        # Only this process uses the file: a claim of any other run of it was left by a broker that died.
        self.owner = new_owner()
        self.approvals = None  # one gateway's file: its approvals are its own
        self._pruned = 0.0  # when outcomes past OUTCOME_KEEP_SECONDS were last forgotten

    async def revoke_token(self, jti: str, expires_at: int) -> None:
        await self._sql("INSERT OR REPLACE INTO revoked_token VALUES (?, ?)", jti, expires_at)

    async def revoke_sandbox(self, sandbox: str) -> None:
        await self._sql("INSERT OR REPLACE INTO revoked_sandbox VALUES (?, ?)", sandbox, time.time())

    async def record_issued(self, jti: str, sandbox: str, expires_at: int) -> None:
        """Remember a token this broker minted until it expires (so that revoking an id it never issued can be
        told apart from a typo); expired ones are forgotten here."""

        def record() -> None:
            self._run("DELETE FROM issued_token WHERE expires_at < ?", (int(time.time()),))
            self._run("INSERT OR REPLACE INTO issued_token VALUES (?, ?, ?)", (jti, sandbox, expires_at))

        await self._call(record)

    async def was_issued(self, jti: str) -> bool:
        return bool(await self._sql("SELECT 1 FROM issued_token WHERE jti = ?", jti))

    async def is_revoked(self, jti: str, sandbox: str, issued_at: int) -> bool:
        def revoked() -> bool:
            if self._run("SELECT 1 FROM revoked_token WHERE jti = ?", (jti,)):
                return True
            # Every token the sandbox held when it was revoked (iat is whole seconds: compare generously).
            rows = self._run("SELECT revoked_at FROM revoked_sandbox WHERE sandbox = ?", (sandbox,))
            return bool(rows) and issued_at <= rows[0][0]

        return await self._call(revoked)

    async def claim(self, scope: str, key: str, request_hash: str) -> ClaimState:
        def claim() -> ClaimState:
            now = time.time()
            if now - self._pruned > PRUNE_EVERY_SECONDS:
                self._pruned = now
                self._run("DELETE FROM idempotency WHERE status IS NOT NULL AND claimed_at < ?",
                          (now - OUTCOME_KEEP_SECONDS,))  # fmt: skip
            inserted = self._run(
                "INSERT INTO idempotency (scope, key, request_hash, owner, claimed_at) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING RETURNING 1",
                (scope, key, request_hash, self.owner, now),
            )
            if inserted:
                return Claimed()
            rows = self._run(
                "SELECT request_hash, owner, status, body FROM idempotency WHERE scope = ? AND key = ?",
                (scope, key),
            )
            if not rows:  # released between the two statements: the caller claims again
                return Held("", "", abandoned=False)
            stored_hash, owner, status, body = rows[0]
            if status is not None:
                return Settled(stored_hash, status, json.loads(body))
            # Only this process uses the file, and its calls with one key are serialised (KeyedLocks): a claim
            # still held is one left behind, by an earlier run that died or by a call whose outcome was not written.
            return Held(stored_hash, owner or "", abandoned=True)

        return await self._call(claim)

    async def take_over(self, scope: str, key: str, owner: str) -> bool:
        rows = await self._sql(
            "UPDATE idempotency SET owner = ?, claimed_at = ? WHERE scope = ? AND key = ? AND owner IS ? "
            "AND status IS NULL RETURNING 1",
            self.owner, time.time(), scope, key, owner or None,
        )  # fmt: skip
        return bool(rows)

    async def settle(self, scope: str, key: str, status: int, body: dict[str, Any]) -> None:
        await self._sql(
            "UPDATE idempotency SET status = ?, body = ?, owner = NULL WHERE scope = ? AND key = ? AND owner = ?",
            status, json.dumps(body), scope, key, self.owner,
        )  # fmt: skip

    async def release(self, scope: str, key: str) -> None:
        await self._sql(
            "DELETE FROM idempotency WHERE scope = ? AND key = ? AND owner = ? AND status IS NULL",
            scope, key, self.owner,
        )  # fmt: skip

    async def outcome_changed(self, scope: str, key: str, timeout: float) -> None:
        await asyncio.sleep(min(timeout, 0.05))  # only this process writes the file: it never waits on another

    async def record_pull_request(self, sandbox: str, repo: str, number: int) -> None:
        """`sandbox` created pull request `number` of `repo` (owner/name, any case). A pull request has one creator:
        a second record of it changes nothing."""
        await self._sql("INSERT OR IGNORE INTO pull_request VALUES (?, ?, ?, ?)", repo.lower(), number, sandbox,
                        time.time())  # fmt: skip

    async def pull_request_creator(self, repo: str, number: int) -> str | None:
        rows = await self._sql("SELECT sandbox FROM pull_request WHERE repo = ? AND number = ?", repo.lower(), number)
        return rows[0][0] if rows else None
