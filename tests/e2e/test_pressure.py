"""The gateway under pressure: a thousand open tunnels, connections beyond the caps, running out of file
descriptors, floods from addresses of no sandbox, an upstream that refuses AAAA, and an audit log that cannot be
written. Real namespaces, real mitmproxy."""

from __future__ import annotations

import contextlib
import http.client
import logging
import math
import os
import re
import resource
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dnslib import RCODE, DNSRecord

from airlock.verify.fakeca import FakeCA
from airlock.verify.topology import GW_IP, SBX_IP, FakeNet, Topology

from gateway_proc import PROXY, GatewayProcess, e2e_gateway_config, gateway_in_thread
from netclient import HeldTunnels, in_netns, proxy_http, raise_open_file_limit, tls_get

ALLOWED_IP = "192.0.2.10"
BROKER = (GW_IP, 8080)
HARD_LIMIT = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
STRANGER = "10.254.0.6"  # an address on the sandbox's link that belongs to no sandbox
SUMMARY = "not audited one by one"


def lines_after_start(gw: GatewayProcess) -> list[str]:
    """The gateway's stderr after its start-up line, asserted free of tracebacks."""
    log = gw.log()
    assert "Traceback" not in log, log[-4000:]
    return log.split("proxy on", 1)[1].splitlines()[1:]


def stopped_audit(gw: GatewayProcess) -> list[dict]:
    """The audit log once the gateway has stopped (which writes the summaries of intervals still open)."""
    assert gw.stop() == 0
    return gw.audit()


# --- many tunnels: the defaults, and beyond the caps ---------------------------------------------------------------


def test_a_thousand_concurrent_tunnels_work_with_the_defaults(
    topology: Topology, fakenet: FakeNet, own_gateway, test_ca: FakeCA, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    # A common default: 1,024 open files (soft), a high hard limit. The gateway raises the soft limit itself.
    config = e2e_gateway_config(tmp_path)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, HARD_LIMIT))
    caplog.set_level(logging.INFO)
    try:
        with gateway_in_thread(topology, config):
            held = HeldTunnels(topology.sbx, PROXY, "allowed.test:443", str(test_ca.ca_cert))
            try:
                opened = held.open(1000)
                assert opened.count("200") == 1000, sorted(set(opened))
                assert held.request_all().count("200") == 1000  # all of them at once, still open
            finally:
                held.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1024), HARD_LIMIT))
    assert fakenet.connections(ALLOWED_IP, 443) == 1000
    assert any(f"open files {HARD_LIMIT}, raised from 1024" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-3000:]


def test_tunnels_beyond_the_cap_get_429_and_a_summary_not_a_line_each(
    topology: Topology, fakenet: FakeNet, own_gateway, test_ca: FakeCA
):
    gw = own_gateway(extra=("--workers", "1", "--max-tunnels", "50"))  # the exact cap: one worker holds it whole
    held = HeldTunnels(topology.sbx, PROXY, "allowed.test:443", str(test_ca.ca_cert))
    try:
        assert held.open(50).count("200") == 50
        assert held.open(300) == ["429"] * 300
    finally:
        held.close()
    time.sleep(0.5)  # closed tunnels free their slots
    assert in_netns(topology.sbx, tls_get, PROXY, "allowed.test:443", "allowed.test", test_ca.ca_cert).status == 200
    assert lines_after_start(gw) == []
    refused = [r for r in stopped_audit(gw) if "sandbox already has 50 open tunnels" in r["reason"]]
    one_by_one = [r for r in refused if SUMMARY not in r["reason"]]
    summaries = [r for r in refused if SUMMARY in r["reason"]]
    assert len(one_by_one) <= 10 and len(summaries) == 1, refused
    assert len(one_by_one) + summaries[0]["extra"]["suppressed"] == 300
    assert summaries[0]["extra"]["clients"] == {SBX_IP: summaries[0]["extra"]["suppressed"]}


def announced_caps(gw: GatewayProcess) -> tuple[int, int]:
    found = re.search(r"at most (\d+) proxied connections, (\d+) per sandbox, of which (\d+) tunnels", gw.log())
    assert found, gw.log()
    return int(found.group(2)), int(found.group(3))


