"""The bounds of the numeric options (`airlock gateway`'s and `airlock run`'s) and their check.

Apart from `common` because it needs the sandbox's limits (and with them dataclasses): `airlock --help` does not."""

from __future__ import annotations

import argparse

from airlock.sandbox.limits import CPUS, DAY, NOFILE, NPROC, OUTPUT_LIMIT, PIDS, TIMEOUT, limit_problem, memory_bytes

from .common import UsageError

# Every limit is a finite number within bounds: 0, a negative number, inf or nan would turn one off (docker reads
# 0 as "unlimited") or break it. Option → (lowest, highest, whether the lowest value itself is allowed).
LIMITS: dict[str, tuple[float, float, bool]] = {
    "proxy_port": (1, 65535, True),
    "transparent_port": (0, 65535, True),  # 0: explicit mode only
    "dns_port": (0, 65535, True),  # 0: no DNS server
    "broker_port": (0, 65535, True),  # 0: no broker
    "connect_timeout": (0, 300, False),
    "idle_timeout": (0, 7 * DAY, False),
    "github_timeout": (0, 300, False),
    "max_tunnels": (1, 1_000_000, True),
    "max_connections": (1, 1_000_000, True),
    "broker_max_connections": (1, 100_000, True),
    "dns_rate": (0, 10_000_000, False),
    "dns_min_ttl": (0, DAY, True),
    "token_ttl": (1, 7 * DAY, True),
    "token_max_ttl": (1, 7 * DAY, True),
    "timeout": (*TIMEOUT, False),
    "cpus": (*CPUS, True),
    "pids": (*PIDS, True),
    "nofile": (*NOFILE, True),
    "nproc": (*NPROC, True),
    "output_limit": (*OUTPUT_LIMIT, True),
}


def check_limits(args: argparse.Namespace) -> None:
    """UsageError for the first limit given that is not a finite number within its bounds (or a bad --memory)."""
    for name, (low, high, low_allowed) in LIMITS.items():
        value = getattr(args, name, None)
        option = f"--{name.replace('_', '-')}"
        if value is not None and (problem := limit_problem(option, value, (low, high), low_allowed)):
            raise UsageError(problem)
    if getattr(args, "memory", None) is not None:
        try:
            memory_bytes(args.memory)
        except ValueError as e:
            raise UsageError(f"--memory: {e}") from None
