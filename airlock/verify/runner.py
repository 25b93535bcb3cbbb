"""One `airlock verify` run: its own fake internet, one real sandbox through `airlock run` with the user's policy
and options running every probe, the evidence gathered outside it, the verdicts.

The fake internet is private network namespaces of a per-run prefix (`airlock.verify.topology`), never linked to
the host's interfaces; `airlock run` runs inside its gateway namespace (where everything it dials lands in the
fake internet or nowhere), with the host's cgroups mounted there as a host run sees them. The docker backend's
sandbox is a container of a docker daemon the run starts in that namespace (`airlock.verify.dockerd`). The gateway
resolves through the fake DNS upstream and trusts only the fake internet's CA. Everything made here is removed at
the end, and only the processes started here are stopped.

One module past 500 lines on purpose: a run is one sequence of nested context managers (the world, the other
sandbox, the main run, the broker's runs, the docker daemon), and its teardown is that nesting read backwards;
split, the order in which things are made and removed would stand in several files."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker.errors

from airlock.errors import AirlockError
from airlock.policy import SANDBOX_LINK_NETWORKS
from airlock.runs import Running, RunsError, running, runs_dir
from airlock.sandbox import cgroups
from airlock.sandbox.docker import LABEL, bridge_name, fence_table, sandbox_token_dir
from airlock.sandbox.docker import Limits as DockerLimits
from airlock.sandbox.fence import NETNS_TABLE_PREFIX
from airlock.sandbox.netns import resolve_user
from airlock.sandbox.seccomp import syscall_number

from . import probe
from .brokerruns import broker_runs
from .checks import (
    BOMB_MARGIN,
    BURN_SECONDS,
    GATEWAY_CANARY_PORTS,
    HOG_MARGIN,
    MARKED_PROGRAMS,
    OTHER_CANARY,
    OTHER_STARTED,
    PLACEHOLDER_VAR,
    PROBE_ARGV,
    PROBE_MARK,
    REBIND_WAIT,
    TIMEOUT_GIVEN,
    TIMEOUT_GRACE,
    TMP_FILL,
    USER_PLACEHOLDER_VAR,
    USER_SECRET,
    BrokerRecord,
    Check,
    CheckVerdict,
    Evidence,
    Limits,
    NotJudged,
    OtherSandbox,
    Sandboxed,
    TimedRun,
    error,
    judge,
)
from .control import stop_proc
from .dockerd import DockerDaemon
from .fakeca import FakeCA, make_fake_ca
from .hostcanaries import host_canaries
from .hostcgroups import with_host_cgroups
from .processes import Process, raw_sockets, read_process, sandbox_processes, sockets_in_view, user_keys
from .targets import SECRET_NAME, UNLISTED, BrokerTarget, Targets
from .topology import DNS_SERVER, GW_OUTSIDE_IP, Canaries, FakeNet, Topology, new_prefix
from .usage import Usage, cgroup_counters, group_counters, sandbox_tmp

SLEEP = shutil.which("sleep") or "/bin/sleep"
OTHER_RELEASE = "release"  # the host's word to the tenancy check's second sandbox to end
OTHER_START_TIMEOUT, OTHER_HOLD = 30.0, 150  # seconds it may take to start; at most it waits
# The second sandbox's command: waits in its working directory until the host releases it (or OTHER_HOLD pass).
OTHER_HOLDER = (
    "import os, time\nopen('started', 'w').close()\nend = time.monotonic() + {hold}\n"
    "while time.monotonic() < end and not os.path.exists('release'):\n    time.sleep(0.1)"
)
RUN_TIMEOUT = 60  # seconds the sandbox may take (`airlock run --timeout`): the probe needs a few
HOST_CANARY_VAR = "AIRLOCK_VERIFY_HOST_CANARY"
SYSCALLS = ("ptrace", "io_uring_setup", "bpf", "userfaultfd", "perf_event_open", "add_key", "keyctl")
DOCKER_SOCKETS = ("/var/run/docker.sock", "/run/docker.sock")  # where the probe tries the docker engine's API
COPY_LIMIT = 64 << 20  # bytes of the docker probe's folder copied out (its dumps hold up to 1 MiB per file read)


class VerifyError(AirlockError):
    """The fake internet or the sandbox could not be set up: nothing could be judged."""


@dataclass(frozen=True)
class Area:
    """The run's folders on the host: `private` root's alone (the CA, the secret, the launcher's temporary state
    directory), `work` the sandbox's working directory, `outside` a folder its user could write on the host."""

    base: Path
    private: Path
    work: Path
    outside: Path
    tmp: Path  # TMPDIR of `airlock run`: where its temporary state directory is made
    programs: Path  # copies of sleep marked setuid-root and with file capabilities (the setuid check runs them)

    @classmethod
    @contextlib.contextmanager
    def made(cls) -> Iterator[Area]:
        base = Path(tempfile.mkdtemp(prefix="airlock-verify-", dir="/var/tmp"))
        try:
            base.chmod(0o755)
            area = cls(base, base / "private", base / "work", base / "outside", base / "private" / "tmp", base / "bin")
            area.private.mkdir(mode=0o700)
            area.tmp.mkdir(mode=0o700)
            area.work.mkdir(mode=0o755)
            pw = resolve_user(None)  # whom `airlock run` runs the command as: the sudo caller, else nobody
            os.chown(area.work, pw.pw_uid, pw.pw_gid)
            area.outside.mkdir()
            area.outside.chmod(0o1777)  # only the sandbox's isolation keeps its user from writing here
            _marked_programs(area.programs)
            yield area
        finally:
            shutil.rmtree(base, ignore_errors=True)


