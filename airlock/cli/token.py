"""`airlock token issue|revoke`: mint or revoke broker tokens through a running gateway's admin listener (and the
listener's client, `Admin`, which `airlock status` and `airlock policy reload` use too)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from airlock.broker.grants import GrantError, parse_grant
from airlock.gateway.config import admin_address, admin_endpoint
from airlock.runs import running, runs_dir

from .common import DEFAULT_STATE_DIR, EXIT_USAGE, NeedsRoot, UsageError, absolute, duration, os_problem


def add_admin_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--admin", metavar="SOCKET|127.0.0.1:PORT", help="default: STATE_DIR/admin.sock")
    parser.add_argument(
        "--state-dir", type=absolute, metavar="DIR", help=f"the gateway's state directory ({DEFAULT_STATE_DIR})"
    )
    # The admin socket and the list of running gateways are root's: a user refused them asks sudo.
    parser.set_defaults(root_when_refused=NeedsRoot("the gateway's admin listener is root's"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    issue = actions.add_parser("issue", help="print a new sandbox token")
    issue.add_argument("--sandbox", required=True)
    issue.add_argument("--grant", action="append", required=True, metavar="TOOL:OWNER/REPO[:base=B,head=P]")
    issue.add_argument("--ttl", type=duration, default=None, metavar="DURATION")
    issue.add_argument(
        "--source", action="append", metavar="CIDR",
        help="a network the token may be used from (repeatable); a broker without --sandbox takes only such tokens",
    )  # fmt: skip
    revoke = actions.add_parser("revoke", help="revoke one token or every token of a sandbox")
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--jti")
    which.add_argument("--sandbox")
    for sub in (issue, revoke):
        add_admin_options(sub)
    issue.set_defaults(func=cmd_token_issue)
    revoke.set_defaults(func=cmd_token_revoke)


@dataclass(frozen=True)
class Admin:
    """The gateway's admin listener: a unix socket (default STATE_DIR/admin.sock) or a loopback HOST:PORT."""

    endpoint: Path | tuple[str, int]
    unfound: str = ""  # why this is only the default: said when nothing answers there

    @classmethod
    def of(cls, args: argparse.Namespace) -> Admin:
        """The listener --admin or --state-dir names, else the one gateway running here (airlock.runs), else the
        default state directory's; UsageError listing them when several run."""
        if args.admin or args.state_dir:
            return cls(admin_endpoint(args.admin or str(Path(args.state_dir) / "admin.sock")))
        gateways = running()
        if len(gateways) > 1:
            listed = "; ".join(f"--admin {shlex.quote(g.admin)} for {g.describe()}" for g in gateways)
            raise UsageError(f"{len(gateways)} gateways run here, say which: {listed}")
        if gateways:
            return cls(admin_endpoint(gateways[0].admin))
        return cls(Path(DEFAULT_STATE_DIR) / "admin.sock", f"none is entered in {runs_dir()}")

    def __str__(self) -> str:
        return admin_address(self.endpoint)

    async def call(self, path: str, payload: dict[str, Any] | None) -> dict[str, Any]:
        """POST `payload` as JSON to `path` (GET when None): the answer's body, or UsageError with the refusal."""
        status, body = await self.request("GET" if payload is None else "POST", path, payload)
        if status != 200:
            raise UsageError(f"{_refuser(path)} refused: {body.get('message', status)}")
        return body

    async def request(
        self, method: str, path: str, payload: dict[str, Any] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """One call of the admin listener: its status and JSON object; UsageError when nothing answers so."""
        import aiohttp

        connector: aiohttp.BaseConnector
        if isinstance(self.endpoint, Path):
            connector, base = aiohttp.UnixConnector(path=str(self.endpoint)), "http://airlock-admin"
        else:
            connector, base = aiohttp.TCPConnector(), f"http://{self}"
        try:
            async with (
                aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session,
                session.request(method, base + path, json=payload) as reply,
            ):
                text = await reply.text()
        except (aiohttp.ClientError, OSError, ValueError, TimeoutError) as e:
            cause = getattr(e, "os_error", e)  # aiohttp's connector error wraps the system's
            if isinstance(cause, PermissionError) and isinstance(self.endpoint, Path):
                raise PermissionError(cause.errno, cause.strerror, str(self.endpoint)) from None  # root's socket
            why = os_problem(cause).removeprefix(f"{cause.filename}: ") if isinstance(cause, OSError) else str(e)
            why = why or type(e).__name__
            if self.unfound:
                raise UsageError(
                    f"no gateway runs here: {self.unfound}, and none answers at {self} ({why}): start one, or name "
                    "it with --admin or --state-dir"
                ) from None
            raise UsageError(f"cannot reach the gateway's admin listener at {self}: {why}") from None
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            if reply.status == 404 and _refuser(path) == "broker":  # aiohttp's own 404: no broker routes are there
                raise UsageError(f"the gateway at {self} runs no broker (airlock run starts one only with --grant)")
            raise UsageError(f"{self} is not a gateway's admin listener (it answered {reply.status})")
        return reply.status, body


def _refuser(path: str) -> str:
    """Who said no, as the user knows it: the broker for tokens, else the gateway."""
    return "broker" if path.startswith(("/v1/tokens", "/v1/revocations", "/v1/keys")) else "gateway"


def cmd_token_issue(args: argparse.Namespace) -> int:
    try:
        grants = [parse_grant(g).to_claim() for g in args.grant]
    except GrantError as e:
        raise UsageError(f"--grant: {e}") from None
    admin = Admin.of(args)
    request = {"sandbox": args.sandbox, "grants": grants, "ttl": args.ttl}
    if args.source:
        request["sources"] = args.source
    body = asyncio.run(admin.call("/v1/tokens", request))
    print(body["token"])
    expires = datetime.fromtimestamp(body["expires_at"], UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(f"jti {body['jti']}, sandbox {body['sandbox']}, expires at {expires}", file=sys.stderr)
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    payload = {"jti": args.jti} if args.jti else {"sandbox": args.sandbox}
    body = asyncio.run(Admin.of(args).call("/v1/revocations", payload))
    what = f"token {args.jti}" if args.jti else f"every token of sandbox {args.sandbox}"
    if body.get("known") is False:
        # Revoked all the same (it can never be used), but the token meant is most likely still valid.
        unknown = "no token with this id was issued" if args.jti else "this gateway serves no such sandbox"
        option = "--jti" if args.jti else "--sandbox"
        print(f"airlock: {what} revoked, but {unknown}: check the {option}", file=sys.stderr)
        return EXIT_USAGE
    print(f"revoked {what}")
    return 0
