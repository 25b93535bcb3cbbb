"""`airlock run [options] -- CMD...`: the command in a fenced sandbox whose only network is its own gateway, by
either backend's `launch()`; the command's exit code passed through (124 after --timeout, 128+N when signal N
stopped the run)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airlock.broker.grants import Grant, GrantError, parse_grant
from airlock.gateway.config import GatewayConfig
from airlock.gateway.reload import PolicyWatcher
from airlock.inspection.secrets import SecretSource, parse_placeholder_env
from airlock.inspection.trust import SYSTEM_BUNDLE, TRUST_ENV_VARS
from airlock.launch.embedded_gateway import gateway_credentials
from airlock.launch.git_identity import IDENTITY_VARS, GitIdentityError, invoker_identity, parse_identity
from airlock.launch.preflight import ISOLATIONS, choose_isolation
from airlock.policy import Policy
from airlock.sandbox.limits import (
    DEFAULT_CPUS,
    DEFAULT_MEMORY,
    DEFAULT_NOFILE,
    DEFAULT_NPROC,
    DEFAULT_OUTPUT_LIMIT,
    DEFAULT_PIDS,
    Resources,
)

from .common import DOCKER_ENVIRONMENT, EXIT_TIMEOUT, NeedsRoot, UsageError, absolute, load_policy_file, signal_future
from .gateway import add_gateway_options, gateway_config
from .option_bounds import check_limits

if TYPE_CHECKING:
    import docker

    from airlock.gateway import Gateway
    from airlock.sandbox.docker import Limits

DOCKER_ONLY = ("mount",)
NETNS_ONLY = ("workdir", "cache")
# What names a CA bundle on a host; the sandbox's clean environment drops them (the notice says how to pass one).
HOST_CA_VARS = (*TRUST_ENV_VARS, "SSL_CERT_DIR")
SYSTEM_TRUST = (SYSTEM_BUNDLE, SYSTEM_BUNDLE.parent)  # what the sandbox's clients read anyway
RESOURCES = ("cpus", "memory", "pids", "nofile", "nproc")


def add_arguments(run: argparse.ArgumentParser) -> None:
    add_gateway_options(run)
    run.add_argument("--backend", choices=("auto", "netns", "docker"), default="auto", help="auto: docker if --image")
    run.add_argument("--image", help="docker backend: the image to run")
    run.add_argument("--cpus", type=float, help=f"CPU limit (default {DEFAULT_CPUS:g})")
    run.add_argument("--memory", help=f"memory limit, memory+swap alike (default {DEFAULT_MEMORY})")
    run.add_argument("--pids", type=int, help=f"limit of processes and threads in the sandbox (default {DEFAULT_PIDS})")
    run.add_argument("--nofile", type=int, help=f"open files per process, RLIMIT_NOFILE (default {DEFAULT_NOFILE})")
    run.add_argument(
        "--nproc", type=int, help=f"processes of the sandbox's user on the host, RLIMIT_NPROC (default {DEFAULT_NPROC})"
    )
    run.add_argument("--timeout", type=float, default=3600.0, metavar="S", help="then kill it all (exit 124)")
    run.add_argument("--output-limit", type=int, default=DEFAULT_OUTPUT_LIMIT, metavar="BYTES")
    run.add_argument("--mount", action="append", metavar="HOST:CONTAINER", help="docker backend: read-only mount")
    run.add_argument("--user", help="run the command as this user (default: the sudo caller, else nobody)")
    run.add_argument(
        "--workdir", type=absolute, metavar="DIR",
        help="netns backend: the folder the command works in and may write (default: the current one)",
    )  # fmt: skip
    run.add_argument(
        "--cache", type=absolute, metavar="DIR",
        help="netns backend: a folder the command may write, kept across runs, for npm's and XDG caches",
    )  # fmt: skip
    run.add_argument(
        "--git-identity", metavar="'NAME <EMAIL>'|none",
        help="who the sandbox's git commits as (default: yours, from your git configuration)",
    )  # fmt: skip
    run.add_argument(
        "--isolation", choices=ISOLATIONS, default="auto",
        help="netns backend: read-only host, private /tmp and PIDs via bubblewrap (auto: when installed)",
    )  # fmt: skip
    run.add_argument("--env", action="append", metavar="NAME[=VALUE]", help="pass a variable in (repeatable)")
    run.add_argument(
        "--placeholder-env", action="append", metavar="VAR=SECRET",
        help="set VAR to a placeholder of --secret SECRET, for SDKs that insist on a key (the gateway injects the "
        "real one where a rule says so; sent anywhere else, the placeholder is refused)",
    )  # fmt: skip
    run.add_argument(
        "--grant", action="append", metavar="TOOL:OWNER/REPO[:base=B|B2,head=PATTERN] | DECLARED_TOOL",
        help="mint a broker token with this grant for the sandbox (repeatable; without, no broker runs)",
    )  # fmt: skip
    run.add_argument("--sandbox-id", metavar="ID", help="name of the sandbox (default: random); [a-z0-9], 1-12 chars")
    run.add_argument("--quiet", action="store_true", help="do not tell each denial on stderr as it happens")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")
    needs = NeedsRoot("it makes a network namespace and its nftables fence; the command runs as you", environment)
    run.set_defaults(func=cmd_run, needs_root=needs)


def environment(args: argparse.Namespace) -> list[str]:
    """The variables of the host's environment a run reads: `--env NAME`, `--secret NAME=env:VAR`,
    `--github-token-env`, docker's, the git identity's and the CA bundles it says it does not pass in."""
    names = [item for item in args.env or [] if "=" not in item]
    sources = [spec.partition("=")[2] for spec in args.secret or []]
    names += [source.removeprefix("env:") for source in sources if source.startswith("env:")]
    names += [args.github_token_env] if args.github_token_env else []
    return [*names, *DOCKER_ENVIRONMENT, *IDENTITY_VARS, *HOST_CA_VARS]


@dataclass
class RunConfig:
    """`airlock run`'s arguments as the launchers take them."""

    backend: str  # "netns" or "docker"
    command: list[str]
    gateway: GatewayConfig
    profile: str | None = None
    sandbox_id: str | None = None
    grants: list[Grant] = field(default_factory=list)
    token_ttl: int | None = None
    timeout: float = 3600.0
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None  # netns
    cache: str | None = None  # netns
    isolation: str = "bwrap"  # netns: "bwrap" or "none"
    resources: Resources = field(default_factory=Resources)  # netns
    image: str | None = None  # docker
    limits: Limits | None = None  # docker
    mounts: list[tuple[str, str]] = field(default_factory=list)  # docker, always read-only