def _marked_programs(folder: Path) -> None:
    """sleep, setuid root; and sleep with file capabilities (CAP_SETUID, CAP_NET_RAW, CAP_SYS_ADMIN permitted and
    effective) where the filesystem keeps them. Harmless programs whatever they run with: the check is whether the
    sandbox's processes get what the marks promise."""
    folder.mkdir(mode=0o755)
    setuid = folder / MARKED_PROGRAMS[0]
    shutil.copy(SLEEP, setuid)
    setuid.chmod(0o4755)
    marked = folder / MARKED_PROGRAMS[1]
    shutil.copy(SLEEP, marked)
    capabilities = (1 << 7) | (1 << 13) | (1 << 21)
    with contextlib.suppress(OSError):  # a filesystem without extended attributes: the setuid copy alone
        os.setxattr(marked, "security.capability", struct.pack("<IIIII", 0x02000001, capabilities, 0, 0, 0))
        return
    marked.unlink()


@dataclass(frozen=True)
class Request:
    """What to verify: the policy file, the targets its profile gives the fake internet, the options passed to
    `airlock run` as given (profile, isolation, limits, grants), the checks; with `image_tarball` (a rootfs
    tarball imported into a daemon of the run's own) the docker backend, else the netns one."""

    policy_path: str
    targets: Targets
    run_options: list[str]
    checks: tuple[Check, ...]
    limits: Limits
    image_tarball: Path | None = None
    user_secret: bytes | None = field(default=None, repr=False)  # the value of `targets.secret` when it is the user's

    @property
    def backend(self) -> str:
        return "netns" if self.image_tarball is None else "docker"

    def attempts(self) -> list[str]:
        """The probe's attempts the checks that apply to this run judge, each once."""
        return list(dict.fromkeys(
            c.attempt for c in self.checks
            if c.attempt and c.not_applicable(self.targets, self.limits, self.backend) is None
        ))  # fmt: skip


def verify(request: Request) -> list[CheckVerdict]:
    nonce = secrets.token_hex(6)
    with _sigterm_as_interrupt(), Area.made() as area:
        ca = make_fake_ca(area.private / "ca", request.targets.names())
        topology = Topology(new_prefix(), sandbox=False)
        try:
            _build(topology)
            net = FakeNet(ca.leaf_cert, ca.leaf_key, zone=request.targets.zone())
            canaries = Canaries(ca.leaf_cert, ca.leaf_key, GATEWAY_CANARY_PORTS)
            try:
                _start(net, canaries, topology, area)
                if request.image_tarball is not None:
                    with _docker_daemon(topology, area, request.image_tarball) as (daemon, image):
                        return _verify_docker(topology, net, canaries, ca, area, request, nonce, daemon, image)
                return _verify_in(topology, net, canaries, ca, area, request, nonce)
            finally:
                net.stop()
                canaries.stop()
        finally:
            topology.destroy()
            _host_tmp(nonce).unlink(missing_ok=True)  # what a weakened run wrote there
            (Path("/tmp") / probe.FILL.format(nonce=nonce)).unlink(missing_ok=True)


def _host_tmp(nonce: str) -> Path:
    """Where the probe's write to its /tmp lands on the host's /tmp if the sandbox's /tmp is not its own."""
    return Path("/tmp") / f"airlock-verify-{nonce}"


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a CI job's timeout, `kill`) as ^C: the fake internet and the run's folders are removed either way."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _start(net: FakeNet, canaries: Canaries, topology: Topology, area: Area) -> None:
    """The fake internet's servers, and canaries on other ports of the gateway's namespace (where a program of
    the host beside the gateway would listen)."""
    try:
        net.start(topology, area.private / "fakenet")
        canaries.start_in(topology, topology.gw, area.private / "canaries")
    except RuntimeError as e:
        raise VerifyError(f"the fake internet's servers could not start: {e}") from None


def _build(topology: Topology) -> None:
    try:
        topology.create_sealed()
    except (RuntimeError, AssertionError, OSError) as e:
        raise VerifyError(f"the fake internet could not be built: {e}") from None
    _count_packets(topology)


def _verify_in(
    topology: Topology, net: FakeNet, canaries: Canaries, ca: FakeCA, area: Area, request: Request, nonce: str
) -> list[CheckVerdict]:
    with _other_sandbox(topology, request, ca, area) as (other, finish_other):
        return _verify_beside(topology, net, canaries, ca, area, request, nonce, other, finish_other)


