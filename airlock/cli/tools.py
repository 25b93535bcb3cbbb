"""`airlock tools log|replay`: read the record of brokered calls, and re-run a sandbox's calls elsewhere.

`log` prints the call log (text, or one JSON object per line). `replay` runs one sandbox's recorded calls again,
in order, through the broker's own code (the same grants, schemas and checks) against another GitHub — a staging
instance, or a fake — and prints what was recorded next to what came back, so that a strange agent run can be
reproduced. A push is replayed only when its bundle is found (by sha256) in `--bundles DIR`: the log never keeps
one. The replay's own state (tokens, idempotency) is a temporary directory; it writes nothing to the call log.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import DEFAULT_STATE_DIR, EXIT_DENY, NeedsRoot, UsageError, absolute, duration

if TYPE_CHECKING:
    import ssl

    import aiohttp

    from airlock.broker.calllog import CallStore, LoggedCall
    from airlock.broker.service import Broker
    from airlock.broker.store import BrokerStore

SUMMARY_WIDTH = 44  # characters of a result shown per side


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    log = actions.add_parser("log", help="print the brokered calls")
    replay = actions.add_parser("replay", help="re-run a sandbox's calls against another GitHub, side by side")
    for sub in (log, replay):
        sub.add_argument("--call-log", type=absolute, metavar="DIR", help=f"default: {DEFAULT_STATE_DIR}/calls")
        sub.add_argument("--state-dir", type=absolute, metavar="DIR", help="the gateway's: its calls/ folder")
        sub.add_argument("--store", metavar="URL", help="a fleet's PostgreSQL store (postgresql://USER@HOST/DB)")
        sub.add_argument("--store-password-file", type=absolute, metavar="FILE", help="its password")
        sub.add_argument("--since", type=since, metavar="WHEN", help="a duration ago (90s, 10m, 2h) or an ISO time")
        sub.add_argument("--json", action="store_true", help="one JSON object per line")
    log.add_argument("--sandbox", metavar="ID")
    replay.add_argument("--sandbox", required=True, metavar="ID")
    replay.add_argument("--api", required=True, metavar="URL", help="the GitHub API to replay against")
    replay.add_argument("--git", metavar="URL", help="where git reaches its repositories (default: from --api)")
    replay.add_argument("--upstream-ca", type=absolute, metavar="FILE", help="CA bundle for that GitHub's TLS")
    replay.add_argument("--bundles", type=absolute, metavar="DIR", help="git bundles of the pushes, found by sha256")
    replay.add_argument("--github-token-file", type=absolute, metavar="FILE")
    replay.add_argument("--github-token-env", metavar="VAR")
    replay.add_argument("--github-app-id", metavar="ID")
    replay.add_argument("--github-app-key", type=absolute, metavar="PEM")
    replay.add_argument("--github-installation-id", type=int, metavar="ID")
    log.set_defaults(func=cmd_tools_log, root_when_refused=NeedsRoot("the call log is root's"))
    replay.set_defaults(func=cmd_tools_replay)


def since(text: str) -> float:
    """`2h` (that long ago) or an ISO 8601 time (UTC unless it says) → a Unix time."""
    try:
        return time.time() - duration(text)
    except argparse.ArgumentTypeError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a duration (90s, 10m, 2h) nor an ISO time") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def logged_calls(args: argparse.Namespace) -> list[LoggedCall]:
    from airlock.broker.calllog import FILE_NAME, CallLog
    from airlock.broker.store import StoreError

    if args.store:
        return asyncio.run(_from_database(args))
    directory = Path(args.call_log or Path(args.state_dir or DEFAULT_STATE_DIR) / "calls")
    if not (directory / FILE_NAME).is_file():  # opening would create an empty log: say there is none instead
        raise UsageError(f"no call log in {directory}")
    try:
        return asyncio.run(_read(CallLog(directory / FILE_NAME), args.sandbox, args.since))
    except StoreError as e:
        raise UsageError(str(e)) from None


async def _from_database(args: argparse.Namespace) -> list[LoggedCall]:
    from airlock.broker.pgstore import PostgresStore
    from airlock.broker.store import StoreError
    from airlock.gateway.broker_inputs import read_password

    if not args.store.startswith(("postgresql://", "postgres://")):
        raise UsageError(f"--store {args.store!r}: give a PostgreSQL URL (a SQLite call log: --call-log DIR)")
    try:
        store = await PostgresStore.open(args.store, read_password(args.store_password_file), replica=False)
        return await _read(store, args.sandbox, args.since)
    except StoreError as e:
        raise UsageError(str(e)) from None


async def _read(log: CallStore, sandbox: str | None, since: float | None) -> list[LoggedCall]:
    try:
        return await log.calls(sandbox, since)
    finally:
        await log.close()


def cmd_tools_log(args: argparse.Namespace) -> int:
    for call in logged_calls(args):
        entry = call.to_json()
        if args.json:
            print(json.dumps(entry, sort_keys=True))
            continue
        outcome = f"{call.status} {call.error}" if call.error else str(call.status or "unfinished")
        took = f"{call.duration_ms:.1f} ms" if call.duration_ms is not None else "-"
        shown = call.result if call.error is None else {"message": call.message}
        print(f"{entry['ts']}  {call.sandbox}  {call.tool}  {outcome}  {took}  {_brief(call.input)} → {_brief(shown)}")
    return 0


def cmd_tools_replay(args: argparse.Namespace) -> int:
    calls = logged_calls(args)
    if not calls:
        raise UsageError(f"the call log has no calls of sandbox {args.sandbox!r}")
    bundles = _bundles(Path(args.bundles)) if args.bundles else {}
    outcomes = asyncio.run(_replay(args, calls, bundles))
    differing = sum(1 for o in outcomes if o.same is False)
    if args.json:
        for outcome in outcomes:
            print(json.dumps(outcome.to_json(), sort_keys=True))
    else:
        _print_side_by_side(outcomes)
    skipped = sum(1 for o in outcomes if o.same is None)
    print(f"airlock: {len(outcomes)} call(s): {len(outcomes) - differing - skipped} same, {differing} differ, "
          f"{skipped} not replayed", file=sys.stderr)  # fmt: skip
    return EXIT_DENY if differing else 0


@dataclass(frozen=True)
class ReplayedCall:
    call: LoggedCall
    replayed: tuple[int, dict[str, Any]] | None  # status and body; None: not replayed
    note: str = ""  # why not, or what the replay lacked

    @property
    def recorded(self) -> tuple[int | None, dict[str, Any] | None]:  # None: the call had not ended
        call = self.call
        return call.status, call.result if call.error is None else {"error": call.error}

    @property
    def same(self) -> bool | None:
        if self.replayed is None:
            return None
        status, body = self.replayed
        return (status, body if status < 400 else {"error": body.get("error")}) == self.recorded

    def differences(self) -> list[str]:
        if self.replayed is None:
            return []
        (old_status, old), (new_status, new) = self.recorded, self.replayed
        new = new if new_status < 400 else {"error": new.get("error")}
        keys = sorted(set(old or {}) | set(new))
        return (["status"] if old_status != new_status else []) + [k for k in keys if (old or {}).get(k) != new.get(k)]

    def to_json(self) -> dict[str, Any]:
        status, body = self.recorded
        replayed = None if self.replayed is None else {"status": self.replayed[0], "body": self.replayed[1]}
        return {
            "id": self.call.id, "tool": self.call.tool, "recorded": {"status": status, "body": body},
            "replayed": replayed, "same": self.same, "differences": self.differences(), "note": self.note,
        }  # fmt: skip


async def _replay(args: argparse.Namespace, calls: list[LoggedCall], bundles: dict[str, Path]) -> list[ReplayedCall]:
    import aiohttp

    from airlock.broker.store import SqliteStore

    with tempfile.TemporaryDirectory(prefix="airlock-replay-") as state:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=_tls(args.upstream_ca))) as session:
            store = SqliteStore(Path(state) / "broker.sqlite3")
            broker = _broker(args, Path(state), session, store)
            try:
                return [await _one(broker, call, bundles) for call in calls]
            finally:
                await store.close()


def _broker(args: argparse.Namespace, state: Path, session: aiohttp.ClientSession, store: BrokerStore) -> Broker:
    """A broker of the replay's own, acting against `--api` with the credential given."""
    from airlock.broker.github import GitHubClient
    from airlock.broker.gitpush import GitTransport, Pusher, git_base_url
    from airlock.broker.service import Broker
    from airlock.broker.tokens import KeyRing, TokenAuthority
    from airlock.gateway.broker_inputs import credential
    from airlock.gateway.config import BrokerConfig

    config = BrokerConfig(
        github_api=args.api, github_app_id=args.github_app_id, github_app_key=args.github_app_key,
        github_installation_id=args.github_installation_id, github_token_file=args.github_token_file,
        github_token_env=args.github_token_env,
    )  # fmt: skip
    github_credential = credential(config)
    if github_credential is None:
        raise UsageError("give the replay a GitHub credential: --github-token-file, --github-token-env or an App")
    github = GitHubClient(args.api, github_credential, session)
    transport = GitTransport(args.git or git_base_url(args.api), args.upstream_ca)
    try:
        pusher: Pusher | None = Pusher(github, transport, workdir=state / "push")
    except FileNotFoundError:  # no git here: pushes answer 503, as in the gateway
        pusher = None
    authority = TokenAuthority(KeyRing(state / "keys", 3600))
    return Broker(authority, store, lambda _: None, github, lambda _: None,
                  pusher=pusher)  # fmt: skip


