"""`airlock demo WALKTHROUGH`: a walk-through of the docs on this machine, without a GitHub App or a model API —
the fake internet, a fake GitHub and a fake model API in network namespaces of their own (airlock/demo/), what to
type next printed, everything removed on Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .common import NeedsRoot

NAMES = ("pull-request", "api-key", "denied", "approvals")  # airlock.demo.guide.WALKTHROUGHS, light for --help


class _List(argparse.Action):
    """`--list`: the walk-throughs, printed while parsing (so that it needs no root)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="list the walk-throughs and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from airlock.demo.session import listing

        print(listing())
        parser.exit()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("walkthrough", choices=NAMES, help="the walk-through (see --list)")
    parser.add_argument("--list", action=_List)
    needs = NeedsRoot("it builds a fake internet of network namespaces and runs sandboxes in it")
    parser.set_defaults(func=cmd_demo, needs_root=needs)


def cmd_demo(args: argparse.Namespace) -> int:
    from airlock.demo import session

    session.serve(args.walkthrough)
    return 0
