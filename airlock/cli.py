"""`airlock` command line: policy check/explain, the gateway, and `run` (a command in a fenced sandbox)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from airlock.broker.grants import GrantError, parse_grant
from airlock.dns.upstream import parse_server
from airlock.policy import (
    WEB_PORTS,
    HostError,
    Policy,
    PolicyError,
    Sandbox,
    canonical_host,
    decide,
    format_host_port,
    load_policy,
    parse_ip_literal,
    vet,
)
from airlock.sandbox.limits import CPUS, DAY, OUTPUT_LIMIT, PIDS, TIMEOUT, limit_problem, memory_bytes
from airlock.sandbox.watchdog import Watchdog, WatchdogError

if TYPE_CHECKING:
    from airlock.sandbox.netns import NetnsSandbox

EXIT_ALLOW, EXIT_DENY, EXIT_USAGE = 0, 1, 2
log = logging.getLogger("airlock")


class UsageError(Exception):
    pass


def _duration(text: str) -> int:
    """`90`, `90s`, `10m`, `1h` → seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1)
    if not number.isdigit() or int(number) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 10m or 1h")
    return int(number) * unit


# Every limit is a finite number within bounds: 0, a negative number, inf or nan would turn one off (docker reads
# 0 as "unlimited") or break it. Option → (lowest, highest, whether the lowest value itself is allowed).
LIMITS: dict[str, tuple[float, float, bool]] = {
    "proxy_port": (1, 65535, True),
    "dns_port": (0, 65535, True),  # 0: no DNS server
    "broker_port": (0, 65535, True),  # 0: no broker
    "connect_timeout": (0, 300, False),
    "idle_timeout": (0, 7 * DAY, False),
    "github_timeout": (0, 300, False),
    "max_tunnels": (1, 1_000_000, True),
    "max_connections": (1, 1_000_000, True),
    "broker_max_connections": (1, 100_000, True),
    "dns_rate": (0, 10_000_000, False),
    "dns_min_ttl": (0, DAY, True),
    "token_ttl": (1, 7 * DAY, True),
    "token_max_ttl": (1, 7 * DAY, True),
    "timeout": (*TIMEOUT, False),
    "cpus": (*CPUS, True),
    "pids": (*PIDS, True),
    "output_limit": (*OUTPUT_LIMIT, True),
}


def check_limits(args: argparse.Namespace) -> None:
    """UsageError for the first limit given that is not a finite number within its bounds (or a bad --memory)."""
    for name, (low, high, low_allowed) in LIMITS.items():
        value = getattr(args, name, None)
        option = f"--{name.replace('_', '-')}"
        if value is not None and (problem := limit_problem(option, value, (low, high), low_allowed)):
            raise UsageError(problem)
    if getattr(args, "memory", None) is not None:
        try:
            memory_bytes(args.memory)
        except ValueError as e:
            raise UsageError(f"--memory: {e}") from None


def default_policy_path() -> Path:
    return Path(str(resources.files("airlock.configs") / "default.yaml"))


def _load(path: str | None) -> Policy:
    return load_policy(path or default_policy_path())


# --- policy check / explain -------------------------------------------------------------------------------------


def cmd_policy_check(args: argparse.Namespace) -> int:
    """Every file is checked and reported, good or bad: exit 2 if any is bad."""
    status = 0
    for path in args.file:
        try:
            policy = load_policy(path)
        except PolicyError as e:
            print(e, file=sys.stderr)
            status = EXIT_USAGE
            continue
        rules = sum(len(p.allow) + len(p.deny) for p in policy.profiles.values())
        counts = f"{len(policy.profiles)} profiles, {rules} rules, default profile {policy.default_profile!r}"
        print(f"{path}: ok ({counts})")
    return status


def parse_target(text: str) -> tuple[str, int]:
    """A URL (`https://host/path`) or `host:port` → (canonical host, port)."""
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise UsageError(f"{text!r}: only http:// and https:// URLs")
        if parts.username is not None or parts.password is not None:
            raise UsageError(f"{text!r}: URLs with userinfo are refused")
        try:
            explicit_port = parts.port
        except ValueError as e:
            raise UsageError(f"{text!r}: {e}") from None
        raw_host = parts.netloc.rsplit(":", 1)[0] if explicit_port else parts.netloc
        port = explicit_port or (443 if parts.scheme == "https" else 80)
    else:
        raw_host, sep, port_text = text.rpartition(":")
        if not sep or not port_text.isdigit():
            raise UsageError(f"{text!r}: give a URL or host:port")
        port = int(port_text)
    if not 1 <= port <= 65535:
        raise UsageError(f"{text!r}: port out of range")
    try:
        return canonical_host(raw_host), port
    except HostError as e:
        raise UsageError(str(e)) from None