def test_a_small_open_file_limit_gives_smaller_caps_and_refusals_beyond_them(
    topology: Topology, fakenet: FakeNet, own_gateway, test_ca: FakeCA
):
    gw = own_gateway(nofile=(512, 512), extra=("--workers", "1"))  # the exact caps: one worker holds them whole
    connections, tunnels = announced_caps(gw)
    assert "open files 512 (hard limit 512)" in gw.log() and 16 <= tunnels <= connections < 256
    held = HeldTunnels(topology.sbx, PROXY, "allowed.test:443", str(test_ca.ca_cert))
    try:
        opened = held.open(connections + 100)
        assert opened.count("200") == tunnels, sorted(set(opened))
        # beyond the tunnel cap 429; beyond the connection cap the connection is closed at once
        assert set(opened) - {"200"} <= {"429", "IncompleteReadError", "ConnectionResetError"}, sorted(set(opened))
        assert held.request_all().count("200") == tunnels
    finally:
        held.close()
    time.sleep(0.5)
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/").status == 200
    assert lines_after_start(gw) == []


def test_running_out_of_file_descriptors_is_one_line_not_a_traceback_per_socket(
    topology: Topology, fakenet: FakeNet, own_gateway
):
    # With the broker's cap per address raised far past what its descriptors allow, holding hundreds of broker
    # connections exhausts a gateway's small limit: the listeners must pause, not spin or log per socket.
    gw = own_gateway(nofile=(512, 512), extra=("--broker-max-connections", "100000"))
    assert gw.proc is not None
    held: list[socket.socket] = []

    def exhaust() -> None:
        raise_open_file_limit()
        for _ in range(700):  # until the gateway stops taking them: its own limit (512) is reached
            try:
                held.append(socket.create_connection(BROKER, timeout=3))
            except OSError:
                break

    in_netns(topology.sbx, exhaust)
    try:
        assert len(held) >= 400
        time.sleep(1)
        cpu = cpu_seconds(gw.proc.pid)
        time.sleep(3)
        assert cpu_seconds(gw.proc.pid) - cpu < 0.5  # no spinning on the listeners while descriptors are out
    finally:
        for sock in held:
            sock.close()
    time.sleep(1.5)  # asyncio retries a paused listener after a second
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/").status == 200
    after = lines_after_start(gw)
    assert 1 <= len(after) <= 3 and all("out of file descriptors" in line for line in after), after


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- addresses of no sandbox -----------------------------------------------------------------------------------


@pytest.fixture
def stranger(topology: Topology) -> Iterator[str]:
    """A second address in the sandbox namespace that no sandbox network covers, routed back from the gateway."""
    topology.run(topology.sbx, ["ip", "addr", "add", f"{STRANGER}/32", "dev", topology.sbx_if])
    topology.run(topology.gw, ["ip", "route", "add", f"{STRANGER}/32", "dev", topology.gw_sbx_if])
    try:
        yield STRANGER
    finally:
        topology.run(topology.gw, ["ip", "route", "del", f"{STRANGER}/32", "dev", topology.gw_sbx_if])
        topology.run(topology.sbx, ["ip", "addr", "del", f"{STRANGER}/32", "dev", topology.sbx_if])


