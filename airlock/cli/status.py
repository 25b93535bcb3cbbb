"""`airlock status` and `airlock policy reload`: a running gateway's (`airlock gateway` or `airlock run`) state and
a reload of its policy file, through its admin listener."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime
from typing import Any

from .common import EXIT_USAGE
from .token import Admin, add_admin_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_admin_options(parser)
    parser.add_argument("--json", action="store_true", help="print the listener's answer as it is")
    parser.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    _, body = asyncio.run(Admin.of(args).request("GET", "/v1/status"))
    if args.json:
        print(json.dumps(body, indent=2, sort_keys=True))
        return 0
    for line in describe(body):
        print(line)
    return 0


def describe(status: dict[str, Any]) -> list[str]:
    """The status as lines a person reads."""
    started = datetime.fromtimestamp(status.get("started_at", 0), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    lines = [f"policy    {status.get('policy_hash')} from {status.get('policy_source')} (gateway up since {started})"]
    for name, profile in status.get("profiles", {}).items():
        mode = f", mode {profile['mode']}" if profile.get("mode", "enforce") != "enforce" else ""
        rules = f"{profile.get('allow_rules')} allow, {profile.get('deny_rules')} deny rules"
        lines.append(f"profile   {name}: {rules}{mode}")
    tunnels, connections = status.get("open_tunnels", {}), status.get("open_connections", {})
    for sandbox in status.get("sandboxes", []):
        sid = sandbox.get("id")
        lines.append(
            f"sandbox   {sid} ({sandbox.get('network')}, profile {sandbox.get('profile')}): "
            f"{connections.get(sid, 0)} connections, {tunnels.get(sid, 0)} tunnels open"
        )
    for kind, decisions in status.get("counters", {}).items():
        counts = ", ".join(f"{decision} {count}" for decision, count in decisions.items())
        lines.append(f"audited   {kind}: {counts}")
    return lines


def cmd_policy_reload(args: argparse.Namespace) -> int:
    """0 when the new policy is in force; 2 (with its errors, one per line) when the running policy stays."""
    status, body = asyncio.run(Admin.of(args).request("POST", "/v1/policy/reload"))
    if status == 200 and body.get("reloaded"):
        print(f"policy reloaded from {body.get('source')}: {body.get('previous_hash')} -> {body.get('policy_hash')}")
        return 0
    for error in body.get("errors") or [body.get("message", f"the gateway answered {status}")]:
        print(error, file=sys.stderr)
    print(f"airlock: policy NOT reloaded, the running policy stays ({body.get('policy_hash')})", file=sys.stderr)
    return EXIT_USAGE
