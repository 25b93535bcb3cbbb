"""The docker backend with real containers. dockerd runs inside the test's gateway namespace, so the sandbox
networks' bridges, the embedded gateway and the fence all live where everything dialled lands in the fake
internet or nowhere. Each denial also asserts that the fake internet counted zero connections."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airlock.broker.grants import parse_grant
from airlock.gateway import Gateway
from airlock.gateway.config import GatewayConfig
from airlock.launch.docker_launcher import launch
from airlock.policy import load_policy
from airlock.sandbox import docker as docker_backend
from airlock.sandbox.docker import LABEL, DockerSandbox, Limits, fence_table
from airlock.sandbox.docker_reaper import remove_sandbox
from airlock.sandbox.fence import Fence
from airlock.verify.topology import DNS_SERVER, GW_OUTSIDE_IP, FakeNet, Topology

from gateway_proc import AIRLOCK, E2E_POLICY
from netclient import SENDER, ForeignListeners, in_netns
from syscalls import expected_in_a_sandbox, probe_argv, results

ALLOWED_IP = "192.0.2.10"
_ids = itertools.count()

# What a sandboxed script can use to find its gateway: the proxy variable names it.
FIND_GATEWAY = "import os; gw = os.environ['HTTP_PROXY'].split('//')[1].split(':')[0]"
PROBE = (
    FIND_GATEWAY
    + """
import socket, sys
for host, port in [(h.replace('GW', gw), int(p)) for h, p in (a.split(':') for a in sys.argv[1:])]:
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect((host, port)); print(host, port, 'open')
    except OSError as e:
        print(host, port, 'blocked', type(e).__name__)
    finally:
        s.close()
"""
)


@pytest.fixture
def docker_run(topology: Topology, fakenet: FakeNet, docker_env: Any):
    """`airlock run --backend docker` inside the gateway namespace; afterwards nothing of it may remain."""
    started: list[str] = []

    def argv(*cmd: str, options: tuple[str, ...] = ()) -> list[str]:
        sandbox_id = f"{topology.prefix}k{next(_ids)}"
        started.append(sandbox_id)
        return [
            AIRLOCK, "run", "--backend", "docker", "--image", docker_env.image, "--policy", str(E2E_POLICY),
            "--upstream-dns", DNS_SERVER, "--sandbox-id", sandbox_id, *options, "--", *cmd,
        ]  # fmt: skip

    def run(*cmd: str, options: tuple[str, ...] = (), timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return topology.run(topology.gw, argv(*cmd, options=options), timeout=timeout, env=_env(docker_env))

    run.argv = argv  # type: ignore[attr-defined]
    yield run
    for sandbox_id in started:
        assert not docker_env.client.containers.list(all=True, filters={"label": f"{LABEL}={sandbox_id}"})
        assert not docker_env.client.networks.list(filters={"label": f"{LABEL}={sandbox_id}"})
        assert fence_table(sandbox_id) not in topology.run(topology.gw, ["nft", "list", "tables"]).stdout


def _env(docker_env: Any) -> dict[str, str]:
    return {**os.environ, **docker_env.env}


def test_allowed_request_through_the_proxy(docker_run, fakenet: FakeNet):
    result = docker_run("curl", "-sS", "--max-time", "10", "http://allowed.test/from-docker")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/from-docker\n"
    assert "backend docker" in result.stderr
    assert fakenet.connections(ALLOWED_IP, 80) == 1


def test_unlisted_host_is_denied(docker_run, fakenet: FakeNet):
    result = docker_run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "http://evil.test/")
    assert result.stdout == "403"
    assert fakenet.total_connections() == 0


def test_clients_that_ignore_the_proxy_get_the_same_policy(docker_run, fakenet: FakeNet):
    script = (
        "curl -sS --noproxy '*' --max-time 5 http://allowed.test/direct; "
        "curl -s --noproxy '*' --max-time 5 -o /dev/null -w 'literal %{http_code}\\n' http://192.0.2.10/; "
        "curl -s --noproxy '*' --max-time 5 -w '\\nmeta %{http_code}\\n' http://169.254.169.254/latest/meta-data/; "
        'python3 -c "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2); '
        "s.connect(('192.0.2.10', 443)); s.send(b'q'); s.recv(9)\" 2>&1 | tail -1"
    )
    result = docker_run("sh", "-c", script)
    assert f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/direct" in result.stdout, result.stdout + result.stderr
    assert "literal 403" in result.stdout  # an IP literal no CIDR rule opens
    assert '"code": "metadata"' in result.stdout and "meta 403" in result.stdout
    # Other UDP (QUIC): refused at once, as it leaves the container (send() fails, as in the netns backend).
    assert "PermissionError: [Errno 1] Operation not permitted" in result.stdout
    assert fakenet.connections(ALLOWED_IP, 80) == 1 and fakenet.total_connections() == 1


# Once the refusal inside the container is there (send() fails, EPERM: it is loaded just after docker starts the
# command), QUIC to 50 ports back to back; then the sandbox tries to lift the refusal (its table, through
# netfilter's netlink, and the ICMP rate limit of its namespace), and sends 50 more.
UDP_BURST = """
import errno, socket, struct, sys, time

