"""`airlock demo [WALKTHROUGH]`: a walk-through of the docs on this machine, without a GitHub App or a model API —
the fake internet, a fake GitHub and a fake model API in network namespaces of their own (airlock/demo/), what to
type next printed, everything removed on Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse

from .common import NeedsRoot, UsageError

NAMES = ("pull-request", "api-key", "denied")  # airlock.demo.guide.WALKTHROUGHS, light for --help


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("walkthrough", nargs="?", choices=NAMES, help="the walk-through (see --list)")
    parser.add_argument("--list", action="store_true", help="list the walk-throughs and exit")
    needs = NeedsRoot("it builds a fake internet of network namespaces and runs sandboxes in it")
    parser.set_defaults(func=cmd_demo, needs_root=needs)


def cmd_demo(args: argparse.Namespace) -> int:
    from airlock.demo import session

    if args.list:
        print(session.listing())
        return 0
    if args.walkthrough is None:
        raise UsageError(f"which walk-through? one of: {', '.join(NAMES)} (airlock demo --list)")
    session.serve(args.walkthrough)
    return 0
