"""What the command groups share: exit codes, the usage error, argument types, the limit checks, the policy file.

Light on purpose (no policy, gateway or sandbox code): `airlock --help` imports this and nothing of the rest."""

from __future__ import annotations

import argparse
from pathlib import Path

from airlock.errors import AirlockError
from airlock.sandbox.limits import CPUS, DAY, NOFILE, NPROC, OUTPUT_LIMIT, PIDS, TIMEOUT, limit_problem, memory_bytes

TYPE_CHECKING = False  # not typing's: importing typing is a tenth of `airlock --help`
if TYPE_CHECKING:
    import asyncio

    from airlock.policy import Policy

EXIT_ALLOW, EXIT_DENY, EXIT_USAGE = 0, 1, 2
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C
DEFAULT_STATE_DIR = "/var/lib/airlock"


class UsageError(AirlockError):
    pass


def duration(text: str) -> int:
    """`90`, `90s`, `10m`, `1h` → seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1)
    if not number.isascii() or not number.isdigit() or int(number) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 10m or 1h")
    return int(number) * unit


def absolute(text: str) -> str:
    """A path option, made absolute against the working directory — never resolved: a symlink stays one (the
    audit log refuses to be opened through one), and every part of airlock sees the same file."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return str(Path(text).absolute())


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


def default_policy_path() -> Path:
    from importlib import resources

    return Path(str(resources.files("airlock.configs") / "default.yaml"))


def load_policy_file(path: str | None) -> Policy:
    """The policy in `path`, or the packaged default; PolicyError (every problem as file:line) if it does not load."""
    from airlock.policy import load_policy

    return load_policy(path or default_policy_path())


def signal_future(*signals: int) -> asyncio.Future[int]:
    """A future of the running loop that gets the number of the first of `signals` to arrive."""
    import asyncio

    loop = asyncio.get_running_loop()
    arrived: asyncio.Future[int] = loop.create_future()
    for signum in signals:
        loop.add_signal_handler(signum, _first, arrived, signum)
    return arrived


def _first(arrived: asyncio.Future[int], signum: int) -> None:
    if not arrived.done():
        arrived.set_result(signum)