async def _one(broker: Broker, call: LoggedCall, bundles: dict[str, Path]) -> ReplayedCall:
    from airlock.audit import AuditRecord
    from airlock.broker.errors import BrokerError
    from airlock.broker.grants import Grant, GrantError
    from airlock.broker.tokens import Claims

    try:
        grants = tuple(Grant.from_claim(g) for g in call.grants)
    except GrantError as e:
        return ReplayedCall(call, None, f"its grants no longer parse: {e}")
    note, payload = "", dict(call.input or {})
    if call.input is None:
        note = "refused before its input was accepted; replayed without input"
    for name, value in payload.items():
        if isinstance(value, dict) and set(value) == {"sha256", "bytes"}:  # content kept by hash
            found = bundles.get(str(value["sha256"]))
            if found is None:
                return ReplayedCall(call, None, f"{name} {value['sha256'][:12]}… not kept: give --bundles DIR")
            payload[name] = base64.b64encode(found.read_bytes()).decode()
    now = int(time.time())
    claims = Claims(call.sandbox, f"replay-{call.id}", now, now + 600, grants)
    record = AuditRecord("broker", call.sandbox, "replay", "-", None, "deny", "", "internal_error")

    async def read_input(limit: int) -> dict[str, Any]:
        return payload

    try:
        status, body, _ = await broker.invoke(call.tool, claims, record, read_input)
    except BrokerError as e:
        status, body = e.status, e.body()
    return ReplayedCall(call, (status, broker.redactor.value(body)), note)


