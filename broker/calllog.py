"""The record of every brokered call, in a database of its own: what an operator reads (`airlock tools log`) and
replays (`airlock tools replay`) to see what an agent did, kept apart from the broker's security state.

A call is written before its tool acts (with the validated input) and completed when it ends, so nothing is done
that the log does not hold: a log that cannot be written refuses the call (503), as the rest of the broker's
state does. Calls refused before their input was accepted (an unknown tool, no grant, an invalid input) are one
row without input. Inputs and results pass the broker's redactor first; fields a schema marks as base64 content
(a push's git bundle) are kept as their sha256 and size, never their bytes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from airlock.audit import AuditRecord

from .errors import BrokerError
from .redact import Redactor
from .store import SqliteFile
from .store_deadline import StoreDeadline

if TYPE_CHECKING:  # named in annotations only: `airlock tools log` reads the log without jwt or jsonschema
    from .calls import Call
    from .tokens import Claims
    from .tool_schemas import ToolSpec

log = logging.getLogger("airlock.broker")

type _Row = tuple[str, str, str, str, list[dict[str, Any]], dict[str, Any] | None]
type _Ending = tuple[int, dict[str, Any] | None, str | None, str | None, float]

FILE_NAME = "calls.sqlite3"
MAX_TOOL_NAME = 100

_MIGRATIONS = (
    """
    CREATE TABLE IF NOT EXISTS call (
        id INTEGER PRIMARY KEY, ts REAL NOT NULL, sandbox TEXT NOT NULL, tool TEXT NOT NULL, jti TEXT NOT NULL,
        request_id TEXT NOT NULL, grants TEXT NOT NULL, input TEXT, status INTEGER, result TEXT, error TEXT,
        message TEXT, duration_ms REAL
    );
    CREATE INDEX IF NOT EXISTS call_by_sandbox ON call (sandbox, ts);
    """,
)


@dataclass(frozen=True)
class LoggedCall:
    id: int
    ts: float
    sandbox: str
    tool: str
    jti: str
    request_id: str
    grants: list[dict[str, Any]]
    input: dict[str, Any] | None
    status: int | None  # None: the call had not ended (it is running, or the broker died during it)
    result: dict[str, Any] | None
    error: str | None
    message: str | None
    duration_ms: float | None

    def to_json(self) -> dict[str, Any]:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.ts)) + f".{int(self.ts % 1 * 1000):03d}Z"
        return {
            "id": self.id, "ts": stamp, "sandbox": self.sandbox, "tool": self.tool, "jti": self.jti,
            "request_id": self.request_id, "input": self.input, "status": self.status, "result": self.result,
            "error": self.error, "message": self.message, "duration_ms": self.duration_ms, "grants": self.grants,
        }  # fmt: skip


class CallStore(Protocol):
    """Where the record of brokered calls is kept: a SQLite file of its own (`CallLog`), or the fleet's database."""

    async def begin(self, sandbox: str, tool: str, jti: str, request_id: str, grants: list[dict[str, Any]],
                    input: dict[str, Any] | None) -> int: ...  # fmt: skip
    async def finish(self, call_id: int, status: int, result: dict[str, Any] | None, error: str | None,
                     message: str | None, duration_ms: float) -> None: ...  # fmt: skip
    async def calls(self, sandbox: str | None = None, since: float | None = None) -> list[LoggedCall]: ...
    async def close(self) -> None: ...


