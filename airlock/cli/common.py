"""What the command groups share: exit codes, the usage error, argument types, the limit checks, the policy file.

Light on purpose (no policy, gateway or sandbox code): `airlock --help` imports this and nothing of the rest."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from airlock.errors import AirlockError

TYPE_CHECKING = False  # not typing's: importing typing is a tenth of `airlock --help`
if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable
    from typing import NoReturn

    from airlock.policy import Policy

EXIT_ALLOW, EXIT_DENY, EXIT_USAGE = 0, 1, 2
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C
DEFAULT_STATE_DIR = "/var/lib/airlock"
DOCKER_ENVIRONMENT = ["DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH"]  # what docker.from_env() reads


class UsageError(AirlockError):
    pass


def _reads_no_environment(args: argparse.Namespace) -> list[str]:
    return []


class NeedsRoot:
    """A command that needs root (its parser's `needs_root` default): `why`, and the names of the environment
    variables it reads from the host's environment (`environment(args)`), which sudo would drop."""

    def __init__(self, why: str, environment: Callable[[argparse.Namespace], list[str]] | None = None) -> None:
        self.why, self.environment = why, environment or _reads_no_environment


def run_as_root(command: str, argv: list[str], needs: NeedsRoot, args: argparse.Namespace) -> NoReturn:
    """Run this command line again as root through sudo, with this interpreter (so this airlock): its caller is
    sudo's SUDO_USER then, as whom a sandbox runs. The variables the command reads from the environment go along
    (sudo keeps TERM and LANG, and drops the rest). Without sudo, a UsageError saying that root is needed."""
    import shutil

    sudo = shutil.which("sudo")
    if sudo is None:
        raise UsageError(f"{command} needs root ({needs.why}), and there is no sudo here: run it as root")
    kept = sorted({name for name in needs.environment(args) if name in os.environ})
    print(f"airlock: {command} needs root ({needs.why}): running it with sudo", file=sys.stderr, flush=True)
    preserve = [f"--preserve-env={','.join(kept)}"] if kept else []
    # -I: root imports nothing from the working directory or PYTHON* variables.
    os.execv(sudo, [sudo, *preserve, "--", sys.executable, "-I", "-m", "airlock", *argv])


def rerun_as_root(command: str, argv: list[str], needs: NeedsRoot, args: argparse.Namespace) -> None:
    """A command refused a file or socket of root's as a user, before it did anything (it reads root's files, or
    asks root's admin listener): run it again through sudo. Where there is no sudo, or as root, return: the
    refusal is told."""
    import shutil

    if os.geteuid() != 0 and shutil.which("sudo") is not None:
        run_as_root(command, argv, needs, args)


def os_problem(error: OSError) -> str:
    """An error of the system as what to do about it: the file and the system's word for it — and, when a user who
    is not root is refused, that it needs root (airlock's state, audit log, call log and admin socket are root's)."""
    where = f"{error.filename}: " if error.filename else ""
    if isinstance(error, PermissionError) and os.geteuid() != 0:
        return f"{where}permission denied: this needs root (run it with sudo)"
    return f"{where}{error.strerror or error or type(error).__name__}"


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