def _verify_beside(
    topology: Topology,
    net: FakeNet,
    canaries: Canaries,
    ca: FakeCA,
    area: Area,
    request: Request,
    nonce: str,
    other: OtherSandbox | None,
    finish_other: Callable[[], OtherSandbox | None],
) -> list[CheckVerdict]:
    """The netns run, beside the tenancy group's second sandbox when it runs (`other`)."""
    sandbox_id = f"{topology.prefix}v"
    secret_file, secret_value, host_canary = _secret(area)
    config = _probe_config(request, area, nonce, secret_file) | (other.config() if other else {})
    where = ["--workdir", str(area.work)]
    argv = [
        *_run_argv(request, ca, where, sandbox_id, RUN_TIMEOUT), "--secret", f"{SECRET_NAME}=file:{secret_file}",
        "--placeholder-env", f"{PLACEHOLDER_VAR}={SECRET_NAME}", *_user_placeholder(request),
        "--audit", str(area.private / "audit.jsonl"),
        "--", *PROBE_ARGV, Path(probe.__file__).read_text(), json.dumps(config), PROBE_MARK,
    ]  # fmt: skip
    env = os.environ | {HOST_CANARY_VAR: host_canary, "TMPDIR": str(area.tmp)}
    with host_canaries() as on_host:
        watched = _run_watched(topology, with_host_cgroups(argv), env, area, sandbox_id, probe.FILL.format(nonce=nonce))
        socket_connections = on_host.connections
    found_other = finish_other()
    timed = _netns_timed_run(topology, request, ca, area, nonce) if _timed(request) else None
    broker = _broker_runs(topology, request, ca, area, nonce)
    evidence = Evidence(
        nonce, request.targets, _probe_record(area), net.stats(), _packets(topology), area.work, area.outside,
        _host_tmp(nonce),
        _secrets(ca, secret_value, host_canary, on_host.token, request.user_secret),
        _every_leftover(topology, area, [sandbox_id, *([broker.first, broker.foreign] if broker else []),
                                         *([other.sandbox_id] if other else [])]),
        watched.sandboxed, canaries.stats(), request.limits, watched.usage,
        timed, socket_connections, broker, audit=_audit(area.private / "audit.jsonl"), other=found_other,
    )  # fmt: skip
    if not evidence.probe:
        why = (watched.stderr.strip().splitlines() or [f"exit {watched.returncode}"])[-1]
        return [judge(c, evidence) if c.attempt is None else error(c, f"the sandbox ran no probe: {why}")
                for c in request.checks]  # fmt: skip
    return [judge(check, evidence) for check in request.checks]


@contextlib.contextmanager
def _docker_daemon(topology: Topology, area: Area, tarball: Path) -> Iterator[tuple[DockerDaemon, str]]:
    """A docker daemon of the run's own in the gateway's namespace (its bridges, and so its containers, reach the
    fake internet alone), with the image imported from `tarball`; stopped with all it made at the end."""
    daemon = DockerDaemon(topology, area.private / "docker", name=f"{topology.prefix}-docker")
    try:
        try:
            daemon.start()
        except (RuntimeError, OSError) as e:
            raise VerifyError(f"the run's docker daemon could not start: {e}") from None
        try:
            image = daemon.import_image(tarball)
        except docker.errors.DockerException as e:
            raise VerifyError(f"{tarball} could not be imported as the sandbox's image: {e}") from None
        yield daemon, image
    finally:
        daemon.stop()


def _verify_docker(
    topology: Topology,
    net: FakeNet,
    canaries: Canaries,
    ca: FakeCA,
    area: Area,
    request: Request,
    nonce: str,
    daemon: DockerDaemon,
    image: str,
) -> list[CheckVerdict]:
    """The docker backend's run: the probe in a container of `image`; what it left in its working directory (the
    container's own /tmp) copied out by the host; judged by that, the fake internet's records, the host's folders
    and, for what is left, the daemon and the gateway's namespace."""
    sandbox_id = f"{topology.prefix}v"
    secret_file, secret_value, host_canary = _secret(area)
    # /run/airlock holds the container's own broker token when --grant is given: the sandbox's to read.
    config = _probe_config(request, area, nonce, secret_file) | {"hold": True}
    config["gateway_paths"] = [path for path in config["gateway_paths"] if path != "/run/airlock"]
    argv = [
        *_run_argv(request, ca, ["--backend", "docker", "--image", image], sandbox_id, RUN_TIMEOUT),
        "--secret", f"{SECRET_NAME}=file:{secret_file}", "--placeholder-env", f"{PLACEHOLDER_VAR}={SECRET_NAME}",
        "--", *PROBE_ARGV, Path(probe.__file__).read_text(), json.dumps(config), PROBE_MARK,
    ]  # fmt: skip
    env = os.environ | daemon.env() | {HOST_CANARY_VAR: host_canary, "TMPDIR": str(area.tmp)}
    with host_canaries() as on_host:
        watched = _docker_watched(topology, argv, env, area, daemon, probe.FILL.format(nonce=nonce))
        socket_connections = on_host.connections
    timed = _docker_timed_run(topology, request, ca, area, nonce, daemon, image) if _timed(request) else None
    evidence = Evidence(
        nonce, request.targets, _probe_record(area), net.stats(), _packets(topology), area.work, area.outside,
        _host_tmp(nonce), _secrets(ca, secret_value, host_canary, on_host.token),
        _docker_leftovers(topology, area, daemon, sandbox_id), watched.sandboxed, canaries.stats(), request.limits,
        watched.usage, timed, socket_connections, backend="docker",
    )  # fmt: skip
    if not evidence.probe:
        why = (watched.stderr.strip().splitlines() or [f"exit {watched.returncode}"])[-1]
        return [judge(c, evidence) if c.attempt is None else error(c, f"the sandbox ran no probe: {why}")
                for c in request.checks]  # fmt: skip
    return [judge(check, evidence) for check in request.checks]


