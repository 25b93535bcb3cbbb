"""A private docker daemon living in a topology's gateway namespace: `airlock verify --backend docker` runs its
sandbox there, and the docker end-to-end tests theirs (it is sealed from the real network, as a user's daemon,
whose bridges are the host's, cannot be).

    ns <p>-sbx --veth-- ns <p>-gw --veth-- ns <p>-net
                        dockerd here: every sandbox network's bridge appears in gw, whose only other link is the
                        fake internet; nothing of docker's touches the host namespace.

How it runs (and why):
- `nsenter --net=/run/netns/<gw>`, not `ip netns exec`: the latter remounts /sys, which hides /sys/fs/cgroup from
  dockerd. `unshare --mount --propagation slave` then gives it a mount namespace of its own, so overlay2 and
  netns bind mounts never show up on the host, and a fresh tmpfs over /run inside it keeps every hard-wired /run
  path (/run/docker/plugins, containerd's /run/containerd/s shim sockets, and the system containerd socket,
  which dockerd 20.10 would otherwise *use* if a host containerd were running) away from the host.
- `--bridge=none --iptables=false --ip6tables=false --ip-masq=false --ip-forward=false --userland-proxy=false`:
  no default bridge, no NAT, no forwarding, no firewall changes; gw's `ip_forward=0` stays.
- Its own `--config-file` (the host's /etc/docker/daemon.json is never read) that moves the trust key, which
  dockerd 20.10 would otherwise write to /etc/docker/key.json, into the workdir.
- `--cgroup-parent=/<name>`: containers' cgroups live under /sys/fs/cgroup/*/<name>, removed by stop().
- Data root, exec root, socket, pidfile and log all live under `workdir`.

stop() removes every container and network, stops dockerd by PID (TERM, then KILL), kills anything of this
daemon that is left (containerd, shims: matched by our workdir in their command line; processes in our cgroups),
removes the cgroup directories and the data/exec roots. It is idempotent and also registered with atexit.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import docker

from airlock.verify.topology import Topology, alive, stop_pid

IMAGE_REPO = "airlock-test"
# Networks created without an explicit subnet come from here (instead of docker's 172.17-31/192.168 pools);
# it is only ever routed inside gw.
DEFAULT_POOL = "base=10.238.0.0/16,size=24"
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{1,30}$")
_SOCK_MAX = 100  # sun_path is 108 bytes; containerd's sockets sit ~30 characters below the exec root
_OUR_COMMS = ("dockerd", "containerd", "runc", "docker-init", "docker-proxy")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Runs inside the new mount namespace: a private /run, then dockerd.
_LAUNCH = 'mount -t tmpfs -o mode=0755,size=16m airlock-docker-run /run && exec "$@"'


DAEMON_TOOLS = ("dockerd", "nsenter", "unshare")
_PACKAGES = {"dockerd": "docker.io", "debootstrap": "debootstrap", "nsenter": "util-linux", "unshare": "util-linux"}


def docker_problem(also: tuple[str, ...] = ()) -> str | None:
    """Why a private daemon cannot run here (a tool missing; `also`: further tools the caller needs), or None."""
    missing = [tool for tool in (*DAEMON_TOOLS, *also) if shutil.which(tool) is None]
    if missing:
        packages = " ".join(dict.fromkeys(_PACKAGES.get(tool, tool) for tool in missing))
        return f"not found on PATH: {', '.join(missing)} (apt-get install {packages})"
    return None


def image_tag(tar_path: Path) -> str:
    """airlock-test:<hash12> for scripts/build-test-image's test-image-<hash>.tar (else a hash of the file)."""
    match = re.fullmatch(r"test-image-([0-9a-f]{12,})\.tar", tar_path.name)
    if match:
        return f"{IMAGE_REPO}:{match.group(1)[:12]}"
    digest = hashlib.sha256()
    with tar_path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return f"{IMAGE_REPO}:{digest.hexdigest()[:12]}"


