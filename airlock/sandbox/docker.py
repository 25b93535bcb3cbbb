"""The docker backend: a hardened container on a network of its own, whose only reachable address is the gateway's
address on that network, fenced by nftables like the netns backend (in transparent mode, whatever else it dials is
redirected there or refused by the same fence, and other UDP is refused inside the container's namespace too).

Hardening is not optional: read-only root, `/tmp` and every VOLUME the image declares as size-capped
noexec/nosuid tmpfs, every capability dropped, no-new-privileges, airlock's seccomp profile, pids/memory
(=memory+swap)/CPU limits and rlimits, a non-root user, an init as PID 1, no host paths but read-only mounts the
caller names (never system folders, engine sockets or state, /run), DNS and proxy pointing at the gateway, a hard
timeout, capped output. Limits can be changed; the rest cannot be turned off.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import select
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import docker
import docker.errors
import requests.exceptions
from docker.types import IPAMConfig, IPAMPool, LogConfig, Ulimit

from airlock.errors import AirlockError
from airlock.inspection.trust import SANDBOX_BUNDLE
from airlock.interfaces import parse_ip_addr
from airlock.policy import SANDBOX_LINK_NETWORKS

from . import SANDBOX_ID, Guardian
from .fence import DOCKER_TABLE_PREFIX, Fence, Interception, load_inner_refusal, unlimited_unreachable
from .limits import (
    CPUS,
    DEFAULT_CPUS,
    DEFAULT_MEMORY,
    DEFAULT_NOFILE,
    DEFAULT_NPROC,
    DEFAULT_OUTPUT_LIMIT,
    DEFAULT_PIDS,
    NOFILE,
    NPROC,
    OUTPUT_LIMIT,
    PIDS,
    TIMEOUT,
    limit_problem,
    memory_bytes,
)
from .seccomp import docker_security_opt

SUBNET_POOL = SANDBOX_LINK_NETWORKS[1]
LABEL = "airlock.sandbox"
EXPIRES_LABEL = "airlock.expires"
TOKEN_PATH = "/run/airlock/token"
EXITING_GRACE = 1.0  # seconds: how long a process out of the container's cgroup may take to be seen as exited
TOKEN_ROOT = Path("/run")  # each sandbox's token lives in TOKEN_ROOT/airlock-d-<id>/ (netns uses airlock-<id>)
# Never mounted, nor anything inside them or containing them: every service socket (/run), the engines' sockets
# and state (a way to start containers outside the fence), other sandboxes' tokens (/run/airlock-*), the kernel.
HOST_INTERNALS = (
    "/run", "/var/run", "/proc", "/sys", "/dev", "/var/lib/docker", "/var/lib/containerd", "/var/lib/containers",
)  # fmt: skip
# Never mounted whole, nor anything containing them; a path inside is fine (/etc/ssl/certs, a project in /home).
SYSTEM_FOLDERS = ("/", "/boot", "/etc", "/home", "/root")


class DockerSandboxError(AirlockError, RuntimeError):
    pass


@dataclass
class Limits:
    cpus: float = DEFAULT_CPUS
    memory: str = DEFAULT_MEMORY  # swap is never added on top: memory+swap = memory
    pids: int = DEFAULT_PIDS
    nofile: int = DEFAULT_NOFILE  # RLIMIT_NOFILE, soft = hard
    nproc: int = DEFAULT_NPROC  # RLIMIT_NPROC: counts every process of the container's uid on the host
    tmp_size: str = "64m"
    timeout: float = 3600.0  # then the container is killed and removed
    output_limit: int = DEFAULT_OUTPUT_LIMIT
    user: str = "65534:65534"

    def check(self) -> None:
        """Every limit is on, finite and bounded: there is no value that turns one off."""
        problems = [
            limit_problem("cpus", self.cpus, CPUS),
            limit_problem("pids", self.pids, PIDS),
            limit_problem("nofile", self.nofile, NOFILE),
            limit_problem("nproc", self.nproc, NPROC),
            limit_problem("timeout", self.timeout, TIMEOUT, lowest_included=False),
            limit_problem("output_limit", self.output_limit, OUTPUT_LIMIT),
        ]
        for name, size in (("memory", self.memory), ("tmp_size", self.tmp_size)):
            try:
                memory_bytes(size)
            except (ValueError, AttributeError) as e:
                problems.append(f"{name}: {e}")
        if found := [p for p in problems if p]:
            raise DockerSandboxError("; ".join(found))
        if self.user.split(":")[0] in ("0", "root"):
            raise DockerSandboxError("refusing to run the container as root")

    @property
    def group(self) -> int:
        return int(self.user.split(":")[1]) if ":" in self.user else 65534

    @property
    def tmpfs_options(self) -> str:
        return f"rw,noexec,nosuid,nodev,size={self.tmp_size}"


def check_mount(host: str, engine_socket: str | None = None) -> Path:
    """The host path with symlinks resolved, unless it is, contains or lies inside a host internal or the socket
    of the engine in use, or is or contains a system folder."""
    source = Path(host).resolve()
    internals = [*HOST_INTERNALS, *([engine_socket] if engine_socket else [])]
    for forbidden in _spellings(internals):
        if forbidden.is_relative_to(source) or source.is_relative_to(forbidden):
            raise DockerSandboxError(f"refusing to mount {host} into a sandbox: it shows {forbidden}")
    for forbidden in _spellings(SYSTEM_FOLDERS):
        if forbidden.is_relative_to(source):
            raise DockerSandboxError(f"refusing to mount {host} into a sandbox: it shows all of {forbidden}")
    return source


def _spellings(paths: list[str] | tuple[str, ...]) -> set[Path]:
    """Each path as written and with symlinks resolved (/var/run is often /run)."""
    return {spelling for p in paths for spelling in (Path(p), Path(p).resolve())}


def _engine_socket(client: docker.DockerClient) -> str | None:
    """The unix socket this client talks to its engine through, if it does."""
    adapter = client.api.get_adapter(client.api.base_url)
    path = getattr(adapter, "socket_path", None)
    return path if isinstance(path, str) else None


def engine_address(client: docker.DockerClient) -> str:
    """Where another process reaches this client's engine ("" when only the environment can say)."""
    if socket_path := _engine_socket(client):
        return f"unix://{socket_path}"
    base = str(client.api.base_url)
    return base if base.startswith(("http://", "https://", "tcp://")) else ""


