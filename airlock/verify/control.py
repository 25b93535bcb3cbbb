"""What the fake internet's servers share (fakenet here, the tests' fake GitHub): the JSON-lines control socket
(server and client side), the READY handshake and stopping by PID.

Server side (in the fake's own process): start_control() serves one JSON object per line, {"cmd": ...} in, one
answer out; "ping" is answered here, every other command by the fake's `commands` function. serve_until_signalled()
prints READY and waits for SIGTERM/SIGINT.

Client side (in the test process): ControlledFake starts the fake in the topology's `net` namespace, waits for
READY and talks to its control socket; stop_proc() stops a process this run started.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .topology import Topology

# cmd, the whole request -> the answer, or None for an unknown command
Commands = Callable[[Any, dict[str, Any]], dict[str, Any] | None]


# --------------------------------------------------------------------------------------------------- server side


async def serve_control(
    commands: Commands,
    log: Callable[[str], None],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    json_default: Callable[[Any], Any] | None = None,
) -> None:
    try:
        while line := await reader.readline():
            try:
                request = json.loads(line)
                cmd = request.get("cmd")
                answer = {"ok": True, "pid": os.getpid()} if cmd == "ping" else commands(cmd, request)
                if answer is None:
                    answer = {"error": f"unknown command {cmd!r}"}
            except (ValueError, AttributeError) as exc:
                answer = {"error": f"bad request: {exc}"}
            writer.write(json.dumps(answer, default=json_default).encode() + b"\n")
            await writer.drain()
    except Exception:
        log(f"control: {traceback.format_exc()}")
    finally:
        writer.close()


def listening_socket(address: str, port: int) -> socket.socket:
    """A fake's own listener on one address of the fake internet. fakenet listens on 0.0.0.0 with SO_REUSEPORT;
    binding a specific address with it too is allowed, and the kernel prefers the more specific listener, so the
    fake answers its address while it runs."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((address, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def start_control(
    path: Path, commands: Commands, log: Callable[[str], None], json_default: Callable[[Any], Any] | None = None
) -> asyncio.Server:
    """Listen on the unix socket `path` (replacing a stale one) for control connections."""
    path.unlink(missing_ok=True)
    return await asyncio.start_unix_server(
        lambda r, w: serve_control(commands, log, r, w, json_default=json_default), str(path)
    )


async def serve_until_signalled() -> None:
    """Print READY (what ControlledFake waits for), then wait for SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("READY", flush=True)
    await stop.wait()


# --------------------------------------------------------------------------------------------------- client side


def stop_proc(proc: subprocess.Popen[Any], wait: float = 3.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(wait)


class ControlledFake:
    """Client for a fake server (the program `program()` names, called `name` in messages) run in the topology's
    `net` namespace with --control, --cert and --key."""

    name: str
    script: Path  # the server's script, unless `program()` names it otherwise

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key
        self.proc: subprocess.Popen[Any] | None = None
        self.control: Path | None = None
        self.workdir: Path | None = None

    def program(self) -> list[str]:
        """The argv that starts the server, before its options."""
        return [sys.executable, str(self.script)]

    def _prepare(self, workdir: Path) -> Path:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.control = workdir / f"{self.name}.sock"  # unix sockets are path-based, so they cross network namespaces
        return self.control

    def _launch(self, topology: Topology | None, argv: list[Any], timeout: float, ns: str | None = None) -> None:
        """Start the script with `argv` after the common flags (in the topology's namespace `ns`, by default its
        `net`, or without a topology here, on loopback), wait for its READY, ping it."""
        assert self.workdir is not None and self.control is not None, "call _prepare first"
        workdir = self.workdir
        argv = [*self.program(), "--control", self.control, "--cert", self.cert, "--key", self.key, *argv]
        with (workdir / "stdout.log").open("wb") as out, (workdir / "stderr.log").open("wb") as err:
            if topology is None:
                self.proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
            else:
                where = ns or topology.net
                self.proc = topology.popen(where, argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while b"READY" not in (workdir / "stdout.log").read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not start:\n{self.log_text()}")
            time.sleep(0.05)
        self.ping()

    def stop(self) -> None:
        if self.proc is not None:
            stop_proc(self.proc)
            self.proc = None

    def log_text(self) -> str:
        """The fake's stderr, for failure messages."""
        path = self.workdir / "stderr.log" if self.workdir else None
        return path.read_text(errors="replace") if path and path.exists() else ""

    def _call(self, cmd: str, **kw: Any) -> dict[str, Any]:
        if self.control is None:
            raise RuntimeError(f"{self.name} not started")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(self.control))
            sock.sendall(json.dumps({"cmd": cmd, **kw}).encode() + b"\n")
            with sock.makefile("rb") as reader:
                answer: dict[str, Any] = json.loads(reader.readline())
        if "error" in answer:
            raise RuntimeError(f"{self.name} {cmd}: {answer['error']}")
        return answer

    def ping(self) -> dict[str, Any]:
        return self._call("ping")
