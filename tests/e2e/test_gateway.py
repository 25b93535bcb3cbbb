"""The gateway as a process and a fence: lifecycle, limits, faults, audit. Real namespaces, real mitmproxy."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from airlock.dns.upstream import ResolverUnavailable
from airlock.gateway import Gateway
from airlock.policy import parse_policy
from airlock.verify.fakeca import FakeCA
from airlock.verify.topology import GW_IP, SBX_IP, FakeNet, Topology

from gateway_proc import AIRLOCK, E2E_POLICY, PROXY, e2e_gateway_config, gateway_in_thread
from netclient import ForeignListeners, in_netns, proxy_http, tcp_probe, tls_get

ALLOWED_IP = "192.0.2.10"
AUDIT_FIELDS = {
    "schema", "ts", "request_id", "sandbox", "client", "kind", "method", "host", "port", "path", "status", "resolved",
    "chosen_ip", "decision", "reason", "code", "profile", "policy_hash", "rule", "rule_source", "hint", "bytes_in",
    "bytes_out", "duration_ms", "extra",
}  # fmt: skip


def test_sandbox_cannot_reach_the_fake_internet_directly(topology: Topology, fakenet: FakeNet, gateway):
    topology.assert_route_inside(topology.sbx, ALLOWED_IP)
    direct = topology.curl(topology.sbx, "--noproxy", "*", "http://192.0.2.10/", max_time=3)
    assert direct.returncode != 0
    assert in_netns(topology.sbx, tcp_probe, (ALLOWED_IP, 80)).startswith("unreachable")
    assert fakenet.total_connections() == 0


def test_fence_stops_forwarding_even_when_the_gateway_host_routes(topology: Topology, fakenet: FakeNet, gateway):
    # Make the gateway namespace a router and give the sandbox a route through it: only the fence remains.
    topology.run(topology.gw, ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
    topology.run(topology.sbx, ["ip", "route", "add", "192.0.2.0/24", "via", GW_IP])
    try:
        topology.assert_route_inside(topology.sbx, ALLOWED_IP)
        # Never forwarded: TCP lands at the gateway's transparent listener, which judges it (an IP literal no
        # rule opens), and nothing else passes.
        reply = in_netns(topology.sbx, tcp_probe, (ALLOWED_IP, 80), 2, b"GET / HTTP/1.0\r\n\r\n")
        assert reply.startswith("open:HTTP/1.1 403"), reply
        assert in_netns(topology.sbx, tcp_probe, (ALLOWED_IP, 22), 2, b"\x00raw") == "open:"  # closed unanswered
        assert fakenet.total_connections() == 0
    finally:
        topology.run(topology.sbx, ["ip", "route", "del", "192.0.2.0/24", "via", GW_IP])
        topology.run(topology.gw, ["sysctl", "-qw", "net.ipv4.ip_forward=0"])


def test_sandbox_reaches_no_other_port_or_address_of_the_gateway(topology: Topology, fakenet: FakeNet, gateway):
    # Canaries on the gateway host: another port on the sandbox-facing address, and the other interface.
    canaries = [
        topology.popen(topology.gw, ["socat", f"TCP-LISTEN:{port},bind={ip},fork,reuseaddr", "SYSTEM:echo canary"])
        for ip, port in ((GW_IP, 9999), ("10.253.0.1", 3128), ("0.0.0.0", 8081))
    ]
    try:
        time.sleep(0.5)
        assert topology.run(topology.gw, ["curl", "-s", "telnet://10.253.0.1:3128", "--max-time", "2"]).stdout
        for target in ((GW_IP, 9999), (GW_IP, 8081), ("10.253.0.1", 3128), ("10.253.0.1", 8081)):
            result = in_netns(topology.sbx, tcp_probe, target, 2)
            assert not result.startswith("open"), (target, result)
        assert in_netns(topology.sbx, tcp_probe, PROXY, 2).startswith("open")  # the one door
    finally:
        for canary in canaries:
            canary.kill()
            canary.wait()


def test_killed_gateway_leaves_the_sandbox_without_network(topology: Topology, fakenet: FakeNet, own_gateway):
    gw = own_gateway()
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/").status == 200
    fakenet.reset()
    gw.stop(signal.SIGKILL)
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/", None, 3).error
    assert topology.curl(topology.sbx, "--noproxy", "*", "http://192.0.2.10/", max_time=3).returncode != 0
    assert fakenet.total_connections() == 0


def _send_udp(address: tuple[str, int], payload: bytes) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(payload, address)


def test_once_the_gateway_is_gone_another_program_on_its_ports_gets_nothing(
    topology: Topology, fakenet: FakeNet, own_gateway
):
    # The fence admits the gateway's own sockets (marked), not its ports: a service that binds them on 0.0.0.0
    # after the gateway died is not reached.
    gw = own_gateway()
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/").status == 200
    for tcp in (False, True):
        assert topology.dns_query(topology.sbx, "allowed.test", server=GW_IP, tcp=tcp).rcode == "NOERROR"
    assert in_netns(topology.sbx, tcp_probe, (GW_IP, 8080), 2).startswith("open")  # the broker
    gw.stop(signal.SIGKILL)
    with ForeignListeners(topology.gw, (3128, 53, 8080), (53,)) as foreign:
        for port in (3128, 53, 8080):
            probe = in_netns(topology.sbx, tcp_probe, (GW_IP, port), 2, b"from the sandbox\n")
            assert probe == "refused", (port, probe)  # as from a closed port; the program sees nothing
        for _ in range(5):
            in_netns(topology.sbx, _send_udp, (GW_IP, 53), b"from the sandbox")
        time.sleep(0.5)
        assert foreign.received == {}


def test_sigterm_stops_cleanly_and_frees_the_port(topology: Topology, fakenet: FakeNet, own_gateway):
    gw = own_gateway()
    assert gw.stop(signal.SIGTERM) == 0
    assert in_netns(topology.sbx, tcp_probe, PROXY, 2) == "refused"
    again = own_gateway()  # the same address and port bind again at once
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/").status == 200
    assert again.stop(signal.SIGTERM) == 0


def test_ctrl_c_stops_it_with_130_and_one_line(topology: Topology, own_gateway):
    gw = own_gateway()
    assert gw.stop(signal.SIGINT) == 130
    assert gw.log().strip().splitlines()[-1] == "airlock: interrupted", gw.log()
    assert in_netns(topology.sbx, tcp_probe, PROXY, 2) == "refused"


def test_bad_policy_refuses_to_start_with_file_and_line(topology: Topology, tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nprofiles:\n  default:\n    allow:\n      - host: '*.com'\n")
    result = topology.run(topology.gw, [AIRLOCK, "gateway", "--policy", bad, "--listen", GW_IP, "--proxy-port", "3999"])
    assert result.returncode == 2
    assert f"{bad}:5: " in result.stderr and "public suffix" in result.stderr
    assert in_netns(topology.sbx, tcp_probe, (GW_IP, 3999), 2) != "open:"


def test_sighup_with_a_bad_policy_keeps_the_running_one(topology: Topology, fakenet: FakeNet, own_gateway, tmp_path):
    policy = tmp_path / "live.yaml"
    policy.write_text(E2E_POLICY.read_text())
    gw = own_gateway(policy)
    policy.write_text("version: 1\nprofiles:\n  default:\n    allow:\n      - host: '*'\n")
    gw.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while "NOT reloaded" not in gw.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "NOT reloaded" in gw.log() and "live.yaml:5: " in gw.log()
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/").status == 200
    policy.write_text("version: 1\nprofiles:\n  default:\n    allow:\n      - host: other.test\n")
    gw.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/").status != 403:
        assert time.monotonic() < deadline, gw.log()
        time.sleep(0.1)


NO_DEFAULT_PROFILE = "version: 1\ndefault_profile: dev\nprofiles:\n  dev:\n    allow:\n      - host: allowed.test\n"


@pytest.mark.parametrize(
    ("extra", "missing"),
    [((), "default"), (("--profile", "strict"), "strict")],
    ids=["default-profile-renamed", "named-profile-removed"],
)
def test_sighup_with_a_policy_missing_a_running_sandboxs_profile_keeps_the_running_one(
    topology: Topology, fakenet: FakeNet, own_gateway, tmp_path: Path, extra: tuple[str, ...], missing: str
):
    # A valid policy that lacks the profile a sandbox was started with would fail every request (500) and every
    # DNS query (SERVFAIL): it is refused like a policy with errors.
    policy = tmp_path / "live.yaml"
    policy.write_text(E2E_POLICY.read_text())
    gw = own_gateway(policy, extra=extra)
    expected = in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/").status  # 200, or 403 when strict
    policy.write_text(NO_DEFAULT_PROFILE if missing == "default" else E2E_POLICY.read_text().split("  strict:")[0])
    gw.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while "NOT reloaded" not in gw.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = gw.log()
    assert "NOT reloaded" in log and f"{policy}: " in log and f"'{missing}'" in log, log
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/").status == expected
    assert topology.dns_query(topology.sbx, "other.test", server=GW_IP).rcode == "NOERROR"


def test_connect_timeout_closes_a_hanging_upstream(topology: Topology, fakenet: FakeNet, own_gateway):
    own_gateway(extra=("--connect-timeout", "1.5"))
    started = time.monotonic()
    reply = in_netns(topology.sbx, proxy_http, PROXY, "http://203.0.113.99:443/", None, 20)
    elapsed = time.monotonic() - started
    assert reply.status == 502, reply
    assert elapsed < 10, elapsed  # mitmproxy alone would wait for the kernel's SYN retries (minutes)


def test_tunnel_cap_per_sandbox(topology: Topology, fakenet: FakeNet, own_gateway, test_ca: FakeCA):
    own_gateway(extra=("--workers", "1", "--max-tunnels", "2"))  # the exact cap: one worker holds it whole

    def three_tunnels() -> list[int]:
        from netclient import connect_tunnel

        held, statuses = [], []
        for _ in range(3):
            sock, reply = connect_tunnel(PROXY, "allowed.test:443")
            statuses.append(reply.status)
            if sock:
                held.append(sock)
        for sock in held:
            sock.close()
        return statuses

    assert in_netns(topology.sbx, three_tunnels) == [200, 200, 429]
    time.sleep(0.5)  # closed tunnels free their slots
    assert in_netns(topology.sbx, tls_get, PROXY, "allowed.test:443", "allowed.test", test_ca.ca_cert).status == 200


def test_two_hundred_concurrent_tunnels_complete(topology: Topology, fakenet: FakeNet, gateway, test_ca: FakeCA):
    async def one(context: ssl.SSLContext, i: int) -> bytes:
        reader, writer = await asyncio.open_connection(*PROXY)
        writer.write(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        await writer.start_tls(context, server_hostname="allowed.test")
        writer.write(f"GET /c{i} HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n".encode())
        body = await reader.read()
        writer.close()
        return body

    async def all_of_them() -> list[bytes | BaseException]:
        context = ssl.create_default_context(cafile=str(test_ca.ca_cert))
        tasks = [one(context, i) for i in range(200)]
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)

    results = in_netns(topology.sbx, asyncio.run, all_of_them())
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    assert all(f"path=/c{i}".encode() in body for i, body in enumerate(results))  # type: ignore[operator]
    assert fakenet.connections(ALLOWED_IP, 443) == 200


def test_every_decision_writes_one_audit_line(topology: Topology, fakenet: FakeNet, own_gateway, test_ca: FakeCA):
    gw = own_gateway()
    allowed = in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/a?secret=1")
    denied = in_netns(topology.sbx, proxy_http, PROXY, "http://evil.test/b")
    tunnel = in_netns(topology.sbx, tls_get, PROXY, "allowed.test:443", "allowed.test", test_ca.ca_cert)
    assert (allowed.status, denied.status, tunnel.status) == (200, 403, 200)
    deadline = time.monotonic() + 5
    while len(gw.audit()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    records = gw.audit()
    assert len(records) == 3, records
    for record in records:
        assert set(record) == AUDIT_FIELDS
        assert record["sandbox"] == "sbx" and record["client"] == SBX_IP
    by_kind = {(r["kind"], r["decision"]): r for r in records}
    http_ok = by_kind[("http", "allow")]
    assert http_ok["host"] == "allowed.test" and http_ok["path"] == "/a" and http_ok["chosen_ip"] == ALLOWED_IP
    assert http_ok["bytes_out"] == len(allowed.body) and http_ok["rule_source"].endswith("e2e.yaml:6")
    assert http_ok["status"] == 200 and by_kind[("http", "deny")]["status"] is None  # the upstream's, when one answered
    assert "secret" not in str(records)  # query strings may carry tokens: never logged
    http_denied = by_kind[("http", "deny")]
    assert http_denied["request_id"] == denied.json()["request_id"] and http_denied["resolved"] == []
    connect = by_kind[("connect", "allow")]
    assert connect["method"] == "CONNECT" and connect["port"] == 443 and connect["duration_ms"] >= 0
    # Tunnels are metered though never decrypted: at least the TLS handshake one way, handshake + body back.
    assert connect["bytes_in"] > 200 and connect["bytes_out"] > len(tunnel.body) + 500


def test_unknown_source_network_is_refused(topology: Topology, fakenet: FakeNet, own_gateway):
    # The gateway knows the sandbox by its address; a sandbox that takes another address is a stranger.
    gw = own_gateway()
    stranger = "10.254.0.6"
    topology.run(topology.sbx, ["ip", "addr", "add", f"{stranger}/32", "dev", topology.sbx_if])
    topology.run(topology.gw, ["ip", "route", "add", f"{stranger}/32", "dev", topology.gw_sbx_if])
    try:

        def from_other_address() -> bytes:
            with socket.socket() as sock:
                sock.bind((stranger, 0))
                sock.settimeout(5)
                sock.connect(PROXY)
                assert sock.getsockname()[0] == stranger
                sock.sendall(b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
                try:
                    return sock.recv(100)
                except ConnectionResetError:
                    return b""

        assert in_netns(topology.sbx, from_other_address) == b""
        assert fakenet.total_connections() == 0
        deadline = time.monotonic() + 3
        while not gw.audit() and time.monotonic() < deadline:
            time.sleep(0.05)  # audit lines are flushed every 100 ms
        assert [(r["client"], r["decision"], r["reason"], r["code"]) for r in gw.audit()] == [
            (stranger, "deny", "unknown sandbox network", "unknown_sandbox")
        ]
    finally:
        topology.run(topology.gw, ["ip", "route", "del", f"{stranger}/32", "dev", topology.gw_sbx_if])
        topology.run(topology.sbx, ["ip", "addr", "del", f"{stranger}/32", "dev", topology.sbx_if])


# --- faults inside the addon: a real gateway in the gw namespace, its resolver made to raise ---------------


@pytest.fixture
def inproc_gateway(topology: Topology, fakenet: FakeNet, own_gateway, tmp_path: Path) -> Iterator[Gateway]:
    """A Gateway object running on its own loop in a thread that joined the gateway namespace."""
    config = e2e_gateway_config(tmp_path)
    with gateway_in_thread(topology, config) as gateway:
        yield gateway


@pytest.mark.parametrize("fault", [RuntimeError("resolver bug"), ResolverUnavailable("upstream down")])
def test_a_fault_inside_the_addon_denies(
    topology: Topology, fakenet: FakeNet, inproc_gateway: Gateway, test_ca: FakeCA, fault: Exception
):
    async def broken(name: str):
        raise fault

    inproc_gateway.parts.resolver.resolve = broken  # type: ignore[method-assign]
    reply = in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/")
    assert reply.status in (403, 500) and reply.headers.get("X-Airlock-Decision") == "deny", reply
    tunnel = in_netns(topology.sbx, tls_get, PROXY, "allowed.test:443", "allowed.test", test_ca.ca_cert)
    assert tunnel.status in (403, 500), tunnel
    assert fakenet.total_connections() == 0


@pytest.mark.parametrize("resolver_breaks", [False, True])
def test_enforcement_point_holds_when_the_early_hooks_do_nothing(
    topology: Topology, fakenet: FakeNet, inproc_gateway: Gateway, test_ca: FakeCA, resolver_breaks: bool
):
    """mitmproxy swallows addon exceptions; if an early hook ever let a request through, `server_connect`
    must still judge it. Disable the early hooks and check that it does, also when the resolver raises."""
    assert inproc_gateway.airlock is not None
    inproc_gateway.airlock.requestheaders = inproc_gateway.airlock.http_connect = lambda flow: None  # type: ignore[method-assign]
    if resolver_breaks:

        async def broken(name: str):
            raise RuntimeError("resolver bug at connect time")

        inproc_gateway.parts.resolver.resolve = broken  # type: ignore[method-assign]
        target = "allowed.test"
    else:
        target = "evil.test"
    reply = in_netns(topology.sbx, proxy_http, PROXY, f"http://{target}/")
    assert reply.status == 502 and b"airlock" in reply.body, reply
    tunnel = in_netns(topology.sbx, tls_get, PROXY, f"{target}:443", target, test_ca.ca_cert)
    assert tunnel.status != 200 or tunnel.error, tunnel
    assert fakenet.total_connections() == 0


def test_idle_tunnel_is_closed_after_the_idle_timeout(topology: Topology, fakenet: FakeNet, own_gateway):
    own_gateway(extra=("--idle-timeout", "2"))

    def idle_tunnel() -> float:
        from netclient import connect_tunnel

        sock, reply = connect_tunnel(PROXY, "ssh.allowed.test:22")
        assert sock is not None, reply
        with sock:
            sock.sendall(b"SSH-2.0-idle\r\n")
            sock.settimeout(15)
            assert sock.recv(100).startswith(b"SSH-2.0-idle")
            started = time.monotonic()
            while sock.recv(100):  # nothing more comes: the gateway closes the idle tunnel
                pass
            return time.monotonic() - started

    assert 1 <= in_netns(topology.sbx, idle_tunnel) < 10


def test_connection_cap_per_sandbox(topology: Topology, fakenet: FakeNet, own_gateway):
    own_gateway(extra=("--workers", "1", "--max-connections", "3"))  # the exact cap: one worker holds it whole

    def flood() -> tuple[bytes, int]:
        held = [socket.create_connection(PROXY, timeout=5) for _ in range(3)]
        time.sleep(0.3)  # the gateway has counted them
        extra = socket.create_connection(PROXY, timeout=5)
        extra.sendall(b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        try:
            refused = extra.recv(100)
        except ConnectionResetError:
            refused = b""
        extra.close()
        held.pop().close()
        time.sleep(0.3)
        status = proxy_http(PROXY, "http://allowed.test/").status  # a freed slot serves again
        for sock in held:
            sock.close()
        return refused, status

    refused, status = in_netns(topology.sbx, flood)
    assert refused == b"" and status == 200
    assert fakenet.connections(ALLOWED_IP, 80) == 1


def test_failed_upstream_connects_leave_no_per_connection_state(
    topology: Topology, fakenet: FakeNet, inproc_gateway: Gateway, test_ca: FakeCA
):
    # Each upstream connection is remembered (resolved addresses, logical name, connect timer) until it ends:
    # refused and timed-out connects end too, and must not leave an entry behind each.
    policy = E2E_POLICY.read_text().replace("ports: [80, 443]", "ports: [80, 443, 81]", 1)
    inproc_gateway.replace_policy(parse_policy(policy, "refused.yaml"))
    assert inproc_gateway.shared is not None
    inproc_gateway.shared.settings.connect_timeout = 0.5
    for _ in range(5):  # nothing listens on allowed.test:81: refused
        assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test:81/").status == 502
        assert in_netns(topology.sbx, tls_get, PROXY, "allowed.test:81", "allowed.test", test_ca.ca_cert).error
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://203.0.113.99:443/").status == 502  # timed out
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/").status == 200
    time.sleep(0.5)
    assert inproc_gateway.airlock is not None
    pinned = inproc_gateway.airlock.pinned
    assert (inproc_gateway.shared.resolved, pinned._names, pinned._timers) == ({}, {}, {})
    assert inproc_gateway.shared.upstream_of == {} and sum(inproc_gateway.shared.upstreams.values()) == 0


def test_an_address_the_gateway_gains_after_start_is_its_own(topology: Topology, own_gateway, tmp_path):
    # A CIDR rule opens 10.99.0.0/16; the gateway gets 10.99.0.1 only after it started (as it does when another
    # sandbox's link comes up). A request there would land on the gateway host's own services: refused.
    policy = tmp_path / "local.yaml"
    policy.write_text(
        "version: 1\nprofiles:\n  default:\n    allow:\n      - cidr: 10.99.0.0/16\n        ports: [8080]\n"
    )
    gw = own_gateway(policy)
    topology.run(topology.gw, ["ip", "addr", "add", "10.99.0.1/32", "dev", "lo"])
    try:
        reply = in_netns(topology.sbx, proxy_http, PROXY, "http://10.99.0.1:8080/")
        assert reply.status == 403, reply
        record = gw.audit_for(host="10.99.0.1")[-1]
        assert record["decision"] == "deny" and "own address" in record["reason"], record
        assert record["code"] == "own_address", record
    finally:
        topology.run(topology.gw, ["ip", "addr", "del", "10.99.0.1/32", "dev", "lo"])


def _twice_from_one_port(port: int) -> list[str]:
    """Two requests from the same source port, the second right after the gateway closed the first (so it meets
    the gateway's TIME_WAIT of that connection): what each got back."""
    seen = []
    for _ in range(2):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.settimeout(10)
            sock.bind((SBX_IP, port))
            try:
                sock.connect(PROXY)
            except OSError as e:
                seen.append(f"connect: {e}")
                continue
            sock.sendall(b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):  # until the gateway closes: the TIME_WAIT is its
                reply += chunk
            seen.append(reply.split(b"\r\n", 1)[0].decode())
    return seen


def test_a_client_that_reuses_its_port_at_once_is_served(topology: Topology, fakenet: FakeNet, gateway):
    # Busy clients reuse source ports whose last connection the gateway closed a moment ago: the SYN meets a
    # TIME_WAIT socket, which carries no mark; it must still reach the gateway.
    port = 40000 + os.getpid() % 20000
    assert in_netns(topology.sbx, _twice_from_one_port, port) == ["HTTP/1.1 200 OK"] * 2
