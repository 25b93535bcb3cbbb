"""The docker harness proves itself: a private dockerd in the gw namespace, sandbox networks whose bridges live in
gw, nothing new in the host namespace, and a stop() that leaves no process, cgroup or state behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import docker
import pytest
from docker.types import IPAMConfig, IPAMPool

from airlock.verify.dockerd import DockerDaemon
from airlock.verify.topology import FakeNet, Topology, alive

from dockerenv import DockerEnv

SMOKE_SUBNET = "10.239.0.0/24"
SMOKE_GATEWAY = "10.239.0.1"
ALLOWED = "192.0.2.10"  # a fakenet upstream that answers on :80
# Names docker gives (or would give) to devices it creates; none may ever show up in the host namespace.
DOCKERISH = re.compile(r"^(docker\d*|br-[0-9a-f]{12}|veth[0-9a-f]+)$")


def host_links() -> dict[str, str]:
    """name -> `ip -o link` line, for the namespace this test process runs in (the host's)."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True, timeout=15).stdout
    return {line.split(": ")[1].split("@")[0]: line for line in out.splitlines()}


def host_bridges() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True, check=True)
    return {line.split(": ")[1].split("@")[0] for line in out.stdout.splitlines()}


def gw_addrs(topology: Topology) -> str:
    return subprocess.run(
        ["ip", "-n", topology.gw, "-o", "addr"], capture_output=True, text=True, check=True, timeout=15
    ).stdout


def same_ns(pid: int, kind: str, path: str) -> bool:
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino == os.stat(path).st_ino


def internal_network(
    client: docker.DockerClient, name: str, subnet: str, gateway: str
) -> docker.models.networks.Network:
    return client.networks.create(
        name,
        driver="bridge",
        internal=True,
        ipam=IPAMConfig(pool_configs=[IPAMPool(subnet=subnet, gateway=gateway)]),
    )


