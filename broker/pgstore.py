"""The broker's state on PostgreSQL: one truth for every replica of a fleet (`--store postgresql://…`).

psycopg 3, async, with its connection pool; plain SQL. What it holds and why:

- The schema is versioned (`schema_version`); the migrations not yet applied run at start, in one transaction under
  an advisory lock (replicas starting together migrate once). A database of a newer airlock is refused.
- Revocations are rows with a sequence number. Each replica keeps them in memory, so that checking a token asks no
  database: a dedicated connection LISTENs for `airlock_revocation` (sent by every revocation, at its commit) and
  reads the rows past the last it has, at once on a notification and every POLL_SECONDS otherwise (a notification
  lost while that connection was down is caught up so). The copy answers only while it is at most
  FRESHNESS_SECONDS old: past that it is read again or, if the database does not answer, the check raises
  StoreError (503) — a revocation made on any replica is in force on every other within a second, or they refuse.
  Revocations are written under an advisory lock, so their sequence numbers commit in order and none is skipped.
- Idempotency keys are claimed with `INSERT … ON CONFLICT DO NOTHING RETURNING`: one caller wins, across replicas.
  A claim names its replica; each replica holds a session advisory lock (LIVENESS_LOCK, its id) on the dedicated
  connection for as long as it lives. When a replica dies its connection closes and PostgreSQL drops the lock: a
  claim whose owner holds no lock is abandoned. A replica that has lost that connection makes no claim (StoreError)
  until it holds its lock again. Settling or releasing a key NOTIFYs `airlock_outcome`, which wakes the callers
  waiting for it (who poll besides).
- Approvals (of gateways sharing the database): each request held is a row, so that any replica lists it and a
  person may answer on any; the answer is a row too, NOTIFYed to the replica that holds the request, which
  releases it (and says how many it released). A sandbox-scope grant is a row every replica consults.
- The call log is a table of the same database (`airlock tools log --store …` reads it). JSON is kept as `json`,
  the exact text, not `jsonb`: a replayed outcome is the same bytes as the first answer, and a NUL a caller sent
  (`\u0000`, which `jsonb` and `text` refuse) is recorded as sent. Text columns get no NUL (their values are
  HTTP header fields, ids and the broker's own messages; a message is cleaned of one).

No GitHub credential is ever written here, and tokens only by their id (jti). The password comes from libpq's own
sources (PGPASSWORD, PGPASSFILE, ~/.pgpass) or a file the caller read: a URL that carries one is refused.

One module past 500 lines on purpose: every statement of the schema and each store's SQL sit together, so that
what the database holds is read in one place (docs/fleet.md says the same in prose).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import Json
from psycopg_pool import AsyncConnectionPool

from .calllog import LoggedCall
from .store import (
    CLAIM_STALE_SECONDS,
    OUTCOME_KEEP_SECONDS,
    PRUNE_EVERY_SECONDS,
    Claimed,
    ClaimState,
    Held,
    Settled,
    StoreError,
)

log = logging.getLogger("airlock.broker")
# The pool logs each failed connection attempt (several lines each); the store says once that the database is
# unreachable, and once that it answers again.
logging.getLogger("psycopg.pool").setLevel(logging.ERROR)

MIGRATION_LOCK = 0x61697231  # pg_advisory_xact_lock keys: airlock's own numbers
REVOCATION_LOCK = 0x61697232
LIVENESS_LOCK = 0x61697233  # (LIVENESS_LOCK, replica id): held by each live replica
REVOCATIONS = "airlock_revocation"
OUTCOMES = "airlock_outcome"
POLL_SECONDS = 0.25
FRESHNESS_SECONDS = 1.0
CONNECT_TIMEOUT = 5  # seconds libpq waits for the server (a host that does not answer)
POOL_WAIT = 3.0  # seconds a store call waits for a connection of the pool
POOL_SIZE = 10
RECONNECT_PAUSE = 0.5

_MIGRATIONS = (
    """
    CREATE TABLE revocation (
        seq bigserial PRIMARY KEY, jti text, sandbox text, revoked_at double precision NOT NULL, expires_at bigint
    );
    CREATE TABLE issued_token (jti text PRIMARY KEY, sandbox text NOT NULL, expires_at bigint NOT NULL);
    CREATE TABLE idempotency (
        scope text NOT NULL, key text NOT NULL, request_hash text NOT NULL, owner integer,
        claimed_at double precision NOT NULL, status integer, body json, PRIMARY KEY (scope, key)
    );
    CREATE TABLE pull_request (
        repo text NOT NULL, number integer NOT NULL, sandbox text NOT NULL, created double precision NOT NULL,
        PRIMARY KEY (repo, number)
    );
    CREATE TABLE call (
        id bigserial PRIMARY KEY, ts double precision NOT NULL, sandbox text NOT NULL, tool text NOT NULL,
        jti text NOT NULL, request_id text NOT NULL, grants json NOT NULL, input json, status integer,
        result json, error text, message text, duration_ms double precision
    );
    CREATE INDEX call_by_sandbox ON call (sandbox, ts);
    CREATE TABLE broker_replica (
        id serial PRIMARY KEY, started double precision NOT NULL, host text NOT NULL, pid integer NOT NULL
    );
    """,
    # Approvals a fleet of gateways shares: what each holds, what a person decided (on any replica), the grants.
    """
    CREATE TABLE approval_pending (
        id text PRIMARY KEY, replica integer NOT NULL, sandbox text NOT NULL, host text NOT NULL, port integer,
        profile text NOT NULL, kind text NOT NULL, client text NOT NULL, asked_at double precision NOT NULL,
        expires_at double precision NOT NULL
    );
    CREATE TABLE approval_decision (
        id text PRIMARY KEY, scope text, by text NOT NULL, ttl double precision, decided_at double precision NOT NULL,
        released integer
    );
    CREATE TABLE approval_grant (
        sandbox text NOT NULL, host text NOT NULL, port integer, until double precision, by text NOT NULL,
        approval text NOT NULL
    );
    CREATE INDEX approval_grant_target ON approval_grant (sandbox, host);
    """,
    # Settled outcomes are forgotten a day after their claim: found by age without reading the whole table.
    """
    CREATE INDEX idempotency_settled_age ON idempotency (claimed_at) WHERE status IS NOT NULL;
    """,
)


def check_url(url: str) -> None:
    """StoreError unless `url` is a PostgreSQL URL without a password (a command line is every user's to read)."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as e:
        raise StoreError(f"--store {url!r}: not a PostgreSQL URL: {_first_line(e)}") from None
    if params.get("password"):
        raise StoreError(
            "--store: the URL holds a password; give it with --store-password-file, PGPASSWORD or PGPASSFILE instead"
        )


class _Revocations:
    """This replica's copy of the revocations: every row up to `seq`, read at `synced` (monotonic)."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}  # jti → expires at
        self.sandboxes: dict[str, float] = {}  # sandbox → the latest revocation
        self.seq = 0
        self.synced = -1e9
        self._pruned = 0.0

    def add(self, rows: Sequence[tuple[Any, ...]], read_at: float) -> None:
        for seq, jti, sandbox, revoked_at, expires_at in rows:
            if jti is not None:
                self.tokens[jti] = max(self.tokens.get(jti, 0), int(expires_at))
            if sandbox is not None:
                self.sandboxes[sandbox] = max(self.sandboxes.get(sandbox, 0.0), revoked_at)
            self.seq = max(self.seq, seq)
        self.synced = max(self.synced, read_at)
        if read_at - self._pruned > 60:  # a revoked token that has expired can never be presented again
            self._pruned, now = read_at, time.time()
            self.tokens = {jti: until for jti, until in self.tokens.items() if until >= now}

    def revoked(self, jti: str, sandbox: str, issued_at: int) -> bool:
        cutoff = self.sandboxes.get(sandbox)
        return jti in self.tokens or (cutoff is not None and issued_at <= cutoff)


class PostgresStore:
    """`BrokerStore` and `CallStore` on one PostgreSQL database. Open with `await PostgresStore.open(url)`."""

    def __init__(self, url: str, conninfo: str, pool: AsyncConnectionPool) -> None:
        self.url, self._conninfo, self.pool = url, conninfo, pool
        self.approvals = PostgresApprovals(self)
        self.replica = 0
        self.owner = ""
        self._revocations = _Revocations()
        self._alive = asyncio.Event()  # the dedicated connection holds this replica's liveness lock
        self._waiting: dict[str, asyncio.Event] = {}  # idempotency keys waited for, by the hash notifications carry
        self._watcher: asyncio.Task[None] | None = None
        self._syncing = asyncio.Lock()  # one read of the revocations at a time: callers that find it stale wait for it
        self._closed = False
        self._pruned = 0.0  # when outcomes past OUTCOME_KEEP_SECONDS were last forgotten

    @classmethod
    async def open(cls, url: str, password: str | None = None, replica: bool = True) -> PostgresStore:
        """Connect, migrate, register this replica and start following the revocations (a reader of the call log,
        `replica` False, does neither); StoreError when the database cannot be reached or is of a newer airlock."""
        check_url(url)
        extra: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT, "application_name": "airlock-broker"}
        if password is not None:
            extra["password"] = password
        conninfo = make_conninfo(url, **extra)
        pool = AsyncConnectionPool(
            conninfo, min_size=1, max_size=POOL_SIZE, open=False, timeout=POOL_WAIT, kwargs={"autocommit": True},
            check=AsyncConnectionPool.check_connection, name="airlock-broker",
        )  # fmt: skip
        store = cls(url, conninfo, pool)
        try:
            await (await psycopg.AsyncConnection.connect(conninfo)).close()  # what is wrong, said as libpq says it
            await pool.open(wait=True, timeout=CONNECT_TIMEOUT + 1)
            await store._migrate()
            if not replica:
                return store
            rows = await store._rows(
                "INSERT INTO broker_replica (started, host, pid) VALUES (%s, %s, %s) RETURNING id",
                (time.time(), socket.gethostname(), os.getpid()),
            )
            store.replica = int(rows[0][0])
            await store._forget_dead_replicas()
            store.owner = str(store.replica)
            store._watcher = asyncio.create_task(store._watch(), name="airlock-broker-store-watch")
            store._watcher.add_done_callback(_said_if_failed)
            async with asyncio.timeout(CONNECT_TIMEOUT + 1):
                await store._alive.wait()
        except (psycopg.Error, StoreError, TimeoutError) as e:
            await store.close()
            if isinstance(e, StoreError):
                raise
            raise StoreError(f"cannot reach the broker's database {url}: {_first_line(e)}") from None
        return store

    async def _migrate(self) -> None:
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            await conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version integer NOT NULL)")
            cursor = await conn.execute("SELECT coalesce(max(version), 0) FROM schema_version")
            row = await cursor.fetchone()
            version = int(row[0]) if row else 0
            if version > len(_MIGRATIONS):
                raise StoreError(
                    f"the broker's database {self.url} has schema version {version}, newer than this "
                    f"airlock's ({len(_MIGRATIONS)}): run the airlock that wrote it, or a newer one"
                )
            for number, script in enumerate(_MIGRATIONS[version:], start=version + 1):
                await conn.execute(script)
                await conn.execute("INSERT INTO schema_version VALUES (%s)", (number,))
                log.info("broker database %s: schema migrated to version %d", self.url, number)

    async def _forget_dead_replicas(self) -> None:
        """The rows of replicas that hold no liveness lock (ended, or killed) and started over a minute ago (one
        that started since may not hold its lock yet): nothing reads them but a person, and each start adds one.
        Their claims need no row: a claim whose owner holds no lock reads as abandoned either way."""
        await self._rows(
            "DELETE FROM broker_replica r WHERE r.id <> %s AND r.started < %s AND NOT EXISTS ("
            " SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2"
            " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND l.classid::bigint = %s AND l.objid::bigint = r.id)",
            (self.replica, time.time() - 60, LIVENESS_LOCK),
        )

    # --- the dedicated connection: liveness lock, notifications, the revocations' copy ------------------------------

    async def _watch(self) -> None:
        said = False
        while not self._closed:
            try:
                conn = await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True)
                async with conn:
                    await conn.execute("SELECT pg_advisory_lock(%s, %s)", (LIVENESS_LOCK, self.replica))
                    await conn.execute(f"LISTEN {REVOCATIONS}")
                    await conn.execute(f"LISTEN {OUTCOMES}")
                    async with self._syncing:
                        await self._sync(conn)
                    self._alive.set()
                    if said:
                        log.warning("broker database %s: reachable again", self.url)
                        said = False
                    while not self._closed:
                        async for note in conn.notifies(timeout=POLL_SECONDS, stop_after=1):
                            self._noted(note)
                        async with self._syncing:
                            await self._sync(conn)
            except (psycopg.Error, OSError) as e:
                self._alive.clear()
                if not said and not self._closed:
                    log.warning("broker database %s unreachable: %s (refusing until it answers)", self.url,
                                _first_line(e))  # fmt: skip
                    said = True
                self._wake_all()
                await asyncio.sleep(RECONNECT_PAUSE)

    def _noted(self, note: psycopg.Notify) -> None:
        if note.channel == OUTCOMES and (event := self._waiting.get(note.payload)) is not None:
            event.set()

    def _wake_all(self) -> None:
        for event in self._waiting.values():
            event.set()

    async def _sync(self, conn: psycopg.AsyncConnection[Any]) -> None:
        read_at = time.monotonic()
        cursor = await conn.execute(
            "SELECT seq, jti, sandbox, revoked_at, expires_at FROM revocation WHERE seq > %s ORDER BY seq",
            (self._revocations.seq,),
        )
        self._revocations.add(await cursor.fetchall(), read_at)

    async def _sync_now(self, unless_fresh: bool = False) -> None:
        try:
            async with self._syncing:
                if unless_fresh and time.monotonic() - self._revocations.synced <= FRESHNESS_SECONDS:
                    return  # another caller has just read them
                async with self.pool.connection() as conn:
                    await self._sync(conn)
        except psycopg.Error as e:
            raise StoreError(f"the broker's database {self.url}: {_first_line(e)}") from None

    # --- statements ---------------------------------------------------------------------------------------------

    async def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        if self._closed:
            raise StoreError(f"the broker's database {self.url}: the store is closed")
        try:
            async with self.pool.connection() as conn:
                cursor = await conn.execute(sql, args)
                return await cursor.fetchall() if cursor.description else []
        except psycopg.Error as e:
            raise StoreError(f"the broker's database {self.url}: {_first_line(e)}") from None

    # --- revocations and tokens ---------------------------------------------------------------------------------

    async def _revoke(self, jti: str | None, sandbox: str | None, expires_at: int | None) -> None:
        if self._closed:
            raise StoreError(f"the broker's database {self.url}: the store is closed")
        try:
            async with self.pool.connection() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(%s)", (REVOCATION_LOCK,))  # sequence in commit order
                await conn.execute(
                    "INSERT INTO revocation (jti, sandbox, revoked_at, expires_at) VALUES (%s, %s, %s, %s)",
                    (jti, sandbox, time.time(), expires_at),
                )
                # A revoked token that has expired can never be presented again (no replica reads old rows again).
                await conn.execute("DELETE FROM revocation WHERE expires_at < %s", (int(time.time()) - 60,))
                await conn.execute("SELECT pg_notify(%s, '')", (REVOCATIONS,))
        except psycopg.Error as e:
            raise StoreError(f"the broker's database {self.url}: {_first_line(e)}") from None
        await self._sync_now()  # in force here at once

    async def revoke_token(self, jti: str, expires_at: int) -> None:
        await self._revoke(jti, None, expires_at)

    async def revoke_sandbox(self, sandbox: str) -> None:
        await self._revoke(None, sandbox, None)

    async def record_issued(self, jti: str, sandbox: str, expires_at: int) -> None:
        await self._rows("DELETE FROM issued_token WHERE expires_at < %s", (int(time.time()),))
        await self._rows(
            "INSERT INTO issued_token VALUES (%s, %s, %s) ON CONFLICT (jti) DO UPDATE SET expires_at = %s",
            (jti, sandbox, expires_at, expires_at),
        )

    async def was_issued(self, jti: str) -> bool:
        return bool(await self._rows("SELECT 1 FROM issued_token WHERE jti = %s", (jti,)))

    async def is_revoked(self, jti: str, sandbox: str, issued_at: int) -> bool:
        if self._closed:
            raise StoreError(f"the broker's database {self.url}: the store is closed")
        if time.monotonic() - self._revocations.synced > FRESHNESS_SECONDS:
            await self._sync_now(unless_fresh=True)  # the dedicated connection is behind, or down
        return self._revocations.revoked(jti, sandbox, issued_at)

    # --- idempotency --------------------------------------------------------------------------------------------

    async def claim(self, scope: str, key: str, request_hash: str) -> ClaimState:
        if not self._alive.is_set():  # another replica would read this claim as abandoned at once
            raise StoreError(f"the broker's database {self.url}: this replica's liveness session is down")
        now = time.time()
        if now - self._pruned > PRUNE_EVERY_SECONDS:
            self._pruned = now
            await self._rows(
                "DELETE FROM idempotency WHERE status IS NOT NULL AND claimed_at < %s", (now - OUTCOME_KEEP_SECONDS,)
            )
        inserted = await self._rows(
            "INSERT INTO idempotency (scope, key, request_hash, owner, claimed_at) VALUES (%s, %s, %s, %s, %s) "
            "ON CONFLICT DO NOTHING RETURNING 1",
            (scope, key, request_hash, self.replica, now),
        )
        if inserted:
            return Claimed()
        rows = await self._rows(
            "SELECT i.request_hash, i.owner, i.claimed_at, i.status, i.body, EXISTS ("
            " SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2"
            " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND l.classid::bigint = %s AND l.objid::bigint = i.owner) "
            "FROM idempotency i WHERE i.scope = %s AND i.key = %s",
            (LIVENESS_LOCK, scope, key),
        )
        if not rows:  # released between the two statements: the caller claims again
            return Held("", "", abandoned=False)
        stored_hash, owner, claimed_at, status, body, owner_lives = rows[0]
        if status is not None:
            return Settled(stored_hash, status, body)
        # This replica's calls with one key are serialised (KeyedLocks): its own claim seen again is one left behind.
        stale = time.time() - claimed_at > CLAIM_STALE_SECONDS
        abandoned = owner is None or owner == self.replica or not owner_lives or stale
        return Held(stored_hash, "" if owner is None else str(owner), abandoned)

    async def take_over(self, scope: str, key: str, owner: str) -> bool:
        rows = await self._rows(
            "UPDATE idempotency SET owner = %s, claimed_at = %s WHERE scope = %s AND key = %s "
            "AND owner IS NOT DISTINCT FROM %s AND status IS NULL RETURNING 1",
            (self.replica, time.time(), scope, key, int(owner) if owner else None),
        )
        return bool(rows)

    async def settle(self, scope: str, key: str, status: int, body: dict[str, Any]) -> None:
        await self._rows(
            "WITH settled AS (UPDATE idempotency SET status = %s, body = %s, owner = NULL "
            "WHERE scope = %s AND key = %s AND owner = %s RETURNING 1) SELECT pg_notify(%s, %s) FROM settled",
            (status, Json(body), scope, key, self.replica, OUTCOMES, _key_hash(scope, key)),
        )

    async def release(self, scope: str, key: str) -> None:
        await self._rows(
            "WITH released AS (DELETE FROM idempotency WHERE scope = %s AND key = %s AND owner = %s "
            "AND status IS NULL RETURNING 1) SELECT pg_notify(%s, %s) FROM released",
            (scope, key, self.replica, OUTCOMES, _key_hash(scope, key)),
        )

    async def outcome_changed(self, scope: str, key: str, timeout: float) -> None:
        """Until the key is settled or released (a notification), or `timeout` passes (the caller looks again)."""
        name = _key_hash(scope, key)
        event = self._waiting.setdefault(name, asyncio.Event())
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
        finally:
            if self._waiting.get(name) is event:
                del self._waiting[name]

    # --- pull requests ------------------------------------------------------------------------------------------

    async def record_pull_request(self, sandbox: str, repo: str, number: int) -> None:
        await self._rows(
            "INSERT INTO pull_request VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
            (repo.lower(), number, sandbox, time.time()),
        )

    async def pull_request_creator(self, repo: str, number: int) -> str | None:
        rows = await self._rows(
            "SELECT sandbox FROM pull_request WHERE repo = %s AND number = %s", (repo.lower(), number)
        )
        return str(rows[0][0]) if rows else None

    # --- the call log -------------------------------------------------------------------------------------------

    async def begin(self, sandbox: str, tool: str, jti: str, request_id: str, grants: list[dict[str, Any]],
                    input: dict[str, Any] | None) -> int:  # fmt: skip
        rows = await self._rows(
            "INSERT INTO call (ts, sandbox, tool, jti, request_id, grants, input) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id",
            (time.time(), sandbox, _text(tool), jti, request_id, Json(grants), _json(input)),
        )
        return int(rows[0][0])

    async def finish(self, call_id: int, status: int, result: dict[str, Any] | None, error: str | None,
                     message: str | None, duration_ms: float) -> None:  # fmt: skip
        await self._rows(
            "UPDATE call SET status = %s, result = %s, error = %s, message = %s, duration_ms = %s WHERE id = %s",
            (status, _json(result), error, _text(message), duration_ms, call_id),
        )

    async def calls(self, sandbox: str | None = None, since: float | None = None) -> list[LoggedCall]:
        rows = await self._rows(
            "SELECT id, ts, sandbox, tool, jti, request_id, grants, input, status, result, error, message, "
            "duration_ms FROM call WHERE (%s::text IS NULL OR sandbox = %s) AND ts >= %s ORDER BY id",
            (sandbox, sandbox, since or 0.0),
        )
        return [LoggedCall(*row) for row in rows]

    async def close(self) -> None:
        """Stop following, close every connection (this replica's liveness lock goes with its own); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._alive.clear()
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        await self.pool.close()


class PostgresApprovals:
    """The approvals a fleet of gateways shares (airlock.gateway.approval_desk.SharedApprovals). Best effort where
    the database fails: a held request is still answered on the replica that holds it, and a grant not read is no
    grant (the request is held and asked, never let through)."""

    SCOPE = "approval"  # the outcome notifications' scope: a decision wakes the replica that holds the request

    def __init__(self, store: PostgresStore) -> None:
        self.store = store

    async def _quietly(self, sql: str, args: Sequence[Any]) -> list[tuple[Any, ...]] | None:
        try:
            return await self.store._rows(sql, args)
        except StoreError as e:
            log.warning("shared approvals: %s", e)
            return None

    async def hold(self, entry: dict[str, Any]) -> None:
        await self._quietly(
            "INSERT INTO approval_pending VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
            (entry["id"], self.store.replica, entry["sandbox"], entry["host"], entry["port"], entry["profile"],
             entry["kind"], entry["client"], entry["asked_at"], entry["expires_at"]),
        )  # fmt: skip

    async def pending(self) -> list[dict[str, Any]]:
        """Every replica's held requests not yet answered (times in Unix seconds)."""
        rows = await self._quietly(
            "SELECT p.id, p.sandbox, p.profile, p.kind, p.host, p.port, p.client, p.asked_at, p.expires_at, "
            "p.replica FROM approval_pending p WHERE p.expires_at > %s AND NOT EXISTS "
            "(SELECT 1 FROM approval_decision d WHERE d.id = p.id) ORDER BY p.asked_at",
            (time.time(),),
        )
        names = ("id", "sandbox", "profile", "kind", "host", "port", "client", "asked_at", "expires_at", "replica")
        return [dict(zip(names, row, strict=True)) for row in rows or []]

    async def entry(self, approval_id: str) -> dict[str, Any] | None:
        return next((p for p in await self.pending() if p["id"] == approval_id), None)

    async def decide(self, approval_id: str, scope: str | None, by: str, ttl: float | None) -> bool:
        """A person's answer (scope None: denied), for the replica that holds the request; False if answered."""
        rows = await self._quietly(
            "WITH decided AS (INSERT INTO approval_decision (id, scope, by, ttl, decided_at) "
            "VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING 1) SELECT pg_notify(%s, %s) FROM decided",
            (approval_id, scope, by, ttl, time.time(), OUTCOMES, _key_hash(self.SCOPE, approval_id)),
        )
        return bool(rows)

    async def decision(self, approval_id: str) -> tuple[str | None, str, float | None]:
        """Until a person answers `approval_id` on any replica: (scope or None for denied, by, ttl)."""
        while True:
            rows = await self._quietly("SELECT scope, by, ttl FROM approval_decision WHERE id = %s", (approval_id,))
            if rows:
                scope, by, ttl = rows[0]
                return scope, by, ttl
            await self.store.outcome_changed(self.SCOPE, approval_id, POLL_SECONDS)

    async def answered(self, approval_id: str, released: int) -> None:
        """The request is no longer held here: answered (`released` requests let go), or timed out."""
        await self._quietly("UPDATE approval_decision SET released = %s WHERE id = %s", (released, approval_id))
        await self._quietly("DELETE FROM approval_pending WHERE id = %s", (approval_id,))

    async def released(self, approval_id: str, wait: float) -> int:
        """How many requests the holder released on this answer (0 if it has not said within `wait` seconds)."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            rows = await self._quietly("SELECT released FROM approval_decision WHERE id = %s", (approval_id,))
            if rows and rows[0][0] is not None:
                return int(rows[0][0])
            await asyncio.sleep(0.05)
        return 0

    async def add_grant(self, sandbox: str, host: str, port: int | None, until: float | None, by: str,
                        approval: str) -> None:  # fmt: skip
        await self._quietly(
            "INSERT INTO approval_grant VALUES (%s, %s, %s, %s, %s, %s)", (sandbox, host, port, until, by, approval)
        )

    async def grants(self, sandbox: str, host: str) -> list[tuple[int | None, float | None, str, str]]:
        """The sandbox-scope grants of (sandbox, host) in force: (port, until in Unix seconds, by, approval)."""
        rows = await self._quietly(
            "SELECT port, until, by, approval FROM approval_grant WHERE sandbox = %s AND host = %s "
            "AND (until IS NULL OR until > %s)",
            (sandbox, host, time.time()),
        )
        return [(port, until, by, approval) for port, until, by, approval in rows or []]


def _said_if_failed(task: asyncio.Task[None]) -> None:
    """The dedicated connection's task ended by a bug: the store refuses from now on (its copy goes stale); said."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("broker database: following the revocations failed (refusing from now on): %r", error)


def _key_hash(scope: str, key: str) -> str:
    return hashlib.sha256(f"{scope}\0{key}".encode()).hexdigest()[:32]


def _json(value: dict[str, Any] | None) -> Json | None:
    return None if value is None else Json(value)


def _text(value: str | None) -> str | None:
    return None if value is None else value.replace("\x00", "\ufffd")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