def _parse_resolve(values: list[str]) -> dict[str, list]:
    table: dict[str, list] = {}
    for value in values:
        host, sep, ips = value.partition("=")
        if not sep or not ips:
            raise UsageError(f"--resolve {value!r}: expected HOST=IP[,IP...]")
        try:
            addresses = [parse_ip_literal(ip.strip()) for ip in ips.split(",")]
            name = canonical_host(host)
        except HostError as e:
            raise UsageError(f"--resolve {value!r}: {e}") from None
        if any(a is None for a in addresses):
            raise UsageError(f"--resolve {value!r}: not an IP address list")
        table[name] = addresses
    return table


def cmd_policy_explain(args: argparse.Namespace) -> int:
    policy = _load(args.policy)
    try:
        profile = policy.profile(args.profile)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None
    host, port = parse_target(args.target)
    resolved = _parse_resolve(args.resolve or [])
    target = format_host_port(host, port)
    decision = decide(profile, host, port)
    print(f"target:   {target} (profile {profile.name})")
    if decision.rule is not None:
        print(f"rule:     {decision.rule.describe()}")
    if not decision.allow:
        print(f"decision: deny [{decision.code}] — {decision.reason}")
        if decision.hint:
            print(f"to allow: {decision.hint}")
        return EXIT_DENY
    if port not in WEB_PORTS and not decision.tunnel:
        print("tunnel:   TLS only; a CONNECT tunnel that is not TLS (e.g. ssh) needs `tunnel: true` on the rule")
    addresses = [ipaddress.ip_address(host)] if parse_ip_literal(host) else resolved.get(host)
    if addresses is None:
        print("decision: allow (name allowed; its addresses are vetted after DNS — pass --resolve to check them)")
        return EXIT_ALLOW
    vetted = vet(profile, addresses, port)
    for rejection in vetted.rejected:
        print(f"blocked:  {rejection.address} — {rejection.reason}")
    if not vetted.allowed:
        print(f"decision: deny [{vetted.code}] — {vetted.reason}")
        return EXIT_DENY
    print(f"decision: allow — would connect to {vetted.allowed[0]}")
    return EXIT_ALLOW


# --- gateway -----------------------------------------------------------------------------------------------------


def _sandboxes(specs: list[str], profile: str | None, policy: Policy) -> list[Sandbox]:
    """`--sandbox ID=CIDR[:PROFILE]`; with none given, one sandbox `default` covers every client."""
    if not specs:
        name = profile or policy.default_profile
        return [Sandbox("default", name, ipaddress.ip_network(n)) for n in ("0.0.0.0/0", "::/0")]
    sandboxes = []
    for spec in specs:
        sandbox_id, sep, rest = spec.partition("=")
        if not sep or not sandbox_id:
            raise UsageError(f"--sandbox {spec!r}: expected ID=CIDR[:PROFILE]")
        cidr, _, sandbox_profile = rest.partition(":") if rest.count(":") <= 1 else (rest, "", "")
        try:
            network = ipaddress.ip_network(cidr, strict=True)
        except ValueError as e:
            raise UsageError(f"--sandbox {spec!r}: {e}") from None
        sandbox_profile = sandbox_profile or profile or policy.default_profile
        if sandbox_profile not in policy.profiles:
            raise UsageError(f"--sandbox {spec!r}: no profile {sandbox_profile!r} in the policy")
        sandboxes.append(Sandbox(sandbox_id, sandbox_profile, network))
    return sandboxes