@dataclass
class DockerSandbox:
    """One sandbox: `create()`, `start(cmd, env)`, `wait()`, `output()`; `destroy()` always."""

    client: docker.DockerClient
    image: str
    sandbox_id: str | None = None
    tcp_ports: tuple[int, ...] = (3128,)
    udp_ports: tuple[int, ...] = ()
    limits: Limits = field(default_factory=Limits)
    mounts: list[tuple[str, str]] = field(default_factory=list)  # (host path, container path), always read-only
    watchdog: Guardian | None = None  # told of the sandbox once its fence is ours: it removes it if we die
    intercept: Interception | None = None  # transparent mode: everything else the sandbox dials reaches the gateway

    def __post_init__(self) -> None:
        self.sandbox_id = self.sandbox_id or secrets.token_hex(4)
        if not SANDBOX_ID.fullmatch(self.sandbox_id):
            raise DockerSandboxError(f"sandbox id {self.sandbox_id!r}: use 1-12 characters a-z, 0-9")
        self.name = f"airlock-{self.sandbox_id}"
        self.bridge = bridge_name(self.sandbox_id)
        self.subnet: ipaddress.IPv4Network | None = None
        # What this sandbox created, and only that, is what destroy() removes: a clash with another sandbox of
        # the same id must not take that one down.
        self.fence: Fence | None = None
        self.network_id: str | None = None
        self.container_id: str | None = None
        self.token_dir: Path | None = None
        self.limits.check()
        engine_socket = _engine_socket(self.client)
        # What was checked is what gets mounted: docker is given the resolved path, not the symlink.
        self.mounts = [(str(check_mount(host, engine_socket)), target) for host, target in self.mounts]

    @property
    def gateway_ip(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    @property
    def sandbox_ip(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 2)

    def labels(self) -> dict[str, str]:
        expires = int(time.time() + self.limits.timeout + 60)
        return {LABEL: self.sandbox_id or "", EXPIRES_LABEL: str(expires)}

    def create(self) -> None:
        """The network and its fence; the gateway must listen on `gateway_ip` before `start()`."""
        for _ in range(8):
            self.subnet = self._free_subnet()
            table = fence_table(self.sandbox_id or "")
            fence = Fence(table, self.bridge, self.gateway_ip, self.tcp_ports, self.udp_ports, self.intercept)
            fence.install()  # before anything is attached: the bridge is never open and unfenced
            self.fence = fence
            if self.watchdog is not None:
                self.watchdog.guard("docker", self.sandbox_id or "", engine_address(self.client))
            pool = IPAMPool(subnet=str(self.subnet), gateway=self.gateway_ip)
            try:
                network = self.client.networks.create(
                    self.name,
                    driver="bridge",
                    ipam=IPAMConfig(pool_configs=[pool]),
                    labels=self.labels(),
                    **self._network_shape(),
                )
                self.network_id = network.id
                return
            except docker.errors.APIError as e:
                if "overlap" not in str(e).lower():
                    raise DockerSandboxError(f"cannot create network {self.name}: {e.explanation or e}") from None
                # Another launch took this subnet between our look and our create: pick again. Our fence goes
                # (nothing is attached to it) and comes back for the next gateway address.
                fence.remove()
                self.fence = None
        raise DockerSandboxError(f"no free subnet for {self.name} after 8 tries")

    def _network_shape(self) -> dict[str, Any]:
        """Explicit mode only: an internal network, with no route out through docker and no NAT. Transparent mode:
        a default route to the gateway's address (docker gives one only on a network that is not internal), still
        without NAT (masquerading off), where the fence redirects or refuses everything and forwards nothing."""
        options = {"com.docker.network.bridge.name": self.bridge}  # one container: no neighbours
        if self.intercept is None:
            return {"internal": True, "options": options}
        return {"internal": False, "options": {**options, "com.docker.network.bridge.enable_ip_masquerade": "false"}}

    def _free_subnet(self) -> ipaddress.IPv4Network:
        used: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for network in self.client.networks.list():
            for config in (network.attrs.get("IPAM") or {}).get("Config") or []:
                if config.get("Subnet"):
                    used.append(ipaddress.ip_network(config["Subnet"], strict=False))
        out = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
        used += [address.network for address in parse_ip_addr(out)]
        for _ in range(64):
            candidate = ipaddress.IPv4Network(f"{SUBNET_POOL.network_address + secrets.randbelow(256) * 256}/24")
            if not any(candidate.version == u.version and candidate.overlaps(u) for u in used):
                return candidate
        raise DockerSandboxError(f"no free /24 left in {SUBNET_POOL}")

    @property
    def token_file(self) -> Path | None:
        return self.token_dir / "token" if self.token_dir is not None else None

    def place_token(self, token: str) -> None:
        """The broker token as a file the container's group can read and nobody in it can change. Born with its
        final mode (never readable by others, not even briefly) in a folder only root may enter: docker
        bind-mounts the file itself, so the container needs no way through the folder."""
        folder = sandbox_token_dir(self.sandbox_id or "")
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            raise DockerSandboxError(f"{folder} exists already: another sandbox with this id has it") from None
        self.token_dir = folder
        fd = os.open(folder / "token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o440)
        with os.fdopen(fd, "w") as f:
            os.fchown(fd, 0, self.limits.group)
            os.fchmod(fd, 0o440)  # exactly: a umask may have taken the group's read bit
            f.write(token)

    def start(self, command: list[str], env: dict[str, str], trust_bundle: Path | None = None) -> None:
        """The container, running `command` with `env`: the mounts read-only, the token file (`place_token`) and
        the `trust_bundle` (the system's CAs plus the gateway's) where the image's clients look first."""
        api = self.client.api
        limits = self.limits
        binds: dict[str, Mapping[str, str]] = {host: {"bind": target, "mode": "ro"} for host, target in self.mounts}
        if self.token_file is not None:
            binds[str(self.token_file)] = {"bind": TOKEN_PATH, "mode": "ro"}
        if trust_bundle is not None:
            binds[str(trust_bundle)] = {"bind": str(SANDBOX_BUNDLE), "mode": "ro"}
        # An image's VOLUMEs would be writable anonymous volumes on the host's disk, past --read-only, and
        # outliving the container: a tmpfs over each, like /tmp, keeps them in (capped) memory instead.
        tmpfs = {path: limits.tmpfs_options for path in ("/tmp", *self._image_volumes())}
        host_config = api.create_host_config(
            network_mode=self.name,
            read_only=True,
            tmpfs=tmpfs,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges", docker_security_opt()],  # docker's default seccomp minus airlock's
            pids_limit=limits.pids,
            mem_limit=memory_bytes(limits.memory),
            memswap_limit=memory_bytes(limits.memory),
            nano_cpus=int(limits.cpus * 1e9),
            ulimits=[
                Ulimit(name="nofile", soft=limits.nofile, hard=limits.nofile),
                Ulimit(name="nproc", soft=limits.nproc, hard=limits.nproc),
            ],
            init=True,
            dns=[self.gateway_ip],
            binds=binds,
            ipc_mode="private",
            # Transparent mode: its namespace does not rate-limit the port-unreachable it sends itself (below).
            sysctls=unlimited_unreachable() if self.intercept is not None else None,
            log_config=LogConfig(type="json-file", config={"max-size": str(limits.output_limit), "max-file": "1"}),
        )
        endpoints = {self.name: api.create_endpoint_config(ipv4_address=self.sandbox_ip)}
        networking = api.create_networking_config(endpoints)  # type: ignore[arg-type]  # the stubs say one endpoint
        try:
            created = api.create_container(
                self.image,
                command=command,
                user=limits.user,
                environment=env,
                host_config=host_config,
                networking_config=networking,
                labels=self.labels(),
                name=self.name,
                working_dir="/tmp",
            )
            self.container_id = created["Id"]
            api.start(self.container_id)
            if self.intercept is not None:
                self._refuse_udp_inside(self.intercept)
        except docker.errors.ImageNotFound:
            raise DockerSandboxError(f"image {self.image!r} not found") from None
        except docker.errors.APIError as e:
            raise DockerSandboxError(f"cannot start the container: {e.explanation or e}") from None

    def _refuse_udp_inside(self, intercept: Interception) -> None:
        """The netns backend's refusal of other UDP inside the sandbox's own namespace (fence.refuse_udp_inside),
        past the gateway side's ICMP rate limit: the container's rate limit was lifted at create (`sysctls`), and
        the table is loaded once docker has started it, the earliest its namespace can be entered (docker starts
        the command at once, and may be given any image: no entrypoint of ours can hold it). What the command sends
        in those first ~15 ms meets the gateway side's refusal alone: the first 6 at once, the rest wait for their
        own timeout. The container's user has no CAP_NET_ADMIN and a read-only /proc/sys: it can undo neither."""
        assert self.fence is not None
        with self._network_namespace() as netns:
            if netns is not None:
                nsenter = ["nsenter", f"--net={netns}", "--"]
                load_inner_refusal(self.fence.table, self.gateway_ip, self.udp_ports, intercept, nsenter)

    @contextlib.contextmanager
    def _network_namespace(self) -> Iterator[str | None]:
        """A path to the network namespace of the container's first process, held open; None once that process
        has ended (docker may still say it runs). DockerSandboxError when the pid docker gives is no process of
        this container here (airlock in another pid namespace than docker's): its namespace is never guessed."""
        assert self.container_id is not None
        pid = self.state().get("Pid") or 0
        try:
            process = os.pidfd_open(pid) if pid else None  # pins the pid: it cannot be reused while this is open
        except ProcessLookupError:
            process = None
        if process is None:
            yield None  # it ended already
            return
        netns = None
        try:
            with contextlib.suppress(OSError):  # a process that ended meanwhile: told by its pidfd below
                netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            ours = netns is not None and in_container(pid, self.container_id)
            ended = select.select([process], [], [], 0)[0]  # the pidfd is readable once the process has exited
            if not ours and not ended:
                # An exiting process leaves its cgroup before its pidfd says it has exited: a short command can be
                # caught in between. One that is really elsewhere is still running after this grace.
                ended = select.select([process], [], [], EXITING_GRACE)[0]
            if ended:
                yield None
            elif not ours:
                raise DockerSandboxError(
                    f"pid {pid}, the container's by docker, is not in its cgroup here (is airlock in another pid"
                    " namespace than docker?): cannot refuse UDP inside the container"
                )
            else:
                yield f"/proc/{os.getpid()}/fd/{netns}"
        finally:
            os.close(process)
            if netns is not None:
                os.close(netns)

    def _image_volumes(self) -> list[str]:
        try:
            config = self.client.api.inspect_image(self.image).get("Config") or {}  # type: ignore[no-untyped-call]
        except docker.errors.ImageNotFound:
            raise DockerSandboxError(f"image {self.image!r} not found") from None
        return list(config.get("Volumes") or {})

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None when the timeout passed (the container is then killed)."""
        assert self.container_id is not None
        try:
            # A float is what requests (the read timeout) takes; the stubs ask for an int.
            result = self.client.api.wait(self.container_id, timeout=timeout or self.limits.timeout)  # type: ignore[arg-type]
            return int(result.get("StatusCode", 1))
        except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
            self.kill()
            return None

    def kill(self) -> None:
        if self.container_id is not None:
            with contextlib.suppress(docker.errors.APIError):  # already gone
                self.client.api.kill(self.container_id)

    def state(self) -> dict[str, Any]:
        assert self.container_id is not None
        state: dict[str, Any] = self.client.api.inspect_container(self.container_id)["State"]
        return state

    def output(self) -> tuple[bytes, bytes]:
        """stdout and stderr, each capped at the output limit."""
        assert self.container_id is not None
        cap = self.limits.output_limit
        api = self.client.api
        stdout = api.logs(self.container_id, stdout=True, stderr=False)[:cap]
        stderr = api.logs(self.container_id, stdout=False, stderr=True)[:cap]
        return stdout, stderr

    def follow(self, stderr: bool, sink: BinaryIO) -> int:
        """Copy one of the container's streams to `sink` as it comes (until the container stops), capped at the
        output limit; what is beyond the cap is read and dropped, so the container never blocks on it. Returns
        how many bytes it saw."""
        assert self.container_id is not None
        seen = 0
        for chunk in self.client.api.logs(
            self.container_id, stdout=not stderr, stderr=stderr, stream=True, follow=True
        ):
            self._write_capped(sink, chunk, seen)
            seen += len(chunk)
        return seen

    def catch_up(self, stderr: bool, sink: BinaryIO, seen: int) -> None:
        """After the container stopped: what a follow missed (docker may close it before the last bytes are
        logged), then the truncation note."""
        assert self.container_id is not None
        full = self.client.api.logs(self.container_id, stdout=not stderr, stderr=stderr)
        if len(full) > seen:
            self._write_capped(sink, full[seen:], seen)
        if max(seen, len(full)) > self.limits.output_limit:
            sink.write(f"\n[airlock: output beyond {self.limits.output_limit} bytes dropped]\n".encode())
            sink.flush()

    def _write_capped(self, sink: BinaryIO, chunk: bytes, offset: int) -> None:
        room = self.limits.output_limit - offset
        if room > 0:
            sink.write(chunk[:room])
            sink.flush()

    def destroy(self) -> None:
        """Remove what this sandbox created: the container, then the network (its bridge goes with it), only then
        the fence, so nothing of the sandbox can ever send unfenced; a failure stops here, leaving the fence up."""
        if self.container_id is not None:
            remove_container(self.client, self.container_id)
        if self.network_id is not None:
            remove_network(self.client, self.network_id)
        if self.fence is not None:
            self.fence.remove()
        if self.token_dir is not None:
            shutil.rmtree(self.token_dir, ignore_errors=True)


def in_container(pid: int, container_id: str) -> bool:
    """Whether the process is in the container's cgroup: docker names it after the container's full id, a path
    component of its own (`…/docker/ID` with the cgroupfs driver, `…/docker-ID.scope` with systemd's). A whole
    component, never a substring: the id of whatever container airlock itself runs in is in the same file."""
    try:
        return cgroups_name_container(Path(f"/proc/{pid}/cgroup").read_text(), container_id)
    except OSError:
        return False


def cgroups_name_container(proc_cgroup: str, container_id: str) -> bool:
    own_names = {container_id, f"docker-{container_id}.scope"}
    return any(own_names.intersection(line.split(":", 2)[-1].split("/")) for line in proc_cgroup.splitlines())


def bridge_name(sandbox_id: str) -> str:
    """The bridge device of the sandbox's network (at most 15 characters, as the kernel wants)."""
    return f"alb{sandbox_id}"[:15]


def fence_table(sandbox_id: str) -> str:
    return f"{DOCKER_TABLE_PREFIX}{sandbox_id}"


def sandbox_token_dir(sandbox_id: str) -> Path:
    return TOKEN_ROOT / f"airlock-d-{sandbox_id}"


def remove_container(client: docker.DockerClient, container_id: str) -> None:
    with contextlib.suppress(docker.errors.NotFound):  # v: anonymous volumes go too
        client.api.remove_container(container_id, force=True, v=True)


def remove_network(client: docker.DockerClient, network_id: str) -> None:
    with contextlib.suppress(docker.errors.NotFound):
        client.api.remove_network(network_id)
