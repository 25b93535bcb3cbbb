"""`launch()`: a command in a network namespace whose only link leads to its own embedded gateway, as one handle
(`wait()`, `stop()`, `kill()`, `logs()`, `close()`; an async context manager) — what `airlock run` uses for the
netns backend. Its docker twin is `airlock.launch.docker_launcher.launch()`.

Checked before anything exists: the command's user (never root), and what it must not read or change. bubblewrap
hides the gateway's credentials, the usual ones of the user's home and the host services that would act outside
the sandbox's network, and binds airlock's own code read-only; with isolation "none" nothing can be hidden, so
`launch()` refuses while any of them is in the user's reach. Whatever the gateway reads or writes by path while the
command runs (`gateway_inputs`) is refused where the command could change it or a folder on its way
(`airlock.sandbox.reach`), and so is a policy put in force later that names such a file. Then, in this order: the
watchdog, the namespace and its fence, the cgroup, the gateway, the environment and token, the working directory's
guard, the command. `close()` goes back: everything in the namespace is killed and namespace, link and fence are
removed, then the cgroup, then the working directory is checked, then the gateway stops, then the state directory
goes and the watchdog is released.

The working directory's guard takes its snapshot while the namespace is built (both wait on subprocesses). The
command does not wait for mitmproxy to load (most of a launch's time): the proxy's sockets listen, marked for the
fence, before the command starts, and the command's connections wait in their backlog until the proxy serves them.
Should the proxy fail to start, `wait()` kills the sandbox and raises the gateway's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pwd
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from airlock.broker.grants import Grant
from airlock.brokerconfig import admin_endpoint
from airlock.gatewayconfig import GatewayConfig
from airlock.inspection.trust import SANDBOX_BUNDLE, SYSTEM_BUNDLE
from airlock.preload import preload_proxy
from airlock.sandbox import cgroups, host_paths, netns, seccomp
from airlock.sandbox.errors import SandboxError
from airlock.sandbox.limits import DEFAULT_OUTPUT_LIMIT, TIMEOUT, Resources, limit_problem, rlimit_argv
from airlock.sandbox.netns import NetnsSandbox
from airlock.sandbox.reach import Reach, policy_files
from airlock.sandbox.workdir import WorkdirError, WorkdirGuard

from .embedded_gateway import (
    fence_interception,
    fence_ports,
    gateway_credentials,
    gateway_environment,
    mint_token,
    prepare_call_log,
    release,
    start_gateway,
    state_directory,
)
from .watchdog import Watchdog

if TYPE_CHECKING:  # imported in a thread while the sandbox is built (`preload_proxy`)
    from airlock.gateway import Gateway

ISOLATIONS = ("auto", "bwrap", "none")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
NPM_RUN_CACHE = "/tmp/.npm"  # in the sandbox's private /tmp: its home is read-only, and npm needs a cache it writes
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
    if problem := limit_problem("timeout", timeout, TIMEOUT, lowest_included=False):
        raise SandboxError(problem)
    isolate_fs = choose_isolation(isolation) == "bwrap"
    pw = netns.resolve_user(user)  # everything that can be refused is, before anything is created
    env = {"PATH": SANDBOX_PATH} | (env or {})
    if problem := command_problem(command[0] if command else "", env["PATH"]):
        raise SandboxError(problem)
    prepare_call_log(gateway)
    hidden = hidden_paths(isolate_fs, pw, gateway_credentials(gateway))
    read_only = kept_from_writes(isolate_fs, pw)
    protected = [*(Path(path) for _, path in gateway_inputs(gateway)), *map(Path, gateway_credentials(gateway))]
    writable = writable_cache(Path(cache), pw, protected) if cache else None
    reach = sandbox_reach(isolate_fs, pw, [*hidden, *read_only], [writable] if writable else [])
    resources = resources or Resources()
    controllers = cgroups.host_parents()
    notes = cgroups.check(resources, controllers)
    if note := unwritable_workdir(pw, named=user is not None):
        notes.append(note)
    for note in notes:
        report(note)
    tcp_ports, udp_ports = fence_ports(gateway)
    gateway, state = state_directory(gateway)
    own = None
    try:
        refuse_inputs_in_reach(reach, gateway)  # the state directory too, also a temporary one
        gateway = dataclasses.replace(gateway, sandbox_reach=reach)  # and what a reload brings
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
        if isolate_fs:
            guard = WorkdirGuard(Path.cwd(), pw, sandbox.sandbox_id, Path(gateway.state_dir) / "workdir")
        # aiohttp and mitmproxy import in a thread from now on: while the namespace is built (ip, nft) this thread
        # mostly waits, whereas the checks above would have shared the interpreter's lock with the import.
        preload_proxy()
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
        cgroup = cgroups.SandboxCgroup(sandbox.sandbox_id, resources, controllers)
        await asyncio.to_thread(cgroup.create)
        keeper.guard("cgroup", sandbox.sandbox_id, cgroup.watchdog_words(), wait=False)
        running = await start_gateway(
            gateway, sandbox.gateway_ip, sandbox.sandbox_id, sandbox.sandbox_ip, profile, wait_for_proxy=False
        )
        environment = host_environment(pw) | cache_environment(writable, isolate_fs) | env
        environment |= gateway_environment(running, sandbox.sandbox_id, bool(grants))
        inspector = running.inspector
        combined = inspector.bundle if inspector is not None else None  # the system's CAs plus the gateway's
        bound = trust_bundle(running, isolate_fs)
        if inspector is not None and combined is not None:
            environment |= inspector.environment(str(bound or combined))
        if token := await mint_token(running, sandbox.sandbox_id, grants or [], token_ttl):
            environment["AIRLOCK_TOKEN_FILE"] = str(sandbox.place_token(token, pw))
        if guard is not None:
            keeper.guard("workdir", sandbox.sandbox_id, str(guard.save()))  # checked even if we die
        fd = await program
        await asyncio.to_thread(keeper.wait_ready)  # nothing runs in the sandbox before its watchdog does
        argv = sandbox.command(
            command, user, isolate_fs, hidden=hidden, read_only=read_only, guard=guard, seccomp_fd=fd,
            trust_bundle=combined if bound else None, writable=[writable] if writable else [],
        )  # fmt: skip
        argv = [*cgroup.enter_argv(), *rlimit_argv(resources), *argv]  # in its cgroup before it runs anything
        pipe = asyncio.subprocess.PIPE if capture_output else None
        # Its own session: no controlling terminal, so it cannot push keystrokes into the shell that started it.
        process = await asyncio.create_subprocess_exec(
            *argv, env=environment, start_new_session=True, stdout=pipe, stderr=pipe, pass_fds=(fd,)
        )
    except BaseException:
        await teardown()
        raise
    finally:
        program.add_done_callback(_close_program)  # the sandbox holds its own copy: ours goes, also on failure
    return NetnsHandle(sandbox, running, process, timeout, teardown, cgroup, output_limit)


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


# --- what is checked before anything is created -----------------------------------------------------------------


def trust_bundle(gateway: Gateway, isolate_fs: bool) -> Path | None:
    """Where the sandbox finds the system's CAs plus the gateway's (inspected hosts), when bubblewrap binds the
    combined bundle over the system's own; None when nothing is inspected or it cannot be bound there (then the
    variables name the bundle where it is)."""
    inspector = gateway.inspector
    if inspector is None or inspector.bundle is None or not isolate_fs or not SYSTEM_BUNDLE.is_file():
        return None
    return Path(SANDBOX_BUNDLE)


def choose_isolation(requested: str) -> str:
    """bwrap unless `none` is asked for; `none` keeps the host filesystem as the user sees it."""
    if requested not in ISOLATIONS:
        raise SandboxError(f"isolation {requested!r}: choose one of {', '.join(ISOLATIONS)}")
    if requested != "none" and not netns.bubblewrap_available():
        # No quiet fallback: without bubblewrap the command sees the host as its user does.
        raise SandboxError(
            "bubblewrap is not installed (apt-get install bubblewrap; scripts/setup does): the command would see "
            "the host's files as its user; install it, or say --isolation none to accept that"
        )
    return "bwrap" if requested == "auto" else requested


def gateway_inputs(config: GatewayConfig) -> list[tuple[str, str]]:
    """What the gateway reads or writes by path while the command runs, each with the option that named it: the
    policy file and the files it names (`policy_files`), the audit log (made anew after a rotation), the upstream CA
    bundle, the system's (read for each new gateway CA), the state directory, the call log and the admin socket; and
    airlock's own code, which the gateway goes on importing (and root runs next time). Secrets, the GitHub key
    and the token file are read once, before the command starts."""
    named = policy_files(config.policy, "--policy" if config.policy_path else "the default policy")
    files = {"--upstream-ca": config.upstream_ca, "--audit": config.audit_path, "--state-dir": config.state_dir}
    if config.broker.port:
        files["--call-log"] = config.broker.call_log
    if config.admin and isinstance(socket := admin_endpoint(config.admin), Path):
        files["--admin"] = str(socket)
    if SYSTEM_BUNDLE.exists():
        files["the system's CA bundle"] = str(SYSTEM_BUNDLE)
    named += [(option, path) for option, path in files.items() if path]
    return named + [("airlock's own code", str(path)) for path in airlock_code()]


def sandbox_reach(
    isolate_fs: bool, user: pwd.struct_passwd, mounted: list[Path], writable: Sequence[Path] = ()
) -> Reach:
    """What the command may change on the host: with bubblewrap its working directory and the `writable` folders
    bound in (`--cache`), but for the folders bubblewrap hides or binds read-only there (`mounted`); without
    bubblewrap whatever its user may."""
    if not isolate_fs:
        return Reach(user, None)
    roots = (Path.cwd().resolve(), *(folder.resolve() for folder in writable))
    return Reach(user, roots, frozenset(p for p in mounted if p.is_dir()))


def refuse_inputs_in_reach(reach: Reach, config: GatewayConfig) -> None:
    """SandboxError when the command could change one of the gateway's inputs, or put another file in its place
    through a folder on its way: bubblewrap can bind a file read-only, not the folders around it."""
    if problems := reach.problems(gateway_inputs(config)):
        raise SandboxError(problems[0])


def hidden_paths(isolate_fs: bool, user: pwd.struct_passwd, credentials: list[str]) -> list[Path]:
    """The paths bubblewrap hides from the command: the gateway's credentials, the usual ones in the user's home,
    and host services that would run commands outside the sandbox. Without bubblewrap nothing can be hidden:
    refuse to start while the command's user could read or change a gateway credential, or has a session whose
    services (systemd --user, rootless docker, dbus) it could ask to run something on the host's network."""
    if isolate_fs:
        return host_paths.credential_paths(user, credentials) + host_paths.host_service_paths()
    for path in host_paths.credential_paths(user, credentials):
        if exposed := host_paths.accessible_by(path, user):
            raise SandboxError(
                f"{exposed[0]} is readable or writable by {user.pw_name}, who runs the sandboxed command, and "
                "--isolation none cannot hide it: make it root's alone (chown root; chmod 600), or use bubblewrap"
            )
    if session := host_paths.user_session(user):
        raise SandboxError(
            f"{user.pw_name} has a session ({session}) whose services could start processes outside the sandbox's "
            "network, and --isolation none cannot hide it: use bubblewrap, or --user an account without a session"
        )
    return []


