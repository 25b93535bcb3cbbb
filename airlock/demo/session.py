"""One `airlock demo` session: the world up, a desk furnished, what to type printed, then waiting until Ctrl-C or
SIGTERM, and everything removed (airlock.demo.world) whichever ends it."""

from __future__ import annotations

import signal
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from airlock.verify.topology import DNS_SERVER

from .desk import Desk
from .guide import BLOCKS, WALKTHROUGHS, Walkthrough
from .world import World, world


def listing() -> str:
    return "\n".join(f"{name:14} {w.title} ({w.page})" for name, w in WALKTHROUGHS.items())


def instructions(name: str, demo: World, desk: Desk) -> str:
    chosen: Walkthrough = WALKTHROUGHS[name]
    steps = "".join(
        f"\n{number}. {step.where}:\n\n{textwrap.indent(BLOCKS[step.block], '    ')}"
        for number, step in enumerate(chosen.steps, 2)
    )
    return f"""airlock demo: {chosen.title} ({chosen.page})

A fake internet of its own is up: namespaces {", ".join(demo.topology.namespaces)}, with no route to any real
address; it serves pkg.example and the package registries, GitHub (acme/app, the App {demo.github.app_id}) and
api.model.example. Its files are in {demo.root}.

1. In another terminal, open the demo's shell (as root; its network is the fake internet, its /etc trusts the fake
   CA, its /tmp is its own):

    sudo {desk.shell}

   It starts in {desk.checkout}:
   app (a clone of acme/app, with the agents app/agent.sh and app/agent.py), app.pem (the App's key), keys.yaml,
   ask.yaml, configs/, and .venv/bin/airlock (this airlock; its `run` is given the fake internet's resolver and
   GitHub API: --upstream-dns {DNS_SERVER} --github-api {demo.github.api_url}).
{steps}
What you should see: {chosen.after}.

Ctrl-C here (or SIGTERM) stops the demo and removes everything it made."""


STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    """The first of Ctrl-C, SIGTERM or a closed terminal stops the demo; later ones are ignored, so that none
    interrupts the removal."""

    def interrupt(signum: int, frame: object) -> None:
        for sig in STOPPING:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, interrupt) for sig in STOPPING}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve(name: str, out: TextIO = sys.stdout) -> None:
    """Run the demo of walk-through `name` until interrupted; then remove it."""
    with _signals_as_interrupt():
        try:
            with world() as demo, demo.desk("desk") as desk:
                print(instructions(name, demo, desk), file=out, flush=True)
                signal.pause()
        except KeyboardInterrupt:
            pass
    print("airlock demo: stopped; everything it made is removed", file=sys.stderr, flush=True)