def _docker_watched(
    topology: Topology, argv: list[str], env: dict[str, str], area: Area, daemon: DockerDaemon, fill: str
) -> Watched:
    """`airlock run --backend docker` to its end; once the probe is ready, what it left in its working directory
    copied into the run's `work` folder, the container's processes and cgroup counters and its /tmp as the host
    sees them (and the keys the kernel counts for its user), then the probe released."""
    seen, usage, uid = Sandboxed([], 0), Usage(), int(DockerLimits().user.split(":")[0])
    keys_before = user_keys(uid)
    with (area.private / "run.err").open("w+") as stderr:
        proc = topology.popen(topology.gw, argv, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + RUN_TIMEOUT + 60
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(NotJudged):  # no probe yet
                pid = Sandboxed(_container_processes(daemon), 0).probe().pid
                if _copied_out(pid, area.work / probe.OUT.name):
                    found, keys_held = _container_processes(daemon), user_keys(uid)
                    keys = None if keys_before is None or keys_held is None else (keys_before, keys_held)
                    seen = Sandboxed(found, raw_sockets(pid), keys, sockets_in_view(pid, DOCKER_SOCKETS))
                    usage = Usage(_container_counters(daemon), *sandbox_tmp(pid, fill))
                    _release(pid)
                    break
            time.sleep(0.05)
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_proc(proc)
            raise VerifyError(f"the sandbox did not end within {RUN_TIMEOUT + 60} seconds") from None
        stderr.seek(0)
        return Watched(seen, usage, proc.returncode, stderr.read())


def _container_counters(daemon: DockerDaemon) -> dict[str, int]:
    """Each counter of the container's groups (under the daemon's cgroup parent, in each hierarchy) the host keeps."""
    found: dict[str, int] = {}
    for hierarchy in cgroups.hierarchies(Path("/proc/self/mountinfo").read_text()):
        parent = hierarchy.mount / daemon.name
        groups = [group for group in parent.iterdir() if group.is_dir()] if parent.is_dir() else []
        for controller in hierarchy.controllers & set(cgroups.CONTROLLER.values()):
            for group in groups:
                found |= group_counters(group, hierarchy.version, controller)
    return found


def _container_processes(daemon: DockerDaemon) -> list[Process]:
    """Every process under the daemon's cgroup parent (it runs the one container), read from /proc."""
    pids = {int(word) for cg in daemon.cgroup_dirs() for procs in cg.rglob("cgroup.procs") for word in _words(procs)}
    return [process for pid in sorted(pids) if (process := read_process(pid)) is not None]


@contextlib.contextmanager
def _probe_folder(pid: int) -> Iterator[int | None]:
    """The probe's folder in its working directory, as a descriptor (None: not there), reached through its
    /proc/PID/cwd and never through a link of the container's (a hostile one could point anywhere on the host)."""
    try:
        cwd = os.open(f"/proc/{pid}/cwd", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield None
        return
    try:
        folder = os.open(probe.OUT.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=cwd)
    except OSError:
        folder = None
    finally:
        os.close(cwd)
    try:
        yield folder
    finally:
        if folder is not None:
            os.close(folder)


def _copied_out(pid: int, into: Path) -> bool:
    """Once the probe is ready: its folder's regular files copied `into`. False while it is not ready."""
    with _probe_folder(pid) as folder:
        if folder is None or not _regular(folder, probe.READY.name):
            return False
        into.mkdir(exist_ok=True)
        budget = COPY_LIMIT
        for name in sorted(os.listdir(folder)):
            if budget > 0 and _regular(folder, name):
                budget -= _copy(folder, name, into / name, budget)
        return True


def _release(pid: int) -> None:
    with _probe_folder(pid) as folder, contextlib.suppress(OSError):
        if folder is not None:
            os.close(os.open(probe.RELEASE.name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644, dir_fd=folder))


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def _regular(folder: int, name: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _copy(folder: int, name: str, to: Path, budget: int) -> int:
    """Up to `budget` bytes of one file (never blocking on what turned into a FIFO meanwhile); the bytes copied."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    except OSError:
        return 0
    with os.fdopen(fd, "rb") as source:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return 0
        data = source.read(budget)
    to.write_bytes(data)
    return len(data)


def _secret(area: Area) -> tuple[Path, str, str]:
    """The --secret's file (root's alone) and value, and the canary put in the host's environment."""
    secret_value, host_canary = f"verify-secret-{secrets.token_hex(16)}", f"verify-host-{secrets.token_hex(16)}"
    secret_file = area.private / "secret"
    secret_file.touch(mode=0o600)
    secret_file.write_text(secret_value)
    return secret_file, secret_value, host_canary


def _secrets(
    ca: FakeCA, secret_value: str, host_canary: str, token: bytes, user_secret: bytes | None = None
) -> dict[str, bytes]:
    """What the sandbox must never hold: name -> its bytes (the user's --secret the inspection check uses too)."""
    return {
        "the fake internet's CA key": ca.ca_key.read_bytes(), "the --secret": secret_value.encode(),
        "the host's environment": host_canary.encode(), "the service-account token": token,
    } | ({USER_SECRET: user_secret} if user_secret else {})  # fmt: skip


def _user_placeholder(request: Request) -> list[str]:
    """The user's --secret the inspection check sends the placeholder of, in the sandbox's environment."""
    if not request.targets.injected_at:
        return []
    return ["--placeholder-env", f"{USER_PLACEHOLDER_VAR}={request.targets.secret}"]


def _run_argv(request: Request, ca: FakeCA, where: list[str], sandbox_id: str, timeout: float) -> list[str]:
    """`airlock run` in the fake internet with the user's policy and options (the command to follow); `where`: the
    netns backend's --workdir, or the docker backend and its image."""
    return [
        sys.executable, "-I", "-m", "airlock", "run", "--policy", request.policy_path,
        "--upstream-dns", DNS_SERVER, "--upstream-ca", str(ca.ca_cert), "--sandbox-id", sandbox_id,
        *where, "--git-identity", "none", "--quiet", "--timeout", f"{timeout:g}", *request.run_options,
    ]  # fmt: skip


@dataclass(frozen=True)
class Watched:
    """What the host saw of the sandbox while the probe was held at its end, and how `airlock run` ended."""

    sandboxed: Sandboxed
    usage: Usage
    returncode: int
    stderr: str


def _run_watched(
    topology: Topology, argv: list[str], env: dict[str, str], area: Area, sandbox_id: str, fill: str
) -> Watched:
    """`airlock run` to its end; once the probe is ready, the sandbox's processes and cgroup counters and its /tmp
    as the host sees them (and the keys the kernel counts for its user), and then the probe's children released."""
    ready, release = area.work / "airlock-verify" / "ready", area.work / "airlock-verify" / "release"
    seen, usage = Sandboxed([], 0), Usage()
    uid = resolve_user(None).pw_uid
    keys_before = user_keys(uid)
    with (area.private / "run.err").open("w+") as stderr:
        proc = topology.popen(topology.gw, argv, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + RUN_TIMEOUT + 60
        while proc.poll() is None and not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if ready.exists():
            found = sandbox_processes(sandbox_id)
            seen = Sandboxed(found, 0)
            usage = Usage(cgroup_counters(sandbox_id))
            keys_held = user_keys(uid)
            keys = None if keys_before is None or keys_held is None else (keys_before, keys_held)
            with contextlib.suppress(NotJudged):  # no probe seen: its checks say so
                pid = seen.probe().pid
                seen = Sandboxed(found, raw_sockets(pid), keys, sockets_in_view(pid, DOCKER_SOCKETS))
                usage = Usage(usage.counters, *sandbox_tmp(pid, fill))
            release.touch()
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_proc(proc)
            raise VerifyError(f"the sandbox did not end within {RUN_TIMEOUT + 60} seconds") from None
        stderr.seek(0)
        return Watched(seen, usage, proc.returncode, stderr.read())


def _timed_run(
    topology: Topology,
    argv: Callable[[str], list[str]],
    env: dict[str, str],
    left: Callable[[str], list[str]],
    nonce: str,
) -> TimedRun:
    """A second, short `airlock run` (`argv(sandbox_id)`, the command to follow) whose command (and a child of it)
    would sleep far beyond its --timeout: how it ended, and what of it is left (its processes, found by the mark on
    their command lines; what `left(sandbox_id)` finds of its sandbox)."""
    sandbox_id, mark = f"{topology.prefix}t", f"airlock-verify-timeout-{nonce}"
    sleeper = (
        "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', "
        "sys.argv[1]])\ntime.sleep(300)"
    )
    started = time.monotonic()
    proc = topology.popen(topology.gw, [*argv(sandbox_id), "--", "python3", "-I", "-c", sleeper, mark], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        returncode = proc.wait(TIMEOUT_GIVEN + TIMEOUT_GRACE + 30)
    except subprocess.TimeoutExpired:
        stop_proc(proc)
        raise VerifyError("the run with --timeout did not end") from None
    seconds = time.monotonic() - started
    running = [pid for pid in _pids() if (p := read_process(pid)) is not None and p.marked(mark)]
    for pid in running:  # judged left over; started by this run, so stopped by it
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return TimedRun(returncode, seconds, [f"process {pid}" for pid in running] + left(sandbox_id))


def _timed(request: Request) -> bool:
    return any(c.id == "timeout" for c in request.checks)


def _netns_timed_run(topology: Topology, request: Request, ca: FakeCA, area: Area, nonce: str) -> TimedRun:
    def argv(sandbox_id: str) -> list[str]:
        return with_host_cgroups(_run_argv(request, ca, ["--workdir", str(area.work)], sandbox_id, TIMEOUT_GIVEN))

    def left(sandbox_id: str) -> list[str]:
        return [f"{kind} {what}" for kind, found in _leftovers(topology, sandbox_id, area).items() for what in found]

    return _timed_run(topology, argv, os.environ | {"TMPDIR": str(area.tmp)}, left, nonce)


def _docker_timed_run(
    topology: Topology, request: Request, ca: FakeCA, area: Area, nonce: str, daemon: DockerDaemon, image: str
) -> TimedRun:
    def argv(sandbox_id: str) -> list[str]:
        return _run_argv(request, ca, ["--backend", "docker", "--image", image], sandbox_id, TIMEOUT_GIVEN)

    def left(sandbox_id: str) -> list[str]:
        found = _docker_leftovers(topology, area, daemon, sandbox_id)
        return [f"{kind} {what}" for kind, what_left in found.items() for what in what_left]

    return _timed_run(topology, argv, os.environ | daemon.env() | {"TMPDIR": str(area.tmp)}, left, nonce)


@contextlib.contextmanager
def _other_sandbox(
    topology: Topology, request: Request, ca: FakeCA, area: Area
) -> Iterator[tuple[OtherSandbox | None, Callable[[], OtherSandbox | None]]]:
    """The tenancy group's second sandbox, alive while the probe runs, when its check is asked for."""
    if not any(c.group == "tenancy" for c in request.checks):
        yield None, lambda: None
        return

    def run_argv(sandbox_id: str, work: Path) -> list[str]:
        return with_host_cgroups(_run_argv(request, ca, ["--workdir", str(work)], sandbox_id, RUN_TIMEOUT + 60))

    pw = resolve_user(None)
    with _run_other_sandbox(topology, run_argv, area.base / "other", pw.pw_uid, pw.pw_gid) as (other, finish):
        yield other, finish


def _broker_runs(topology: Topology, request: Request, ca: FakeCA, area: Area, nonce: str) -> BrokerRecord | None:
    """The broker group's runs, when one of its checks applies (airlock.verify.brokerruns)."""
    target = request.targets.broker
    if not isinstance(target, BrokerTarget) or not any(c.group == "broker" for c in request.checks):
        return None

    def run_argv(sandbox_id: str, work: Path) -> list[str]:
        return with_host_cgroups(_run_argv(request, ca, ["--workdir", str(work)], sandbox_id, RUN_TIMEOUT))

    def left(sandbox_id: str) -> list[str]:
        return [what for found in _leftovers(topology, sandbox_id, area).values() for what in found]

    try:
        return broker_runs(topology, ca.leaf_cert, ca.leaf_key, area.private, area.base, target, nonce, run_argv, left)
    except RuntimeError as e:
        raise VerifyError(f"the fake GitHub could not start: {e}") from None


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _probe_config(request: Request, area: Area, nonce: str, secret_file: Path) -> dict[str, Any]:
    targets = request.targets
    return {
        "nonce": nonce,
        "attempts": request.attempts(),
        "allowed": list(targets.allowed), "front": targets.front, "canaries": list(targets.canaries),
        "canary": UNLISTED, "metadata_alias": targets.metadata_alias, "rebind": targets.rebind,
        "rebind_wait": REBIND_WAIT, "outside": str(area.outside), "inspected": targets.inspected,
        "plain": targets.plain, "passthrough": targets.passthrough,
        "inspection_var": USER_PLACEHOLDER_VAR if targets.injected_at else PLACEHOLDER_VAR,
        "gateway_paths": [str(area.private), "/run/airlock", "/var/lib/airlock", "/tmp/airlock-run-*"],
        "secret_file": str(secret_file), "mount_point": f"airlock-verify/mnt-{nonce}",
        "marked_programs": [str(p) for p in sorted(area.programs.iterdir())],
        "syscalls": {name: syscall_number(name) for name in SYSCALLS},
        "gateway_ports": list(GATEWAY_CANARY_PORTS), "gateway_other_address": GW_OUTSIDE_IP,
        "burners": request.limits.burners(), "burn_seconds": BURN_SECONDS,
        "hog_bytes": request.limits.memory + HOG_MARGIN, "bomb_forks": request.limits.pids + BOMB_MARGIN,
        "tmp_fill": TMP_FILL,
    }  # fmt: skip


def _audit(path: Path) -> list[dict[str, Any]]:
    """The gateway's audit lines of the run (none: it wrote no file)."""
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def _probe_record(area: Area) -> dict[str, str]:
    """What the probe says it attempted (shown beside the verdicts; an attempt missing is a check not run)."""
    record = area.work / "airlock-verify" / "probe.json"
    try:
        seen = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in seen.items()} if isinstance(seen, dict) else {}


# --------------------------------------------------------------------------------------------------- tenancy
# The tenancy group's second sandbox: another `airlock run` beside the probe's, with its own --sandbox-id and working
# directory (a canary file in it), alive while the probe runs. Its gateway listens on its own link's address in the
# gateway's namespace; a counter there, after every sandbox's fence, counts what reaches that address from any link
# but its own sandbox's.


def _link(sandbox_id: str) -> str:
    return f"alh{sandbox_id}"  # the gateway's side of a netns sandbox's link (airlock.launch.netns_launcher)


@contextlib.contextmanager
def _run_other_sandbox(
    topology: Topology, run_argv: Callable[[str, Path], list[str]], workdir: Path, uid: int, gid: int
) -> Iterator[tuple[OtherSandbox, Callable[[], OtherSandbox]]]:
    """Start the second sandbox (`run_argv(sandbox_id, workdir)`, the command to follow) and its counter; yield
    it as started and a function that releases it and says what the host found. Stopped, with its counter, at the
    end either way."""
    sandbox_id, canary = f"{topology.prefix}o", f"verify-other-{secrets.token_hex(16)}"
    workdir.mkdir(mode=0o755)
    os.chown(workdir, uid, gid)
    (workdir / OTHER_CANARY).write_text(canary)
    argv = [*run_argv(sandbox_id, workdir), "--", "python3", "-I", "-c", OTHER_HOLDER.format(hold=OTHER_HOLD)]
    proc = topology.popen(topology.gw, argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    table = f"{topology.prefix}_tenancy"
    try:
        deadline = time.monotonic() + OTHER_START_TIMEOUT
        while proc.poll() is None and not (workdir / OTHER_STARTED).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not (workdir / OTHER_STARTED).exists():
            raise VerifyError(f"the second sandbox did not start (exit {proc.poll()})")
        _wait_entered(workdir, deadline)
        gateway = _address(topology, _link(sandbox_id))
        tcp, udp = _listening(topology, gateway, "-t"), _listening(topology, gateway, "-u")
        _count(topology, table, gateway, _link(sandbox_id))
        started = OtherSandbox(sandbox_id, workdir, gateway, tcp, udp, canary)

        def finish() -> OtherSandbox:
            files = tuple(sorted(os.listdir(workdir)))
            found = (workdir / OTHER_CANARY).read_text() if (workdir / OTHER_CANARY).is_file() else None
            reached = _counted(topology, table)
            (workdir / OTHER_RELEASE).touch()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            return OtherSandbox(**{**started.__dict__, "files": files, "found": found, "reached": reached})

        yield started, finish
    finally:
        if proc.poll() is None:
            (workdir / OTHER_RELEASE).touch()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                stop_proc(proc)
        topology.run(topology.gw, ["nft", "delete", "table", "inet", table])


def _wait_entered(workdir: Path, deadline: float) -> None:
    """Until the second sandbox's run is entered among the running gateways with its working directory: a sandbox
    started from then on hides that folder (airlock.launch.tenants), as the probe's must."""
    folder = str(workdir.resolve())
    while not any(folder in entry.folders for entry in _running()):
        if time.monotonic() > deadline:
            raise VerifyError(f"the second sandbox's run was not entered among the running gateways ({runs_dir()})")
        time.sleep(0.05)


def _running() -> list[Running]:
    try:
        return running()
    except (OSError, RunsError) as e:
        raise VerifyError(f"the running gateways cannot be listed: {e}") from None


def _address(topology: Topology, link: str) -> str:
    done = topology.run(topology.gw, ["ip", "-j", "-4", "addr", "show", "dev", link])
    found = [a["local"] for entry in json.loads(done.stdout or "[]") for a in entry.get("addr_info", [])]
    if not found:
        raise VerifyError(f"the second sandbox's link {link} has no address")
    return str(found[0])


def _listening(topology: Topology, address: str, kind: str) -> tuple[int, ...]:
    """The ports the gateway's namespace listens on at `address` itself, TCP (-t) or UDP (-u)."""
    done = topology.run(topology.gw, ["ss", "-Hn", "-l", kind])
    ports = set()
    for line in done.stdout.splitlines():
        local = line.split()[3]
        host, _, port = local.rpartition(":")
        if host.partition("%")[0] == address:
            ports.add(int(port))
    return tuple(sorted(ports))


def _count(topology: Topology, table: str, address: str, link: str) -> None:
    """A counter after every fence (priority 100: a fence's drop at -200 is final), of what reaches `address`
    from any link but `link`."""
    rules = f"""table inet {table} {{
        counter reached {{}}
        chain input {{
            type filter hook input priority 100; policy accept;
            ip daddr {address} iifname != "{link}" iifname != "lo" counter name reached
        }}
    }}"""
    done = topology.run(topology.gw, ["nft", "-f", "-"], input=rules)
    if done.returncode != 0:
        raise VerifyError(f"the counter at the second sandbox's gateway could not be set: {done.stderr.strip()}")


def _counted(topology: Topology, table: str) -> int:
    done = topology.run(topology.gw, ["nft", "-j", "list", "counter", "inet", table, "reached"])
    found = [item["counter"] for item in json.loads(done.stdout or "{}").get("nftables", []) if "counter" in item]
    if not found:
        raise VerifyError("the counter at the second sandbox's gateway could not be read")
    return int(found[0]["packets"])


# --------------------------------------------------------------------------------------------------- packets

_COUNTERS = ("from_sandbox", "icmp_echo", "ipv6_frames")


def _counter_table(topology: Topology) -> str:
    return f"{topology.prefix}_verify"


def _count_packets(topology: Topology) -> None:
    """Counters on the ingress of the fake internet's link (before any address or protocol handling, so that even
    IPv6 it has turned off is counted): what came from a sandbox's own address (it went past the gateway), ICMP
    echo requests, IPv6."""
    pool = ", ".join(str(network) for network in SANDBOX_LINK_NETWORKS)
    rules = f"""table netdev {_counter_table(topology)} {{
        {"; ".join(f"counter {name} {{}}" for name in _COUNTERS)}
        chain ingress {{
            type filter hook ingress device "{topology.net_if}" priority 0; policy accept;
            ip saddr {{ {pool} }} counter name from_sandbox
            icmp type echo-request counter name icmp_echo
            meta protocol ip6 counter name ipv6_frames
        }}
    }}"""
    done = topology.run(topology.net, ["nft", "-f", "-"], input=rules)
    if done.returncode != 0:
        raise VerifyError(f"the fake internet's packet counters could not be set: {done.stderr.strip()}")


def _packets(topology: Topology) -> dict[str, int]:
    done = topology.run(topology.net, ["nft", "-j", "list", "counters", "table", "netdev", _counter_table(topology)])
    if done.returncode != 0:
        raise VerifyError(f"the fake internet's packet counters could not be read: {done.stderr.strip()}")
    found = [item["counter"] for item in json.loads(done.stdout)["nftables"] if "counter" in item]
    return {str(c["name"]): int(c["packets"]) for c in found}


# --------------------------------------------------------------------------------------------------- leftovers


def _every_leftover(topology: Topology, area: Area, sandbox_ids: list[str]) -> dict[str, list[str]]:
    """What of these sandboxes (the main one's, the broker group's, one of them killed) is still there, by kind."""
    found: dict[str, list[str]] = {}
    for sandbox_id in sandbox_ids:
        for kind, what in _leftovers(topology, sandbox_id, area).items():
            found[kind] = list(dict.fromkeys([*found.get(kind, []), *what]))  # the state directory is everyone's
    return found


def _docker_leftovers(topology: Topology, area: Area, daemon: DockerDaemon, sandbox_id: str) -> dict[str, list[str]]:
    """What of the docker run's sandbox is still there, by kind: its container and network (the daemon's word),
    its fence and bridge in the gateway's namespace, a cgroup under the daemon's cgroup parent (the daemon runs
    nothing else), its token folder and the launcher's state directory."""
    client = daemon.client()
    labelled: dict[str, str | list[str] | bool] = {"label": f"{LABEL}={sandbox_id}"}
    found = [f"container {c.name}" for c in client.containers.list(all=True, filters=labelled)]
    found += [f"network {n.name}" for n in client.networks.list(filters=labelled)]
    tables = topology.run(topology.gw, ["nft", "list", "tables"]).stdout.split("\n")
    bridge = bridge_name(sandbox_id)
    links = topology.run(topology.gw, ["ip", "-o", "link", "show", "dev", bridge]).stdout.strip()
    token = sandbox_token_dir(sandbox_id)
    return {
        "container": found,
        "fence": [line.strip() for line in tables if fence_table(sandbox_id) in line] + ([bridge] if links else []),
        "cgroup": [str(d) for parent in daemon.cgroup_dirs() for d in parent.iterdir() if d.is_dir()],
        "state-dir": [str(p) for p in area.tmp.iterdir()] + ([str(token)] if token.exists() else []),
    }


def _leftovers(topology: Topology, sandbox_id: str, area: Area) -> dict[str, list[str]]:
    """What of the run's sandbox is still there, by kind."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    tables = topology.run(topology.gw, ["nft", "list", "tables"]).stdout.split("\n")
    links = topology.run(topology.gw, ["ip", "-o", "link"]).stdout.split("\n")
    return {
        "namespace": [f"airlock-{sandbox_id}"] if f"airlock-{sandbox_id}" in namespaces.split() else [],
        "fence": [line.strip() for line in tables if f"{NETNS_TABLE_PREFIX}{sandbox_id}" in line]
        + [line.split(":")[1].strip() for line in links if f"alh{sandbox_id}" in line],
        "cgroup": [str(p / sandbox_id) for p, _ in cgroups.host_parents().values() if (p / sandbox_id).exists()],
        "state-dir": [str(p) for p in area.tmp.iterdir()],
    }
