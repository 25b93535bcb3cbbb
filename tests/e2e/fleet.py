"""A fleet for the tests: `airlock broker` replicas as processes of their own on loopback, sharing one PostgreSQL
database and one signing key, in front of one fake GitHub (airlock.verify.fakegithub, run here on loopback), each minted
tokens through by `airlock token issue --admin <its socket>`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

AUDIENCE = "http://broker.fleet.test"  # the one URL every replica answers to (a load balancer's)
SANDBOX = "sbx-1"
GRANT = "create_pull_request:acme/app"
SOURCE = "127.0.0.1/32"  # the replicas name no sandbox by network: each token names its own


_HANDED: set[int] = set()  # ports free_port gave: the kernel may pick a port just closed again


def free_port() -> int:
    """A loopback port no process holds now and this one was not given before (two replicas made one after the
    other once got the same port, and the second could not listen)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port not in _HANDED:
            _HANDED.add(port)
            return port


def airlock(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "airlock", *argv], capture_output=True, text=True, timeout=timeout, check=False
    )


class Replica:
    """One `airlock broker` process. `url` is its sandbox surface, `admin` its admin socket."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        store: str | tuple[str, Path],
        signing_key: Path | list[Path],
        github: Any,
        ca: Path,
    ) -> None:
        """`store`: its URL, or its URL and the database password's file (--store-password-file); `signing_key`: one
        --signing-key, or several in order (the first signs)."""
        keys = [signing_key] if isinstance(signing_key, Path) else signing_key
        url, password = (store, None) if isinstance(store, str) else store
        self.name = name
        self.state = workdir / name
        self.admin = self.state / "admin.sock"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"{name}.log"
        self.argv = [
            sys.executable, "-m", "airlock", "broker", "--listen", "127.0.0.1", "--port", str(self.port),
            "--state-dir", str(self.state), "--store", url, *(f"--signing-key={key}" for key in keys),
            "--audience", AUDIENCE, "--github-api", github.api_url,
            "--github-token-file", str(github.static_token_path), "--upstream-ca", str(ca),
            "--audit", str(workdir / f"{name}.audit.jsonl"),
            *(["--store-password-file", str(password)] if password is not None else []),
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30) -> Replica:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        # Its sandbox surface answers, then its admin listener comes right after; one that exits meanwhile (its
        # port taken by another process) is told at once, with its log, never waited for.
        while not (self._answers() and self.admin.exists()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"replica {self.name} did not start:\n{self.log_text()}")
            time.sleep(0.05)
        return self

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/.well-known/jwks.json", timeout=1) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def jwks(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/.well-known/jwks.json", timeout=5) as reply:
            return dict(json.loads(reply.read()))

    def token(self, sandbox: str = SANDBOX) -> tuple[str, str]:
        """A token minted through this replica's admin listener by the CLI: (token, jti)."""
        done = airlock("token", "issue", "--admin", str(self.admin), "--sandbox", sandbox, "--grant", GRANT,
                       "--source", SOURCE)  # fmt: skip
        assert done.returncode == 0, done.stderr
        jti = done.stderr.split("jti ", 1)[1].split(",", 1)[0]
        return done.stdout.strip(), jti

    def kill(self) -> None:
        """SIGKILL: no ending of any kind (its connections close with the process)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-4000:]
        return ""
