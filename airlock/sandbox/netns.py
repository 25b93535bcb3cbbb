"""The netns backend: a network namespace whose only link is a veth to the gateway, fenced by nftables.

The sandbox side has one address and one connected /30 route: the fence lets the gateway's address answer only on
the gateway's ports. With interception (transparent mode) it also has a default route via the gateway's address,
so that what a client dials elsewhere reaches the gateway's side of the link, where the fence redirects it to the
gateway (TCP, DNS) or refuses it (other UDP) and forwards nothing; other UDP is refused inside the namespace too,
past the gateway side's ICMP rate limit (`refuse_udp_here`). Without interception it has no default route and the
kernel has nowhere to send anything but the gateway's address. The command runs without root and without
capabilities (setpriv, no_new_privs), so it cannot change routes, load rules, sysctls, or enter another namespace.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ipaddress
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from airlock.inspection.trust import SANDBOX_BUNDLE
from airlock.interfaces import interface_addresses
from airlock.policy import SANDBOX_LINK_NETWORKS, HostError, canonical_host, is_ip

from . import SANDBOX_ID, Guardian
from .errors import SandboxError
from .fence import (
    NETNS_TABLE_PREFIX,
    Fence,
    FenceError,
    Interception,
    in_network_namespace,
    refuse_udp_here,
    write_sysctl,
)
from .host_paths import existing_paths
from .workdir import WorkdirGuard

LINK_POOL = SANDBOX_LINK_NETWORKS[0]


def _run(argv: list[str], check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return _finish(_start(argv, stdin), check)


def _start(argv: list[str], stdin: str | None = None) -> _Started:
    """`argv` started (and given `stdin`), to be finished with `_finish()`: a few run side by side."""
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    except OSError as e:
        raise SandboxError(f"{' '.join(argv)}: {e}") from e
    return _Started(argv, proc, stdin)


@dataclass
class _Started:
    argv: list[str]
    proc: subprocess.Popen[str]
    stdin: str | None


def _finish(started: _Started, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv, proc = started.argv, started.proc
    try:
        stdout, stderr = proc.communicate(started.stdin, timeout=30)
    except subprocess.SubprocessError as e:
        proc.kill()
        proc.wait()
        raise SandboxError(f"{' '.join(argv)}: {e}") from e
    if check and proc.returncode != 0:
        raise SandboxError(f"{' '.join(argv)}: {stderr.strip()}")
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def _write_sysctl(name: str, value: str) -> None:
    """A sysctl of this thread's network namespace, as `sysctl -w` sets it; quietly not where the kernel has no
    such one."""
    with contextlib.suppress(FenceError):
        write_sysctl(name, value)


def _used_networks() -> list[ipaddress.IPv4Network]:
    try:
        return [address.network for address in interface_addresses() if isinstance(address, ipaddress.IPv4Interface)]
    except OSError as e:
        raise SandboxError(f"this namespace's addresses cannot be listed: {e}") from e


def hosts_file(hostname: str) -> str:
    """The sandbox's /etc/hosts: localhost, and the host name it keeps (bubblewrap's UTS namespace starts with the
    host's), on 127.0.1.1 as Debian puts it — so that what asks for its own name (git for its ident, sudo, many a
    server) is answered in the sandbox and never asks the gateway's DNS. A name no resolver could read is left out."""
    lines = ["127.0.0.1 localhost", "::1 localhost"]
    try:
        name = canonical_host(hostname)
    except HostError:
        name = "localhost"
    if name != "localhost" and not is_ip(name):
        short = name.partition(".")[0]
        lines.insert(1, f"127.0.1.1 {name}" + (f" {short}" if short != name else ""))
    return "\n".join(lines) + "\n"