def _bundles(directory: Path) -> dict[str, Path]:
    """The files in `directory` by the sha256 of their content."""
    if not directory.is_dir():
        raise UsageError(f"--bundles {directory}: not a folder")
    return {hashlib.sha256(p.read_bytes()).hexdigest(): p for p in directory.iterdir() if p.is_file()}


def _tls(ca_file: str | None) -> ssl.SSLContext:
    import ssl

    return ssl.create_default_context(cafile=ca_file)


def _print_side_by_side(outcomes: list[ReplayedCall]) -> None:
    print(f"{'#':>4}  {'tool':<22}{'recorded':<{SUMMARY_WIDTH + 2}}{'replayed':<{SUMMARY_WIDTH + 2}}")
    for o in outcomes:
        status, body = o.recorded
        left = f"{status} {_brief(body, SUMMARY_WIDTH - 4)}"
        if o.replayed is None:
            right, verdict = "-", f"not replayed: {o.note}"
        else:
            right = f"{o.replayed[0]} {_brief(o.replayed[1], SUMMARY_WIDTH - 4)}"
            verdict = "same" if o.same else "DIFFERS: " + ", ".join(o.differences())
            verdict += f" ({o.note})" if o.note else ""
        print(f"{o.call.id:>4}  {o.call.tool:<22}{left:<{SUMMARY_WIDTH + 2}}{right:<{SUMMARY_WIDTH + 2}}{verdict}")


def _brief(value: Any, width: int = 80) -> str:
    text = "-" if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 1] + "…"