def refused_as_it_leaves():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("192.0.2.10", 19999))
        try:
            sock.send(b"q")
        except PermissionError:
            return True
    return False

def burst():
    refused = 0
    for port in range(20000, 20050):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(0.2)
            sock.connect(("192.0.2.10", port))
            started = time.perf_counter()
            try:
                sock.send(bytes(1200))
            except PermissionError:  # refused as it left; the socket reports ECONNREFUSED next
                pass
            try:
                sock.recv(1)
            except ConnectionRefusedError:
                refused += (time.perf_counter() - started) < 0.1
            except TimeoutError:
                pass
    print("refused", refused)

def delete_table(name):
    def message(kind, flags, seq, body):
        return struct.pack("=IHHII", 16 + len(body), kind, flags, seq, 0) + body
    batch = struct.pack("=BBH", 0, 0, socket.htons(10))  # NFNL_SUBSYS_NFTABLES
    table = name.encode() + bytes(4 - len(name) % 4)  # NUL-terminated, padded
    attribute = struct.pack("=HH", 4 + len(name) + 1, 1) + table  # NFTA_TABLE_NAME
    delete = message(10 << 8 | 2, 5, 2, struct.pack("=BBH", 1, 0, 0) + attribute)  # NFT_MSG_DELTABLE inet, ack
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12) as nl:  # NETLINK_NETFILTER
        nl.send(message(0x10, 1, 1, batch) + delete + message(0x11, 1, 3, batch))
        error = struct.unpack_from("=i", nl.recv(4096), 16)[0]
    print("nft", errno.errorcode[-error] if error else "deleted")

started = time.monotonic()
while not refused_as_it_leaves() and time.monotonic() - started < 2:
    time.sleep(0.005)
print("refused inside", "within 2 s" if time.monotonic() - started < 2 else "never")
burst()
print("ratemask", open("/proc/sys/net/ipv4/icmp_ratemask").read().strip())
delete_table(sys.argv[1])
for name in ("icmp_ratemask", "icmp_ratelimit"):
    try:
        with open(f"/proc/sys/net/ipv4/{name}", "w") as f:
            f.write("6168")
        print(name, "changed")
    except OSError as e:
        print(name, errno.errorcode[e.errno])
burst()
"""


def test_back_to_back_udp_is_each_refused_at_once_and_the_sandbox_cannot_undo_it(topology, docker_run, docker_env):
    # Past the gateway side's ICMP rate limit (a burst of 6, then one a second): the container's own namespace
    # refuses it, and does not rate-limit the port-unreachable it sends itself.
    argv = docker_run.argv("python3", "-I", "-c", UDP_BURST, "TABLE")
    argv[-1] = fence_table(argv[argv.index("--sandbox-id") + 1])
    result = topology.run(topology.gw, argv, timeout=120, env=_env(docker_env))
    lines = result.stdout.splitlines()
    assert lines == [
        "refused inside within 2 s",
        "refused 50",
        "ratemask 6160",  # the kernel's 6168 without port-unreachable (type 3)
        "nft EPERM",
        "icmp_ratemask EROFS",
        "icmp_ratelimit EROFS",
        "refused 50",
    ], result.stdout + result.stderr


INSPECTED_POLICY = """\
version: 1
profiles:
  default:
    allow:
      - host: allowed.test
        inspect: true
        inject:
          - {header: Authorization, value: "Bearer {secret:model_api}"}
      - host: other.test
