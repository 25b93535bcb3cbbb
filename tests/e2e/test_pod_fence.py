"""The pod fence (`airlock fence --pod`) with real nft, in a network namespace that stands in for a pod (pod.py): the
gateway (`airlock gateway` on loopback, as its own UID) and the agent (another UID, no capabilities) share it, as a
pod's containers do, and its only link leads to the fake internet."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from airlock.verify.topology import DNS_SERVER, FakeNet, Topology

from gateway_proc import E2E_POLICY
from pod import (
    ADMIN,
    AGENT_UID,
    AGENT_USER,
    ALLOWED_IP,
    BROKER,
    DNS,
    EVIL_IP,
    FENCE,
    GATEWAY_USER,
    POD_IP,
    PROXY,
    TRANSPARENT,
    Pod,
)

ECHO = r"""
import select, socket, sys
socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in sys.argv[2:]]
for sock, address in zip(socks, sys.argv[2:]):
    sock.bind((address, int(sys.argv[1])))
print("ready", flush=True)
while True:
    for sock in select.select(socks, [], [])[0]:
        sock.sendto(*sock.recvfrom(100))
"""
UDP_ECHO = 4433
# This gateway has a broker of its own on BROKER: refused to the agent like its admin port.
HOST_FENCE = (*FENCE, "--gateway-port", str(BROKER), "--gateway-port", str(ADMIN))


def host_gateway(state: Path) -> list[str]:
    """`airlock gateway` on the pod's loopback with the fence's ports, as any launcher of its own would run it."""
    return [
        "--policy", str(E2E_POLICY), "--listen", "127.0.0.1", "--upstream-dns", DNS_SERVER, "--state-dir",
        str(state / "state"), "--audit", str(state / "audit.jsonl"), "--proxy-port", str(PROXY), "--transparent-port",
        str(TRANSPARENT), "--dns-port", str(DNS), "--broker-port", str(BROKER), "--admin", f"127.0.0.1:{ADMIN}",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def pod(topology: Topology, fakenet: FakeNet) -> Iterator[Pod]:
    """The pod, fenced (as an init container would, before anything runs in it), its gateway started."""
    made = Pod(topology, host_gateway, HOST_FENCE)
    try:
        made.create()
        installed = made.fence()
        assert installed.returncode == 0, installed.stderr
        made.start_gateway()
        yield made
    finally:
        made.destroy()


def test_direct_tcp_to_an_address_not_allowed_reaches_nothing(pod: Pod, fakenet: FakeNet) -> None:
    pinned = pod.agent("curl", "-sS", "--max-time", "10", "-w", "%{http_code}", f"http://{EVIL_IP}/")
    assert pinned.stdout.endswith("403") and '"code": "not_allowlisted"' in pinned.stdout, pinned
    assert fakenet.total_connections() == 0


def test_an_allowed_host_is_reached_through_the_redirect(pod: Pod, fakenet: FakeNet) -> None:
    plain = pod.agent("curl", "-sS", "--max-time", "10", "--resolve", f"allowed.test:80:{ALLOWED_IP}",
                      "http://allowed.test/hello")  # fmt: skip
    assert plain.stdout == f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/hello\n", plain.stderr
    assert fakenet.connections(ALLOWED_IP, 80) == 1  # the gateway's own connection: its UID's traffic passes
    proxied = pod.agent("curl", "-sS", "--max-time", "10", "--proxy", f"http://127.0.0.1:{PROXY}",
                        "http://allowed.test/proxied")  # fmt: skip
    assert proxied.stdout == f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/proxied\n", proxied.stderr


@pytest.fixture(scope="module")
def udp_echo(topology: Topology, fakenet: FakeNet) -> Iterator[int]:
    """A UDP echo on every address of the fake internet, port UDP_ECHO: what an unfenced agent would hear."""
    # One socket per address: a reply comes from the address that was dialled, or a connected socket ignores it.
    echo = ["/usr/bin/python3", "-I", "-c", ECHO, str(UDP_ECHO), ALLOWED_IP, EVIL_IP, DNS_SERVER]
    proc = topology.popen(topology.net, echo, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    try:
        yield UDP_ECHO
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("host", [ALLOWED_IP, EVIL_IP, DNS_SERVER, "8.8.8.8"])
def test_udp_to_any_address_is_refused_at_once(pod: Pod, udp_echo: int, host: str) -> None:
    assert pod.probe("udp", ALLOWED_IP, udp_echo, user=GATEWAY_USER) == "answered"  # the gateway's UDP passes
    started = time.monotonic()
    assert pod.probe("udp", host, udp_echo) in ("ECONNREFUSED", "EPERM")
    assert time.monotonic() - started < 2  # refused, not timed out


@pytest.mark.parametrize("kind", ["tcp", "udp"])
def test_ipv6_is_refused_at_once(pod: Pod, kind: str) -> None:
    started = time.monotonic()
    assert pod.probe(kind, "2001:4860::8888", 443) in ("ECONNREFUSED", "EPERM")
    assert time.monotonic() - started < 2  # refused, not left to time out on a link that leads nowhere


def test_ping_fails(pod: Pod) -> None:
    assert pod.probe("ping", "127.0.0.1", 0) == "reply"  # the agent may ping: the fence, not the sysctl, refuses
    assert pod.probe("ping", ALLOWED_IP, 0) in ("EPERM", "ECONNREFUSED")


@pytest.mark.parametrize("resolver", [DNS_SERVER, "8.8.8.8", "127.0.0.53"])
def test_dns_to_any_resolver_is_answered_by_the_gateway(pod: Pod, fakenet: FakeNet, resolver: str) -> None:
    assert pod.probe("dns", resolver, 53, "unlisted.example") == "REFUSED"
    assert fakenet.dns_queries("unlisted.example") == 0  # nothing forwarded
    assert pod.probe("dns", resolver, 53, "allowed.test") == "NOERROR"


@pytest.mark.parametrize("port", [BROKER, ADMIN, TRANSPARENT, DNS])
def test_the_gateways_own_ports_are_refused_to_the_agent_by_loopback(pod: Pod, port: int) -> None:
    assert pod.probe("tcp", "127.0.0.1", port, user=GATEWAY_USER) == "connected"  # they listen: the gateway's own
    assert pod.probe("tcp", "127.0.0.1", port) == "ECONNREFUSED"
    assert pod.probe("tcp", POD_IP, port) == "ECONNREFUSED"  # the pod's address is its loopback too
    assert pod.probe("tcp", "127.0.0.1", PROXY) == "connected"  # the proxy port is the one it may dial


def test_the_gateways_own_connection_to_its_admin_port_closes_cleanly(pod: Pod) -> None:
    # Its last ACK leaves from a socket in TIME_WAIT, which has no UID: refused, it would leave the admin
    # listener's end retransmitting its FIN (LAST-ACK) for minutes, the pod's namespace alive with it.
    assert pod.probe("tcp", "127.0.0.1", ADMIN, user=GATEWAY_USER) == "connected"
    deadline = time.monotonic() + 5
    while (left := pod.run(["ss", "-Htn", "state", "last-ack"]).stdout.strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == ""


def test_the_pods_own_loopback_stays_open_to_the_agent(pod: Pod) -> None:
    server = ["/usr/bin/python3", "-I", "-c", "import socket, time; s = socket.create_server(('127.0.0.1', 4000));"
              "print('ready', flush=True); s.accept(); time.sleep(1)"]  # fmt: skip
    with subprocess.Popen(["ip", "netns", "exec", pod.name, *AGENT_USER, *server], stdout=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
            assert pod.probe("tcp", "127.0.0.1", 4000) == "connected"
        finally:
            proc.kill()


def test_check_says_whether_the_fence_in_place_is_the_one_asked_for(pod: Pod) -> None:
    assert pod.fence("--check").returncode == 0
    assert pod.fence().returncode == 0  # installed again: still one table, the same
    tables = pod.run(["nft", "list", "tables"]).stdout
    assert tables.count("airlock_pod") == 1, tables
    check = pod.fence("--check")
    assert check.returncode == 0 and "redirect to :3129" in check.stdout, check
    assert pod.fence("--check", "--proxy-port", "3000").returncode == 1  # not what this command would install
    changed = pod.run(
        ["nft", "insert", "rule", "inet", "airlock_pod", "egress", "meta", "skuid", str(AGENT_UID), "accept"]
    )
    assert changed.returncode == 0, changed.stderr
    try:
        assert pod.fence("--check").returncode == 1
    finally:
        assert pod.fence().returncode == 0
    assert pod.fence("--check").returncode == 0


def test_with_the_gateway_dead_nothing_of_the_agents_reaches_anything(pod: Pod, fakenet: FakeNet) -> None:
    pod.stop_gateway(signal.SIGKILL)
    try:
        assert pod.probe("tcp", ALLOWED_IP, 80) == "ECONNREFUSED"  # the redirect lands on a closed loopback port
        assert pod.probe("tcp", "1.1.1.1", 443) == "ECONNREFUSED"
        assert pod.probe("dns", DNS_SERVER, 53, "allowed.test") == "ECONNREFUSED"
        assert pod.probe("udp", ALLOWED_IP, 443) in ("ECONNREFUSED", "EPERM")
        assert fakenet.total_connections() == 0 and fakenet.dns_queries("allowed.test") == 0
    finally:
        pod.start_gateway()
    assert pod.probe("tcp", ALLOWED_IP, 80) == "connected"  # restarted, the gateway serves the pod again
