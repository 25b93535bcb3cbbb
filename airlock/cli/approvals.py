"""`airlock approvals list|approve|deny`: answer the requests a profile with `on_unlisted: ask` holds, through the
running gateway's admin listener (who answers is audited: the admin socket's peer user, or "loopback" over TCP)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from typing import Any

from .common import UsageError, duration
from .token import Admin, add_admin_options

_ID = re.compile(r"[0-9a-f]{1,64}")  # what the gateway's ids are made of: never a path of their own


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="the requests waiting for an answer")
    listing.add_argument("--json", action="store_true", help="print the gateway's JSON answer")
    approve = actions.add_parser("approve", help="let a held request through")
    approve.add_argument("id", metavar="ID")
    approve.add_argument(
        "--scope", choices=("once", "sandbox", "policy"), default="once",
        help="once: the requests held now; sandbox: this host:port for this sandbox (until --ttl); "
        "policy: the rule written into the policy file and reloaded",
    )  # fmt: skip
    approve.add_argument("--ttl", type=duration, metavar="DURATION", help="--scope sandbox: for this long (e.g. 1h)")
    deny = actions.add_parser("deny", help="refuse a held request")
    deny.add_argument("id", metavar="ID")
    for sub in (listing, approve, deny):
        add_admin_options(sub)
    listing.set_defaults(func=cmd_list)
    approve.set_defaults(func=cmd_approve)
    deny.set_defaults(func=cmd_deny)


def _path(approval_id: str, action: str) -> str:
    if not _ID.fullmatch(approval_id):
        raise UsageError(f"{approval_id!r} is not an approval id (see airlock approvals list)")
    return f"/v1/approvals/{approval_id}/{action}"


def cmd_list(args: argparse.Namespace) -> int:
    pending = asyncio.run(Admin.of(args).call("/v1/approvals", None))["pending"]
    if args.json:
        print(json.dumps(pending, indent=2))
    elif not pending:
        print("no request waits for approval")
    else:
        print(table(pending, time.time()))
    return 0


def table(pending: list[dict[str, Any]], now: float) -> str:
    rows = [("ID", "SANDBOX", "KIND", "TARGET", "WAITING", "EXPIRES IN")]
    for entry in pending:
        left = max(0, round(entry["expires_at"] - now))
        rows.append((entry["id"], entry["sandbox"], entry["kind"], entry["target"], str(entry["waiting"]), f"{left}s"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def cmd_approve(args: argparse.Namespace) -> int:
    if args.ttl is not None and args.scope != "sandbox":
        raise UsageError("--ttl goes with --scope sandbox only")
    body = asyncio.run(Admin.of(args).call(_path(args.id, "approve"), {"scope": args.scope, "ttl": args.ttl}))
    print(f"approved {body['target']} ({body['scope']}): {_released(body)}")
    if "rule" in body:
        print(f"policy: added {body['rule']}, reloaded")
    return 0


def cmd_deny(args: argparse.Namespace) -> int:
    body = asyncio.run(Admin.of(args).call(_path(args.id, "deny"), {}))
    print(f"denied {body['target']}: {_released(body)}")
    return 0


def _released(body: dict[str, Any]) -> str:
    count = body["released"]
    return f"{count} waiting request{'s' if count != 1 else ''} answered"
