"""The reader's machine inside the demo's world: `sh` in a checkout, in a mount namespace of its own (held by a
process the demo started) inside the fake internet's gateway namespace.

- the checkout: `configs/` (the packaged policies), `.venv/bin/airlock` (this airlock, whose `run` is handed the fake
  internet's resolver and GitHub API, and a sandbox id of the demo's prefix), what the walk-throughs say the reader
  has: `app` (a clone of acme/app the sandbox's user owns, with the agents in it), `app.pem` (the App's key),
  `keys.yaml`, `ask.yaml`;
- the host: an `/etc` layer holding the fake internet's CA among the system's and `/etc/airlock/model_api.key`, a
  private `/tmp`, and a git identity in `$HOME/.gitconfig`.
Nothing here reaches the host's network: the gateway namespace's only routes lead into the fake internet."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from airlock.verify.hostcgroups import with_host_cgroups
from airlock.verify.topology import Topology

from . import DemoError
from .guide import AGENT_PY, BLOCKS

NOBODY = 65534
IDENTITY = ("Walk Through", "walk@example.test")
SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
WRAPPER = """#!/bin/sh
# The checkout's airlock, its gateway wired to the demo's fake internet: its resolver and its GitHub API.
if [ "$1" = run ]; then
    runs=$(($(cat {counter} 2>/dev/null || echo 0) + 1)) && echo "$runs" > {counter} && shift
    set -- run --upstream-dns {dns} --github-api {github} --sandbox-id {prefix}w"$runs" "$@"
fi
exec {airlock} "$@"
"""


@dataclass(frozen=True)
class Wiring:
    """What the desk's `airlock run` is handed: the fake internet's resolver and GitHub API, and sandbox ids
    `<sandbox_prefix>w<n>`, n counted in `counter` (one file for every desk of a world: no id twice)."""

    dns: str
    github_api: str
    sandbox_prefix: str
    counter: Path


class Desk:
    """A checkout and its host (see the module's text); `run`/`start` are each a terminal of their own, `shell`
    the script that opens one for a person."""

    def __init__(self, topology: Topology, root: Path, private_tmp: bool, extra_env: dict[str, str]) -> None:
        self.checkout, self.layer, self.home = root / "checkout", root / "etc", root / "home"
        for folder in (self.checkout / ".venv" / "bin", self.layer / "upper" / "airlock", self.layer / "work"):
            folder.mkdir(parents=True)
        self.home.mkdir()
        mounts = f"mount -t overlay demo -o lowerdir=/etc,upperdir={self.layer}/upper,workdir={self.layer}/work /etc"
        if private_tmp:
            mounts += " && mount -t tmpfs -o mode=1777 demo /tmp"
        argv = with_host_cgroups(["sh", "-c", f"{mounts} && echo ready && exec sleep infinity"])
        self.holder = topology.popen(topology.gw, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if self.holder.stdout is None or self.holder.stdout.readline() != "ready\n":
            self.holder.kill()
            raise DemoError(f"the demo's mount namespace could not be made: {self.holder.communicate()[1].strip()}")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SUDO_", "GIT_"))}
        self.env = env | {"HOME": str(self.home)} | extra_env
        self.shell = root / "shell"
        self.started: list[subprocess.Popen[str]] = []

    def furnish(self, ca_cert: Path, model_key: str, wiring: Wiring, links: dict[str, Path]) -> Self:
        """What the walk-throughs say the reader has."""
        wrapper = self.checkout / ".venv" / "bin" / "airlock"
        airlock = shlex.join([sys.executable, "-I", "-m", "airlock"])
        counter = shlex.quote(str(wiring.counter))
        wrapper.write_text(
            WRAPPER.format(
                dns=wiring.dns, github=wiring.github_api, prefix=wiring.sandbox_prefix, counter=counter, airlock=airlock
            )
        )
        wrapper.chmod(0o755)
        for name, target in links.items():
            (self.checkout / name).symlink_to(target)
        bundle = self.layer / "upper" / "ssl" / "certs"
        bundle.mkdir(parents=True)
        (bundle / SYSTEM_BUNDLE.name).write_bytes(SYSTEM_BUNDLE.read_bytes() + ca_cert.read_bytes())
        _private(self.layer / "upper" / "airlock" / "model_api.key", model_key + "\n")
        name, email = IDENTITY
        (self.home / ".gitconfig").write_text(f"[user]\n\tname = {name}\n\temail = {email}\n")
        (self.checkout / "keys.yaml").write_text(BLOCKS["api-key/policy"])
        (self.checkout / "ask.yaml").write_text(BLOCKS["approvals/policy"])
        self._write_shell()
        return self

    def clone(self, bare: str, app_key: Path) -> Path:
        """`app`, the agent's working directory: a clone of `bare` that the sandbox's user (nobody) owns, with the
        walk-throughs' agents in it; and the App's key beside it."""
        app = self.checkout / "app"
        cloned = subprocess.run(["git", "clone", "-q", bare, str(app)], env=self.env, capture_output=True, text=True)
        if cloned.returncode != 0:
            raise DemoError(f"the clone of acme/app failed: {cloned.stderr.strip()}")
        (app / "agent.sh").write_text(BLOCKS["pull-request/agent"])
        (app / "agent.sh").chmod(0o755)
        (app / "agent.py").write_text(AGENT_PY)
        for path in [app, *app.rglob("*")]:
            os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
        _private(self.checkout / "app.pem", app_key.read_text())
        return app

    def _write_shell(self) -> None:
        # env -i: the shell has the desk's HOME and nothing of the caller's (sudo's SUDO_* among them).
        keep = f"HOME={shlex.quote(str(self.home))} PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        enter = shlex.join(self.argv_prefix())
        self.shell.write_text(
            "#!/bin/sh\n# A shell in the airlock demo's world: its network is the fake internet (-c CMD: one).\n"
            '[ "$(id -u)" = 0 ] || exec sudo "$0" "$@"\n'
            "[ $# -gt 0 ] || set -- -i\n"
            f'exec {enter} env -i {keep} TERM="${{TERM:-dumb}}" PS1="(airlock demo) \\$ " sh "$@"\n'
        )
        self.shell.chmod(0o755)

    def argv_prefix(self) -> list[str]:
        return ["nsenter", f"--target={self.holder.pid}", "--mount", "--net", f"--wd={self.checkout}"]

    def argv(self, script: str) -> list[str]:
        return [*self.argv_prefix(), "sh", "-c", script]

    def run(self, script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(script), env=self.env, capture_output=True, text=True, timeout=timeout)

    def start(self, script: str, out: Path) -> subprocess.Popen[str]:
        """A terminal left running: its stdout and stderr go to `out`.stdout/.stderr as they come."""
        with out.with_suffix(".stdout").open("w") as stdout, out.with_suffix(".stderr").open("w") as stderr:
            process = subprocess.Popen(self.argv(script), env=self.env, stdout=stdout, stderr=stderr, text=True)
        self.started.append(process)
        return process

    def close(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # airlock run removes its sandbox, as on a terminal's Ctrl-C
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(30)
            if process.poll() is None:
                process.kill()
                process.wait()
        self.holder.kill()
        self.holder.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _private(path: Path, text: str) -> None:
    path.touch(mode=0o600)
    path.write_text(text)
