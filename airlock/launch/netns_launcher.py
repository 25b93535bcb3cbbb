"""`launch()`: a command in a network namespace whose only link leads to its own embedded gateway, as one handle
(`wait()`, `stop()`, `kill()`, `logs()`, `close()`; an async context manager) — what `airlock run` uses for the
netns backend. Its docker twin is `airlock.launch.docker_launcher.launch()`.

Checked before anything exists (`airlock.launch.preflight`): the command's user (never root), and what it must not
read or change. bubblewrap hides the gateway's credentials, the usual ones of the user's home and the host services
that would act outside the sandbox's network, and binds airlock's own code read-only; with isolation "none" nothing
can be hidden, so `launch()` refuses while any of them is in the user's reach. Whatever the gateway reads or writes
by path while the command runs (`gateway_inputs`) is refused where the command could change it or a folder on its
way (`airlock.sandbox.reach`), and so is a policy put in force later that names such a file. Then, in this order:
the watchdog, the namespace and its fence, the cgroup, the gateway, the environment and token, the working
directory's guard, the command. `close()` goes back: everything in the namespace is killed and namespace, link and
fence are removed, then the cgroup, then the working directory is checked, then the gateway stops, then the state
directory goes and the watchdog is released.

The working directory's guard takes its snapshot while the namespace is built (both wait on subprocesses). The
command does not wait for mitmproxy to load (most of a launch's time): the proxy's sockets listen, marked for the
fence, before the command starts, and the command's connections wait in their backlog until the proxy serves them.
Should the proxy fail to start, `wait()` kills the sandbox and raises the gateway's error.

`launch()` stays one function of some 100 lines (a third of them its signature and docstring): the order things are
created in, and what each failure removes again, read in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from airlock.broker.grants import Grant
from airlock.gateway.config import GatewayConfig
from airlock.gateway.startup.preload import foreground, preload_proxy
from airlock.inspection.trust import SANDBOX_BUNDLE, SYSTEM_BUNDLE
from airlock.sandbox import cgroups, seccomp
from airlock.sandbox.limits import DEFAULT_OUTPUT_LIMIT, Resources, rlimit_argv
from airlock.sandbox.netns import NetnsSandbox
from airlock.sandbox.workdir import WorkdirError, WorkdirGuard

from .embedded_gateway import (
    fence_interception,
    fence_ports,
    gateway_environment,
    mint_token,
    release,
    start_gateway,
    state_directory,
)
from .preflight import NetnsPlan, cache_environment, host_environment, plan_launch, refuse_inputs_in_reach
from .watchdog import Watchdog

if TYPE_CHECKING:  # imported in a thread while the sandbox is built (`preload_proxy`)
    from airlock.gateway import Gateway

STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when the command is asked to stop

Report = Callable[[str], None]


def say(line: str) -> None:
    """The launcher's word to the user: one line on stderr."""
    print(f"airlock: {line}", file=sys.stderr, flush=True)


