"""The sandbox pod (deploy/kubernetes/base/sandbox-pod.yaml) as real containers: airlock's image for the fence and
the gateway sidecar, the test image as the agent, each container built from the spec (podspec.py), all of them in
the network namespace of one pause container, as a kubelet runs a pod.

    ns <p>-gw: dockerd, and <p>-gn, parent of the pod network's macvlan --veth-- <p>-ng in ns <p>-net
    pause container: eth0 (macvlan on <p>-gn, POD_SUBNET), default route via POD_ROUTER (an address of <p>-ng)

The pod network leads only to the fake internet: a macvlan child talks to its parent's link (the net namespace), never
to the gw namespace it hangs off, and the net namespace routes nowhere else. Each assertion made inside the agent's
container has its evidence outside: the fake internet's counters and the gateway's audit lines."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airlock.verify.topology import DNS_SERVER, FAKE_ADDRS, FakeNet, Topology

from dockerenv import DockerEnv
from gateway_proc import AIRLOCK, E2E_POLICY
from pod import PROBE
from podspec import Node, check_pod, load_pod_spec, run_argv, volume_commands

# The first test's setup may build airlock's image (scripts/build-image: a minute cold, more on a busy machine; CI
# builds it ahead, and an unchanged tree imports at once).
pytestmark = pytest.mark.timeout(600)
SPEC = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base" / "sandbox-pod.yaml"
POD_SUBNET, POD_ROUTER = "10.251.0.0/24", "10.251.0.1"
ALLOWED_IP, EVIL_IP, METADATA_IP = "192.0.2.10", "203.0.113.66", "169.254.169.254"
PROXY, TRANSPARENT, DNS, RELAY, ADMIN = 3128, 3129, 5353, 8080, 8081
GATEWAY_PYTHON = "/opt/airlock/python/bin/python3"
AUDIT_FLUSH = 0.3  # the gateway writes its audit lines out every 100 ms
# The test image (the agent's stand-in) has no command of its own: what the agent's image would run.
AGENT_COMMAND = ("sleep", "infinity")


def docker(env: DockerEnv, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, env=env.env | _path())
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])} ... failed ({result.returncode}): {result.stderr}")
    return result


def _path() -> dict[str, str]:
    return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


class DockerPod:
    """The pod: its network (a macvlan towards the fake internet), pause container, volumes and containers."""

    def __init__(self, topology: Topology, env: DockerEnv, image: str, workdir: Path) -> None:
        self.topology, self.env, self.workdir = topology, env, workdir
        self.name = f"{topology.prefix}-pod"
        self.network, self.pause = f"{self.name}-net", f"{self.name}-pause"
        self.spec = load_pod_spec(SPEC)
        check_pod(self.spec)
        seccomp_root = workdir / "seccomp"
        self.node = Node(
            pod=self.name, network=self.pause, files_dir=workdir / "files", seccomp_root=seccomp_root,
            images={"airlock:0.1.0": image, "airlock-agent:0.1.0": env.image},
            commands={"agent": AGENT_COMMAND},
            files={"airlock-policy": {"policy.yaml": E2E_POLICY.read_text()},
                   "airlock-sandbox-broker-token": {"token": "pod-token-of-the-test\n"}},
            mounts=[f"type=bind,src={workdir / 'resolv.conf'},dst=/etc/resolv.conf,readonly"],
        )  # fmt: skip
        self.image = image
        self.volumes: list[str] = []

    def container(self, name: str) -> str:
        return f"{self.name}-{name}"

    def spec_container(self, name: str) -> dict[str, Any]:
        containers = [*self.spec.get("initContainers", []), *self.spec["containers"]]
        return next(c for c in containers if c["name"] == name)

    # ------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._node_files()
        self._network()
        docker(self.env, "run", "--detach", f"--name={self.pause}", f"--network={self.network}",
               f"--hostname={self.name}", "--user=65535:65535", "--cap-drop=ALL", "--read-only",
               "--security-opt=no-new-privileges", "--entrypoint=sleep", self.image, "infinity")  # fmt: skip
        self._assert_routes_inside()
        creates, sources = volume_commands(self.spec, self.node)
        for create in creates:
            docker(self.env, *create)
            self.volumes.append(create[-1])
        for container in self.spec.get("initContainers", []):
            sidecar = container.get("restartPolicy") == "Always"
            argv = run_argv(container, self.spec, self.node, sources, detach=sidecar)
            ran = docker(self.env, *argv, timeout=120, check=False)
            assert ran.returncode == 0, f"init container {container['name']}: {ran.stdout}{ran.stderr}"
            if sidecar:
                self.wait_gateway()
        for container in self.spec["containers"]:
            docker(self.env, *run_argv(container, self.spec, self.node, sources, detach=True))

    def _node_files(self) -> None:
        """What the node has: the seccomp profile (`airlock seccomp-profile`), the pod's resolv.conf."""
        profile = self.node.seccomp_root / "airlock" / "agent.json"
        profile.parent.mkdir(parents=True)
        printed = subprocess.run([AIRLOCK, "seccomp-profile"], capture_output=True, text=True, check=True)
        profile.write_text(printed.stdout)
        (self.workdir / "resolv.conf").write_text(f"nameserver {DNS_SERVER}\noptions timeout:2 attempts:1\n")
        (self.workdir / "resolv.conf").chmod(0o644)

    def _network(self) -> None:
        net = self.topology.net
        subprocess.run(["ip", "-n", net, "addr", "add", f"{POD_ROUTER}/24", "dev", self.topology.net_if], check=True)
        docker(self.env, "network", "create", "--driver=macvlan", f"--subnet={POD_SUBNET}", f"--gateway={POD_ROUTER}",
               f"--opt=parent={self.topology.gw_net_if}", "--opt=macvlan_mode=bridge", self.network)  # fmt: skip

    def _assert_routes_inside(self) -> None:
        """The pod's namespace has lo and eth0 alone, and everything it dials leaves by eth0, towards net."""
        links = self.nsenter("ip", "-o", "link").stdout
        assert sorted(line.split(": ")[1].split("@")[0] for line in links.splitlines()) == ["eth0", "lo"], links
        eth0 = self.nsenter("ip", "-d", "-o", "link", "show", "eth0").stdout
        assert " macvlan mode bridge " in eth0, eth0  # a child of <p>-gn: its frames go to the net namespace alone
        for destination in (*FAKE_ADDRS, "8.8.8.8", "1.1.1.1", "10.254.0.1", "10.253.0.1"):
            route = self.nsenter("ip", "route", "get", destination).stdout
            assert re.search(r"\bdev eth0\b", route), route

    def nsenter(self, *argv: str) -> subprocess.CompletedProcess[str]:
        pid = docker(self.env, "inspect", "--format={{.State.Pid}}", self.pause).stdout.strip()
        return subprocess.run(["nsenter", "-t", pid, "-n", *argv], capture_output=True, text=True, timeout=15)

    def stop(self) -> None:
        names = [self.container(c["name"]) for c in [*self.spec.get("initContainers", []), *self.spec["containers"]]]
        docker(self.env, "rm", "--force", *names, self.pause, check=False)
        for volume in self.volumes:
            docker(self.env, "volume", "rm", "--force", volume, check=False)
        docker(self.env, "network", "rm", self.network, check=False)
        subprocess.run(["ip", "-n", self.topology.net, "addr", "del", f"{POD_ROUTER}/24", "dev", self.topology.net_if],
                       capture_output=True, check=False)  # fmt: skip

    # ------------------------------------------------------------------------------------------- the gateway

    def wait_gateway(self, starts: int = 1, timeout: float = 60) -> None:
        """Until the gateway has said it listens `starts` times (once per start of its container)."""
        deadline = time.monotonic() + timeout
        while True:
            logs = docker(self.env, "logs", self.container("airlock-gateway"), check=False)
            if logs.stderr.count("proxy on") >= starts:
                return
            state = docker(self.env, "inspect", "--format={{.State.Status}}", self.container("airlock-gateway"))
            assert time.monotonic() < deadline and state.stdout.strip() in ("created", "running", "restarting"), (
                f"the gateway did not start ({state.stdout.strip()}):\n{logs.stdout}{logs.stderr}"
            )
            time.sleep(0.2)

    def audit(self) -> list[dict[str, Any]]:
        """The gateway's audit records so far (--audit-stdout: one JSON object a line), its DNS answers left out."""
        out = docker(self.env, "logs", self.container("airlock-gateway")).stdout
        return [
            r
            for r in map(json.loads, (line for line in out.splitlines() if line.startswith("{")))
            if r["kind"] != "dns"
        ]

    def audit_mark(self) -> int:
        """How many records there are once the gateway wrote out what it holds (it flushes every 100 ms)."""
        time.sleep(AUDIT_FLUSH)
        return len(self.audit())

    def records_since(self, mark: int, count: int, timeout: float = 5) -> list[dict[str, Any]]:
        """The records after `mark`, once there are `count` of them (or the timeout passed), and a flush later."""
        deadline = time.monotonic() + timeout
        while len(self.audit()) - mark < count and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(AUDIT_FLUSH)  # one that should not be there would be by now
        return self.audit()[mark:]

    # ------------------------------------------------------------------------------------------- the agent

    def agent(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return docker(self.env, "exec", self.container("agent"), *argv, timeout=timeout, check=False)

    def probe(self, kind: str, host: str, port: int, *rest: str, container: str = "agent") -> str:
        python = GATEWAY_PYTHON if container == "airlock-gateway" else "python3"
        argv = ["exec", self.container(container), python, "-I", "-c", PROBE, kind, host, str(port), *rest]
        return docker(self.env, *argv, check=False).stdout.strip()

    def curl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.agent("curl", "-sS", "--max-time", "10", *args)


@pytest.fixture(scope="module")
def pod(
    topology: Topology, fakenet: FakeNet, docker_env: DockerEnv, airlock_image: str, tmp_path_factory: Any
) -> Iterator[DockerPod]:
    made = DockerPod(topology, docker_env, airlock_image, tmp_path_factory.mktemp("pod"))
    try:
        made.start()
        yield made
    finally:
        made.stop()


# ------------------------------------------------------------------------------------------- the image


def test_the_image_runs_airlock_as_the_gateways_user(docker_env: DockerEnv, airlock_image: str) -> None:
    config = json.loads(docker(docker_env, "image", "inspect", airlock_image).stdout)[0]["Config"]
    assert config["User"] == "10001" and config["Entrypoint"] == ["/opt/airlock/venv/bin/airlock"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == airlock_image.split(":")[1] == "0.1.0"
    assert labels["org.opencontainers.image.title"] == "airlock"
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", labels["org.opencontainers.image.revision"])
    ran = docker(docker_env, "run", "--rm", "--network=none", airlock_image, "--version")
    assert ran.stdout == "airlock 0.1.0\n"
    whoami = docker(docker_env, "run", "--rm", "--network=none", "--entrypoint=id", airlock_image)
    assert whoami.stdout == "uid=10001(airlock) gid=10001(airlock) groups=10001(airlock)\n"


# ------------------------------------------------------------------------------------------- the pod


def test_the_containers_are_the_specs(pod: DockerPod) -> None:
    agent = json.loads(docker(pod.env, "inspect", pod.container("agent")).stdout)[0]
    host = agent["HostConfig"]
    assert agent["Config"]["User"] == "10002:10002" and host["ReadonlyRootfs"] and host["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in host["SecurityOpt"] and any(o.startswith("seccomp=") for o in host["SecurityOpt"])
    pause_id = docker(pod.env, "inspect", "--format={{.Id}}", pod.pause).stdout.strip()
    assert host["NetworkMode"] == f"container:{pause_id}" and host["Memory"] == 2 * 2**30
    status = pod.agent("sh", "-c", "id -u; grep -E '^(NoNewPrivs|Seccomp|CapEff):' /proc/self/status")
    assert status.stdout.split() == ["10002", "CapEff:", "0000000000000000", "NoNewPrivs:", "1", "Seccomp:", "2"]
    fence = json.loads(docker(pod.env, "inspect", pod.container("airlock-fence")).stdout)[0]
    assert fence["State"]["Status"] == "exited" and fence["State"]["ExitCode"] == 0
    assert fence["HostConfig"]["CapAdd"] in (["NET_ADMIN"], ["CAP_NET_ADMIN"])  # as the engine's version spells it
    gateway = json.loads(docker(pod.env, "inspect", pod.container("airlock-gateway")).stdout)[0]
    assert gateway["Config"]["User"] == "10001:10001" and gateway["HostConfig"]["CapDrop"] == ["ALL"]


def test_the_agent_sees_the_volumes_the_spec_gives_it_and_no_other(pod: DockerPod) -> None:
    # The gateway publishes its trust bundle in the shared volume; the agent reads it (SSL_CERT_FILE), cannot change
    # it, never sees the broker token, and writes only to its workspace and /tmp.
    script = (
        'grep -c "BEGIN CERTIFICATE" "$SSL_CERT_FILE"; touch /var/run/airlock/trust/x 2>/dev/null || echo trust ro; '
        "test -e /var/run/airlock/broker/token || echo no token; touch /x 2>/dev/null || echo root ro; "
        'touch /tmp/x /workspace/x && echo writable; echo "$HOME $(pwd)"'
    )
    seen = pod.agent("sh", "-c", script).stdout.splitlines()
    assert int(seen[0]) >= 1 and seen[1:] == ["trust ro", "no token", "root ro", "writable", "/workspace /workspace"]


def test_the_fence_in_place_is_the_one_the_spec_asks_for(pod: DockerPod) -> None:
    # `--check` with the fence container's own arguments, in a container of the pod that may read nftables.
    args = pod.spec_container("airlock-fence")["args"]
    check = docker(pod.env, "run", "--rm", f"--network=container:{pod.pause}", "--user=0", "--cap-drop=ALL",
                   "--cap-add=NET_ADMIN", pod.image, *args, "--check", check=False)  # fmt: skip
    assert check.returncode == 0 and "redirect to :3129" in check.stdout, check.stdout + check.stderr


def test_an_allowed_host_is_reached_through_the_proxy_and_transparently(pod: DockerPod, fakenet: FakeNet) -> None:
    mark = pod.audit_mark()
    proxied = pod.curl("http://allowed.test/proxied")  # the spec's HTTP_PROXY
    assert proxied.stdout == f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/proxied\n", proxied.stderr
    direct = pod.curl("--noproxy", "*", "http://allowed.test/direct")  # its DNS and its TCP, both redirected
    assert direct.stdout == f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/direct\n", direct.stderr
    assert fakenet.connections(ALLOWED_IP, 80) == 2 and fakenet.total_connections() == 2
    records = pod.records_since(mark, 2)
    assert [(r["host"], r["decision"]) for r in records] == [("allowed.test", "allow")] * 2, records


@pytest.mark.parametrize("host", [EVIL_IP, "8.8.8.8", POD_ROUTER, "10.254.0.1"])
def test_direct_tcp_to_any_other_address_reaches_only_the_gateway(pod: DockerPod, fakenet: FakeNet, host) -> None:
    mark = pod.audit_mark()
    refused = pod.curl("--noproxy", "*", "-o", "/dev/null", "-w", "%{http_code}", f"http://{host}/")
    assert refused.stdout == "403", refused
    assert fakenet.total_connections() == 0
    records = pod.records_since(mark, 1)
    assert [(r["host"], r["decision"]) for r in records] == [(host, "deny")], records


@pytest.mark.parametrize("host", [ALLOWED_IP, EVIL_IP, DNS_SERVER, "8.8.8.8"])
def test_udp_and_icmp_to_any_address_are_refused_at_once(pod: DockerPod, host: str) -> None:
    started = time.monotonic()
    assert pod.probe("udp", host, 443) in ("ECONNREFUSED", "EPERM")
    assert pod.probe("ping", host, 0) in ("ECONNREFUSED", "EPERM")
    assert time.monotonic() - started < 4  # refused, not timed out
    assert pod.probe("ping", "127.0.0.1", 0) == "reply"  # the agent may ping: the fence, not a sysctl, refuses


@pytest.mark.parametrize("resolver", [DNS_SERVER, "8.8.8.8", "127.0.0.53"])
def test_dns_to_any_resolver_is_answered_by_the_gateway(pod: DockerPod, fakenet: FakeNet, resolver: str) -> None:
    assert pod.probe("dns", resolver, 53, "unlisted.example") == "REFUSED"
    assert fakenet.dns_queries("unlisted.example") == 0  # nothing forwarded
    assert pod.probe("dns", resolver, 53, "allowed.test") == "NOERROR"


def test_cloud_metadata_is_refused_by_address_and_by_name(pod: DockerPod, fakenet: FakeNet) -> None:
    mark = pod.audit_mark()
    literal = pod.curl("--noproxy", "*", "-o", "/dev/null", "-w", "%{http_code}", f"http://{METADATA_IP}/latest/")
    proxied = pod.curl("-o", "/dev/null", "-w", "%{http_code}", f"http://{METADATA_IP}/latest/")
    named = pod.curl("-o", "/dev/null", "-w", "%{http_code}", "http://meta.allowed.test/latest/")
    assert (literal.stdout, proxied.stdout, named.stdout) == ("403", "403", "403"), (literal, proxied, named)
    assert fakenet.total_connections() == 0
    records = pod.records_since(mark, 3)
    assert len(records) == 3 and {r["decision"] for r in records} == {"deny"}, records


def test_sni_and_host_fronting_are_refused(pod: DockerPod, fakenet: FakeNet) -> None:
    mark = pod.audit_mark()
    # An allowed address, another name in the TLS handshake (curl's SNI is the URL's host, --resolve its address).
    sni = pod.curl("--noproxy", "*", "--insecure", "--resolve", f"evil.test:443:{ALLOWED_IP}", "https://evil.test/")
    assert sni.returncode != 0 and sni.stdout == "", sni
    host = pod.curl("--noproxy", "*", "-o", "/dev/null", "-w", "%{http_code}", "-H", "Host: evil.test",
                    f"http://{ALLOWED_IP}/")  # fmt: skip
    proxied = pod.curl("-o", "/dev/null", "-w", "%{http_code}", "-H", "Host: evil.test", "http://allowed.test/")
    assert (host.stdout, proxied.stdout) == ("403", "403"), (host, proxied)
    assert fakenet.total_connections() == 0
    records = pod.records_since(mark, 3)
    assert len(records) == 3 and {r["decision"] for r in records} == {"deny"}, records


def test_another_port_of_an_allowed_host_is_refused(pod: DockerPod, fakenet: FakeNet) -> None:
    proxied = pod.curl("-o", "/dev/null", "-w", "%{http_code}", "http://allowed.test:8080/")
    direct = pod.curl("--noproxy", "*", "-o", "/dev/null", "-w", "%{http_code}", f"http://{ALLOWED_IP}:8080/")
    assert (proxied.stdout, direct.stdout) == ("403", "403"), (proxied, direct)
    assert fakenet.total_connections() == 0


@pytest.mark.parametrize("port", [ADMIN, TRANSPARENT, DNS])
def test_the_gateways_own_ports_are_refused_to_the_agent_by_loopback(pod: DockerPod, port: int) -> None:
    assert pod.probe("tcp", "127.0.0.1", port, container="airlock-gateway") == "connected"  # they listen
    assert pod.probe("tcp", "127.0.0.1", port) == "ECONNREFUSED"
    assert pod.probe("tcp", "127.0.0.1", PROXY) == "connected"  # the proxy port is the one it may dial
    assert pod.probe("tcp", "127.0.0.1", RELAY) == "connected"  # and the broker relay (AIRLOCK_BROKER_URL)


def test_with_the_gateway_killed_the_agent_has_no_network_and_its_restart_restores_it(
    pod: DockerPod, fakenet: FakeNet
) -> None:
    docker(pod.env, "kill", pod.container("airlock-gateway"))  # docker does not restart what it was told to kill
    try:
        assert pod.probe("tcp", ALLOWED_IP, 80) == "ECONNREFUSED"  # the redirect lands on a closed loopback port
        assert pod.probe("tcp", "1.1.1.1", 443) == "ECONNREFUSED"
        assert pod.probe("tcp", "127.0.0.1", PROXY) == "ECONNREFUSED"
        assert pod.probe("dns", DNS_SERVER, 53, "allowed.test") == "ECONNREFUSED"
        assert pod.probe("udp", ALLOWED_IP, 443) in ("ECONNREFUSED", "EPERM")
        assert pod.curl("http://allowed.test/").returncode != 0
        assert fakenet.total_connections() == 0 and fakenet.dns_queries("allowed.test") == 0
    finally:
        docker(pod.env, "start", pod.container("airlock-gateway"))
        pod.wait_gateway(starts=2)
    restored = pod.curl("http://allowed.test/again")
    assert restored.stdout == f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/again\n", restored.stderr
    assert fakenet.connections(ALLOWED_IP, 80) == 1
