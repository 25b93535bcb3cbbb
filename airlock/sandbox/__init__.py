"""The kernel's side of a sandbox, primitives only: the network namespace (`netns`) or container (`docker`), the
fence that makes the gateway their only route (`fence`), cgroups, rlimits, seccomp, the working directory's guard
(`workdir`) and what a sandbox could change on the host (`reach`). The launchers that put them together with a
gateway live in `airlock.launch`; nothing here imports them."""

import re
from typing import Protocol

# Sandbox ids name namespaces, interfaces (15 characters at most with their prefix) and nft tables.
SANDBOX_ID = re.compile(r"[a-z0-9]{1,12}")


class Guardian(Protocol):
    """What removes a sandbox should its launcher die (`airlock.launch.watchdog.Watchdog`): a backend names each
    sandbox to it as soon as the sandbox is its own."""

    def guard(self, backend: str, sandbox_id: str, engine: str = "", *, wait: bool = True) -> None: ...
