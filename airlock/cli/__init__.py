"""`airlock` command line: policy check/explain, the gateway, and `run` (a command in a fenced sandbox).

One module per command group adds its arguments and turns them into the library's settings. Only the group named
on the command line is imported: `airlock --help` loads none of them, each command what it runs."""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence

from airlock.errors import AirlockError

from .common import EXIT_INTERRUPTED, EXIT_USAGE, os_problem, rerun_as_root, run_as_root

TYPE_CHECKING = False  # not typing's: `airlock --help` imports no typing
if TYPE_CHECKING:
    from types import ModuleType
    from typing import NoReturn

# name → (help, module with add_arguments(parser)), in the order --help lists them
GROUPS = {
    "policy": ("check or explain a policy", "airlock.cli.policy"),
    "gateway": ("run the gateway in the foreground", "airlock.cli.gateway"),
    "broker": ("run the credential broker alone (a fleet's replica: shared store and keys)", "airlock.cli.broker"),
    "status": ("a running gateway's policy, sandboxes and counters (admin listener)", "airlock.cli.status"),
    "token": ("mint or revoke broker tokens (gateway or broker admin listener)", "airlock.cli.token"),
    "approvals": ("list, approve or deny requests held for a person (gateway admin listener)", "airlock.cli.approvals"),
    "tools": ("read the record of brokered calls, or replay a sandbox's calls", "airlock.cli.tools"),
    "reap": ("remove expired sandboxes and leftovers of crashed runs", "airlock.cli.reap"),
    "fence": ("install or check the pod fence in this network namespace (an init container's)", "airlock.cli.fence"),
    "seccomp-profile": ("print the agent's seccomp profile (docker's and the kubelet's JSON)", "airlock.cli.seccomp"),
    "run": ("run a command in a sandbox whose only network is the gateway", "airlock.cli.run"),
    "verify": ("check a sandbox in a fake internet of its own: the evaluation matrix", "airlock.cli.verify"),
    "demo": ("a walk-through of the docs in a fake internet of its own, fake GitHub included", "airlock.cli.demo"),
}


class _Parser(argparse.ArgumentParser):
    """A usage error is one `airlock: ...` line and where the usage is, not the usage itself (its subcommands'
    parsers are of this class too: argparse makes them of their parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"airlock: {message} (see {self.prog} --help)\n")

    def parse_command(self, argv: Sequence[str]) -> argparse.Namespace:
        """`parse_args`, but an option no parser knows points at the help of the command it was given to: argparse
        leaves unknown options to the top parser, which would point at `airlock --help`."""
        args, extras = self.parse_known_args(argv)
        if extras:
            where = f"{self.prog} {args.command}" if getattr(args, "command", None) else self.prog
            self.exit(EXIT_USAGE, f"airlock: unrecognized arguments: {' '.join(extras)} (see {where} --help)\n")
        return args


class _Version(argparse.Action):
    """`--version`, read from the installed package's metadata only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print airlock's version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"airlock {version('airlock')}")
        except PackageNotFoundError:
            print("airlock (not installed as a package: no version)")
        parser.exit()


def build_parser(groups: Iterable[str] = GROUPS) -> _Parser:
    """The parser, with the arguments of `groups` (every group by default; the others are listed, not loaded)."""
    parser = _Parser(prog="airlock", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--version", action=_Version)
    # A command that needs root sets a NeedsRoot; one that needs root only for root's files or sockets sets
    # `root_when_refused`: refused one as a user before it did anything, it runs again through sudo.
    parser.set_defaults(needs_root=None, root_when_refused=None)
    commands = parser.add_subparsers(dest="command", required=True)
    load = set(groups)
    for name, (summary, module) in GROUPS.items():
        group = commands.add_parser(name, help=summary, description=summary)
        if name in load:
            _load(module).add_arguments(group)
    return parser


def _load(module: str) -> ModuleType:
    """A command group's module, imported with the cycle collector paused: the import makes objects that stay (some
    thirty collections would walk them, about a tenth of `airlock run`'s import), and they are out of its sight
    afterwards (airlock/gateway/startup/collection.py)."""
    from airlock.gateway.startup.collection import paused_collection

    with paused_collection():
        return importlib.import_module(module)


def _group(argv: Sequence[str]) -> list[str]:
    """The command group argv names: its first word that is not an option (the top level's take no value)."""
    first = next((word for word in argv if not word.startswith("-")), None)
    return [first] if first in GROUPS else []


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code. Every error airlock knows is one line and exit 2, Ctrl-C is exit 130.
    Without `argv` it runs this process's own command line, and the process ends after it."""
    if argv is not None:
        return _main(argv)
    code = _main(sys.argv[1:])
    preload = sys.modules.get("airlock.gateway.startup.preload")  # imported only by the commands that run a gateway
    if preload is not None and preload.proxy_loading():
        _end_now(code)
    # The process ends now: its last garbage collection need not walk every object the imports made (mitmproxy's
    # alone would take a run's exit about 70 ms). Whatever has to be closed was closed.
    gc.freeze()
    return code


def _end_now(code: int) -> NoReturn:
    """End the process without finalizing the interpreter: a run that ended before its proxy was needed leaves
    mitmproxy importing in a thread, and finalizing beside that could crash (so it would wait for the import). The
    run has closed and removed everything: what is left is to flush the output."""
    import contextlib

    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing left to tell it
            stream.flush()
    os._exit(code)


def _main(argv: list[str]) -> int:
    verbose = "-v" in argv[:1] or "--verbose" in argv[:1]
    args = None
    try:
        args = build_parser(_group(argv)).parse_command(argv)
        verbose = args.verbose
        import logging  # only now: `--help` and a bad argument need none of it

        logging.basicConfig(
            level=logging.INFO if verbose else logging.WARNING,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
        )
        if args.needs_root is not None and os.geteuid() != 0:
            run_as_root(args.command, argv, args.needs_root, args)
        command: Callable[[argparse.Namespace], int] = args.func
        return command(args)
    except KeyboardInterrupt:
        print("airlock: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except AirlockError as e:
        print(_message(e), file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # a file or socket refused (most often: root's, and not run as root)
        if isinstance(e, PermissionError) and args is not None and args.root_when_refused is not None:
            rerun_as_root(args.command, argv, args.root_when_refused, args)
        if verbose:
            import traceback

            traceback.print_exc()
        print(f"airlock: {os_problem(e)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # a bug, or an error not foreseen: still one line (-v adds the traceback)
        if verbose:
            import traceback

            traceback.print_exc()
        print(f"airlock: unexpected error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_USAGE


def _message(error: AirlockError) -> str:
    from airlock.policy import PolicyError

    if isinstance(error, PolicyError):
        return str(error)  # one `file:line: problem` line per problem
    return "airlock: " + "; ".join(line.strip() for line in str(error).splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