class DockerDaemon:
    def __init__(self, topology: Topology, workdir: Path, name: str | None = None) -> None:
        self.topology = topology
        self.name = name or topology.prefix  # cgroup parent; unique per run
        if not _NAME_RE.match(self.name):
            raise ValueError(f"bad daemon name {self.name!r}: want [a-z][a-z0-9-]{{1,30}}")
        self.workdir = Path(workdir).resolve()
        self.data_root = self.workdir / "root"
        self.exec_root = self.workdir / "exec"
        self.sock = self.workdir / "docker.sock"
        self.pidfile = self.workdir / "docker.pid"
        self.log_path = self.workdir / "dockerd.log"
        self.config_path = self.workdir / "daemon.json"
        longest = max(len(str(self.sock)), len(str(self.exec_root / "containerd" / "containerd.sock.ttrpc")))
        if longest > _SOCK_MAX:
            raise ValueError(f"workdir {self.workdir} is too long for unix socket paths; use a shorter one")
        self.proc: subprocess.Popen[bytes] | None = None
        self._client: docker.DockerClient | None = None
        self._api_version: str | None = None
        self._bridges: set[str] = set()  # bridge devices of our networks, seen while the daemon was up
        self._cleaned = False  # containers and networks were removed through the API

    @property
    def host(self) -> str:
        return f"unix://{self.sock}"

    def env(self) -> dict[str, str]:
        return {"DOCKER_HOST": self.host}

    # ------------------------------------------------------------------------------------------- lifecycle

    def argv(self) -> list[str]:
        return [
            "nsenter", f"--net=/run/netns/{self.topology.gw}", "--",
            "unshare", "--mount", "--propagation", "slave", "--",
            "sh", "-c", _LAUNCH, "sh",
            "dockerd",
            "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-masq=false", "--ip-forward=false",
            "--userland-proxy=false", "--storage-driver=overlay2", f"--cgroup-parent=/{self.name}",
            f"--default-address-pool={DEFAULT_POOL}", f"--config-file={self.config_path}",
            f"--data-root={self.data_root}", f"--exec-root={self.exec_root}", f"--pidfile={self.pidfile}",
            "-H", self.host,
        ]  # fmt: skip

    def start(self, timeout: float = 20) -> DockerDaemon:
        if self.proc is not None:
            return self
        problem = docker_problem()
        if problem:
            raise RuntimeError(problem)
        self.topology._check_ns(self.topology.gw)  # only ever inside a live namespace of this run
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps({"deprecated-key-path": str(self.workdir / "key.json")}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
        env["PATH"] = _PATH
        atexit.register(self.stop)
        try:
            with self.log_path.open("wb") as log:
                # start_new_session: ^C goes to the caller, which stops the daemon; nsenter, unshare and sh all exec,
                # so proc.pid is dockerd's PID.
                self.proc = subprocess.Popen(
                    self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=env, start_new_session=True,
                )  # fmt: skip
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dockerd exited with {self.proc.returncode}:\n{self.log()}")
            if self.sock.exists():
                try:
                    probe = docker.DockerClient(base_url=self.host, version="auto", timeout=5)
                    try:
                        probe.info()
                        self._api_version = probe.api.api_version
                    finally:
                        probe.close()
                    return
                except Exception as exc:  # not up yet; keep the last error for the message
                    last = exc
            time.sleep(0.1)
        raise RuntimeError(f"dockerd did not answer `docker info` within {timeout}s ({last!r}):\n{self.log()}")

    def client(self) -> docker.DockerClient:
        if self._client is None:
            if self.proc is None:
                raise RuntimeError("docker daemon not started")
            self._client = docker.DockerClient(base_url=self.host, version=self._api_version or "auto", timeout=120)
        return self._client

    def import_image(self, tar_path: Path | str, tag: str | None = None) -> str:
        """`docker import` a rootfs tarball (with a PATH, which a bare rootfs lacks); returns the image tag."""
        tar_path = Path(tar_path)
        tag = tag or image_tag(tar_path)
        repository, _, version = tag.partition(":")
        self.client().api.import_image(
            src=str(tar_path), repository=repository, tag=version or "latest", changes=[f"ENV PATH={_PATH}"]
        )
        self.client().images.get(tag)  # raises if the import did not produce it
        return tag

    def log(self, tail: int = 200) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-tail:])

    def stop(self) -> None:
        """Idempotent: remove containers and networks, stop dockerd and everything it left, clean up the disk."""
        atexit.unregister(self.stop)
        if self.proc is not None and self.proc.poll() is None:
            self._remove_objects()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        for pid in self._daemon_pids():
            stop_pid(pid, wait=20)  # dockerd stops its containerd before exiting
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        self._kill_leftovers()
        self._remove_cgroups()
        self._remove_bridges()
        for path in (self.data_root, self.exec_root):
            if path.exists():
                # Our mounts lived in dockerd's private mount namespace, so there are none here; still never
                # let rm cross into one.
                subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False, timeout=120)
        for path in (self.sock, self.pidfile):
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------------- cleanup

    def _remove_objects(self) -> None:
        try:
            cli = docker.DockerClient(base_url=self.host, version=self._api_version or "auto", timeout=30)
        except Exception:  # daemon not answering: the kill below still cleans up
            return
        try:
            for ctr in cli.containers.list(all=True):
                with contextlib.suppress(Exception):
                    ctr.remove(force=True)
            for net in cli.networks.list():
                if net.name in ("bridge", "host", "none"):
                    continue
                options = net.attrs.get("Options") or {}
                self._bridges.add(options.get("com.docker.network.bridge.name") or f"br-{(net.id or '')[:12]}")
                with contextlib.suppress(Exception):
                    net.remove()
            self._cleaned = True
        except Exception:
            pass
        finally:
            cli.close()

    def _daemon_pids(self) -> list[int]:
        pids = []
        if self.proc is not None and self.proc.poll() is None:
            pids.append(self.proc.pid)
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.pidfile.read_text().strip())
            if pid not in pids and str(self.pidfile).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)  # only a dockerd that was given *our* pidfile
        return pids

    def our_processes(self) -> list[int]:
        """PIDs of dockerd/containerd/shims/runc of this daemon (their command lines name our workdir)."""
        mark = str(self.workdir).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                comm = (entry / "comm").read_text().strip()
                if comm.startswith(_OUR_COMMS) and mark in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def cgroup_dirs(self) -> list[Path]:
        """Our cgroup-parent directories (v1: one per hierarchy; v2: one), never a hierarchy's mount point."""
        root = Path("/sys/fs/cgroup")
        candidates = [*root.glob(f"*/{self.name}"), root / self.name]
        return [p for p in candidates if p.is_dir() and (p / "cgroup.procs").exists() and not os.path.ismount(p)]

    def _kill_leftovers(self) -> None:
        for pid in self.our_processes():
            with contextlib.suppress(Exception):
                stop_pid(pid, wait=5)
        for cg in self.cgroup_dirs():
            for procs in cg.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    for word in procs.read_text().split():
                        with contextlib.suppress(ProcessLookupError, ValueError):
                            os.kill(int(word), signal.SIGKILL)  # a container process of our daemon

    def _remove_cgroups(self, timeout: float = 5) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = []
            for cg in self.cgroup_dirs():
                for dirpath, _, _ in sorted(os.walk(cg), key=lambda t: -len(t[0])):  # deepest first
                    try:
                        os.rmdir(dirpath)
                    except OSError:
                        left.append(dirpath)
            if not left:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cgroup dirs of docker daemon {self.name} would not go: {left}")
            time.sleep(0.1)

    def _bridges_in_store(self) -> set[str]:
        """Bridge names of every network libnetwork recorded (its bolt store keeps them as plain JSON), so even
        after a crashed daemon we know exactly which devices in gw were ours."""
        store = self.data_root / "network" / "files" / "local-kv.db"
        try:
            raw = store.read_bytes()
        except OSError:
            return set()
        return {m.decode() for m in re.findall(rb'"BridgeName":"([A-Za-z0-9_.-]{1,15})"', raw)}

    def _remove_bridges(self) -> None:
        """Delete bridge devices of our networks that are still in gw (docker leaves them when it dies)."""
        gw = self.topology.gw
        # After an orderly removal the store only holds stale names; consult it when the daemon was not answering.
        ours = self._bridges | (set() if self._cleaned else self._bridges_in_store())
        self._bridges.clear()
        if not ours or gw not in self.topology._owned:
            return  # no networks, or the namespace (and every device in it) is gone already
        out = subprocess.run(
            ["ip", "-n", gw, "-o", "link", "show", "type", "bridge"], capture_output=True, text=True, timeout=15
        ).stdout
        present = {line.split(": ")[1].split("@")[0] for line in out.splitlines() if ": " in line}
        for dev in sorted(ours & present):
            subprocess.run(["ip", "-n", gw, "link", "del", dev], capture_output=True, check=False, timeout=15)

    def alive(self) -> bool:
        return any(alive(pid) for pid in self._daemon_pids())

    def __enter__(self) -> DockerDaemon:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