def kept_from_writes(isolate_fs: bool, user: pwd.struct_passwd) -> list[Path]:
    """What bubblewrap binds read-only although it lies in the writable working directory: airlock's own code and
    environment, which root runs next time (without bubblewrap, `refuse_inputs_in_reach` refuses them in the
    user's reach). A working directory whose files run outside the sandbox is refused."""
    if not isolate_fs:
        return []
    cwd = Path.cwd().resolve()
    if problem := host_paths.workdir_problem(cwd, user):
        raise SandboxError(f"the working directory {Path.cwd()} would be writable in the sandbox, but {problem}")
    return [path for path in airlock_code() if cwd in (path.resolve(), *path.resolve().parents)]


def airlock_code() -> list[Path]:
    """Where this airlock and its Python environment live (an editable install's source folders included, and the
    packaged policies)."""
    import airlock
    import airlock.audit
    import airlock.broker
    import airlock.configs
    import airlock.dns
    import airlock.policy
    import airlock.proxy

    packages = (airlock, airlock.audit, airlock.broker, airlock.configs, airlock.dns, airlock.policy, airlock.proxy)
    return [Path(sys.prefix)] + [Path(module.__file__).parent for module in packages if module.__file__]


def command_problem(program: str, search_path: str) -> str | None:
    """Why `program` cannot be started in the sandbox, if it surely cannot: a name found in no folder of the
    sandbox's PATH (a shell would not look in the working directory either), a path to nothing."""
    if not program:
        return None
    if "/" in program:
        if os.path.lexists(program):
            return None
        return f"{program}: no such file (the working directory is {Path.cwd()})"
    if any(os.path.lexists(os.path.join(folder or ".", program)) for folder in search_path.split(":")):
        return None
    local = f"; to run the one in the working directory: ./{program}" if os.path.lexists(program) else ""
    return f"{program}: command not found in the sandbox's PATH ({search_path}){local}"


