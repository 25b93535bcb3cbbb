"""Broker state that must survive a restart: revocations, the tokens issued (until they expire), idempotency
records, the pull requests each sandbox created. (The record of brokered calls is broker.calllog's, in a file of
its own.)

`BrokerStore` is the interface; `SqliteStore` (WAL) is the default. A fleet of gateways would put a shared
store behind the same methods. Any store failure raises `StoreError`, and the broker answers 503: an unreadable
revocation list must never read as "not revoked".
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Protocol


class StoreError(Exception):
    pass


class BrokerStore(Protocol):
    def revoke_token(self, jti: str, expires_at: int) -> None: ...
    def revoke_sandbox(self, sandbox: str) -> None: ...
    def record_issued(self, jti: str, sandbox: str, expires_at: int) -> None: ...
    def was_issued(self, jti: str) -> bool: ...
    def is_revoked(self, jti: str, sandbox: str, issued_at: int) -> bool: ...
    def idempotent_get(self, scope: str, key: str) -> tuple[str, int, dict[str, Any]] | None: ...
    def idempotent_put(self, scope: str, key: str, request_hash: str, status: int, body: dict[str, Any]) -> None: ...
    def record_pull_request(self, sandbox: str, repo: str, number: int) -> None: ...
    def pull_request_creator(self, repo: str, number: int) -> str | None: ...


_SCHEMA = """
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
"""


class SqliteFile:
    """One SQLite database (WAL) with one connection per thread that calls (SQLite's rule: a connection is used by
    one thread at a time; with WAL, each thread's reads go on while another's write waits for a lock). A write
    waits `busy_timeout` seconds for a lock held elsewhere, then fails as StoreError."""

    SCHEMA = ""
    WHAT = "broker state"

    def __init__(self, path: Path, busy_timeout: float = 5.0) -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        self._local = threading.local()
        self._lock = threading.Lock()  # guards the list of connections and `_closed`
        self._connections: list[sqlite3.Connection] = []
        self._closed = False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = self._connection()
            db.execute("PRAGMA journal_mode=WAL")  # kept in the file: every connection uses it
            db.executescript(self.SCHEMA)
        except (sqlite3.Error, OSError) as e:
            self.close()
            raise StoreError(f"cannot open {self.WHAT} {path}: {e}") from e

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
        try:
            return self._connection().execute(sql, args).fetchall()
        except sqlite3.Error as e:
            raise StoreError(f"{self.WHAT} {self.path}: {e}") from e

    def close(self) -> None:
        """Close every thread's connection; any call afterwards raises StoreError."""
        with self._lock:
            self._closed = True
            for db in self._connections:
                db.close()
            self._connections.clear()


class SqliteStore(SqliteFile):
    SCHEMA = _SCHEMA

    def revoke_token(self, jti: str, expires_at: int) -> None:
        self._run("INSERT OR REPLACE INTO revoked_token VALUES (?, ?)", (jti, expires_at))

    def revoke_sandbox(self, sandbox: str) -> None:
        self._run("INSERT OR REPLACE INTO revoked_sandbox VALUES (?, ?)", (sandbox, time.time()))

    def record_issued(self, jti: str, sandbox: str, expires_at: int) -> None:
        """Remember a token this broker minted until it expires (so that revoking an id it never issued can be
        told apart from a typo); expired ones are forgotten here."""
        self._run("DELETE FROM issued_token WHERE expires_at < ?", (int(time.time()),))
        self._run("INSERT OR REPLACE INTO issued_token VALUES (?, ?, ?)", (jti, sandbox, expires_at))

    def was_issued(self, jti: str) -> bool:
        return bool(self._run("SELECT 1 FROM issued_token WHERE jti = ?", (jti,)))

    def is_revoked(self, jti: str, sandbox: str, issued_at: int) -> bool:
        if self._run("SELECT 1 FROM revoked_token WHERE jti = ?", (jti,)):
            return True
        # Every token the sandbox held when it was revoked (iat is whole seconds: compare generously).
        rows = self._run("SELECT revoked_at FROM revoked_sandbox WHERE sandbox = ?", (sandbox,))
        return bool(rows) and issued_at <= rows[0][0]

    def idempotent_get(self, scope: str, key: str) -> tuple[str, int, dict[str, Any]] | None:
        rows = self._run("SELECT request_hash, status, body FROM idempotency WHERE scope = ? AND key = ?", (scope, key))
        if not rows:
            return None
        request_hash, status, body = rows[0]
        return request_hash, status, json.loads(body)

    def idempotent_put(self, scope: str, key: str, request_hash: str, status: int, body: dict[str, Any]) -> None:
        self._run(
            "INSERT OR REPLACE INTO idempotency VALUES (?, ?, ?, ?, ?, ?)",
            (scope, key, request_hash, status, json.dumps(body), time.time()),
        )

    def record_pull_request(self, sandbox: str, repo: str, number: int) -> None:
        """`sandbox` created pull request `number` of `repo` (owner/name, any case). A pull request has one creator:
        a second record of it changes nothing."""
        row = (repo.lower(), number, sandbox, time.time())
        self._run("INSERT OR IGNORE INTO pull_request VALUES (?, ?, ?, ?)", row)

    def pull_request_creator(self, repo: str, number: int) -> str | None:
        rows = self._run("SELECT sandbox FROM pull_request WHERE repo = ? AND number = ?", (repo.lower(), number))
        return rows[0][0] if rows else None