def cmd_run(args: argparse.Namespace) -> int:
    check_limits(args)
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise UsageError("nothing to run: airlock run [options] -- CMD...")
    enter_workdir(args)
    run = run_config(args, command, load_policy_file(args.policy))
    detail = f", image {run.image}" if run.backend == "docker" else f", filesystem isolation {run.isolation}"
    print(f"airlock: backend {run.backend}{detail}", file=sys.stderr)
    if note := host_ca_note(run.env):
        print(note, file=sys.stderr)
    return asyncio.run(_run_docker(run) if run.backend == "docker" else _run_netns(run))


def run_config(args: argparse.Namespace, command: list[str], policy: Policy) -> RunConfig:
    grants = parse_grants(args.grant or [], policy)
    gateway = gateway_config(args, policy, "0.0.0.0", [])  # listen and sandbox: the launcher's
    gateway = dataclasses.replace(gateway, show_denials=not args.quiet, tell_reloads=True)
    env = git_identity(args.git_identity) | passed_env(args.env or [])
    env |= placeholder_env(args.placeholder_env or [], gateway.broker.secrets)
    if shown := sorted({s.where for s in gateway.broker.secrets if s.kind == "env"} & env.keys()):
        raise UsageError(f"--env {shown[0]}: that variable holds a --secret, which the sandbox must never see")
    if not grants:  # the sandbox holds no token: a broker could only refuse it, so none runs (its port stays shut)
        gateway = dataclasses.replace(gateway, broker=dataclasses.replace(gateway.broker, port=0))
    run = RunConfig(
        choose_backend(args.backend, args.image), command, gateway, args.profile, args.sandbox_id, grants,
        args.token_ttl, args.timeout, env,
    )  # fmt: skip
    if run.backend == "netns":
        if docker_only := [f"--{name}" for name in DOCKER_ONLY if getattr(args, name)]:
            raise UsageError(f"{', '.join(docker_only)}: docker backend only")
        run.user, run.isolation, run.cache = args.user, choose_isolation(args.isolation), args.cache
        run.resources = netns_resources(args)
    else:
        if netns_only := [f"--{name}" for name in NETNS_ONLY if getattr(args, name)]:
            raise UsageError(f"{', '.join(netns_only)}: netns backend only (a container writes nothing of the host)")
        run.image, run.limits = args.image, docker_limits(args)
        run.mounts = [parse_mount(m, gateway_credentials(gateway)) for m in args.mount or []]
    return run