def writable_cache(cache: Path, user: pwd.struct_passwd, protected: list[Path]) -> Path:
    """`--cache DIR`, resolved, once it is clear that the command may write it without changing what runs or is
    read outside the sandbox: not a system folder, a home or a cache of the user's own tools; not the working
    directory or above it; holding none of the gateway's inputs and credentials nor airlock's code."""
    path = cache.resolve()
    if not path.is_dir():
        raise SandboxError(f"--cache {cache}: no such folder (make it, writable for {user.pw_name})")
    problem = host_paths.workdir_problem(path, user)
    home = Path(user.pw_dir).resolve()
    if any(path == own or own in path.parents for own in (home / ".npm", home / ".cache")):
        problem = f"it is {user.pw_name}'s own cache, which the tools outside the sandbox read"
    elif path in (Path.cwd().resolve(), *Path.cwd().resolve().parents):
        problem = "it holds the working directory"
    elif inside := [p for p in protected if path in (p.resolve(), *p.resolve().parents)]:
        problem = f"it holds {inside[0]}, which the command must not change"
    elif not host_paths.may_write(path, user):
        problem = f"{user.pw_name}, who runs the command, may not write it"
    if problem:
        raise SandboxError(f"--cache {path} would be writable in the sandbox, but {problem}: give a folder of its own")
    return path