def _gateway_config(args: argparse.Namespace, policy: Policy, listen: str, sandboxes: list[Sandbox]):
    from airlock.brokerd import BrokerConfig
    from airlock.gateway import GatewayConfig

    try:
        upstream_dns = [parse_server(s) for s in args.upstream_dns or []]
    except ValueError as e:
        raise UsageError(f"--upstream-dns: {e}") from None
    if args.profile and args.profile not in policy.profiles:
        raise UsageError(f"no profile {args.profile!r} in {policy.source}")
    return GatewayConfig(
        policy=policy,
        listen=listen,
        proxy_port=args.proxy_port,
        sandboxes=sandboxes,
        upstream_dns=upstream_dns,
        upstream_ca=args.upstream_ca,
        audit_path=args.audit,
        audit_stdout=getattr(args, "audit_stdout", False),
        connect_timeout=args.connect_timeout,
        idle_timeout=args.idle_timeout,
        max_tunnels_per_sandbox=args.max_tunnels,
        max_connections_per_sandbox=args.max_connections,
        dns_min_ttl=args.dns_min_ttl,
        dns_port=args.dns_port,
        dns_rate=args.dns_rate,
        state_dir=args.state_dir,
        broker=BrokerConfig(
            port=args.broker_port,
            admin=args.broker_admin,
            github_api=args.github_api,
            github_app_id=args.github_app_id,
            github_app_key=args.github_app_key,
            github_installation_id=args.github_installation_id,
            github_token_file=args.github_token_file,
            github_token_env=args.github_token_env,
            github_timeout=args.github_timeout,
            token_ttl=args.token_ttl,
            token_max_ttl=args.token_max_ttl,
            max_connections_per_client=args.broker_max_connections,
        ),
    )