class NetnsHandle:
    """A running sandboxed command. `wait()` for it; `close()` (or leaving `async with`) removes the sandbox."""

    def __init__(
        self,
        sandbox: NetnsSandbox,
        gateway: Gateway,
        process: asyncio.subprocess.Process,
        timeout: float,
        teardown: Callable[[], Awaitable[None]],
        cgroup: cgroups.SandboxCgroup | None = None,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
    ) -> None:
        self.sandbox, self.gateway, self.process, self.cgroup = sandbox, gateway, process, cgroup
        self._teardown: Callable[[], Awaitable[None]] | None = teardown  # once only
        self._deadline = asyncio.get_running_loop().time() + timeout
        self._exited = asyncio.ensure_future(process.wait())
        self._proxy = asyncio.ensure_future(gateway.proxy_started())
        self._output = (bytearray(), bytearray())
        self._readers = [
            asyncio.ensure_future(_drain(stream, into, output_limit))
            for stream, into in zip((process.stdout, process.stderr), self._output, strict=True)
            if stream is not None
        ]

    async def wait(self, timeout: float | None = None) -> int | None:
        """The command's exit code (128+N when signal N ended it); None when the given timeout or the launch's
        passed first — then every process in the sandbox has been killed. The gateway's GatewayError when its proxy
        could not start while the command ran: the sandbox is killed first."""
        loop = asyncio.get_running_loop()
        left = self._deadline - loop.time()
        until = loop.time() + (left if timeout is None else min(left, timeout))
        while not self._exited.done() and (left := until - loop.time()) > 0:
            watched = {self._exited} if self._proxy.done() else {self._exited, self._proxy}
            await asyncio.wait(watched, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not self._exited.done() and (failure := _failure(self._proxy)):
                await asyncio.to_thread(self.sandbox.kill_all)  # a sandbox whose proxy will never serve
                await self._exited
                raise failure
        if not self._exited.done():
            await asyncio.to_thread(self.sandbox.kill_all)  # the whole namespace, not only the command's process
            await self._exited
            return None
        return self._code()

    async def stop(self, grace: float = STOP_GRACE) -> int:
        """SIGTERM to the command, SIGKILL if it has not ended `grace` seconds later; its exit code."""
        with contextlib.suppress(ProcessLookupError):
            self.process.terminate()
        done, _ = await asyncio.wait({self._exited}, timeout=grace)
        if not done:
            self.kill()
            await self._exited
        return self._code()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    def oom_killed(self) -> bool:
        """Whether the memory limit made the kernel kill a process of the sandbox (ask before `close()`)."""
        return self.cgroup is not None and self.cgroup.oom_killed()

    def logs(self) -> tuple[bytes, bytes]:
        """stdout and stderr so far, each capped at the output limit (empty unless launched with capture_output)."""
        return bytes(self._output[0]), bytes(self._output[1])

    async def close(self) -> None:
        """Kill everything in the sandbox and remove it, check the working directory, then stop the gateway."""
        teardown, self._teardown = self._teardown, None
        if teardown is None:
            return
        try:
            await teardown()
        finally:
            self._proxy.cancel()
            pending = {self._exited, *self._readers}
            await asyncio.wait(pending, timeout=5)  # everything that held the pipes is gone
            for task in pending:
                task.cancel()

    def _code(self) -> int:
        code = self.process.returncode if self.process.returncode is not None else 1
        return code if code >= 0 else 128 - code

    async def __aenter__(self) -> NetnsHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _failure(future: asyncio.Future[None]) -> BaseException | None:
    """What a finished `future` raised (not its cancellation); None while it runs or when it succeeded."""
    return future.exception() if future.done() and not future.cancelled() else None


async def _drain(stream: asyncio.StreamReader, into: bytearray, limit: int) -> None:
    """Keep what fits under `limit`, read and drop the rest: the command never blocks on a full pipe."""
    while chunk := await stream.read(65536):
        into += chunk[: max(0, limit - len(into))]


async def launch(
    command: list[str],
    gateway: GatewayConfig,
    *,
    profile: str | None = None,
    sandbox_id: str | None = None,
    user: str | None = None,
    isolation: str = "auto",
    env: dict[str, str] | None = None,
    grants: list[Grant] | None = None,
    token_ttl: int | None = None,
    timeout: float = 3600.0,
    resources: Resources | None = None,
    cache: str | None = None,
    watchdog: Watchdog | None = None,
    capture_output: bool = False,
    output_limit: int = DEFAULT_OUTPUT_LIMIT,
    report: Report = say,
) -> NetnsHandle:
    """Run `command` in a new fenced namespace, in this process's working directory, as `user` (default: whoever
    called sudo, else nobody; never root). `gateway` gives the gateway's settings; its `listen` and `sandboxes`
    are filled in here, and a temporary state directory when it names none. `env` adds variables to a clean
    environment. The command's output goes where this process's goes, or with `capture_output` to `logs()`.
    `report` hears what the user must know (notes before the start, the working directory's check at the end).
    `resources` are its compute limits (default: `Resources()`), enforced by a cgroup of its own and rlimits.
    `cache` is a folder it may write besides the working directory, kept across runs, for package managers' caches.
    On any failure everything created so far is removed again. A watchdog process (started here unless one is
    given, which its giver releases) removes the sandbox if this process dies, or if it is still there `GRACE`
    seconds after `timeout`."""
    plan = plan_launch(command, gateway, user, isolation, env, timeout, resources, cache, report)
    tcp_ports, udp_ports = fence_ports(gateway)
    gateway, state = state_directory(gateway)
    own = None
    try:
        refuse_inputs_in_reach(plan.reach, gateway)  # the state directory too, also a temporary one
        gateway = dataclasses.replace(gateway, sandbox_reach=plan.reach)  # and what a reload brings
        if watchdog is None:
            own = await asyncio.to_thread(Watchdog.start, timeout, [state.name] if state else [])
        # Removes the sandbox if this process dies (bubblewrap's --die-with-parent ends only the command, and
        # without bubblewrap nothing would); namespace, link and fence calls block: all of them off the event loop.
        keeper = watchdog or own
        assert keeper is not None
        sandbox = NetnsSandbox(sandbox_id, tcp_ports, udp_ports, keeper, fence_interception(gateway))
    except BaseException:
        await release(own, state)
        raise
    running: Gateway | None = None
    guard: WorkdirGuard | None = None
    cgroup: cgroups.SandboxCgroup | None = None
    # libseccomp compiles the filter while the namespace is built (its calls leave the event loop and the GIL).
    program = asyncio.ensure_future(asyncio.to_thread(seccomp.program_fd))

    async def teardown() -> None:
        await _teardown(sandbox, cgroup, guard, running, own, state, report)

    try:
        assert sandbox.sandbox_id is not None and gateway.state_dir is not None
        if plan.isolate_fs:
            guard = WorkdirGuard(Path.cwd(), plan.user, sandbox.sandbox_id, Path(gateway.state_dir) / "workdir")
        # aiohttp and mitmproxy import in a thread from now on: while the namespace is built (ip, nft) this thread
        # mostly waits, whereas the checks above would have shared the interpreter's lock with the import. Until the
        # command runs, the import gives way to the sandbox's start for the CPUs (a lower priority).
        preload_proxy(background=True)
        # The working directory's snapshot (git) is taken while the namespace is built (ip, nft): both mostly wait.
        created, prepared = await asyncio.gather(
            asyncio.to_thread(sandbox.create),
            asyncio.to_thread(guard.prepare) if guard else asyncio.sleep(0),
            return_exceptions=True,
        )
        if isinstance(prepared, WorkdirError):
            guard = None  # nothing was changed: nothing to check afterwards
        for outcome in (created, prepared):
            if isinstance(outcome, BaseException):
                raise outcome
        cgroup = cgroups.SandboxCgroup(sandbox.sandbox_id, plan.resources, plan.controllers)
        await asyncio.to_thread(cgroup.create)
        keeper.guard("cgroup", sandbox.sandbox_id, cgroup.watchdog_words(), wait=False)
        running = await start_gateway(
            gateway, sandbox.gateway_ip, sandbox.sandbox_id, sandbox.sandbox_ip, profile, wait_for_proxy=False
        )
        environment, bundle = await _environment(running, sandbox, plan, grants or [], token_ttl)
        if guard is not None:
            keeper.guard("workdir", sandbox.sandbox_id, str(guard.save()))  # checked even if we die
        fd = await program
        await asyncio.to_thread(keeper.wait_ready)  # nothing runs in the sandbox before its watchdog does
        argv = sandbox.command(
            command, user, plan.isolate_fs, hidden=plan.hidden, read_only=plan.read_only, guard=guard,
            seccomp_fd=fd, trust_bundle=bundle, writable=[plan.writable] if plan.writable else [],
        )  # fmt: skip
        argv = [*cgroup.enter_argv(), *rlimit_argv(plan.resources), *argv]  # in its cgroup before it runs anything
        pipe = asyncio.subprocess.PIPE if capture_output else None
        # Its own session: no controlling terminal, so it cannot push keystrokes into the shell that started it.
        process = await asyncio.create_subprocess_exec(
            *argv, env=environment, start_new_session=True, stdout=pipe, stderr=pipe, pass_fds=(fd,)
        )
    except BaseException:
        await teardown()
        raise
    finally:
        foreground()  # the command runs (or nothing will): the import's thread gets its usual share again
        program.add_done_callback(_close_program)  # the sandbox holds its own copy: ours goes, also on failure
    return NetnsHandle(sandbox, running, process, timeout, teardown, cgroup, output_limit)


async def _environment(
    running: Gateway, sandbox: NetnsSandbox, plan: NetnsPlan, grants: list[Grant], token_ttl: int | None
) -> tuple[dict[str, str], Path | None]:
    """The command's variables: a clean environment, the caches', the caller's, the gateway's, the trust bundle's
    and the token file's (the token placed); and the combined trust bundle when bubblewrap binds it over the
    system's."""
    assert sandbox.sandbox_id is not None
    environment = host_environment(plan.user) | cache_environment(plan.writable, plan.isolate_fs) | plan.env
    environment |= gateway_environment(running, sandbox.sandbox_id, bool(grants))
    inspector = running.inspector
    combined = inspector.bundle if inspector is not None else None  # the system's CAs plus the gateway's
    bound = trust_bundle(running, plan.isolate_fs)
    if inspector is not None and combined is not None:
        environment |= inspector.environment(str(bound or combined))
    if token := await mint_token(running, sandbox.sandbox_id, grants, token_ttl):
        environment["AIRLOCK_TOKEN_FILE"] = str(sandbox.place_token(token, plan.user))
    return environment, combined if bound else None


def _close_program(program: asyncio.Future[int]) -> None:
    if not program.cancelled() and program.exception() is None:
        os.close(program.result())


async def _teardown(
    sandbox: NetnsSandbox,
    cgroup: cgroups.SandboxCgroup | None,
    guard: WorkdirGuard | None,
    gateway: Gateway | None,
    watchdog: Watchdog | None,
    state: tempfile.TemporaryDirectory[str] | None,
    report: Report,
) -> None:
    """Nothing of the sandbox outlives its gateway, and the working directory is checked only once nothing of the
    sandbox is left to write in it. If removing fails, the gateway stops anyway (the fence stays: the sandbox has
    nothing to reach) and the watchdog is not released: it removes the rest, and checks the working directory,
    when this process exits."""
    try:
        await asyncio.to_thread(sandbox.destroy)
        if cgroup is not None:  # after the namespace's processes are killed: it is empty, or emptied now
            await asyncio.to_thread(cgroup.remove)
    except BaseException:
        if gateway is not None:
            await gateway.stop()
        raise
    if guard is not None:
        await asyncio.to_thread(_finish_workdir, guard, report)
    if gateway is not None:
        await gateway.stop()
    await release(watchdog, state)


def _finish_workdir(guard: WorkdirGuard, report: Report) -> None:
    try:
        lines = guard.finish()
    except Exception as e:  # whatever went wrong, the user must hear that the folder was not checked
        lines = [f"could not check the working directory for files the sandbox planted ({e}): do not run git there"]
    for line in lines:
        report(line)


def trust_bundle(gateway: Gateway, isolate_fs: bool) -> Path | None:
    """Where the sandbox finds the system's CAs plus the gateway's (inspected hosts), when bubblewrap binds the
    combined bundle over the system's own; None when nothing is inspected or it cannot be bound there (then the
    variables name the bundle where it is)."""
    inspector = gateway.inspector
    if inspector is None or inspector.bundle is None or not isolate_fs or not SYSTEM_BUNDLE.is_file():
        return None
    return Path(SANDBOX_BUNDLE)
