"""How many proxied connections the open-file limit allows: the soft limit raised to the hard one, then the caps in
all and per sandbox that leave descriptors for everything else the gateway keeps open."""

from __future__ import annotations

import contextlib
import logging
import resource
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from airlock.gateway.errors import GatewayError
from airlock.policy import Sandbox

log = logging.getLogger("airlock.gateway")

# File descriptors kept apart from proxied connections: the process itself, listeners, audit log, broker store
# and broker calls; per sandbox, its DNS over TCP (16) and DNS queries waiting on upstream (32), with room left.
RESERVED_FILES = 256
RESERVED_FILES_PER_SANDBOX = 64
FILES_PER_CONNECTION = 2  # the sandbox's socket and the upstream one
# A tunnel relayed in the kernel (proxy/splice_relay.py) holds a duplicate of each socket and a pipe each way.
FILES_PER_SPLICE = 6
# Per sandbox, when the open-file limit allows it: 1,000 idle tunnels with room to spare, at about 38 KiB of
# memory each (bench/tunnels.py). Tunnels get 7/8 of the connections, so that a client beyond the tunnel cap is
# told so (429) instead of finding its connection closed.
DEFAULT_CONNECTIONS_PER_SANDBOX = 4096
MIN_CONNECTIONS = 16


@dataclass(frozen=True)
class ConnectionCaps:
    """What the open-file limit allows: proxied connections in all (client and upstream ones counted apart, each
    at most this many) and per sandbox; `notes` say where a requested cap had to be lowered."""

    open_files: int
    total: int
    per_sandbox: int
    tunnels: int
    spliced: int  # tunnels relayed in the kernel at once, in the descriptors the caps above leave (others: mitmproxy)
    notes: tuple[str, ...] = ()


def raise_open_file_limit() -> tuple[int, int, int]:
    """RLIMIT_NOFILE's soft limit raised to the hard one: (soft before, soft now, hard)."""
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = hard
    if hard == resource.RLIM_INFINITY:
        try:
            ceiling = int(Path("/proc/sys/fs/nr_open").read_text())  # the kernel's ceiling for any soft limit
        except (OSError, ValueError):
            ceiling = 1 << 20
    if before != resource.RLIM_INFINITY and before < ceiling:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return before, ceiling if now == resource.RLIM_INFINITY else now, hard


def connection_caps(
    open_files: int, sandboxes: int, per_sandbox: int | None = None, tunnels: int | None = None
) -> ConnectionCaps:
    """The caps an open-file limit allows, with `sandboxes` sandbox networks; a cap asked for (`per_sandbox`,
    `tunnels`) is kept when the limit allows it, else lowered. `notes` say what the limit held down; GatewayError
    when it leaves too little."""
    reserved = RESERVED_FILES + RESERVED_FILES_PER_SANDBOX * max(1, sandboxes)
    total = (open_files - reserved) // FILES_PER_CONNECTION
    if total < MIN_CONNECTIONS:
        need = reserved + MIN_CONNECTIONS * FILES_PER_CONNECTION
        raise GatewayError(f"the open-file limit ({open_files}) is too low for a gateway: it needs at least {need}")
    for option, value in (("--max-connections", per_sandbox), ("--max-tunnels", tunnels)):
        if value is not None and value < 1:
            raise GatewayError(f"{option} {value}: must be at least 1")
    notes: list[str] = []
    if per_sandbox is None:
        per_sandbox = min(DEFAULT_CONNECTIONS_PER_SANDBOX, total)
        if per_sandbox < DEFAULT_CONNECTIONS_PER_SANDBOX:
            notes.append(f"{per_sandbox} connections per sandbox instead of {DEFAULT_CONNECTIONS_PER_SANDBOX}")
    elif per_sandbox > total:
        notes.append(f"--max-connections {per_sandbox} lowered to {total}")
        per_sandbox = total
    if tunnels is None:
        tunnels = max(1, per_sandbox - per_sandbox // 8)
    elif tunnels > per_sandbox:
        notes.append(f"--max-tunnels {tunnels} lowered to {per_sandbox}")
        tunnels = per_sandbox
    sockets = FILES_PER_CONNECTION * min(total, per_sandbox * max(1, sandboxes))
    spliced = min(total, max(0, open_files - reserved - sockets) // FILES_PER_SPLICE)
    return ConnectionCaps(open_files, total, per_sandbox, tunnels, spliced, tuple(notes))


def sandbox_count(sandboxes: Iterable[Sandbox]) -> int:
    return len({sandbox.id for sandbox in sandboxes})


def announce(caps: ConnectionCaps, before: int, hard: int) -> None:
    raised = f", raised from {before}" if before != caps.open_files else ""
    summary = (
        f"open files {caps.open_files}{raised} (hard limit {hard}): at most {caps.total} proxied connections, "
        f"{caps.per_sandbox} per sandbox, of which {caps.tunnels} tunnels; {caps.spliced} tunnels relayed in the kernel"
    )
    if caps.notes:
        why = "; ".join(caps.notes)
        log.warning("%s (%s: the open-file limit allows no more; raise it: ulimit -Hn, LimitNOFILE=)", summary, why)
    else:
        log.info("%s", summary)
