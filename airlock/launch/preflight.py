"""What a netns launch works out before anything of the sandbox exists, each refusal a SandboxError: the isolation
(bubblewrap or none), the gateway's inputs and whether the command could change one, what bubblewrap hides (the
other running sandboxes' folders among it: `airlock.launch.tenants`) and binds read-only, the command found on the
sandbox's PATH, the `--cache` folder, and the command's clean environment."""

from __future__ import annotations

import os
import pwd
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from airlock.gateway.config import GatewayConfig, admin_endpoint
from airlock.inspection.trust import SYSTEM_BUNDLE
from airlock.sandbox import cgroups, host_paths, netns
from airlock.sandbox.errors import SandboxError
from airlock.sandbox.limits import TIMEOUT, Resources, limit_problem
from airlock.sandbox.reach import Reach, policy_files

from .embedded_gateway import gateway_credentials, prepare_call_log
from .tenants import other_sandboxes_folders

ISOLATIONS = ("auto", "bwrap", "none")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
NPM_RUN_CACHE = "/tmp/.npm"  # in the sandbox's private /tmp: its home is read-only, and npm needs a cache it writes


@dataclass(frozen=True)
class NetnsPlan:
    """What a netns launch settled before anything of its sandbox exists (`plan_launch`)."""

    user: pwd.struct_passwd  # who runs the command
    isolate_fs: bool  # bubblewrap
    env: dict[str, str]  # the caller's variables over the sandbox's PATH
    hidden: list[Path]
    read_only: list[Path]
    writable: Path | None  # `--cache`, resolved
    reach: Reach  # what the command may change on the host
    resources: Resources
    controllers: dict[str, tuple[Path, int]]  # this host's cgroup parents (`cgroups.host_parents`)


def plan_launch(
    command: Sequence[str],
    gateway: GatewayConfig,
    user: str | None,
    isolation: str,
    env: dict[str, str] | None,
    timeout: float,
    resources: Resources | None,
    cache: str | None,
    report: Callable[[str], None],
) -> NetnsPlan:
    """Everything `launch()` can refuse is refused here, before anything is created (SandboxError, CgroupError);
    what the user must know (default limits this host cannot enforce, a working directory the command cannot
    write) goes to `report`."""
    if problem := limit_problem("timeout", timeout, TIMEOUT, lowest_included=False):
        raise SandboxError(problem)
    isolate_fs = choose_isolation(isolation) == "bwrap"
    pw = netns.resolve_user(user)
    env = {"PATH": SANDBOX_PATH} | (env or {})
    if problem := command_problem(command[0] if command else "", env["PATH"]):
        raise SandboxError(problem)
    prepare_call_log(gateway)
    hidden = hidden_paths(isolate_fs, pw, gateway_credentials(gateway))
    read_only = read_only_binds(isolate_fs, pw)
    protected = [*(Path(path) for _, path in gateway_inputs(gateway)), *map(Path, gateway_credentials(gateway))]
    writable = writable_cache(Path(cache), pw, protected) if cache else None
    # Without bubblewrap nothing can be hidden: the command sees the host as its user does (docs/security-model.md).
    others, shared = other_sandboxes_folders(own_folders(writable)) if isolate_fs else ([], [])
    hidden += others
    reach = sandbox_reach(isolate_fs, pw, [*hidden, *read_only], [writable] if writable else [])
    resources = resources or Resources()
    controllers = cgroups.host_parents()
    notes = cgroups.check(resources, controllers) + shared
    if note := unwritable_workdir(pw, named=user is not None):
        notes.append(note)
    for note in notes:
        report(note)
    return NetnsPlan(pw, isolate_fs, env, hidden, read_only, writable, reach, resources, controllers)


def own_folders(writable: Path | None) -> list[Path]:
    """The folders the sandbox writes, resolved: its working directory and its `--cache`."""
    return [Path.cwd().resolve(), *([writable] if writable else [])]


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
    the host's own credentials every user may read (a pod's service-account token), and host services that would
    run commands outside the sandbox. Without bubblewrap nothing can be hidden:
    refuse to start while the command's user could read or change a gateway credential, or has a session whose
    services (systemd --user, rootless docker, dbus) it could ask to run something on the host's network."""
    if isolate_fs:
        return [
            *host_paths.credential_paths(user, credentials), *host_paths.host_secret_paths(),
            *host_paths.host_service_paths(),
        ]  # fmt: skip
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


def read_only_binds(isolate_fs: bool, user: pwd.struct_passwd) -> list[Path]:
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
