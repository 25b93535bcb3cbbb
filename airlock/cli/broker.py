"""`airlock broker`: the credential broker alone — the sandbox surface (REST, MCP, the JWKS) and the admin surface,
no proxy, no DNS — for a fleet of replicas that share one store (`--store postgresql://…`) and one set of signing
keys (`--signing-key`); docs/fleet.md walks through two."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from airlock.gateway.config import BrokerConfig, BrokerConfigError, broker_url
from airlock.policy import Sandbox, format_host_port
from airlock.runs import registered

from .common import DEFAULT_STATE_DIR, EXIT_INTERRUPTED, UsageError, absolute, signal_future
from .gateway import add_broker_options, audit_destination, broker_config, check_ca_bundle, local_address

if TYPE_CHECKING:
    from airlock.audit import AuditLog

log = logging.getLogger("airlock")
AUDIT_FLUSH_SECONDS = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", required=True, metavar="ADDR", help="the address the sandbox surface listens on")
    parser.add_argument("--port", type=int, default=8080, metavar="PORT", help="the sandbox surface's port")
    parser.add_argument(
        "--admin", metavar="SOCKET|127.0.0.1:PORT", help="the admin listener (tokens); default: STATE_DIR/admin.sock"
    )
    parser.add_argument("--state-dir", type=absolute, metavar="DIR", help=f"default: {DEFAULT_STATE_DIR}")
    parser.add_argument(
        "--sandbox", action="append", metavar="ID=CIDR",
        help="name a sandbox by its source network, as a gateway does (repeatable); without any, a token must name "
        "the networks it is used from (airlock token issue --source)",
    )  # fmt: skip
    parser.add_argument("--upstream-ca", type=absolute, metavar="FILE", help="CA bundle for GitHub's TLS")
    parser.add_argument("--audit", type=audit_destination, metavar="FILE", help="one JSON line per call ('-': stdout)")
    parser.add_argument(
        "--max-connections", type=int, default=32, metavar="N", help="open connections per client address"
    )
    add_broker_options(parser)
    parser.set_defaults(func=cmd_broker)


def registry(specs: list[str]) -> list[Sandbox]:
    """`--sandbox ID=CIDR`: the sandboxes this broker names by their source network."""
    found = []
    for spec in specs:
        sandbox_id, sep, cidr = spec.partition("=")
        if not sep or not sandbox_id:
            raise UsageError(f"--sandbox {spec!r}: expected ID=CIDR")
        try:
            found.append(Sandbox(sandbox_id, "default", ipaddress.ip_network(cidr, strict=True)))
        except ValueError as e:
            raise UsageError(f"--sandbox {spec!r}: {e}") from None
    return found


def cmd_broker(args: argparse.Namespace) -> int:
    try:
        ipaddress.ip_address(args.listen)
    except ValueError:
        raise UsageError(f"--listen {args.listen!r}: give the IP address to listen on (0.0.0.0, ::, ...)") from None
    if not ipaddress.ip_address(args.listen).is_unspecified:
        local_address(args.listen)
    if args.upstream_ca:
        check_ca_bundle(args.upstream_ca)
    logging.getLogger("airlock").setLevel(logging.INFO)  # a service: its INFO lines are what its operator reads
    args.state_dir = args.state_dir or DEFAULT_STATE_DIR
    sandboxes = registry(args.sandbox or [])
    config = broker_config(args, args.port, args.max_connections, [])
    return asyncio.run(serve(args, config, sandboxes))


async def serve(args: argparse.Namespace, config: BrokerConfig, sandboxes: list[Sandbox]) -> int:
    """Run until SIGTERM (exit 0) or SIGINT (130); SIGUSR1 reopens the audit file."""
    from airlock.audit import AuditLog
    from airlock.broker.store import StoreError
    from airlock.broker.tokens import TokenError
    from airlock.gateway.admin import AdminApp
    from airlock.gateway.broker_runtime import StandaloneBroker
    from airlock.policy import SandboxRegistry

    state_dir = Path(args.state_dir)
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # its keys, its SQLite store, the admin socket
        audit = AuditLog(None if args.audit == "-" else args.audit, stdout=args.audit == "-")
    except OSError as e:
        raise BrokerConfigError(f"{e.filename or state_dir}: {e.strerror or e}") from None
    stopped = signal_future(signal.SIGTERM, signal.SIGINT)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, audit.reopen)
    named = SandboxRegistry(sandboxes) if sandboxes else None
    broker = StandaloneBroker(config, state_dir, audit.emit, args.upstream_ca, named)
    admin = AdminApp(args.admin or str(state_dir / "admin.sock"))
    flushing = asyncio.create_task(_flush(audit))
    try:
        try:
            running = await broker.start(args.listen)
            admin.mount(running.admin_app())
            admin.listen()
            await admin.serve()
        except (OSError, StoreError, TokenError, ValueError) as e:
            raise BrokerConfigError(f"broker could not start: {getattr(e, 'strerror', None) or e}") from None
        store = (config.store or "sqlite://" + str(state_dir / "broker.sqlite3")).split("?")[0]
        print(
            f"airlock broker: sandbox surface on {broker_url(args.listen, config.port)} "
            f"({format_host_port(args.listen, config.port)}), admin on {admin.address}, state in {store}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        with registered(admin.address, store, "airlock broker"):
            signum = await stopped
    finally:
        await admin.stop()
        await broker.stop()
        flushing.cancel()
        audit.close()
    if signum == signal.SIGINT:
        print("airlock: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


async def _flush(audit: AuditLog) -> None:
    while True:
        await asyncio.sleep(AUDIT_FLUSH_SECONDS)
        audit.flush()