def enter_workdir(args: argparse.Namespace) -> None:
    """`--workdir DIR`: the launcher works there from now on, as the command will (every path option was made
    absolute as it was read)."""
    if not args.workdir:
        return
    try:
        os.chdir(args.workdir)
    except OSError as e:
        raise UsageError(f"--workdir {args.workdir}: {e.strerror}") from None


def git_identity(given: str | None) -> dict[str, str]:
    """The variables git in the sandbox commits with: `--git-identity`, else the invoker's own identity."""
    try:
        return parse_identity(given) if given is not None else invoker_identity()
    except GitIdentityError as e:
        raise UsageError(str(e)) from None


def host_ca_note(env: dict[str, str]) -> str | None:
    """What to tell a user whose shell names a CA bundle that the sandbox's clean environment drops (the system's
    own is the sandbox's too: nothing is lost)."""
    dropped = [
        name for name in HOST_CA_VARS
        if os.environ.get(name) and name not in env and Path(os.environ[name]).resolve() not in SYSTEM_TRUST
    ]  # fmt: skip
    if not dropped:
        return None
    return (
        f"airlock: {', '.join(dropped)} {'is' if len(dropped) == 1 else 'are'} set here but not passed into the "
        f"sandbox (its environment is clean): to have its clients trust that CA, --env {dropped[0]} (the file must "
        "be readable there); for the upstreams the gateway itself verifies, --upstream-ca FILE"
    )


def choose_backend(backend: str, image: str | None) -> str:
    """docker when asked (or when an image is named); netns otherwise."""
    if backend == "netns" and image:
        raise UsageError("--image needs --backend docker")
    if backend == "docker" and not image:
        raise UsageError("--backend docker needs --image IMAGE")
    return "docker" if image else "netns"


def parse_grants(texts: list[str], policy: Policy) -> list[Grant]:
    """The grants, each of a built-in tool or of one the policy declares."""
    try:
        grants = [parse_grant(g) for g in texts]
    except GrantError as e:
        raise UsageError(f"--grant: {e}") from None
    declared = [tool.name for tool in policy.tools]
    for grant in grants:
        if grant.declared and grant.tool not in declared:
            known = ", ".join(declared) or "none"
            raise UsageError(f"--grant {grant.tool}: {policy.source} declares no such tool (declared: {known})")
    return grants


def passed_env(passed: list[str]) -> dict[str, str]:
    """`--env NAME` (from this environment) and `--env NAME=VALUE`."""
    env: dict[str, str] = {}
    for item in passed:
        name, sep, value = item.partition("=")
        if not name.isidentifier():
            raise UsageError(f"--env {item!r}: not a variable name")
        if sep:
            env[name] = value
        elif name in os.environ:
            env[name] = os.environ[name]
    return env