def test_daemon_answers_from_gw_namespace(docker_env: DockerEnv, topology: Topology) -> None:
    assert docker_env.client.ping()
    info = docker_env.client.info()
    assert info["Driver"] == "overlay2"
    assert docker_env.client.images.get(docker_env.image)
    assert docker_env.env == {"DOCKER_HOST": docker_env.host}
    assert docker_env.host == f"unix://{docker_env.daemon.sock}"
    # dockerd sits in gw's network namespace and in a mount namespace of its own, never the host's.
    pid = docker_env.daemon.proc.pid
    assert same_ns(pid, "net", f"/run/netns/{topology.gw}")
    assert not same_ns(pid, "net", "/proc/self/ns/net")
    assert not same_ns(pid, "mnt", "/proc/self/ns/mnt")
    assert (docker_env.daemon.workdir / "key.json").exists()  # not /etc/docker/key.json
    # The docker CLI reaches it through env() alone.
    cli = subprocess.run(
        ["docker", "version", "--format", "{{.Server.Version}}"],
        env={**os.environ, **docker_env.env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == docker_env.client.version()["Version"]


def test_container_on_internal_network(docker_env: DockerEnv, topology: Topology) -> None:
    client = docker_env.client
    links_before, bridges_before = host_links(), host_bridges()
    net = internal_network(client, f"{topology.prefix}-smoke", SMOKE_SUBNET, SMOKE_GATEWAY)
    try:
        # The bridge (with the network's gateway address) is a device of the gateway namespace.
        assert re.search(rf"\binet {re.escape(SMOKE_GATEWAY)}/24\b", gw_addrs(topology)), gw_addrs(topology)
        script = "print(1); print(open('/proc/net/route').read())"
        out = client.containers.run(
            docker_env.image,
            ["python3", "-c", script],
            network=net.name,
            remove=True,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            user="65534:65534",
            read_only=True,
        ).decode()
        assert out.splitlines()[0] == "1"
        # dockerd 20.10 gives containers on an --internal network a default route via the bridge (its "internal"
        # is enforced only by iptables rules, which --iptables=false turns off): every packet goes to gw, and
        # no further (see test_container_cannot_reach_past_gw).
        routes = [line.split() for line in out.splitlines()[2:] if line.strip()]
        gateways = {r[2] for r in routes if r[1] == "00000000"}
        assert gateways <= {"0100EF0A"}, out  # 10.239.0.1, little-endian hex
        # Nothing docker made appeared in the host namespace.
        links_after = host_links()
        new = sorted(set(links_after) - set(links_before))
        assert not [n for n in new if DOCKERISH.match(n)], new
        assert host_bridges() == bridges_before
    finally:
        net.remove()
    assert SMOKE_GATEWAY not in gw_addrs(topology)  # network removal took its bridge along


def test_container_cannot_reach_past_gw(docker_env: DockerEnv, topology: Topology, fakenet: FakeNet) -> None:
    """The gateway namespace does not forward, and dockerd (--ip-forward=false) did not turn that on."""
    sysctl = topology.run(topology.gw, ["sysctl", "-n", "net.ipv4.ip_forward"])
    assert sysctl.stdout.strip() == "0"
    net = internal_network(docker_env.client, f"{topology.prefix}-smoke2", "10.239.2.0/24", "10.239.2.1")
    try:
        # Safe to send: the container's only route is into gw, which has no link to the host.
        res = docker_env.client.containers.run(
            docker_env.image,
            ["sh", "-c", f"curl -sS --max-time 3 http://{ALLOWED}/ ; echo rc=$?"],
            network=net.name,
            remove=True,
            stderr=True,
        ).decode()
        assert "curl: (" in res and "rc=0" not in res, res
    finally:
        net.remove()
    assert fakenet.connections(ALLOWED, 80) == 0
    assert topology.run(topology.gw, ["sysctl", "-n", "net.ipv4.ip_forward"]).stdout.strip() == "0"


@pytest.mark.parametrize("crash", [False, True], ids=["orderly", "after-sigkill"])
def test_stop_leaves_nothing_behind(
    docker_env: DockerEnv, topology: Topology, tmp_path_factory: pytest.TempPathFactory, crash: bool
) -> None:
    """A second, short-lived daemon with its own name (cgroup parent) in the same gw namespace; with `crash`,
    dockerd is SIGKILLed first, orphaning containerd, a shim and a running container, which stop() must find."""
    name = f"{topology.prefix}-d{int(crash)}"
    workdir: Path = tmp_path_factory.mktemp("d2")
    run_containerd_s = set(os.listdir("/run/containerd/s")) if os.path.isdir("/run/containerd/s") else set()
    daemon = DockerDaemon(topology, workdir, name=name).start()
    try:
        client = daemon.client()
        image = daemon.import_image(docker_env.tarball)
        assert image == docker_env.image
        net = internal_network(client, f"{name}-net", "10.239.1.0/24", "10.239.1.1")
        ctr = client.containers.run(image, ["sleep", "300"], network=net.name, detach=True)
        ctr.reload()
        container_pid = ctr.attrs["State"]["Pid"]
        assert ctr.status == "running"
        assert daemon.cgroup_dirs(), "a running container should have created our cgroup parent"
        assert "10.239.1.1/24" in gw_addrs(topology)
        assert len(daemon.our_processes()) >= 3  # dockerd, containerd, a shim
        # shim sockets went to the daemon's private /run, not the host's
        now = set(os.listdir("/run/containerd/s")) if os.path.isdir("/run/containerd/s") else set()
        assert now == run_containerd_s
        pids = daemon.our_processes()
        if crash:
            os.kill(daemon.proc.pid, signal.SIGKILL)
            daemon.proc.wait(10)
            assert daemon.our_processes(), "containerd and the shim outlive a SIGKILLed dockerd"
    finally:
        daemon.stop()
    assert not daemon.alive()
    assert daemon.our_processes() == []
    assert not [pid for pid in [*pids, container_pid] if alive(pid)]
    assert daemon.cgroup_dirs() == []
    assert list(Path("/sys/fs/cgroup").glob(f"*/{name}")) == []
    assert not daemon.data_root.exists() and not daemon.exec_root.exists() and not daemon.sock.exists()
    assert "10.239.1.1" not in gw_addrs(topology)
    daemon.stop()  # idempotent
    # The session's daemon is untouched.
    assert docker_env.client.ping()