"""
DOCKER_SECRET = "sk-airlock-docker-5d1c0b9a8e7f6a5b4c3d"
# Each client through the container's own trust store (no --cacert): curl both ways, Python's urllib, git.
TRUST_SCRIPT = r"""
echo "curl $(curl -sS --max-time 10 https://allowed.test/headers)"
echo "direct $(curl -sS --noproxy '*' --max-time 10 https://allowed.test/headers)"
python3 -c 'import urllib.request as u; print("urllib", u.urlopen("https://allowed.test/headers").read().decode())'
GIT_TERMINAL_PROMPT=0 git ls-remote https://allowed.test/repo.git >/dev/null 2>&1; echo "git $?"
echo "passthrough $(curl -sSkv --max-time 10 -o /dev/null https://other.test/ 2>&1 | grep -i 'issuer:')"
env | grep -E '^(SSL_CERT_FILE|REQUESTS_CA_BUNDLE|GIT_SSL_CAINFO)=' | sort
"""


def test_inspected_hosts_work_through_the_containers_trust_store_and_it_never_holds_the_secret(
    docker_run, fakenet: FakeNet, test_ca, tmp_path: Path
):
    policy = tmp_path / "inspect.yaml"
    policy.write_text(INSPECTED_POLICY)
    secret = tmp_path / "model_api.secret"
    secret.write_text(DOCKER_SECRET + "\n")
    secret.chmod(0o600)
    options = ("--policy", str(policy), "--upstream-ca", str(test_ca.ca_cert), "--secret", f"model_api=file:{secret}")
    result = docker_run("sh", "-c", TRUST_SCRIPT, options=options)
    out = result.stdout
    for client in ("curl", "direct", "urllib"):
        line = next(line for line in out.splitlines() if line.startswith(client + " "))
        assert '"Authorization", "Bearer ****' in line, (client, out, result.stderr)
    assert "git 0" in out or "git 128" in out
    assert "airlock fake internet" in next(line for line in out.splitlines() if line.startswith("passthrough "))
    assert "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" in out
    assert DOCKER_SECRET not in out and DOCKER_SECRET not in result.stderr
    seen = [
        r for r in fakenet.http_requests() if r["target"] in ("/headers", "/repo.git/info/refs?service=git-upload-pack")
    ]
    assert len(seen) == 4, seen
    assert all(
        [v for k, v in r["headers"] if k.lower() == "authorization"] == [f"Bearer {DOCKER_SECRET}"] for r in seen
    )


def test_explicit_mode_only_leaves_no_direct_way_out(docker_run, fakenet: FakeNet):
    script = (
        "curl -sS --noproxy '*' --max-time 3 http://192.0.2.10/ || echo DIRECT-BLOCKED; "
        "curl -sS --noproxy '*' --max-time 3 http://169.254.169.254/latest/meta-data/ || echo META-BLOCKED; "
        "curl -s -o /dev/null -w '%{http_code}\\n' http://169.254.169.254/latest/meta-data/"
    )
    result = docker_run("sh", "-c", script, options=("--transparent-port", "0"))
    assert "DIRECT-BLOCKED" in result.stdout and "META-BLOCKED" in result.stdout
    assert result.stdout.strip().endswith("403")
    assert fakenet.total_connections() == 0


def test_canaries_on_other_gateway_ports_and_addresses_are_unreachable(topology: Topology, docker_run, fakenet):
    canaries = [
        topology.popen(topology.gw, ["socat", f"TCP-LISTEN:{port},bind={ip},fork,reuseaddr", "SYSTEM:echo canary"])
        for ip, port in (("0.0.0.0", 9999), (GW_OUTSIDE_IP, 3128))
    ]
    try:
        time.sleep(0.5)
        result = docker_run(
            "python3", "-c", PROBE, "GW:9999", "GW:22", f"{GW_OUTSIDE_IP}:3128", f"{GW_OUTSIDE_IP}:9999"
        )
        lines = result.stdout.splitlines()
        assert len(lines) == 4 and all("blocked" in line for line in lines), result.stdout + result.stderr
    finally:
        for canary in canaries:
            canary.kill()
            canary.wait()


def test_sandbox_a_cannot_reach_sandbox_b(topology: Topology, docker_run, docker_env, fakenet: FakeNet):
    server = "import http.server as h; h.HTTPServer(('0.0.0.0', 8000), h.SimpleHTTPRequestHandler).serve_forever()"
    b_argv = docker_run.argv("python3", "-c", server, options=("--timeout", "60"))
    b_id = b_argv[b_argv.index("--sandbox-id") + 1]
    b = topology.popen(topology.gw, b_argv, env=_env(docker_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not (found := docker_env.client.containers.list(filters={"label": f"{LABEL}={b_id}"})):
            assert time.monotonic() < deadline and b.poll() is None, "sandbox B did not start"
            time.sleep(0.2)
        networks = found[0].attrs["NetworkSettings"]["Networks"]
        b_ip = next(iter(networks.values()))["IPAddress"]
        b_gateway = next(iter(networks.values()))["Gateway"]
        # (Port 53 of any address, B's gateway's included, is this sandbox's own gateway's DNS.)
        result = docker_run("python3", "-c", PROBE, f"{b_gateway}:3128", f"{b_gateway}:8080")
        lines = result.stdout.splitlines()
        assert len(lines) == 2 and all("blocked" in line for line in lines), result.stdout + result.stderr
        # B's own address is redirected to A's gateway like any address, which never connects to a sandbox link.
        fetch = f"curl -s --noproxy '*' --max-time 5 -w ' %{{http_code}}' http://{b_ip}:8000/"
        reply = docker_run("sh", "-c", fetch).stdout
        assert reply.endswith(" 403") and '"decision": "deny"' in reply, reply  # internal, and a sandbox link
    finally:
        b.send_signal(signal.SIGTERM)
        b.communicate(timeout=60)


def test_dns_comes_only_from_the_gateway(docker_run, fakenet: FakeNet):
    script = (
        "getent hosts allowed.test; getent hosts evil.test || echo EVIL-UNRESOLVED; "
        "dig +short +time=2 +tries=1 @192.0.2.53 other.test; dig +time=2 +tries=1 @192.0.2.53 evil.test"
    )
    result = docker_run("sh", "-c", script)
    assert result.stdout.split()[0] == ALLOWED_IP, result.stdout + result.stderr
    assert "EVIL-UNRESOLVED" in result.stdout
    # A resolver address dialled directly is answered by the gateway, with the policy's answers.
    assert "198.51.100.10" in result.stdout and "status: REFUSED" in result.stdout, result.stdout
    assert fakenet.dns_queries("evil.test") == 0


def test_the_container_resolves_its_own_host_name_without_the_gateway(docker_run, tmp_path: Path):
    """docker writes the container's /etc/hosts with its host name (the container id) on its address: what asks for
    its own name never reaches the gateway's DNS, and `airlock run` tells no denial of it."""
    audit = tmp_path / "audit.jsonl"
    script = 'getent ahosts "$(hostname)" | head -1; getent hosts printer || echo no-printer'
    result = docker_run("sh", "-c", script, options=("--audit", str(audit)))
    address = result.stdout.split()[0]
    assert address.startswith("10.232.") and result.stdout.split()[-1] == "no-printer", result.stdout + result.stderr
    assert "airlock: denied" not in result.stderr, result.stderr
    asked = {json.loads(line)["host"] for line in audit.read_text().splitlines() if '"kind":"dns"' in line}
    assert asked == {"printer"}, asked