async def _serve(args: argparse.Namespace, policy: Policy) -> int:
    from airlock.gateway import Gateway

    config = _gateway_config(args, policy, args.listen, _sandboxes(args.sandbox or [], args.profile, policy))
    gateway = Gateway(config)
    # Handlers first: a SIGTERM that arrives while the gateway starts still stops it cleanly.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: _reload(gateway, args.policy))
    try:
        await gateway.start()
        dns = f", DNS on port {args.dns_port}" if args.dns_port else ""
        where = format_host_port(args.listen, args.proxy_port)
        print(f"airlock gateway: proxy on {where}{dns}", file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        await gateway.stop()
    return 0


def _reload(gateway, path: str | None) -> None:
    """SIGHUP: load the policy again; a bad file is reported and the running policy stays."""
    try:
        gateway.replace_policy(_load(path))
        log.warning("policy reloaded from %s", path or default_policy_path())
    except PolicyError as e:
        log.error("policy NOT reloaded, the running policy stays:\n%s", e)
    except Exception as e:  # e.g. a SIGHUP before the gateway has started: keep what runs
        log.error("policy NOT reloaded, the running policy stays: %s: %s", type(e).__name__, e)


DEFAULT_STATE_DIR = "/var/lib/airlock"


def cmd_gateway(args: argparse.Namespace) -> int:
    try:  # before the state directory exists; a name would be resolved differently by each listener
        ipaddress.ip_address(args.listen)
    except ValueError:
        raise UsageError(f"--listen {args.listen!r}: give the IP address to listen on (127.0.0.1, ::1, ...)") from None
    args.state_dir = args.state_dir or DEFAULT_STATE_DIR
    policy = _load(args.policy)
    return asyncio.run(_serve(args, policy))


# --- run ---------------------------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    if not args.cmd:
        raise UsageError("nothing to run: airlock run [options] -- CMD...")
    if os.geteuid() != 0:
        print(
            "airlock run: needs root to create a network namespace and its nftables fence; "
            "run it with sudo (the command itself runs as you, without privileges)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    policy = _load(args.policy)
    try:
        [parse_grant(g) for g in args.grant or []]
    except GrantError as e:
        raise UsageError(f"--grant: {e}") from None
    backend = _choose_backend(args)
    if backend == "netns":
        args.isolation = _choose_isolation(args.isolation)
        docker_only = [f"--{name}" for name in ("cpus", "memory", "pids", "mount") if getattr(args, name)]
        if docker_only:
            raise UsageError(f"{', '.join(docker_only)}: docker backend only (the netns backend sets no such limits)")
    detail = f", image {args.image}" if backend == "docker" else f", filesystem isolation {args.isolation}"
    print(f"airlock: backend {backend}{detail}", file=sys.stderr)
    if backend == "docker":
        return asyncio.run(_run_docker(args, policy))
    return asyncio.run(_run_sandboxed(args, policy))


def _choose_isolation(requested: str) -> str:
    """bwrap unless `none` is asked for; `none` keeps the host filesystem as the user sees it."""
    from airlock.sandbox.netns import bubblewrap_available

    if requested != "none" and not bubblewrap_available():
        # No quiet fallback: without bubblewrap the command sees the host as its user does.
        raise UsageError(
            "bubblewrap is not installed (apt-get install bubblewrap; scripts/setup does): the command would see "
            "the host's files as its user; install it, or say --isolation none to accept that"
        )
    return "bwrap" if requested == "auto" else requested


def _choose_backend(args: argparse.Namespace) -> str:
    """docker when asked (or when an image is named and an engine answers); netns otherwise."""
    if args.backend == "netns":
        if args.image:
            raise UsageError("--image needs --backend docker")
        return "netns"
    if args.backend == "docker" and not args.image:
        raise UsageError("--backend docker needs --image IMAGE")
    if args.image:
        return "docker"
    return "netns"


def _ports(args: argparse.Namespace) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The gateway's TCP and UDP ports the fence opens to the sandbox."""
    dns = (args.dns_port,) if args.dns_port else ()
    broker = (args.broker_port,) if args.broker_port else ()
    return (args.proxy_port, *dns, *broker), dns


async def _start_gateway(args: argparse.Namespace, policy: Policy, gateway_ip: str, sandbox_id: str, sandbox_ip: str):
    from airlock.gateway import Gateway

    profile = args.profile or policy.default_profile
    registry = [Sandbox(sandbox_id, profile, ipaddress.ip_network(f"{sandbox_ip}/32"))]
    config = _gateway_config(args, policy, gateway_ip, registry)
    gateway = Gateway(config)
    await gateway.start()
    return gateway


def _mint(args: argparse.Namespace, gateway, sandbox_id: str) -> str | None:
    if not args.grant or gateway.broker is None:
        return None
    token, _ = gateway.broker.mint(sandbox_id, [parse_grant(g) for g in args.grant], args.token_ttl)
    return token


async def _run_docker(args: argparse.Namespace, policy: Policy) -> int:
    import docker

    from airlock.sandbox.launch import launch

    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as e:
        raise UsageError(f"no docker engine answers ({e}); use --backend netns") from None
    limits = docker_limits(args)
    mounts = [_mount(m, _gateway_credentials(args)) for m in args.mount or []]
    state = tempfile.TemporaryDirectory(prefix="airlock-run-")
    args.state_dir = args.state_dir or state.name
    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, interrupted.set)
    watchdog = Watchdog.start(args.timeout, [state.name])  # removes the sandbox if this process dies
    try:
        handle = await launch(
            client, args.image, args.cmd, _gateway_config(args, policy, "0.0.0.0", []),
            profile=args.profile, sandbox_id=args.sandbox_id, limits=limits,
            mounts=mounts, env=_passed_env(args.env or []),
            grants=[parse_grant(g) for g in args.grant or []], token_ttl=args.token_ttl, watchdog=watchdog,
        )  # fmt: skip
        async with handle:
            output = asyncio.ensure_future(handle.stream(sys.stdout.buffer, sys.stderr.buffer))
            waiter = asyncio.ensure_future(handle.wait())
            stopper = asyncio.ensure_future(interrupted.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done():
                handle.kill()
            code = await waiter
            stopper.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(output, 10)  # the streams end when the container stops
            if code is None:
                print(f"airlock: killed after the {args.timeout:g}s timeout", file=sys.stderr)
                return 124
            if handle.oom_killed():
                print(f"airlock: killed at the {limits.memory} memory limit", file=sys.stderr)
            return code
    finally:
        state.cleanup()
        await asyncio.to_thread(watchdog.release)


def docker_limits(args: argparse.Namespace):
    """The container's limits: those given, the defaults for the rest."""
    from airlock.sandbox.docker import Limits

    given = {"cpus": args.cpus, "memory": args.memory, "pids": args.pids}
    chosen = {k: v for k, v in given.items() if v is not None}
    return Limits(**chosen, timeout=args.timeout, output_limit=args.output_limit)


def _mount(text: str, credentials: list[str]) -> tuple[str, str]:
    host, sep, target = text.partition(":")
    if not sep or not host.startswith("/") or not target.startswith("/"):
        raise UsageError(f"--mount {text!r}: expected /host/path:/container/path (always read-only)")
    source = Path(host).resolve()
    for credential in credentials:
        if Path(credential).resolve().is_relative_to(source):
            raise UsageError(f"--mount {text!r}: would show the container {credential}, a gateway credential")
    return host, target.removesuffix(":ro")


async def _run_sandboxed(args: argparse.Namespace, policy: Policy) -> int:
    from airlock.sandbox import proxy_environment
    from airlock.sandbox.netns import NetnsSandbox, resolve_user
    from airlock.sandbox.workdir import WorkdirError, WorkdirGuard

    user = resolve_user(args.user)  # fail before creating anything
    hidden, read_only = _hidden_paths(args, user), _kept_from_writes(args, user)
    tcp_ports, udp_ports = _ports(args)
    sandbox = NetnsSandbox(args.sandbox_id, tcp_ports=tcp_ports, udp_ports=udp_ports)
    state = tempfile.TemporaryDirectory(prefix="airlock-run-")
    gateway = None
    guard: WorkdirGuard | None = None
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, interrupted.set)
    # Removes the sandbox if this process dies (bubblewrap's --die-with-parent ends only the command, and
    # without bubblewrap nothing would); namespace, link and fence calls block: all of them off the event loop.
    watchdog = sandbox.watchdog = Watchdog.start(args.timeout, [state.name])
    try:
        await asyncio.to_thread(sandbox.create)
        args.state_dir = args.state_dir or state.name
        gateway = await _start_gateway(args, policy, sandbox.gateway_ip, sandbox.sandbox_id, sandbox.sandbox_ip)
        env = sandbox_environment(args.env or [], user)
        env |= proxy_environment(sandbox.gateway_ip, args.proxy_port, args.broker_port if args.grant else None)
        env["AIRLOCK_SANDBOX"] = sandbox.sandbox_id
        if token := _mint(args, gateway, sandbox.sandbox_id):
            env["AIRLOCK_TOKEN_FILE"] = str(sandbox.place_token(token, user))
        isolate_fs = args.isolation == "bwrap"
        if isolate_fs:
            guard = WorkdirGuard(Path.cwd(), user, sandbox.sandbox_id, Path(args.state_dir) / "workdir")
            try:
                await asyncio.to_thread(guard.prepare)
            except WorkdirError as e:
                guard = None
                raise UsageError(str(e)) from None
            watchdog.guard("workdir", sandbox.sandbox_id, str(guard.save()))  # checked even if we die
        command = sandbox.command(args.cmd, args.user, isolate_fs, hidden=hidden, read_only=read_only, guard=guard)
        return await _supervise(sandbox, command, env, args.timeout, interrupted)
    finally:
        await asyncio.to_thread(sandbox.destroy)  # before the gateway stops: nothing of it outlives its gateway
        if guard is not None:  # only now: nothing of the sandbox is left to write while the tree is checked
            await asyncio.to_thread(_finish_workdir, guard)
        if gateway is not None:
            await gateway.stop()
        state.cleanup()
        await asyncio.to_thread(watchdog.release)


async def _supervise(
    sandbox: NetnsSandbox, command: list[str], env: dict[str, str], timeout: float, interrupted: asyncio.Event
) -> int:
    """Run the command until it exits (its code), the timeout passes (124) or a signal asks to stop."""
    # Its own session: no controlling terminal, so it cannot push keystrokes into the shell that started it.
    child = await asyncio.create_subprocess_exec(*command, env=env, start_new_session=True)
    waiter = asyncio.create_task(child.wait())
    stopper = asyncio.create_task(interrupted.wait())
    try:
        await asyncio.wait({waiter, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done() and not stopper.done():
            await asyncio.to_thread(sandbox.kill_all)  # the whole namespace, not only the command's own process
            await waiter
            print(f"airlock: killed after the {timeout:g}s timeout", file=sys.stderr)
            return 124
        if not waiter.done():
            with contextlib.suppress(ProcessLookupError):
                child.terminate()
            try:
                await asyncio.wait_for(waiter, 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                await waiter
        code = child.returncode if child.returncode is not None else 1
        return code if code >= 0 else 128 - code
    finally:
        stopper.cancel()


def _finish_workdir(guard) -> None:
    try:
        lines = guard.finish()
    except Exception as e:  # whatever went wrong, the user must hear that the folder was not checked
        lines = [f"could not check the working directory for files the sandbox planted ({e}): do not run git there"]
    for line in lines:
        print(f"airlock: {line}", file=sys.stderr)


def _gateway_credentials(args: argparse.Namespace) -> list[str]:
    """What the gateway holds that the sandbox must never read: the GitHub key or token file, and a state
    directory named with --state-dir (signing keys, broker store, admin socket). A temporary one is 0700 root."""
    return [p for p in (args.github_app_key, args.github_token_file, args.state_dir) if p]


def _hidden_paths(args: argparse.Namespace, user) -> list[Path]:
    """The paths bubblewrap hides from the command: the gateway's credentials, the usual ones in the user's home,
    and host services that would run commands outside the sandbox. Without bubblewrap nothing can be hidden:
    refuse to start while the command's user could read or change a gateway credential, or has a session whose
    services (systemd --user, rootless docker, dbus) it could ask to run something on the host's network."""
    from airlock.sandbox.netns import accessible_by, credential_paths, host_service_paths, user_session

    if args.isolation == "bwrap":
        return credential_paths(user, _gateway_credentials(args)) + host_service_paths()
    for path in credential_paths(user, _gateway_credentials(args)):
        if exposed := accessible_by(path, user):
            raise UsageError(
                f"{exposed[0]} is readable or writable by {user.pw_name}, who runs the sandboxed command, and "
                "--isolation none cannot hide it: make it root's alone (chown root; chmod 600), or use bubblewrap"
            )
    if session := user_session(user):
        raise UsageError(
            f"{user.pw_name} has a session ({session}) whose services could start processes outside the sandbox's "
            "network, and --isolation none cannot hide it: use bubblewrap, or --user an account without a session"
        )
    return []


def _kept_from_writes(args: argparse.Namespace, user) -> list[Path]:
    """What the command must not change although it may be in reach: the gateway's inputs (policy, CA, audit log)
    and airlock's own code, which root runs next time. bubblewrap binds these read-only (returned); without it,
    refuse to start. A working directory whose files run outside the sandbox is refused either way."""
    from airlock.sandbox.netns import workdir_problem, writable_in_sandbox

    isolate_fs = args.isolation == "bwrap"
    if isolate_fs and (problem := workdir_problem(Path.cwd(), user)):
        raise UsageError(f"the working directory {Path.cwd()} would be writable in the sandbox, but {problem}")
    inputs = [args.policy or default_policy_path(), args.upstream_ca, args.audit]
    paths = [Path(p) for p in inputs if p] + _airlock_code()
    exposed = [p for p in paths if writable_in_sandbox(p, user, isolate_fs)]
    if exposed and not isolate_fs:
        raise UsageError(
            f"{exposed[0]} could be changed by {user.pw_name}, who runs the sandboxed command, and --isolation none "
            "cannot protect it: make it (and its folder) root's, or use bubblewrap"
        )
    return exposed


def _airlock_code() -> list[Path]:
    """Where this airlock and its Python environment live (an editable install's source folders included)."""
    import airlock.broker
    import airlock.dns
    import airlock.policy
    import airlock.proxy

    packages = (airlock, airlock.broker, airlock.dns, airlock.policy, airlock.proxy)
    return [Path(sys.prefix)] + [Path(module.__file__).parent for module in packages if module.__file__]


def sandbox_environment(passed: list[str], user) -> dict[str, str]:
    """A clean environment: nothing of the host's leaks in (tokens live in environments) but what is named."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": user.pw_dir if os.path.isdir(user.pw_dir) else "/tmp",
        "USER": user.pw_name,
        "LOGNAME": user.pw_name,
        "LANG": os.environ.get("LANG", "C.UTF-8"),
    }
    if "TERM" in os.environ:
        env["TERM"] = os.environ["TERM"]
    return env | _passed_env(passed)


def _passed_env(passed: list[str]) -> dict[str, str]:
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


def cmd_reap(args: argparse.Namespace) -> int:
    """Remove sandboxes whose lifetime has passed (docker labels) and leftovers of crashed runs."""
    import docker

    from airlock.sandbox.docker import reap
    from airlock.sandbox.netns import reap_netns

    removed: list[str] = []
    try:
        client = docker.from_env()
        client.ping()
        removed += [f"docker {s}" for s in reap(client, args.older_than)]
    except docker.errors.DockerException:
        print("airlock reap: no docker engine answers; docker sandboxes not checked", file=sys.stderr)
    if args.older_than is not None:
        removed += [f"netns {s}" for s in reap_netns(args.older_than)]
    for item in removed:
        print(f"removed {item}")
    return 0


# --- tokens (through the running gateway's admin listener) -----------------------------------------------------


async def _admin_call(args: argparse.Namespace, path: str, payload: dict) -> dict:
    import aiohttp

    address = args.admin or f"{args.state_dir or DEFAULT_STATE_DIR}/admin.sock"
    if address.startswith("/"):
        connector, base = aiohttp.UnixConnector(path=address), "http://airlock-admin"
    else:
        connector, base = aiohttp.TCPConnector(), f"http://{address}"
    try:
        timeout = aiohttp.ClientTimeout(total=10)
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            session.post(base + path, json=payload) as reply,
        ):
            body = await reply.json(content_type=None)
            if reply.status != 200:
                raise UsageError(f"broker refused: {body.get('message', reply.status)}")
            return body
    except (aiohttp.ClientError, OSError) as e:
        raise UsageError(f"cannot reach the broker's admin listener at {address}: {e}") from None


def cmd_token_issue(args: argparse.Namespace) -> int:
    try:
        grants = [parse_grant(g).to_claim() for g in args.grant]
    except GrantError as e:
        raise UsageError(f"--grant: {e}") from None
    body = asyncio.run(_admin_call(args, "/v1/tokens", {"sandbox": args.sandbox, "grants": grants, "ttl": args.ttl}))
    print(body["token"])
    print(f"jti {body['jti']}, sandbox {body['sandbox']}, expires at {body['expires_at']}", file=sys.stderr)
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    payload = {"jti": args.jti} if args.jti else {"sandbox": args.sandbox}
    body = asyncio.run(_admin_call(args, "/v1/revocations", payload))
    print(f"revoked {body['revoked']}")
    return 0


# --- argument parsing --------------------------------------------------------------------------------------------


def _gateway_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", metavar="FILE", help="policy file (default: the packaged configs/default.yaml)")
    parser.add_argument("--profile", metavar="P", help="profile for sandboxes that do not name one")
    parser.add_argument("--proxy-port", type=int, default=3128, metavar="PORT")
    parser.add_argument("--upstream-dns", action="append", metavar="IP[:PORT]", help="repeatable")
    parser.add_argument("--upstream-ca", metavar="FILE", help="CA bundle for upstream TLS the gateway verifies")
    parser.add_argument("--audit", metavar="FILE", help="append one JSON line per decision to FILE")
    parser.add_argument("--connect-timeout", type=float, default=10.0, metavar="S")
    parser.add_argument("--idle-timeout", type=float, default=300.0, metavar="S")
    parser.add_argument(
        "--max-tunnels", type=int, metavar="N", help="open tunnels per sandbox (default: 7/8 of --max-connections)"
    )
    parser.add_argument(
        "--max-connections", type=int, metavar="N",
        help="open proxy connections per sandbox (default: 4096, or what the open-file limit allows)",
    )  # fmt: skip
    parser.add_argument("--dns-port", type=int, default=53, metavar="PORT", help="sandbox DNS; 0 turns it off")
    parser.add_argument("--dns-rate", type=float, default=100.0, metavar="QPS", help="DNS queries/s per sandbox")
    parser.add_argument("--state-dir", metavar="DIR", help="keys, broker state, admin socket")
    parser.add_argument("--broker-port", type=int, default=8080, metavar="PORT", help="0 turns the broker off")
    parser.add_argument("--broker-admin", metavar="SOCKET|127.0.0.1:PORT", help="default: STATE_DIR/admin.sock")
    parser.add_argument(
        "--broker-max-connections", type=int, default=32, metavar="N", help="open broker connections per address"
    )
    parser.add_argument("--github-api", default="https://api.github.com", metavar="URL")
    parser.add_argument("--github-app-id", metavar="ID")
    parser.add_argument("--github-app-key", metavar="PEM", help="the GitHub App's private key file")
    parser.add_argument("--github-installation-id", type=int, metavar="ID", help="default: looked up per repo")
    parser.add_argument("--github-token-file", metavar="FILE", help="static-token mode (GitHub Enterprise)")
    parser.add_argument("--github-token-env", metavar="VAR", help="static-token mode, from an environment variable")
    parser.add_argument("--github-timeout", type=float, default=10.0, metavar="S")
    parser.add_argument("--token-ttl", type=_duration, default=900, metavar="DURATION", help="e.g. 15m")
    parser.add_argument("--token-max-ttl", type=_duration, default=3600, metavar="DURATION")
    parser.add_argument("--dns-min-ttl", type=int, default=5, metavar="S", help="shortest time an answer is cached")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="airlock", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    commands = parser.add_subparsers(dest="command", required=True)

    policy = commands.add_parser("policy", help="check or explain a policy").add_subparsers(
        dest="action", required=True
    )
    check = policy.add_parser("check", help="validate policy files: exit 0 all valid, 2 with FILE:LINE errors")
    check.add_argument("file", nargs="+")
    check.set_defaults(func=cmd_policy_check)
    explain = policy.add_parser("explain", help="decide one target: exit 0 allow, 1 deny, 2 error")
    explain.add_argument("--policy", metavar="FILE")
    explain.add_argument("--profile", metavar="P")
    explain.add_argument("--resolve", action="append", metavar="HOST=IP[,IP...]", help="repeatable")
    explain.add_argument("target", help="URL or host:port")
    explain.set_defaults(func=cmd_policy_explain)

    gateway = commands.add_parser("gateway", help="run the gateway in the foreground")
    _gateway_options(gateway)
    gateway.add_argument("--listen", required=True, metavar="ADDR")
    gateway.add_argument("--sandbox", action="append", metavar="ID=CIDR[:PROFILE]", help="repeatable")
    gateway.add_argument("--audit-stdout", action="store_true")
    gateway.set_defaults(func=cmd_gateway)

    token_parser = commands.add_parser("token", help="mint or revoke broker tokens (gateway admin listener)")
    token = token_parser.add_subparsers(dest="action", required=True)
    issue = token.add_parser("issue", help="print a new sandbox token")
    issue.add_argument("--sandbox", required=True)
    issue.add_argument("--grant", action="append", required=True, metavar="TOOL:OWNER/REPO[:base=B,head=P]")
    issue.add_argument("--ttl", type=_duration, default=None, metavar="DURATION")
    revoke = token.add_parser("revoke", help="revoke one token or every token of a sandbox")
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--jti")
    which.add_argument("--sandbox")
    for sub in (issue, revoke):
        sub.add_argument("--admin", metavar="SOCKET|127.0.0.1:PORT")
        sub.add_argument("--state-dir", metavar="DIR", help=f"the gateway's state directory ({DEFAULT_STATE_DIR})")
    issue.set_defaults(func=cmd_token_issue)
    revoke.set_defaults(func=cmd_token_revoke)

    reap = commands.add_parser("reap", help="remove expired sandboxes and leftovers of crashed runs")
    reap.add_argument("--older-than", type=_duration, metavar="DURATION", help="also anything older than this")
    reap.set_defaults(func=cmd_reap)

    run = commands.add_parser("run", help="run a command in a sandbox whose only network is the gateway")
    _gateway_options(run)
    run.add_argument("--backend", choices=("auto", "netns", "docker"), default="auto", help="auto: docker if --image")
    run.add_argument("--image", help="docker backend: the image to run")
    run.add_argument("--cpus", type=float, help="docker backend: CPU limit (default 1)")
    run.add_argument("--memory", help="docker backend: memory limit, memory+swap alike (default 512m)")
    run.add_argument("--pids", type=int, help="docker backend: process limit (default 256)")
    run.add_argument("--timeout", type=float, default=3600.0, metavar="S", help="then kill it all (exit 124)")
    run.add_argument("--output-limit", type=int, default=10 * 1024 * 1024, metavar="BYTES")
    run.add_argument("--mount", action="append", metavar="HOST:CONTAINER", help="docker backend: read-only mount")
    run.add_argument("--user", help="run the command as this user (default: the sudo caller, else nobody)")
    run.add_argument(
        "--isolation", choices=("auto", "bwrap", "none"), default="auto",
        help="netns backend: read-only host, private /tmp and PIDs via bubblewrap (auto: when installed)",
    )  # fmt: skip
    run.add_argument("--env", action="append", metavar="NAME[=VALUE]", help="pass a variable in (repeatable)")
    run.add_argument(
        "--grant", action="append", metavar="TOOL:OWNER/REPO[:base=B|B2,head=PATTERN]",
        help="mint a broker token with this grant for the sandbox (repeatable)",
    )  # fmt: skip
    run.add_argument("--sandbox-id", metavar="ID", help="name of the sandbox (default: random); [a-z0-9], 1-12 chars")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")
    run.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "cmd", None) and args.cmd[0] == "--":
        args.cmd = args.cmd[1:]
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        check_limits(args)
        return args.func(args)
    except PolicyError as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE
    except UsageError as e:
        print(f"airlock: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # the gateway's and sandbox's own errors: one clear line, no traceback
        from airlock.gateway import GatewayError
        from airlock.sandbox.docker import DockerSandboxError
        from airlock.sandbox.fence import FenceError
        from airlock.sandbox.netns import SandboxError

        if isinstance(e, GatewayError | SandboxError | FenceError | DockerSandboxError | WatchdogError):
            print(f"airlock: {e}", file=sys.stderr)
            return EXIT_USAGE
        raise


if __name__ == "__main__":
    sys.exit(main())