def test_a_flood_from_an_address_of_no_sandbox_gets_a_few_audit_lines_and_a_summary(
    topology: Topology, fakenet: FakeNet, own_gateway, stranger: str
):
    gw = own_gateway()

    def flood() -> tuple[int, int]:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind((stranger, 0))
            for i in range(300):
                udp.sendto(DNSRecord.question(f"q{i}.allowed.test").pack(), (GW_IP, 53))
            udp.settimeout(1)
            answered = 0
            with contextlib.suppress(TimeoutError):
                while DNSRecord.parse(udp.recv(4096)).header.rcode == RCODE.REFUSED:
                    answered += 1
        refused = 0
        for _ in range(100):
            with socket.socket() as sock:
                sock.bind((stranger, 0))
                sock.settimeout(5)
                sock.connect(PROXY)
                try:
                    sock.sendall(b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
                    refused += sock.recv(100) == b""  # closed, nothing said
                except (ConnectionResetError, BrokenPipeError):
                    refused += 1
        return answered, refused

    answered, refused = in_netns(topology.sbx, flood)
    assert answered <= 10 and refused == 100
    assert fakenet.total_connections() == 0 and fakenet.stats()["dns"] == {}
    # The DNS server is the gateway's one; each proxy worker summarizes its own refusals, from its share of the
    # lines audited one by one: N workers write no more of those than one process.
    workers = gw.workers()
    records = stopped_audit(gw)
    for kind, sent, summarizers in (("dns", 300, 1), ("connect", 100, workers)):
        lines = [r for r in records if r["kind"] == kind and r["sandbox"] == "-"]
        summaries = [r for r in lines if SUMMARY in r["reason"]]
        one_by_one = len(lines) - len(summaries)
        assert one_by_one <= 10 and 1 <= len(summaries) <= summarizers, lines
        assert one_by_one + sum(s["extra"]["suppressed"] for s in summaries) == sent
        assert all(s["extra"]["clients"] == {stranger: s["extra"]["suppressed"]} for s in summaries)
    assert len(records) <= 21 + workers


# --- the one resolver caches failures briefly --------------------------------------------------------------------


def test_an_upstream_refusing_aaaa_is_asked_once_per_few_seconds_not_per_request(
    topology: Topology, fakenet: FakeNet, own_gateway
):
    gw = own_gateway()
    name = "refused6.allowed.test"

    def requests() -> list[int]:
        return [proxy_http(PROXY, f"http://{name}/").status for _ in range(30)]

    started = time.monotonic()
    assert in_netns(topology.sbx, requests) == [200] * 30
    for _ in range(10):
        assert topology.dns_query(topology.sbx, name, "AAAA", server=GW_IP).rcode == "SERVFAIL"
        assert topology.dns_query(topology.sbx, name, "A", server=GW_IP).rcode == "NOERROR"
    elapsed = time.monotonic() - started
    # The DNS server's resolver and each proxy worker's cache their answers apart (docs/operations.md, Workers).
    resolvers = 1 + gw.workers() if gw.workers() > 1 else 1
    allowed_queries = resolvers * (1 + math.ceil(elapsed / 3.0))  # each resolver's failure_ttl: 3 s
    assert 1 <= fakenet.dns_queries(name, "AAAA") <= allowed_queries, (fakenet.dns_queries(name, "AAAA"), elapsed)
    assert 1 <= fakenet.dns_queries(name, "A") <= resolvers  # kept for --dns-min-ttl (the zone's TTL is 0)


# --- the audit log cannot be written ---------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs of this test's own, unmounted afterwards."""
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def fill(disk: Path) -> Path:
    filler = disk / "filler"
    with contextlib.suppress(OSError), filler.open("wb", buffering=0) as f:
        while True:
            f.write(b"x" * 1024)
    return filler


def wait_for(predicate, timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_full_audit_disk_denies_new_requests_until_there_is_room_again(
    topology: Topology, fakenet: FakeNet, own_gateway, tiny_disk: Path
):
    gw = own_gateway(audit_path=tiny_disk / "audit.jsonl")
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/first").status == 200
    assert topology.dns_query(topology.sbx, "allowed.test", server=GW_IP).rcode == "NOERROR"  # now remembered
    assert wait_for(lambda: any(r["path"] == "/first" for r in gw.audit()))
    filler = fill(tiny_disk)
    # Lines go on filling the file's last page; the first that cannot be written is when the gateway knows.
    passed: list[str] = []
    while "AUDIT LOG CANNOT BE WRITTEN" not in gw.log():
        assert len(passed) < 40, gw.log()
        passed.append(f"/passed{len(passed)}")
        if in_netns(topology.sbx, proxy_http, PROXY, f"http://allowed.test{passed[-1]}").status != 200:
            break
        time.sleep(0.15)  # a flush
    assert wait_for(lambda: "AUDIT LOG CANNOT BE WRITTEN" in gw.log()), gw.log()
    fakenet.reset()
    denied = [in_netns(topology.sbx, proxy_http, PROXY, f"http://allowed.test/denied{i}") for i in range(20)]
    assert {r.status for r in denied} == {403}
    assert "audit log unavailable" in denied[0].json()["reason"] and "No space left" in denied[0].json()["reason"]
    assert topology.dns_query(topology.sbx, "allowed.test", server=GW_IP).rcode == "SERVFAIL"
    assert fakenet.total_connections() == 0
    assert gw.log().count("AUDIT LOG CANNOT BE WRITTEN") == 1  # once, not once per request
    filler.unlink()
    assert wait_for(lambda: "audit log written again" in gw.log()), gw.log()
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/after").status == 200
    # Nothing was lost: the lines that waited were written once there was room, in the order of their requests
    # (the order of their time stamps: proxy workers send theirs apart).
    paths = [r["path"] for r in sorted(stopped_audit(gw), key=lambda r: r["ts"]) if r["kind"] == "http"]
    assert paths == ["/first", *passed, *[f"/denied{i}" for i in range(20)], "/after"], paths
    assert len(lines_after_start(gw)) == 2


def test_a_removed_audit_log_is_created_again(topology: Topology, fakenet: FakeNet, own_gateway):
    gw = own_gateway()
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/before").status == 200
    assert wait_for(lambda: len(gw.audit()) == 1)
    gw.audit_path.unlink()
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/after").status == 200
    assert wait_for(lambda: gw.audit_path.exists() and len(gw.audit()) == 1)
    assert [r["path"] for r in gw.audit()] == ["/after"]
    rotated = gw.audit_path.with_suffix(".1")
    gw.audit_path.rename(rotated)  # log rotation: renamed away, the gateway goes on at the path
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/rotated").status == 200
    assert wait_for(lambda: gw.audit_path.exists() and len(gw.audit()) == 1)
    assert [r["path"] for r in gw.audit()] == ["/rotated"]
    assert len(lines_after_start(gw)) == 2


def test_upstream_connections_are_capped_like_client_connections(topology: Topology, fakenet: FakeNet, own_gateway):
    # mitmproxy keeps the upstream connections of a client connection open for reuse, one per host it sent plain
    # HTTP to: without a cap of their own, one client connection could hold any number of descriptors.
    own_gateway(extra=("--workers", "1", "--max-connections", "3"))  # the exact cap: one worker holds it whole

    def one_client_connection() -> list[tuple[int, bytes]]:
        conn = http.client.HTTPConnection(*PROXY, timeout=10)
        replies = []
        for i in range(5):
            conn.request("GET", f"http://h{i}.allowed.test/", headers={"Host": f"h{i}.allowed.test"})
            response = conn.getresponse()
            replies.append((response.status, response.read()))
        conn.close()
        return replies

    replies = in_netns(topology.sbx, one_client_connection)
    # The fourth host finds the sandbox's three upstream slots taken; the 502 closes that client connection and
    # its upstream ones, so the fifth request (on a new connection) has room again.
    assert [status for status, _ in replies] == [200, 200, 200, 502, 200]
    assert b"sandbox already has 3 upstream connections open" in replies[3][1]
    assert fakenet.connections(ALLOWED_IP, 80) == 4


def test_broker_connections_are_capped_per_address(topology: Topology, fakenet: FakeNet, own_gateway):
    gw = own_gateway(extra=("--broker-max-connections", "8"))
    held: list[socket.socket] = []

    def hold(count: int) -> list[str]:
        seen = []
        for _ in range(count):
            sock = socket.create_connection(BROKER, timeout=3)
            held.append(sock)
            sock.settimeout(0.5)
            try:
                seen.append("closed" if sock.recv(1) == b"" else "data")
            except TimeoutError:
                seen.append("open")
            except OSError:
                seen.append("closed")
        return seen

    try:
        assert in_netns(topology.sbx, hold, 12) == ["open"] * 8 + ["closed"] * 4
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.5)
    assert in_netns(topology.sbx, hold, 1) == ["open"]  # freed again once they close
    for sock in held:
        sock.close()
    assert "connection(s) refused" in gw.log() and "Traceback" not in gw.log()