def test_root_is_read_only_and_tmp_is_not_executable(docker_run):
    script = "touch /x; id -u; cp /bin/true /tmp/t && /tmp/t; echo tmp-exec-rc=$?; touch /tmp/ok && echo TMP-WRITABLE"
    result = docker_run("sh", "-c", script)
    assert "Read-only file system" in result.stderr
    assert "Permission denied" in result.stderr and "tmp-exec-rc=126" in result.stdout
    assert "TMP-WRITABLE" in result.stdout and result.stdout.splitlines()[0] == "65534"


def test_no_capabilities(docker_run):
    script = (
        "grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs)' /proc/self/status; "
        "ping -c1 -W1 10.9.9.9 || echo PING-FAILED; mount -t tmpfs none /tmp || echo MOUNT-FAILED"
    )
    result = docker_run("sh", "-c", script)
    assert result.stdout.count("0000000000000000") == 3 and "NoNewPrivs:\t1" in result.stdout
    assert "PING-FAILED" in result.stdout and "MOUNT-FAILED" in result.stdout


def test_every_listed_call_is_refused_by_the_containers_seccomp_profile(docker_run):
    probe = docker_run(*probe_argv())
    found = results(probe.stdout)
    assert len(found) > 50 and found == expected_in_a_sandbox(found), probe.stderr
    status = docker_run("grep", "-E", "^Seccomp:", "/proc/self/status")
    assert status.stdout.split() == ["Seccomp:", "2"], status
    script = (
        "unshare -U true; echo user=$?; unshare -n true; echo net=$?; python3 -c 'import os; print(os.cpu_count() > 0)'"
    )
    ordinary = docker_run("sh", "-c", script)
    assert ordinary.stdout.split() == ["user=1", "net=1", "True"], ordinary