def placeholder_env(specs: list[str], secrets: list[SecretSource]) -> dict[str, str]:
    """`--placeholder-env VAR=SECRET`: VAR holds `airlock-placeholder-SECRET`, never the secret itself; SECRET must
    be one of the gateway's --secrets."""
    given = {source.name for source in secrets}
    env: dict[str, str] = {}
    for spec in specs:
        parsed = parse_placeholder_env(spec)
        if parsed.secret not in given:
            raise UsageError(f"--placeholder-env {spec!r}: no --secret {parsed.secret} is given")
        env[parsed.variable] = parsed.value
    return env


def given_resources(args: argparse.Namespace) -> dict[str, Any]:
    """The compute limits named on the command line."""
    return {name: getattr(args, name) for name in RESOURCES if getattr(args, name, None) is not None}


def netns_resources(args: argparse.Namespace) -> Resources:
    """The sandbox's limits: those given (refused if the host cannot enforce them), the defaults for the rest."""
    given = given_resources(args)
    return Resources(**given, required=frozenset(given))


def docker_limits(args: argparse.Namespace) -> Limits:
    """The container's limits: those given, the defaults for the rest."""
    from airlock.sandbox.docker import Limits

    return Limits(**given_resources(args), timeout=args.timeout, output_limit=args.output_limit)


def parse_mount(text: str, credentials: list[str]) -> tuple[str, str]:
    host, sep, target = text.partition(":")
    if not sep or not host.startswith("/") or not target.startswith("/"):
        raise UsageError(f"--mount {text!r}: expected /host/path:/container/path (always read-only)")
    source = Path(host).resolve()
    for credential in credentials:
        if Path(credential).resolve().is_relative_to(source):
            raise UsageError(f"--mount {text!r}: would show the container {credential}, a gateway credential")
    return host, target.removesuffix(":ro")


# --- the two backends --------------------------------------------------------------------------------------------


