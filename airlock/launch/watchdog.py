"""The watchdog: a small process that removes a sandbox whose launcher is gone.

The gateway lives inside the launcher (`airlock run`, or an orchestrator calling `launch()`), so a launcher killed
by any signal, SIGKILL included, leaves a sandbox that nothing serves, nothing times out and nothing removes. The
launcher therefore starts this process first, in a session of its own (a ^C or hang-up for the launcher's terminal
does not reach it), holding the read end of a pipe whose write end only the launcher holds. The launcher names each
sandbox it has claimed (`netns ID`, `docker ID ENGINE`, `cgroup ID GROUPS` for a netns sandbox's compute limits,
`workdir ID STATE-FILE` for the working-directory check)
over the pipe and says `release` once it has removed them itself. End of file without `release` means the launcher
died: the watchdog removes what was named (every process, the container, the link or network, then the fence, in the
backends' own order) and the launcher's temporary folders. It does the same when the deadline (the sandbox's timeout
plus `GRACE`) passes while the launcher still runs but has not cleaned up, and on SIGTERM.

It runs as `python -I` from `/`: nothing in the sandbox's working directory (which it may have written) is ever
imported by a process running as root. It starts beside the sandbox's set-up, on the same CPUs: until it must act
it imports no more than it needs to wait (the launcher's side and the removal import the rest).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Sequence

from airlock.errors import AirlockError

TYPE_CHECKING = False  # typing's, without importing typing: mypy reads it as True
if TYPE_CHECKING:
    import subprocess

# How long past a sandbox's timeout its launcher has to remove it before the watchdog does.
GRACE = 15.0
READY = b"ready\n"
RELEASE = "release"


class WatchdogError(AirlockError, RuntimeError):
    pass


class Watchdog:
    """The launcher's end: `start()`, `guard()` each sandbox once it is claimed, `release()` after teardown."""

    def __init__(self, proc: subprocess.Popen[bytes], pipe: int) -> None:
        self._proc = proc
        self._pipe: int | None = pipe
        self._ready = False

    @classmethod
    def start(cls, timeout: float, leftovers: Sequence[str] = (), grace: float = GRACE) -> Watchdog:
        """Spawn a watchdog whose deadline is `timeout` + `grace` seconds away; `leftovers` are folders it removes
        too when it acts. It starts up while the launcher builds the sandbox: `guard()` waits for it."""
        import subprocess  # the launcher's, which has it already: the watchdog process does without

        read_end, write_end = os.pipe()  # both non-inheritable: only the watchdog gets the read end, by pass_fds
        module = "airlock.launch.watchdog"
        argv = [sys.executable, "-I", "-m", module, str(read_end), repr(timeout), repr(grace), *leftovers]
        try:
            proc = subprocess.Popen(
                argv, pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, cwd="/",
                start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            os.close(write_end)
            raise WatchdogError(f"cannot start the sandbox watchdog: {e}") from e
        finally:
            os.close(read_end)
        return cls(proc, write_end)

    def guard(self, backend: str, sandbox_id: str, engine: str = "", *, wait: bool = True) -> None:
        """Name a sandbox this launcher has claimed (its namespace or fence exists and is ours). Fails closed:
        WatchdogError when no watchdog would remove it. With `wait=False` the name waits in the pipe for a
        watchdog still starting up: then `wait_ready()` before anything of the sandbox runs."""
        if wait:
            self.wait_ready()
        self._send(f"{backend} {sandbox_id} {engine}".rstrip())

    def release(self) -> None:
        """Everything is removed: the watchdog exits without touching anything (the names may be reused)."""
        with contextlib.suppress(WatchdogError):  # it acted already (deadline) or was killed: nothing to release
            self._send(RELEASE)
        self._close()

    def wait_ready(self) -> None:
        """Once the watchdog runs (it reads what was sent before); WatchdogError if it did not start."""
        if self._ready:
            return
        stdout = self._proc.stdout
        assert stdout is not None
        line = stdout.readline() if select.select([stdout], [], [], 20)[0] else b""
        if line != READY:
            self._proc.kill()
            self._close()
            raise WatchdogError("the sandbox watchdog did not start: refusing to run a sandbox nothing would remove")
        self._ready = True

    def _send(self, line: str) -> None:
        if self._pipe is None:
            raise WatchdogError("the sandbox watchdog is gone")
        try:
            os.write(self._pipe, f"{line}\n".encode())  # short lines: one atomic pipe write each
        except OSError as e:
            raise WatchdogError(f"the sandbox watchdog is gone: {e}") from e

    def _close(self) -> None:
        import subprocess

        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


# --- the watchdog process ----------------------------------------------------------------------------------------


class _Stop(Exception):
    pass


def _stop(signum: int, frame: object) -> None:
    raise _Stop(f"signal {signum}")


def watch(fd: int, timeout: float, grace: float) -> tuple[list[list[str]], str | None]:
    """Read the launcher's lines until `release` (→ None) or until it must act: end of file, the deadline or
    SIGTERM (→ why). Returns the sandboxes named so far."""
    deadline = time.monotonic() + timeout + grace
    guarded: list[list[str]] = []
    pending = b""
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                return guarded, "its launcher is gone"
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                words = line.decode(errors="replace").split(" ", 2)  # an engine address may hold spaces
                if words == [RELEASE]:
                    return guarded, None
                if words != [""] and words not in guarded:
                    guarded.append(words)
    except _Stop as e:
        return guarded, f"the watchdog got {e}"
    return guarded, f"its {timeout:g}s timeout passed {grace:g}s ago"


def remove(words: list[str]) -> str:
    """Remove one named sandbox the way its backend's reaper does; returns what it was. The backends are imported
    here, when one is to be removed: the process says it is ready (which the launcher waits for) before that."""
    from airlock.sandbox import SANDBOX_ID

    backend, sandbox_id, engine = [*words, "", ""][:3]
    if not SANDBOX_ID.fullmatch(sandbox_id):
        raise ValueError(f"not a sandbox id: {sandbox_id!r}")
    if backend == "netns":
        from airlock.sandbox.netns import NetnsSandbox

        leftover = NetnsSandbox(sandbox_id)
        leftover.owned = True  # its launcher claimed it and is gone: the watchdog takes it over
        leftover.destroy()
    elif backend == "docker":
        import docker

        from airlock.sandbox.docker_reaper import remove_sandbox

        client = docker.DockerClient(base_url=engine) if engine else docker.from_env()
        try:
            remove_sandbox(client, sandbox_id)
        finally:
            client.close()
    elif backend == "cgroup":  # named after its namespace: whatever is left in it is killed, then it goes
        from airlock.sandbox.cgroups import remove_named

        remove_named(engine, sandbox_id)
    elif backend == "workdir":  # named after its sandbox, which is gone by now
        from pathlib import Path

        from airlock.sandbox.workdir import WorkdirGuard

        lines = WorkdirGuard.load(Path(engine)).finish()
        return "; ".join([f"working directory of sandbox {sandbox_id} checked", *lines])
    else:
        raise ValueError(f"unknown backend {backend!r}")
    return f"{backend} sandbox {sandbox_id} removed"


def main(argv: list[str]) -> int:
    fd, timeout, grace, leftovers = int(argv[0]), float(argv[1]), float(argv[2]), argv[3:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    with contextlib.suppress(BrokenPipeError):  # a launcher done before it needed us reads no more
        os.write(sys.stdout.fileno(), READY)
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing reads it after READY
    guarded, why = watch(fd, timeout, grace)
    if why is None:
        os._exit(0)  # released: nothing to close or flush, and its launcher waits for this exit
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # removing is not interrupted half-way
    failed = 0
    for words in guarded:
        try:
            _say(f"{remove(words)}: {why}")
        except Exception as e:  # one sandbox's failure must not keep the others
            failed += 1
            _say(f"removing {' '.join(words[:2])} failed ({type(e).__name__}: {e}): run `airlock reap`")
    import shutil

    for folder in leftovers:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if failed else 0


def _say(message: str) -> None:
    with contextlib.suppress(OSError):  # the launcher's terminal may be gone with it
        print(f"airlock watchdog: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