def test_rlimits_have_defaults_and_follow_the_flags(docker_run):
    probe = "import resource as r; print(*(r.getrlimit(x) for x in (r.RLIMIT_NOFILE, r.RLIMIT_NPROC)))"
    assert docker_run("python3", "-c", probe).stdout.split() == ["(4096,", "4096)", "(8192,", "8192)"]
    given = docker_run("python3", "-c", probe, options=("--nofile", "64", "--nproc", "500"))
    assert given.stdout.split() == ["(64,", "64)", "(500,", "500)"], given.stderr


def test_fork_bomb_stops_at_the_pids_limit_and_the_host_stays_responsive(topology, docker_run, docker_env):
    bomb = "bomb() { bomb | bomb & }; bomb; sleep 5; echo survived"
    argv = docker_run.argv("sh", "-c", bomb, options=("--pids", "32", "--timeout", "15"))
    proc = topology.popen(
        topology.gw, argv, env=_env(docker_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(3)
    started = time.monotonic()
    assert topology.run(topology.gw, ["sh", "-c", "for i in 1 2 3 4 5; do true; done"]).returncode == 0
    assert time.monotonic() - started < 3  # forking on the host is unaffected
    _, stderr = proc.communicate(timeout=60)
    assert "Cannot fork" in stderr or "Resource temporarily unavailable" in stderr, stderr[-2000:]


def test_memory_hog_is_killed_at_its_limit(docker_run):
    result = docker_run(
        "python3", "-c", "x = bytearray(512 * 1024 * 1024); print('allocated')", options=("--memory", "64m")
    )
    assert result.returncode == 137 and "allocated" not in result.stdout
    assert "memory limit" in result.stderr


def test_busy_loop_is_killed_at_the_timeout_and_removed(docker_run, docker_env):
    started = time.monotonic()
    result = docker_run("python3", "-c", "while True: pass", options=("--timeout", "3"))
    assert result.returncode == 124 and "timeout" in result.stderr
    assert time.monotonic() - started < 30
    # the fixture checks that its container, network and fence are gone


def test_output_is_streamed_live_and_capped(topology: Topology, docker_run, docker_env):
    capped = docker_run("python3", "-c", "print('x' * 5000)", options=("--output-limit", "100"))
    assert capped.returncode == 0 and capped.stdout.startswith("x" * 100) and "x" * 101 not in capped.stdout
    assert "output beyond 100 bytes dropped" in capped.stdout
    argv = docker_run.argv("sh", "-c", "echo first; sleep 4; echo second")
    proc = topology.popen(topology.gw, argv, env=_env(docker_env), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "first\n"
        first_seen = time.monotonic()
        assert proc.stdout.readline() == "second\n"
        assert time.monotonic() - first_seen > 2  # "first" arrived while the command still ran, not at its end
    finally:
        proc.communicate(timeout=60)


def test_reap_removes_an_orphaned_sandbox(topology: Topology, docker_env, fakenet: FakeNet):
    orphan = DockerSandbox(docker_env.client, docker_env.image, f"{topology.prefix}orph", limits=Limits(timeout=3600))
    in_netns(topology.gw, orphan.create)  # the fence belongs in gw, as a crashed run leaves it
    orphan.start(["sleep", "600"], {})
    assert docker_env.client.containers.list(filters={"label": f"{LABEL}={orphan.sandbox_id}"})
    time.sleep(1.5)
    result = topology.run(topology.gw, [AIRLOCK, "reap", "--older-than", "1s"], env=_env(docker_env))
    assert f"removed docker {orphan.sandbox_id}" in result.stdout, result.stdout + result.stderr
    assert not docker_env.client.containers.list(all=True, filters={"label": f"{LABEL}={orphan.sandbox_id}"})
    assert not docker_env.client.networks.list(filters={"label": f"{LABEL}={orphan.sandbox_id}"})
    assert fence_table(orphan.sandbox_id or "") not in topology.run(topology.gw, ["nft", "list", "tables"]).stdout


def test_python_launch_api(topology: Topology, docker_env, fakenet: FakeNet, tmp_path):
    """What an orchestrator uses: launch() → handle with wait, logs, kill, close."""
    config = _launch_config(tmp_path)

    async def orchestrate() -> tuple[int | None, bytes, int | None]:
        async with await launch(
            docker_env.client, docker_env.image, ["curl", "-sS", "http://allowed.test/api"], config,
            sandbox_id=f"{topology.prefix}api",
        ) as handle:  # fmt: skip
            code = await handle.wait(60)
            stdout, _ = handle.logs()
        sleeper = await launch(
            docker_env.client, docker_env.image, ["sleep", "60"], config, sandbox_id=f"{topology.prefix}slp"
        )
        try:
            waiting = asyncio.ensure_future(sleeper.wait(60))
            await asyncio.sleep(1)
            sleeper.kill()
            killed = await waiting
        finally:
            await sleeper.close()
        return code, stdout, killed

    code, stdout, killed = in_netns(topology.gw, lambda: asyncio.run(orchestrate()))
    assert code == 0 and stdout == f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/api\n".encode()
    assert killed == 137
    for sandbox_id in (f"{topology.prefix}api", f"{topology.prefix}slp"):
        assert not docker_env.client.containers.list(all=True, filters={"label": f"{LABEL}={sandbox_id}"})


def _launch_config(state_dir: Path) -> GatewayConfig:
    return GatewayConfig(
        policy=load_policy(E2E_POLICY), listen="0.0.0.0", upstream_dns=[(DNS_SERVER, 53)], state_dir=str(state_dir)
    )


def _running(docker_env: Any, sandbox_id: str, proc: subprocess.Popen[Any]) -> None:
    deadline = time.monotonic() + 30
    while not docker_env.client.containers.list(filters={"label": f"{LABEL}={sandbox_id}"}):
        assert time.monotonic() < deadline and proc.poll() is None, f"sandbox {sandbox_id} did not start"
        time.sleep(0.2)


@pytest.fixture
def volume_image(docker_env: Any) -> Iterator[str]:
    """The test image declaring `VOLUME /data`, as many images do."""
    container = docker_env.client.containers.create(docker_env.image, ["true"], network_mode="none")
    try:
        image = container.commit(repository="airlock-test-volume", tag="latest", changes=["VOLUME /data"])
    finally:
        container.remove()
    try:
        yield "airlock-test-volume:latest"
    finally:
        docker_env.client.images.remove(image.id, force=True)


def test_image_volumes_are_capped_memory_and_leave_nothing_on_disk(docker_run, docker_env, volume_image: str):
    script = (
        "grep ' /data ' /proc/self/mounts; echo kept > /data/f && cat /data/f; "
        "cp /bin/true /data/t && /data/t; echo data-exec-rc=$?"
    )
    result = docker_run("sh", "-c", script, options=("--image", volume_image))
    assert result.stdout, (result.returncode, result.stderr)
    mount = result.stdout.splitlines()[0].split()
    assert mount[:3] == ["tmpfs", "/data", "tmpfs"], result.stdout + result.stderr
    assert {"rw", "noexec", "nosuid", "nodev", "size=65536k"} <= set(mount[3].split(","))  # as /tmp
    assert "kept" in result.stdout and "data-exec-rc=126" in result.stdout
    assert not docker_env.client.volumes.list()  # no anonymous volume was made, none is left


def test_removing_a_sandbox_removes_its_containers_anonymous_volumes(topology: Topology, docker_env, volume_image):
    sandbox_id = f"{topology.prefix}vol"
    container = docker_env.client.containers.create(
        volume_image, ["true"], labels={LABEL: sandbox_id}, network_mode="none"
    )  # as an older airlock, or docker itself, would have made it: an anonymous volume for /data
    volumes = [m["Name"] for m in container.attrs["Mounts"] if m["Type"] == "volume"]
    assert volumes
    in_netns(topology.gw, lambda: remove_sandbox(docker_env.client, sandbox_id))
    assert not docker_env.client.containers.list(all=True, filters={"label": f"{LABEL}={sandbox_id}"})
    left = {v.name for v in docker_env.client.volumes.list()}
    assert not left & set(volumes)


def test_the_token_is_readable_in_the_container_and_private_on_the_host(
    topology: Topology, docker_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(docker_backend, "TOKEN_ROOT", tmp_path)  # here dockerd has a /run of its own
    sandbox_id = f"{topology.prefix}tok"
    folder = tmp_path / f"airlock-d-{sandbox_id}"
    script = 'id -u; cat "$AIRLOCK_TOKEN_FILE"; echo; echo x > "$AIRLOCK_TOKEN_FILE" || echo TOKEN-READ-ONLY'

    async def orchestrate() -> tuple[bytes, os.stat_result, os.stat_result]:
        async with await launch(
            docker_env.client, docker_env.image, ["sh", "-c", script], _launch_config(tmp_path / "state"),
            sandbox_id=sandbox_id, grants=[parse_grant("create_pull_request:acme/app")],
        ) as handle:  # fmt: skip
            await handle.wait(60)
            return handle.logs()[0], folder.stat(), (folder / "token").stat()

    stdout, on_host, token = in_netns(topology.gw, lambda: asyncio.run(orchestrate()))
    uid, jwt, read_only = stdout.decode().splitlines()
    assert uid == "65534" and jwt.count(".") == 2 and read_only == "TOKEN-READ-ONLY"
    assert stat.S_IMODE(on_host.st_mode) & 0o027 == 0 and on_host.st_uid == 0
    assert (stat.S_IMODE(token.st_mode), token.st_uid, token.st_gid) == (0o440, 0, 65534)
    assert not folder.exists()


def test_a_sandbox_whose_id_is_taken_fails_and_the_other_keeps_running(topology: Topology, docker_run, docker_env):
    first = docker_run.argv("sleep", "60", options=("--timeout", "60"))
    first_id = first[first.index("--sandbox-id") + 1]
    proc = topology.popen(topology.gw, first, env=_env(docker_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _running(docker_env, first_id, proc)
        second = docker_run("true", options=("--sandbox-id", first_id))
        assert second.returncode != 0 and "exists already" in second.stderr, second.stderr
        assert docker_env.client.containers.list(filters={"label": f"{LABEL}={first_id}"})
        assert docker_env.client.networks.list(filters={"label": f"{LABEL}={first_id}"})
        assert fence_table(first_id) in topology.run(topology.gw, ["nft", "list", "tables"]).stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_teardown_removes_container_network_fence_in_order_then_stops_the_gateway(
    topology: Topology, docker_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    sandbox_id = f"{topology.prefix}ord"
    label = {"label": f"{LABEL}={sandbox_id}"}
    seen: dict[str, tuple[bool, bool, bool]] = {}

    def look(moment: str) -> None:
        """What of the sandbox still exists: container, network, bridge."""
        bridge = topology.run(topology.gw, ["ip", "link", "show", "dev", f"alb{sandbox_id}"[:15]])
        client = docker_env.client
        seen[moment] = (
            bool(client.containers.list(all=True, filters=label)),
            bool(client.networks.list(filters=label)),
            bridge.returncode == 0,
        )

    remove, stop = Fence.remove, Gateway.stop

    def watched_remove(fence: Fence, netns_cmd: list[str] | None = None) -> None:
        if fence.table == fence_table(sandbox_id):
            look("fence removed")
        remove(fence, netns_cmd)

    async def watched_stop(gateway: Gateway) -> None:
        look("gateway stopped")
        await stop(gateway)

    monkeypatch.setattr(Fence, "remove", watched_remove)
    monkeypatch.setattr(Gateway, "stop", watched_stop)

    async def orchestrate() -> None:
        handle = await launch(
            docker_env.client, docker_env.image, ["sleep", "60"], _launch_config(tmp_path), sandbox_id=sandbox_id
        )
        look("running")
        await handle.close()

    in_netns(topology.gw, lambda: asyncio.run(orchestrate()))
    assert seen == {
        "running": (True, True, True),
        "fence removed": (False, False, False),  # nothing of the sandbox could send any more
        "gateway stopped": (False, False, False),  # the container was gone before its gateway
    }


def test_a_killed_launcher_leaves_no_container_and_no_way_to_another_program_on_its_ports(
    topology: Topology, docker_run, docker_env, shared_gateway_stopped: None
):
    # The container would run on unserved and untimed: the watchdog removes it, and until it has, the fence
    # lets nothing reach a program that took the gateway's ports.
    argv = docker_run.argv("python3", "-c", SENDER, options=("--timeout", "120"))
    sandbox_id = argv[argv.index("--sandbox-id") + 1]
    label = {"label": f"{LABEL}={sandbox_id}"}
    launcher = topology.popen(
        topology.gw, argv, env=_env(docker_env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        _running(docker_env, sandbox_id, launcher)
        time.sleep(1.5)  # it is sending to the gateway
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        with ForeignListeners(topology.gw, (3128, 53, 8080), (53,)) as foreign:
            while left := [
                what
                for what, there in (
                    ("container", docker_env.client.api.containers(all=True, filters=label)),  # no inspect: no race
                    ("network", docker_env.client.networks.list(filters=label)),
                    ("fence", fence_table(sandbox_id) in topology.run(topology.gw, ["nft", "list", "tables"]).stdout),
                )
                if there
            ]:
                assert time.monotonic() - killed < 10, f"the sandbox outlived its launcher: {left}"
                time.sleep(0.1)
            time.sleep(1)
            assert foreign.received == {}
        _, stderr = launcher.communicate(timeout=30)  # its stderr closes once the watchdog has exited
        assert f"docker sandbox {sandbox_id} removed: its launcher is gone" in stderr, stderr
    finally:
        if launcher.poll() is None:
            launcher.kill()
        in_netns(topology.gw, lambda: remove_sandbox(docker_env.client, sandbox_id))  # only after a failure


def test_nothing_of_airlock_is_left(topology: Topology, docker_env):
    assert not docker_env.client.containers.list(all=True, filters={"label": LABEL})
    assert not docker_env.client.networks.list(filters={"label": LABEL})
    assert not docker_env.client.volumes.list()  # this run's daemon: any volume would be a sandbox's leftover
    tables = topology.run(topology.gw, ["nft", "list", "tables"]).stdout
    assert "airlock_" not in tables