def pick_link() -> ipaddress.IPv4Network:
    """A /30 for the gateway-sandbox link that no interface of this namespace uses yet."""
    used = _used_networks()
    for _ in range(64):
        index = secrets.randbelow(LINK_POOL.num_addresses // 4)
        link = ipaddress.IPv4Network(f"{LINK_POOL.network_address + index * 4}/30")
        if not any(link.overlaps(u) for u in used):
            return link
    raise SandboxError(f"no free /30 left in {LINK_POOL}")


@dataclass
class NetnsSandbox:
    """One sandbox namespace. `create()` then `command(...)`; `destroy()` always, even after failures."""

    sandbox_id: str | None = None  # default: random
    tcp_ports: tuple[int, ...] = (3128,)
    udp_ports: tuple[int, ...] = ()
    watchdog: Guardian | None = None  # told of the namespace once it is ours: it removes it if we die
    intercept: Interception | None = None  # transparent mode: everything else the sandbox dials reaches the gateway

    def __post_init__(self) -> None:
        self.sandbox_id = self.sandbox_id or secrets.token_hex(4)
        if not SANDBOX_ID.fullmatch(self.sandbox_id):
            raise SandboxError(f"sandbox id {self.sandbox_id!r}: use 1-12 characters a-z, 0-9")
        self.netns = f"airlock-{self.sandbox_id}"
        self.host_if = f"alh{self.sandbox_id}"[:15]
        self.sandbox_if = f"als{self.sandbox_id}"[:15]
        self.link: ipaddress.IPv4Network | None = None
        self.fence: Fence | None = None
        self.owned = False  # the namespace is this instance's: destroy() touches nothing of another sandbox

    @property
    def gateway_ip(self) -> str:
        assert self.link is not None
        return str(self.link.network_address + 1)

    @property
    def sandbox_ip(self) -> str:
        assert self.link is not None
        return str(self.link.network_address + 2)

    def create(self) -> None:
        """Namespace, link and fence, in that order; each step that does not need the one before runs beside it
        (a launch waits on these subprocesses)."""
        self.link = pick_link()
        _run(["ip", "netns", "add", self.netns])  # fails when the id is taken: then nothing here is ours
        self.owned = True
        if self.watchdog is not None:  # it may still be starting: the launcher waits for it before the command
            assert self.sandbox_id is not None  # given or drawn when built
            self.watchdog.guard("netns", self.sandbox_id, wait=False)
        self._link_and_fence()
        etc = Path("/etc/netns") / self.netns
        etc.mkdir(parents=True, exist_ok=True)
        # `ip netns exec` bind-mounts these over /etc inside the command's mount namespace.
        (etc / "resolv.conf").write_text(f"nameserver {self.gateway_ip}\noptions timeout:2 attempts:1\n")
        (etc / "hosts").write_text(hosts_file(socket.gethostname()))

    def _link_and_fence(self) -> None:
        """The veth pair, the namespace's own settings, the gateway side's fence, then the link's addresses (and
        the route through the gateway), up."""
        assert self.link is not None
        prefix = self.link.prefixlen
        # The sandbox's end is made in its namespace: it is never an interface of this one.
        _run(["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.sandbox_if, "netns", self.netns])
        # IPv6 off on both ends: the link carries exactly the IPv4 the fence describes.
        _write_sysctl(f"net.ipv6.conf.{self.host_if}.disable_ipv6", "1")
        inside = in_network_namespace(NETNS_DIR / self.netns, self._configure_inside)  # beside the fence
        # Fence first, then bring the link up: no moment exists when the sandbox's link is open and unfenced.
        fence = Fence(self.fence_table, self.host_if, self.gateway_ip, self.tcp_ports, self.udp_ports, self.intercept)
        try:
            fence.install()
        except BaseException:
            concurrent.futures.wait([inside])  # nothing of this launch runs on once it has failed
            raise
        self.fence = fence  # only once installed: a table that exists already is another sandbox's
        inside.result()
        host_end = f"addr add {self.gateway_ip}/{prefix} dev {self.host_if}\nlink set {self.host_if} up\n"
        sandbox_end = (
            f"link set lo up\naddr add {self.sandbox_ip}/{prefix} dev {self.sandbox_if}\n"
            f"link set {self.sandbox_if} up\n"
        )
        if self.intercept is not None:  # only now that the refusal inside is loaded
            sandbox_end += f"route add default via {self.gateway_ip}\n"
        both = [_start(["ip", "-batch", "-"], host_end), _start(["ip", "-n", self.netns, "-batch", "-"], sandbox_end)]
        for started in both:
            _finish(started)

    def _configure_inside(self) -> None:
        """In the namespace (`in_network_namespace`): IPv6 off on its interfaces (the link's end is there already),
        and in transparent mode the refusal of other UDP (`refuse_udp_here`)."""
        _write_sysctl("net.ipv6.conf.all.disable_ipv6", "1")
        if self.intercept is not None:
            refuse_udp_here(self.fence_table, self.gateway_ip, self.udp_ports, self.intercept)

    @property
    def run_dir(self) -> Path:
        return Path("/run") / self.netns

    def place_token(self, token: str, user: pwd.struct_passwd) -> Path:
        """The broker token as a file the sandbox user can read but not change (root owns it and its folder)."""
        self.run_dir.mkdir(mode=0o750, exist_ok=True)
        os.chown(self.run_dir, 0, user.pw_gid)
        path = self.run_dir / "token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o440)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        os.chown(path, 0, user.pw_gid)
        return path

    @property
    def fence_table(self) -> str:
        return f"{NETNS_TABLE_PREFIX}{self.sandbox_id}"

    def destroy(self) -> None:
        """Everything inside dies first, then the link goes, and only then the fence: at no moment can something
        of the sandbox send through an open link without its fence. Only what this instance created."""
        if not self.owned:
            return
        self.kill_all()
        # -force: the namespace goes even when the link is gone already
        _run(["ip", "-force", "-batch", "-"], check=False, stdin=f"link del {self.host_if}\nnetns del {self.netns}\n")
        (self.fence or Fence(self.fence_table, self.host_if, "", ())).remove()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.rmtree(Path("/etc/netns") / self.netns, ignore_errors=True)
        self.owned = False

    def kill_all(self) -> None:
        """SIGKILL every process in the namespace, also ones the command left running in the background."""
        for _ in range(10):
            pids = pids_in(self.netns)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def command(
        self,
        argv: list[str],
        user: str | None = None,
        isolate_fs: bool = True,
        hidden: Sequence[Path] = (),
        read_only: Sequence[Path] = (),
        guard: WorkdirGuard | None = None,
        seccomp_fd: int | None = None,
        trust_bundle: Path | None = None,
        writable: Sequence[Path] = (),
    ) -> list[str]:
        """The argv that runs `argv` inside the namespace as an unprivileged user without capabilities; with
        `isolate_fs`, bubblewrap also gives it a read-only view of the host without the `hidden` paths, the
        working directory (and the `writable` folders) writable but for `read_only` paths in it and what the
        `guard` protects, its own /tmp and /dev/shm (the folders on the way to what is bound there as the host's)
        and PID namespace. The BPF program at `seccomp_fd` (inherited) becomes its seccomp filter."""
        pw = resolve_user(user)
        drop_privileges = [
            # No supplementary groups: `docker`, `lxd`, `disk` and the like would each be a way out.
            "setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups",
            "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all", "--",
        ]  # fmt: skip
        if isolate_fs:
            isolation = _bubblewrap(hidden, read_only, guard, seccomp_fd, trust_bundle, writable)
        else:
            isolation = _own_processes(seccomp_fd)
        prelude = guard.prelude() if guard and isolate_fs else []
        return ["ip", "netns", "exec", self.netns, *prelude, *isolation, *drop_privileges, *argv]


def pids_in(netns: str) -> list[int]:
    """The processes in the named namespace, found as `ip netns pids` finds them (whose /proc/PID/ns/net is the
    namespace's file) without starting it: a teardown waits on this."""
    try:
        namespace = os.stat(Path("/run/netns") / netns)
    except FileNotFoundError:
        return []
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            net = os.stat(f"/proc/{entry.name}/ns/net")
        except OSError:  # ended meanwhile
            continue
        if (net.st_dev, net.st_ino) == (namespace.st_dev, namespace.st_ino):
            found.append(int(entry.name))
    return found


def _own_processes(seccomp_fd: int | None = None) -> list[str]:
    """Without bubblewrap still a PID and IPC namespace and a /proc of its own: the host's processes (those of
    the same user included, which it could otherwise ptrace or read the memory of) are out of sight. The
    seccomp filter is installed after those namespaces exist (it refuses new ones)."""
    load = [sys.executable, "-I", "-m", "airlock.sandbox.seccomp_load", str(seccomp_fd), "--"]
    unshare = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--"]
    return unshare + (load if seccomp_fd is not None else [])


def _bubblewrap(
    hidden: Sequence[Path],
    read_only: Sequence[Path],
    guard: WorkdirGuard | None,
    seccomp_fd: int | None = None,
    trust_bundle: Path | None = None,
    writable: Sequence[Path] = (),
) -> list[str]:
    """The whole host read-only (so nothing planted for root to run later), the working directory writable as its
    permissions say but for `read_only` paths and what the `guard` keeps (git's own folders get a private layer,
    files that run later are read-only), the `writable` folders too, the `hidden` paths empty, a private /tmp and
    /dev/shm, and the command's own PID, IPC and UTS namespaces."""
    cwd = os.getcwd()
    around, inside = (guard.enclosing_binds(), guard.bubblewrap_binds()) if guard else ([], [])
    # Only below a private mount: elsewhere `/` shows the work tree already, and a private mount itself (or `/`)
    # bound again would show the host's own.
    around = [bind for bind in around if _private_mount(Path(bind[-1]))]
    # The writable folders before the working directory's bind and its masks, which a later bind above would cover.
    binds = [["--bind", str(folder), str(folder)] for folder in writable]
    mounts = [(bind, False) for bind in [*around, *binds, ["--bind", cwd, cwd], *inside]]
    for path in hidden:  # after the working directory's bind: a credential inside it is covered too
        if path.is_dir():
            mounts.append((["--tmpfs", str(path)], True))
        elif os.path.lexists(path):  # gone since it was chosen (another sandbox's folder, removed): nothing to hide
            mounts.append((["--ro-bind", "/dev/null", str(path)], True))
    mounts += [(["--ro-bind", str(path), str(path)], False) for path in existing_paths(read_only)]
    if trust_bundle is not None:  # the system's CAs and the gateway's, where every client looks first
        mounts.append((["--ro-bind", str(trust_bundle), str(SANDBOX_BUNDLE)], False))
    placed, made = _below_private_mounts(mounts)
    if seccomp_fd is not None:  # bubblewrap installs it last, just before the command
        placed += ["--seccomp", str(seccomp_fd)]
    return [
        "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp",
        "--perms", "1777", "--tmpfs", "/dev/shm", *placed, "--chdir", cwd,
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session", "--",
        *_give_owners(made),
    ]  # fmt: skip


# Where bubblewrap gives the command file systems of its own (innermost first), empty but for what is bound in.
PRIVATE_MOUNTS = (Path("/tmp"), Path("/dev/shm"), Path("/dev"))
# Run as root after bubblewrap, before the command: `$0` is chown, then owner and folder pairs up to `--`.
_GIVE_OWNERS = 'while [ "$1" != -- ]; do "$0" -h -- "$1" "$2" || exit 125; shift 2; done; shift; exec "$@"'


def _private_mount(path: Path) -> Path | None:
    """The private mount (`PRIVATE_MOUNTS`) that `path` lies below, if any."""
    return next((mount for mount in PRIVATE_MOUNTS if mount in path.parents), None)


def _below_private_mounts(mounts: Iterable[tuple[list[str], bool]]) -> tuple[list[str], dict[Path, os.stat_result]]:
    """bubblewrap's words for `mounts` (each its words, destination last, and whether it hides a host path). Below
    a private mount bubblewrap would make the folders on the way to a destination root's with mode 0700, which
    the command's user cannot enter: they are made first as the host's are, with their modes (and given their
    owners by `_give_owners`). A hiding mount there is left out where nothing of the host's shows. Also returned:
    the folders made, with the host's stat of each."""
    words: list[str] = []
    made: dict[Path, os.stat_result] = {}
    shown: list[Path] = []  # what is bound from the host below a private mount
    for mount, hides in mounts:
        destination = Path(mount[-1])
        private = _private_mount(destination)
        if private is not None and not any(s == destination or s in destination.parents for s in shown):
            if hides:
                continue
            for folder in reversed(destination.parents):
                if private in folder.parents and folder not in made:
                    made[folder] = folder.stat()
                    words += ["--dir", str(folder), "--chmod", f"{stat.S_IMODE(made[folder].st_mode):o}", str(folder)]
            shown.append(destination)
        for folder in [f for f in made if f == destination or destination in f.parents]:
            del made[folder]  # bound over: the host's own folder now, not one made here
        words += mount
    return words, made


def _give_owners(made: dict[Path, os.stat_result]) -> list[str]:
    """The argv, run as root once bubblewrap has made the `made` folders, that gives each the host's owner and
    group (bubblewrap cannot; chown keeps a folder's mode) before the command starts; nothing when root owns all."""
    pairs = [
        [f"{st.st_uid}:{st.st_gid}", str(folder)] for folder, st in made.items() if (st.st_uid, st.st_gid) != (0, 0)
    ]
    if not pairs:
        return []
    return ["sh", "-c", _GIVE_OWNERS, shutil.which("chown") or "/usr/bin/chown", *(w for p in pairs for w in p), "--"]


def bubblewrap_available() -> bool:
    return shutil.which("bwrap") is not None


def resolve_user(user: str | None) -> pwd.struct_passwd:
    """The user the command runs as: the one named, else whoever called sudo, else `nobody` — never root."""
    if user is None:
        sudo_uid = os.environ.get("SUDO_UID")
        with contextlib.suppress(KeyError, ValueError):
            if sudo_uid and int(sudo_uid) != 0:
                return pwd.getpwuid(int(sudo_uid))
        user = "nobody" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    try:
        pw = pwd.getpwnam(user) if not user.isdigit() else pwd.getpwuid(int(user))
    except KeyError:
        raise SandboxError(f"no such user: {user}") from None
    if pw.pw_uid == 0:
        raise SandboxError("refusing to run the sandboxed command as root: it could leave the namespace")
    return pw


NETNS_DIR = Path("/run/netns")  # where `ip netns` keeps the namespaces it names


def has_namespace(sandbox_id: str) -> bool:
    """Whether the netns sandbox of this id still has its namespace (it runs, or a crashed run left it)."""
    return (NETNS_DIR / f"airlock-{sandbox_id}").exists()


def reap_netns(older_than: float, now: float | None = None) -> list[str]:
    """Remove `airlock run` namespaces left by a crashed run: older than `older_than` seconds, no process inside.
    A name whose namespace is mounted only in another mount namespace is a launcher's there: left alone."""
    now = time.time() if now is None else now
    removed = []
    elsewhere: set[str] | None = None
    for path in sorted(NETNS_DIR.glob("airlock-*")):
        sandbox_id = path.name.removeprefix("airlock-")
        if not SANDBOX_ID.fullmatch(sandbox_id) or path.stat().st_mtime > now - older_than:
            continue
        if not os.path.ismount(path):  # no namespace here (`ip netns pids` then lists nothing)...
            elsewhere = _mounted_elsewhere() if elsewhere is None else elsewhere
            if path.name in elsewhere:
                continue  # ...but one in another mount namespace, whose processes this one cannot list
        if _run(["ip", "netns", "pids", path.name], check=False).stdout.strip():
            continue  # something still runs in it: not a leftover
        leftover = NetnsSandbox(sandbox_id)
        leftover.owned = True  # its run crashed: the reaper takes it over
        leftover.destroy()
        removed.append(sandbox_id)
    return removed


def _mounted_elsewhere() -> set[str]:
    """The names in NETNS_DIR on which another mount namespace of this host has a network namespace mounted: `ip
    netns add` run in a private mount namespace (a launcher under `ip netns exec`, say) mounts it there alone."""
    seen = {os.stat("/proc/self/ns/mnt").st_ino}
    names: set[str] = set()
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or (mnt := (proc / "ns" / "mnt").stat().st_ino) in seen:
                continue
            seen.add(mnt)
            names |= netns_mounts((proc / "mountinfo").read_text())
        except OSError:
            continue  # it ended meanwhile
    return names


def netns_mounts(mountinfo: str) -> set[str]:
    """The names in NETNS_DIR with a network namespace mounted on them, in a /proc/PID/mountinfo text."""
    names = set()
    for line in mountinfo.splitlines():
        fields = line.split()
        with contextlib.suppress(ValueError, IndexError):  # not a mount line
            if fields[fields.index("-") + 1] == "nsfs" and (point := Path(fields[4])).parent == NETNS_DIR:
                names.add(point.name)
    return names
