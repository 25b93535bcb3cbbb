"""Passed-through tunnels relayed in the kernel once judged (proxy/spliced_tunnels.py): byte-exact both ways,
audited with the bytes the upstream counted, timed out when idle, capped, ended by a reload that denies them and by
the gateway's shutdown; inspected and refused tunnels are never spliced. Real gateway, real fake internet."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from airlock.verify.fakeca import FakeCA
from airlock.verify.topology import FakeNet, Topology

from gateway_proc import AIRLOCK, E2E_POLICY, PROXY, GatewayProcess
from netclient import connect_tunnel, in_netns, tls_get

SSH = ("192.0.2.10", 22)  # the fake internet's echo server behind ssh.allowed.test (a raw tunnel)
MB = 1024 * 1024


def _echoed(target: str, payload: bytes) -> tuple[str, str]:
    """Send payload through a raw tunnel to the echo server while reading the echo back: both sides' hashes."""
    sock, reply = connect_tunnel(PROXY, target, timeout=30)
    assert sock is not None, reply
    received = hashlib.sha256()
    with sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        left = len(payload)
        while left:
            chunk = sock.recv(min(left, 1 << 20))
            assert chunk, f"tunnel closed with {left} bytes still to come"
            received.update(chunk)
            left -= len(chunk)
        sender.join()
    return hashlib.sha256(payload).hexdigest(), received.hexdigest()


def _spliced_tunnel(target: str = "ssh.allowed.test:22") -> socket.socket:
    """An open raw tunnel that has carried its first bytes (so the kernel relays it from then on)."""
    sock, reply = connect_tunnel(PROXY, target)
    assert sock is not None, reply
    sock.sendall(b"SSH-2.0-spliced\r\n")
    assert sock.recv(100) == b"SSH-2.0-spliced\r\n"
    return sock


def _ended_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _tunnel_lines(gw: GatewayProcess, host: str, n: int = 1) -> list[dict]:
    deadline = time.monotonic() + 5
    while len(lines := gw.audit_for(host=host, kind="connect")) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    return lines


def test_a_50_mb_raw_tunnel_is_byte_exact_both_ways_and_audited_as_the_upstream_counted(
    topology: Topology, fakenet: FakeNet, own_gateway
):
    gw = own_gateway()
    payload = os.urandom(50 * MB)
    sent, echoed = in_netns(topology.sbx, _echoed, "ssh.allowed.test:22", payload)
    assert sent == echoed
    [line] = _tunnel_lines(gw, "ssh.allowed.test")
    assert line["extra"]["relayed_by"] == "kernel"
    assert line["bytes_in"] == fakenet.bytes_in(*SSH) == len(payload)  # what the upstream received, each byte
    assert line["bytes_out"] == len(payload)  # the echo, all of it
    assert line["duration_ms"] > 0


def test_a_50_mb_tls_download_through_a_spliced_tunnel(
    topology: Topology, fakenet: FakeNet, own_gateway, test_ca: FakeCA
):
    gw = own_gateway()
    size = 50 * MB
    reply = in_netns(
        topology.sbx, tls_get, PROXY, "allowed.test:443", "allowed.test", test_ca.ca_cert, f"/big?n={size}"
    )
    assert reply.status == 200 and len(reply.body) == size and reply.body == b"x" * size, reply.status
    [line] = _tunnel_lines(gw, "allowed.test")
    assert line["extra"]["relayed_by"] == "kernel" and line["bytes_out"] > size


def test_the_idle_timeout_closes_a_spliced_tunnel(topology: Topology, fakenet: FakeNet, own_gateway):
    gw = own_gateway(extra=("--idle-timeout", "2"))

    def idle() -> float:
        with _spliced_tunnel() as sock:
            started = time.monotonic()
            assert _ended_within(sock, 15)
            return time.monotonic() - started

    assert 1.5 <= in_netns(topology.sbx, idle) < 5
    [line] = _tunnel_lines(gw, "ssh.allowed.test")
    assert line["extra"]["relayed_by"] == "kernel" and line["bytes_in"] == line["bytes_out"] == 17


def test_a_busy_spliced_tunnel_outlives_the_idle_timeout(topology: Topology, fakenet: FakeNet, own_gateway):
    own_gateway(extra=("--idle-timeout", "2"))

    def busy() -> int:
        with _spliced_tunnel() as sock:
            for _ in range(10):  # 5 s of traffic, never 2 s idle
                time.sleep(0.5)
                sock.sendall(b"ping")
                assert sock.recv(4) == b"ping"
            return 10

    assert in_netns(topology.sbx, busy) == 10