def cache_environment(cache: Path | None, isolate_fs: bool) -> dict[str, str]:
    """Where the package managers keep their caches: in `cache` (npm's and every XDG one, pip's among them), or,
    as the home is read-only in the sandbox, npm's in its private /tmp (npm cannot work without one it writes)."""
    if cache is not None:
        return {"XDG_CACHE_HOME": str(cache), "npm_config_cache": str(cache / "npm")}
    return {"npm_config_cache": NPM_RUN_CACHE} if isolate_fs else {}


def unwritable_workdir(user: pwd.struct_passwd, named: bool) -> str | None:
    """What to tell the user when the command's user cannot write the working directory: the run goes on (the
    command may only read), but a command that writes would fail there later."""
    cwd = Path.cwd()
    if host_paths.may_write(cwd, user):
        return None
    why = "" if named or os.environ.get("SUDO_UID") else " (airlock run as root, not through sudo)"
    return (
        f"the command runs as {user.pw_name}{why}, who cannot write the working directory {cwd}: to let it, pass "
        f"--user with an account that may, or make the folder writable for {user.pw_name}"
    )


def host_environment(user: pwd.struct_passwd) -> dict[str, str]:
    """A clean environment: nothing of the host's leaks in (tokens live in environments)."""
    env = {
        "PATH": SANDBOX_PATH,
        "HOME": user.pw_dir if os.path.isdir(user.pw_dir) else "/tmp",
        "USER": user.pw_name,
        "LOGNAME": user.pw_name,
        "LANG": os.environ.get("LANG", "C.UTF-8"),
    }
    if "TERM" in os.environ:
        env["TERM"] = os.environ["TERM"]
    return env