def _stop_signals() -> asyncio.Future[int]:
    """The first of SIGINT, SIGTERM and SIGHUP to arrive (its number): the run is then stopped and removed (a
    hang-up ends the sandbox; the policy reloads when its file changes, or through the admin listener)."""
    return signal_future(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _watch_policy(gateway: Gateway) -> PolicyWatcher:
    """Reload the policy when its file changes, each outcome told on stderr in one line."""
    watcher = PolicyWatcher(gateway.config.policy.source, gateway.reload_policy, gateway.tell_reload)
    watcher.start()
    return watcher


def _entered(
    gateway: Gateway, sandbox_id: str | None, folders: list[str | Path | None]
) -> contextlib.AbstractContextManager[None]:
    """The run among the gateways `airlock status` (and `token`, `approvals`) find without --admin, with the host
    folders of its sandbox, which a netns sandbox started later hides (`airlock.launch.tenants`)."""
    from airlock.runs import registered

    what, named = f"airlock run, sandbox {sandbox_id}", [str(f) for f in [*folders, gateway.config.state_dir] if f]
    return registered(gateway.admin.address, gateway.config.policy.source, what, named)


def _reopen_audit_on_sigusr1(gateway: Gateway) -> None:
    """As `airlock gateway` does: log rotation moves the audit file away, then sends SIGUSR1."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, gateway.reopen_audit)


async def _first(waiter: asyncio.Future[int | None], stopped: asyncio.Future[int]) -> bool:
    """Whether a signal came before the command ended."""
    futures: list[asyncio.Future[Any]] = [waiter, stopped]
    await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    return not waiter.done()


async def _run_netns(run: RunConfig) -> int:
    from airlock.launch.netns_launcher import launch

    stopped = _stop_signals()  # before anything exists: a signal while the sandbox is built still removes it
    handle = await launch(
        run.command, run.gateway, profile=run.profile, sandbox_id=run.sandbox_id, user=run.user,
        isolation=run.isolation, env=run.env, grants=run.grants, token_ttl=run.token_ttl, timeout=run.timeout,
        resources=run.resources, cache=run.cache,
    )  # fmt: skip
    async with handle:
        _reopen_audit_on_sigusr1(handle.gateway)
        watcher = _watch_policy(handle.gateway)
        waiter = asyncio.ensure_future(handle.wait())
        # The working directory (the launcher works there, as the command does), the cache, the token's folder.
        folders = [os.getcwd(), run.cache, handle.sandbox.run_dir]
        with _entered(handle.gateway, handle.sandbox.sandbox_id, folders):
            interrupted = await _first(waiter, stopped)
        if interrupted:
            waiter.cancel()
            await handle.stop()
        await watcher.stop()
        code = None if interrupted else waiter.result()
        if code is not None and handle.oom_killed():
            print(f"airlock: killed at the {run.resources.memory} memory limit", file=sys.stderr)
    return _outcome(code, stopped.result() if interrupted else None, run.timeout)


async def _run_docker(run: RunConfig) -> int:
    from airlock.launch.docker_launcher import launch
    from airlock.sandbox.docker import sandbox_token_dir

    assert run.image is not None and run.limits is not None
    client = _docker_client()
    stopped = _stop_signals()
    handle = await launch(
        client, run.image, run.command, run.gateway, profile=run.profile, sandbox_id=run.sandbox_id,
        limits=run.limits, mounts=run.mounts, env=run.env, grants=run.grants, token_ttl=run.token_ttl,
    )  # fmt: skip
    async with handle:
        _reopen_audit_on_sigusr1(handle.gateway)
        watcher = _watch_policy(handle.gateway)
        output = asyncio.ensure_future(handle.stream(sys.stdout.buffer, sys.stderr.buffer))
        waiter = asyncio.ensure_future(handle.wait())
        assert handle.sandbox.sandbox_id is not None  # given or drawn when built
        with _entered(handle.gateway, handle.sandbox.sandbox_id, [sandbox_token_dir(handle.sandbox.sandbox_id)]):
            interrupted = await _first(waiter, stopped)
        if interrupted:
            handle.kill()
        code = await waiter
        await watcher.stop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(output, 10)  # the streams end when the container stops
        if code is not None and not interrupted and handle.oom_killed():
            print(f"airlock: killed at the {run.limits.memory} memory limit", file=sys.stderr)
    return _outcome(code, stopped.result() if interrupted else None, run.timeout)


def _docker_client() -> docker.DockerClient:
    import docker

    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as e:
        raise UsageError(no_docker_engine(e)) from None
    return client


def no_docker_engine(error: BaseException) -> str:
    """Where airlock looked for a docker engine, the system's word for why none answered there, and what to do —
    sudo's first: it passes no DOCKER_HOST on, so an engine the user's shell names is not the one asked."""
    engine = os.environ.get("DOCKER_HOST")
    why = next((e.strerror for e in _causes(error) if isinstance(e, OSError) and e.strerror), None)
    told = f"no docker engine answers at {engine or 'unix:///var/run/docker.sock'} ({why or 'no answer'})"
    start = "install and start one (apt-get install docker.io; systemctl start docker)"
    if engine is None and os.environ.get("SUDO_USER"):
        return (
            f"{told}: sudo does not pass DOCKER_HOST on — if yours names the engine, keep it with "
            f"sudo --preserve-env=DOCKER_HOST airlock run ...; else {start}, or use --backend netns"
        )
    return f"{told}: {start}, or point DOCKER_HOST at one — or use --backend netns"


def _causes(error: BaseException) -> list[BaseException]:
    """The error and those it was raised from or during, the first one first."""
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return chain


def _outcome(code: int | None, signum: int | None, timeout: float) -> int:
    if signum is not None:
        print(f"airlock: stopped by {signal.Signals(signum).name}; the sandbox is removed", file=sys.stderr)
        return 128 + signum
    if code is None:
        print(f"airlock: killed after the {timeout:g}s timeout", file=sys.stderr)
        return EXIT_TIMEOUT
    return code