def test_the_tunnel_cap_holds_while_tunnels_are_spliced(topology: Topology, fakenet: FakeNet, own_gateway):
    gw = own_gateway(extra=("--workers", "1", "--max-tunnels", "2"))  # the exact cap: one worker holds it whole

    def three() -> tuple[int, bool]:
        held = [_spliced_tunnel(), _spliced_tunnel()]
        time.sleep(0.3)  # both are the kernel's now
        sock, reply = connect_tunnel(PROXY, "ssh.allowed.test:22")
        refused = reply.status
        held.pop().close()
        time.sleep(0.5)  # the closed one frees its slot
        with _spliced_tunnel():
            pass
        for s in held:
            s.close()
        return refused, sock is None

    assert in_netns(topology.sbx, three) == (429, True)
    lines = _tunnel_lines(gw, "ssh.allowed.test", 4)
    assert sorted(line["decision"] for line in lines) == ["allow", "allow", "allow", "deny"]
    assert all(line["extra"].get("relayed_by") == "kernel" for line in lines if line["decision"] == "allow")


def test_a_reload_that_denies_a_spliced_tunnel_closes_it(
    topology: Topology, fakenet: FakeNet, own_gateway, tmp_path: Path
):
    policy = tmp_path / "live.yaml"
    policy.write_text(E2E_POLICY.read_text())
    gw = own_gateway(policy, ("--close-denied-on-reload",))
    denied = in_netns(topology.sbx, _spliced_tunnel)
    kept = in_netns(topology.sbx, _spliced_tunnel, "198.51.100.10:22")
    time.sleep(0.3)
    policy.write_text(E2E_POLICY.read_text().replace("    deny:\n", "    deny:\n      - host: ssh.allowed.test\n", 1))
    result = subprocess.run(
        [AIRLOCK, "policy", "reload", "--state-dir", str(gw.workdir / "state")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert _ended_within(denied, 3)
    kept.sendall(b"still")
    assert kept.recv(5) == b"still"  # a spliced tunnel the new policy still allows relays on
    kept.close()
    [closed] = _tunnel_lines(gw, "ssh.allowed.test")
    assert closed["extra"]["relayed_by"] == "kernel"
    assert closed["extra"]["closed"].startswith("closed at a policy reload, which denies it")


def test_sigterm_ends_spliced_tunnels(topology: Topology, fakenet: FakeNet, own_gateway):
    gw = own_gateway()
    socks = [in_netns(topology.sbx, _spliced_tunnel) for _ in range(3)]
    time.sleep(0.3)
    started = time.monotonic()
    assert gw.stop(signal.SIGTERM) == 0
    assert time.monotonic() - started < 5
    assert all(_ended_within(sock, 3) for sock in socks)
    for sock in socks:
        sock.close()


def test_inspected_and_refused_tunnels_are_never_spliced(
    topology: Topology, fakenet: FakeNet, own_gateway, test_ca: FakeCA, tmp_path: Path
):
    policy = tmp_path / "inspect.yaml"
    rule = "      - host: other.test\n        ports: [443]\n"
    policy.write_text(E2E_POLICY.read_text().replace(rule, rule + "        inspect: true\n", 1))
    gw = own_gateway(policy, ("--upstream-ca", str(test_ca.ca_cert)))
    (ca,) = sorted((gw.workdir / "state" / "ca").glob("*/gateway-ca-*.pem"))
    inspected = in_netns(topology.sbx, tls_get, PROXY, "other.test:443", "other.test", ca)
    assert inspected.status == 200, inspected
    mismatch = in_netns(topology.sbx, tls_get, PROXY, "allowed.test:443", "other.test", test_ca.ca_cert)
    assert mismatch.status != 200 or mismatch.error
    passed = in_netns(topology.sbx, tls_get, PROXY, "allowed.test:443", "allowed.test", test_ca.ca_cert)
    assert passed.status == 200, passed
    lines = _tunnel_lines(gw, "other.test") + _tunnel_lines(gw, "allowed.test", 2)
    by_outcome = {(line["host"], line["decision"]): line["extra"].get("relayed_by") for line in lines}
    assert by_outcome == {
        ("other.test", "allow"): None,
        ("allowed.test", "deny"): None,
        ("allowed.test", "allow"): "kernel",
    }
