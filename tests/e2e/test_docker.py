"""The docker backend with real containers. dockerd runs inside the test's gateway namespace, so the sandbox
networks' bridges, the embedded gateway and the fence all live where everything dialled lands in the fake
internet or nowhere. Each denial also asserts that the fake internet counted zero connections."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import time
from typing import Any

import pytest

from airlock.sandbox.docker import LABEL, DockerSandbox, Limits

from gateway_proc import AIRLOCK, E2E_POLICY
from topology import DNS_SERVER, GW_OUTSIDE_IP, FakeNet, Topology

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
        assert f"airlock_{sandbox_id}" not in topology.run(topology.gw, ["nft", "list", "tables"]).stdout


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


def test_direct_connections_and_metadata_fail(docker_run, fakenet: FakeNet):
    script = (
        "curl -sS --noproxy '*' --max-time 3 http://192.0.2.10/ || echo DIRECT-BLOCKED; "
        "curl -sS --noproxy '*' --max-time 3 http://169.254.169.254/latest/meta-data/ || echo META-BLOCKED; "
        "curl -s -o /dev/null -w '%{http_code}\\n' http://169.254.169.254/latest/meta-data/"
    )
    result = docker_run("sh", "-c", script)
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
        result = docker_run("python3", "-c", PROBE, f"{b_ip}:8000", f"{b_gateway}:3128", f"{b_gateway}:53")
        lines = result.stdout.splitlines()
        assert len(lines) == 3 and all("blocked" in line for line in lines), result.stdout + result.stderr
    finally:
        b.send_signal(signal.SIGTERM)
        b.communicate(timeout=60)


def test_dns_comes_only_from_the_gateway(docker_run, fakenet: FakeNet):
    script = (
        "getent hosts allowed.test; getent hosts evil.test || echo EVIL-UNRESOLVED; "
        "dig +short +time=2 +tries=1 @192.0.2.53 other.test || echo DIRECT-DNS-BLOCKED"
    )
    result = docker_run("sh", "-c", script)
    assert result.stdout.split()[0] == ALLOWED_IP, result.stdout + result.stderr
    assert "EVIL-UNRESOLVED" in result.stdout and "DIRECT-DNS-BLOCKED" in result.stdout
    assert fakenet.dns_queries("other.test") == 0 and fakenet.dns_queries("evil.test") == 0


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
    in_gw = os.open(f"/run/netns/{topology.gw}", os.O_RDONLY)
    try:
        _in_namespace(in_gw, orphan.create)  # the fence belongs in the gateway namespace, as a crashed run leaves it
        orphan.start(["sleep", "600"], {})
    finally:
        os.close(in_gw)
    assert docker_env.client.containers.list(filters={"label": f"{LABEL}={orphan.sandbox_id}"})
    time.sleep(1.5)
    result = topology.run(topology.gw, [AIRLOCK, "reap", "--older-than", "1s"], env=_env(docker_env))
    assert f"removed docker {orphan.sandbox_id}" in result.stdout, result.stdout + result.stderr
    assert not docker_env.client.containers.list(all=True, filters={"label": f"{LABEL}={orphan.sandbox_id}"})
    assert not docker_env.client.networks.list(filters={"label": f"{LABEL}={orphan.sandbox_id}"})
    assert f"airlock_{orphan.sandbox_id}" not in topology.run(topology.gw, ["nft", "list", "tables"]).stdout


def _in_namespace(fd: int, fn: Any) -> None:
    """Run fn in a thread that joined the namespace behind fd (nft and ip act on the caller's namespace)."""
    import threading

    box: dict[str, BaseException] = {}

    def target() -> None:
        os.setns(fd, os.CLONE_NEWNET)
        try:
            fn()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]


def test_python_launch_api(topology: Topology, docker_env, fakenet: FakeNet, tmp_path):
    """What an orchestrator uses: launch() → handle with wait, logs, kill, close."""
    from airlock.gateway import GatewayConfig
    from airlock.policy import load_policy
    from airlock.sandbox.launch import launch

    config = GatewayConfig(
        policy=load_policy(E2E_POLICY), listen="0.0.0.0", upstream_dns=[(DNS_SERVER, 53)], state_dir=str(tmp_path)
    )

    async def orchestrate() -> tuple[int | None, bytes, int | None]:
        import asyncio

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

    def run() -> tuple[int | None, bytes, int | None]:
        import asyncio

        return asyncio.run(orchestrate())

    in_gw = os.open(f"/run/netns/{topology.gw}", os.O_RDONLY)
    box: dict[str, Any] = {}
    try:
        _in_namespace(in_gw, lambda: box.setdefault("result", run()))
    finally:
        os.close(in_gw)
    code, stdout, killed = box["result"]
    assert code == 0 and stdout == f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/api\n".encode()
    assert killed == 137
    for sandbox_id in (f"{topology.prefix}api", f"{topology.prefix}slp"):
        assert not docker_env.client.containers.list(all=True, filters={"label": f"{LABEL}={sandbox_id}"})


def test_nothing_of_airlock_is_left(topology: Topology, docker_env):
    assert not docker_env.client.containers.list(all=True, filters={"label": LABEL})
    assert not docker_env.client.networks.list(filters={"label": LABEL})
    tables = topology.run(topology.gw, ["nft", "list", "tables"]).stdout
    assert "airlock_" not in tables