class CallLog(SqliteFile):
    MIGRATIONS = _MIGRATIONS
    WHAT = "call log"

    @classmethod
    def in_directory(cls, directory: Path) -> CallLog:
        """The log in `directory`: folder 0700 and file 0600 (inputs of every sandbox: root's alone; SQLite gives
        its -wal and -shm files the database file's mode)."""
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = directory / FILE_NAME
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
        os.chmod(path, 0o600)  # one made before by an older airlock, or under another umask
        return cls(path)

    async def begin(self, sandbox: str, tool: str, jti: str, request_id: str, grants: list[dict[str, Any]],
                    input: dict[str, Any] | None) -> int:  # fmt: skip
        rows = await self._sql(
            "INSERT INTO call (ts, sandbox, tool, jti, request_id, grants, input) VALUES (?, ?, ?, ?, ?, ?, ?) "
            "RETURNING id",
            time.time(), sandbox, tool, jti, request_id, json.dumps(grants), _json(input),
        )  # fmt: skip
        return int(rows[0][0])

    async def finish(self, call_id: int, status: int, result: dict[str, Any] | None, error: str | None,
                     message: str | None, duration_ms: float) -> None:  # fmt: skip
        await self._sql(
            "UPDATE call SET status = ?, result = ?, error = ?, message = ?, duration_ms = ? WHERE id = ?",
            status, _json(result), error, message, duration_ms, call_id,
        )  # fmt: skip

    async def calls(self, sandbox: str | None = None, since: float | None = None) -> list[LoggedCall]:
        rows = await self._sql(
            "SELECT id, ts, sandbox, tool, jti, request_id, grants, input, status, result, error, message, "
            "duration_ms FROM call WHERE (? IS NULL OR sandbox = ?) AND ts >= ? ORDER BY id",
            sandbox, sandbox, since or 0.0,
        )  # fmt: skip
        return [
            LoggedCall(
                id, ts, sbx, tool, jti, rid, json.loads(grants), _parsed(input), status, _parsed(result), error,
                message, duration,
            )
            for id, ts, sbx, tool, jti, rid, grants, input, status, result, error, message, duration in rows
        ]  # fmt: skip


def content_fields(schema: dict[str, Any]) -> list[str]:
    """The top-level fields the schema marks as base64 content (a push's bundle)."""
    properties = schema.get("properties", {})
    return [n for n, f in properties.items() if isinstance(f, dict) and f.get("contentEncoding") == "base64"]


def recorded_input(value: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """The input as the log keeps it: each content field replaced by the sha256 and size of its bytes."""
    return {k: _digest(v) if k in fields and isinstance(v, str) else v for k, v in value.items()}


def _digest(text: str) -> dict[str, Any]:
    try:
        data = base64.b64decode(text, validate=True)
    except binascii.Error:  # the tool refuses it; the log still says what was sent
        data = text.encode()
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _json(value: dict[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def _parsed(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class CallRecorder:
    """The broker's side of the log: written through its store, redacted on the event loop (the redactor learns
    new credentials there), bundles hashed off it."""

    def __init__(self, log: CallStore, state: StoreDeadline, redactor: Redactor) -> None:
        self.log, self.state, self.redactor = log, state, redactor

    async def begin(self, spec: ToolSpec, call: Call) -> int:
        """The call's row, before its tool acts; BrokerError (503) when it cannot be written."""
        kept = call.input
        if fields := content_fields(spec.input_schema):  # megabytes to hash: off the event loop
            kept = await asyncio.to_thread(recorded_input, call.input, fields)
        row = self._row(spec.name, call.claims, call.record, self.redactor.value(kept))
        return await self.state(self.log.begin(*row))

    async def end(self, call_id: int, status: int, result: dict[str, Any] | None, error: BrokerError | None,
                  started: float) -> None:  # fmt: skip
        """Complete the row. The tool has acted: a log that fails now is reported, not turned into a refusal."""
        ending = self._ending(status, result, error, started)
        try:
            await self.state(self.log.finish(call_id, *ending))
        except BrokerError:
            log.error("call log: could not complete call %d (it stays without an ending)", call_id)

    async def refused(self, name: str, claims: Claims, record: AuditRecord, error: BrokerError, started: float) -> None:
        """One row for a call refused before its input was accepted."""
        row = self._row(name, claims, record, None)
        ending = self._ending(error.status, None, error, started)
        try:
            await self.state(self._begin_and_finish(row, ending))
        except BrokerError:
            log.error("call log: could not record a refused call of %s (request %s)", name, record.request_id)

    async def _begin_and_finish(self, row: _Row, ending: _Ending) -> None:
        await self.log.finish(await self.log.begin(*row), *ending)

    def _row(self, name: str, claims: Claims, record: AuditRecord, input: dict[str, Any] | None) -> _Row:
        grants = [g.to_claim() for g in claims.grants]
        # `name` may be any path the caller sent (an unknown tool): kept, but not at any length.
        return (claims.sandbox, name[:MAX_TOOL_NAME], claims.jti, record.request_id, grants, input)

    def _ending(self, status: int, result: dict[str, Any] | None, error: BrokerError | None,
                started: float) -> _Ending:  # fmt: skip
        took = round((time.monotonic() - started) * 1000, 3)
        body = None if result is None else self.redactor.value(result)
        message = None if error is None else self.redactor.text(error.message)
        return status, body, None if error is None else error.code, message, took
