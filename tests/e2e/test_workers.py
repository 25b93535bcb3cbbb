"""`airlock gateway --workers 2` as a process in the gateway namespace: requests served and audited by both workers,
a worker killed under load (the other serves, the dead one comes back), a reload under load (no line judged by a
mix of policies, every line after the reload returned carries the new hash), a refused policy refused by all, a
spliced tunnel through a worker, the supervisor killed (no worker serves on). Real namespaces, real mitmproxy."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from airlock.policy import load_policy
from airlock.verify.fakeca import FakeCA
from airlock.verify.topology import FakeNet, Topology

from gateway_proc import E2E_POLICY, PROXY, AdminConnection, GatewayProcess
from netclient import closed_within, connect_tunnel, in_netns, proxy_http, tcp_probe, tls_get

WORKERS = ("--workers", "2")
# The e2e policy without allowed.test: its requests are denied (unlisted) where the e2e policy allows them.
DENYING = "version: 1\nprofiles:\n  default:\n    allow:\n      - host: other.test\n        ports: [443]\n"


def admin(gw: GatewayProcess, method: str, path: str) -> Any:
    """The admin listener's JSON answer (its unix socket: path-based, reachable from this namespace)."""
    conn = AdminConnection(gw.workdir / "state" / "admin.sock", timeout=60)
    try:
        conn.request(method, path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def worker_pids(gw: GatewayProcess) -> dict[int, int]:
    return {w["index"]: w["pid"] for w in admin(gw, "GET", "/v1/status")["workers"] if w["serving"]}


def worker_hashes(gw: GatewayProcess, expected: set[str], wait: float = 10) -> set[str | None]:
    """The policy hash each worker last reported (the supervisor asks them every second), once it is `expected`."""
    deadline = time.monotonic() + wait
    while (hashes := {w["policy_hash"] for w in admin(gw, "GET", "/v1/status")["workers"]}) != expected:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return hashes


class Load:
    """Threads in the sandbox's namespace sending plain-HTTP requests through the proxy, each on a new
    connection, until stopped; every reply kept as (path, status)."""

    def __init__(self, topology: Topology, url: Callable[[int], str], threads: int = 4) -> None:
        self.topology, self.url = topology, url
        self.replies: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._count = iter(range(10**9))
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def _run(self) -> None:
        fd = os.open(f"/run/netns/{self.topology.sbx}", os.O_RDONLY)
        os.setns(fd, os.CLONE_NEWNET)
        os.close(fd)
        while not self._stop.is_set():
            with self._lock:
                url = self.url(next(self._count))
            reply = proxy_http(PROXY, url, timeout=10)
            with self._lock:
                self.replies.append((url, reply.status))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def wait_for(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        start = len(self.replies)
        while len(self.replies) < start + n:
            assert time.monotonic() < deadline, f"only {len(self.replies) - start} replies in {timeout}s"
            time.sleep(0.02)


def http_lines(gw: GatewayProcess, prefix: str, n: int, wait: float = 10) -> list[dict[str, Any]]:
    """The plain-HTTP audit lines whose path starts with `prefix`, once there are at least `n`."""
    deadline = time.monotonic() + wait
    while True:
        lines = [r for r in gw.audit() if r["kind"] == "http" and (r["path"] or "").startswith(prefix)]
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


@pytest.fixture
def workers_gateway(own_gateway: Callable[..., GatewayProcess]) -> Callable[..., GatewayProcess]:
    def start(policy: Path = E2E_POLICY, extra: tuple[str, ...] = ()) -> GatewayProcess:
        return own_gateway(policy, WORKERS + extra)

    return start


def test_requests_are_served_by_both_workers_and_audited_whole_in_one_file(
    topology: Topology, fakenet: FakeNet, workers_gateway: Callable[..., GatewayProcess]
) -> None:
    gw = workers_gateway()
    assert "(2 workers)" in gw.log()
    pids = worker_pids(gw)
    assert sorted(pids) == [0, 1] and os.getpid() not in pids.values()
    with Load(topology, lambda i: f"http://allowed.test/both-{i}", threads=6) as load:
        load.wait_for(200)
    assert {status for _, status in load.replies} == {200}
    lines = http_lines(gw, "/both-", len(load.replies))
    assert len(lines) == len(load.replies)  # every request audited once, every line whole (each parsed as JSON)
    assert len({line["request_id"] for line in lines}) == len(lines)
    by_worker = Counter(line["extra"]["worker"] for line in lines)
    assert set(by_worker) == {0, 1}, by_worker  # both served
    assert fakenet.connections("192.0.2.10", 80) == len(load.replies)
    assert all(line["decision"] == "allow" and line["profile"] == "default" for line in lines)
    # The workers' counters are the supervisor's to report.
    status = admin(gw, "GET", "/v1/status")
    assert status["counters"]["http"]["allow"] >= len(lines)


def test_metrics_add_up_every_workers_counters(
    topology: Topology, fakenet: FakeNet, workers_gateway: Callable[..., GatewayProcess]
) -> None:
    gw = workers_gateway()
    with Load(topology, lambda i: f"http://allowed.test/metrics-{i}", threads=4) as load:
        load.wait_for(40)
    denied = [in_netns(topology.sbx, proxy_http, PROXY, f"http://evil.test/{i}").status for i in range(5)]
    assert set(denied) == {403}
    lines = http_lines(gw, "/metrics-", len(load.replies))
    assert {line["extra"]["worker"] for line in lines} == {0, 1}
    conn = AdminConnection(gw.workdir / "state" / "admin.sock")
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    samples = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    allowed = {("kind", "http"), ("decision", "allow"), ("profile", "default"), ("code", "allowed")}
    assert samples[("airlock_decisions_total", frozenset(allowed))] == len(load.replies)
    denials = {("kind", "http"), ("decision", "deny"), ("profile", "default"), ("code", "not_allowlisted")}
    assert samples[("airlock_decisions_total", frozenset(denials))] == 5
    decided = samples[("airlock_decide_duration_seconds_count", frozenset({("source", "proxy")}))]
    assert decided >= len(load.replies) + 5  # the workers' judgements, timed in them


def test_a_killed_worker_loses_only_its_connections_the_other_serves_and_it_is_restarted(
    topology: Topology, fakenet: FakeNet, workers_gateway: Callable[..., GatewayProcess]
) -> None:
    gw = workers_gateway()
    before = worker_pids(gw)
    with Load(topology, lambda i: f"http://allowed.test/kill-{i}", threads=4) as load:
        load.wait_for(50)
        os.kill(before[0], signal.SIGKILL)
        killed_at = len(load.replies)
        load.wait_for(100)  # served on while worker 0 is down, and after
        deadline = time.monotonic() + 60
        while (now := worker_pids(gw)).get(0) in (None, before[0]):
            assert time.monotonic() < deadline, f"worker 0 not restarted:\n{gw.log()}"
            time.sleep(0.1)
        restarted_at = len(load.replies)
        load.wait_for(150)
    assert now[1] == before[1]  # the other worker was never touched
    assert "proxy worker 0 (pid" in gw.log() and "ended (exit -9): restarting it" in gw.log()
    statuses = [status for _, status in load.replies]
    # Only requests worker 0 held when it died may have failed (a handful), none after it was back.
    assert statuses[:killed_at].count(200) == killed_at
    assert len(statuses[killed_at:]) - statuses[killed_at:].count(200) <= 8, Counter(statuses[killed_at:])
    assert set(statuses[restarted_at + 8 :]) == {200}
    # The restarted worker 0 serves again: lines of its own after the restart.
    lines = http_lines(gw, "/kill-", 100)
    late = {f"http://allowed.test{line['path']}" for line in lines if line["extra"]["worker"] == 0}
    assert late & {url for url, _ in load.replies[restarted_at:]}, "the restarted worker served nothing"


def test_a_reload_under_load_judges_no_request_by_a_mix_and_is_in_force_everywhere_once_it_returns(
    topology: Topology, fakenet: FakeNet, workers_gateway: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(E2E_POLICY.read_text())
    old, new = load_policy(policy).hash, None
    gw = workers_gateway(policy)
    with Load(topology, lambda i: f"http://allowed.test/during-{i}", threads=6) as load:
        load.wait_for(60)
        policy.write_text(DENYING)
        new = load_policy(policy).hash
        outcome = admin(gw, "POST", "/v1/policy/reload")
        load.wait_for(60)
    assert outcome["reloaded"] and outcome["policy_hash"] == new and outcome["previous_hash"] == old, outcome
    after = [in_netns(topology.sbx, proxy_http, PROXY, f"http://allowed.test/after-{i}").status for i in range(20)]
    assert set(after) == {403}
    lines = http_lines(gw, "/during-", len(load.replies))
    verdicts = Counter((line["policy_hash"], line["decision"]) for line in lines)
    # Each line says which policy judged it, and the verdict is that policy's: never one policy's hash on the
    # other's decision.
    assert set(verdicts) == {(old, "allow"), (new, "deny")}, verdicts
    after_lines = http_lines(gw, "/after-", 20)
    assert len(after_lines) == 20 and {(r["policy_hash"], r["decision"]) for r in after_lines} == {(new, "deny")}
    assert {r["extra"]["worker"] for r in lines} == {0, 1}
    [reloaded] = [r for r in gw.audit() if r["kind"] == "policy"]
    assert reloaded["code"] == "policy_loaded" and reloaded["policy_hash"] == new
    assert worker_hashes(gw, {new}) == {new}


def test_a_policy_that_does_not_load_is_refused_and_the_running_one_stays(
    topology: Topology, fakenet: FakeNet, workers_gateway: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(E2E_POLICY.read_text())
    running = load_policy(policy).hash
    gw = workers_gateway(policy)
    policy.write_text("version: 1\nprofiles:\n  default:\n    allow:\n      - hots: typo.test\n")
    broken = admin(gw, "POST", "/v1/policy/reload")
    assert not broken["reloaded"] and broken["policy_hash"] == running
    assert worker_hashes(gw, {running}) == {running}
    replies = [in_netns(topology.sbx, proxy_http, PROXY, f"http://allowed.test/stays-{i}").status for i in range(10)]
    assert set(replies) == {200}
    assert {r["policy_hash"] for r in http_lines(gw, "/stays-", 10)} == {running}
    assert [r["code"] for r in gw.audit() if r["kind"] == "policy"] == ["policy_refused"]


def test_a_spliced_passthrough_tunnel_through_a_worker_is_audited_and_counted(
    topology: Topology, fakenet: FakeNet, workers_gateway: Callable[..., GatewayProcess], test_ca: FakeCA
) -> None:
    gw = workers_gateway()
    size = 4 << 20
    reply = in_netns(
        topology.sbx, tls_get, PROXY, "allowed.test:443", "allowed.test", test_ca.ca_cert, f"/big?n={size}"
    )
    assert reply.status == 200 and len(reply.body) == size
    deadline = time.monotonic() + 5
    while not (lines := gw.audit_for(host="allowed.test", kind="connect")) and time.monotonic() < deadline:
        time.sleep(0.05)
    [line] = lines
    assert line["extra"]["relayed_by"] == "kernel" and line["extra"]["worker"] in (0, 1)
    assert line["bytes_out"] > size and line["bytes_in"] > fakenet.bytes_in("192.0.2.10", 443) > 0  # TLS around it
    assert fakenet.connections("192.0.2.10", 443) == 1


def test_each_worker_holds_its_share_of_the_tunnel_cap_so_together_they_never_pass_it(
    topology: Topology, fakenet: FakeNet, workers_gateway: Callable[..., GatewayProcess]
) -> None:
    gw = workers_gateway(extra=("--max-tunnels", "2"))  # one each

    def open_tunnels(n: int) -> list[int]:
        held, statuses = [], []
        for _ in range(n):
            sock, reply = connect_tunnel(PROXY, "ssh.allowed.test:22")
            statuses.append(reply.status)
            if sock is not None:
                held.append(sock)
        for sock in held:
            sock.close()
        return statuses

    statuses = in_netns(topology.sbx, open_tunnels, 6)
    assert 1 <= statuses.count(200) <= 2 and statuses.count(429) == 6 - statuses.count(200), statuses
    deadline = time.monotonic() + 5
    while not (refused := [r for r in gw.audit() if r["code"] == "tunnel_limit"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert refused and "open tunnels in this proxy worker (its share of the cap: 2 workers)" in refused[0]["reason"]


def test_with_its_supervisor_killed_no_worker_serves_on(
    topology: Topology, fakenet: FakeNet, workers_gateway: Callable[..., GatewayProcess]
) -> None:
    gw = workers_gateway()
    pids = worker_pids(gw).values()
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/").status == 200
    assert gw.proc is not None
    gw.proc.kill()
    gw.proc.wait()
    deadline = time.monotonic() + 10
    while alive := [pid for pid in pids if _alive(pid)]:
        assert time.monotonic() < deadline, f"workers {alive} outlived their supervisor"
        time.sleep(0.05)
    assert not in_netns(topology.sbx, tcp_probe, PROXY, 2).startswith("open")
    fakenet.reset()
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/", None, 3).status == 0
    assert fakenet.total_connections() == 0


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped serves nothing, and holds no socket)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_no_secret_reaches_a_workers_command_line_or_environment(
    topology: Topology, fakenet: FakeNet, workers_gateway: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    value = os.urandom(16).hex()
    secret = tmp_path / "token"
    secret.write_text(value)
    gw = workers_gateway(extra=("--secret", f"TOKEN=file:{secret}"))
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/").status == 200
    for pid in worker_pids(gw).values():
        for what in ("cmdline", "environ"):
            seen = Path(f"/proc/{pid}/{what}").read_bytes()
            assert value.encode() not in seen and str(secret).encode() not in seen, what
        assert b"airlock.gateway.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_close_denied_on_reload_closes_the_denied_tunnels_in_every_worker_and_keeps_the_allowed(
    topology: Topology,
    fakenet: FakeNet,
    workers_gateway: Callable[..., GatewayProcess],
    tmp_path: Path,
    test_ca: FakeCA,
) -> None:
    policy = tmp_path / "live.yaml"
    policy.write_text(E2E_POLICY.read_text())
    gw = workers_gateway(policy, ("--close-denied-on-reload",))
    denied = []

    def tunnels_by_worker() -> list[int]:
        return [w["tunnels"] for w in admin(gw, "GET", "/v1/status")["workers"]]

    # Tunnels to allowed.test until each worker holds one (a worker takes whichever connection it accepts first).
    while len(denied) < 20 and min(tunnels_by_worker()) == 0:
        sock, reply = in_netns(topology.sbx, connect_tunnel, PROXY, "allowed.test:443")
        assert sock is not None, reply
        denied.append(sock)
    assert min(tunnels_by_worker()) >= 1, tunnels_by_worker()
    kept, _ = in_netns(topology.sbx, connect_tunnel, PROXY, "other.test:443")
    assert kept is not None
    policy.write_text(E2E_POLICY.read_text().replace("    deny:\n", "    deny:\n      - host: allowed.test\n", 1))
    result = admin(gw, "POST", "/v1/policy/reload")
    assert result["reloaded"], result
    assert all(closed_within(sock, 3) for sock in denied)
    kept.settimeout(10)
    with ssl.create_default_context(cafile=test_ca.ca_cert).wrap_socket(kept, server_hostname="other.test") as tls:
        tls.sendall(b"GET /kept HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n")
        assert tls.recv(65536).startswith(b"HTTP/1.1 200")  # a tunnel the new policy still allows keeps relaying
    assert f"closed {len(denied)} open tunnels the reloaded policy denies" in gw.log()
    for sock in denied:
        sock.close()
    gw.stop()
    closed = [r for r in gw.audit() if r["kind"] == "connect" and r["host"] == "allowed.test"]
    assert len(closed) == len(denied) and {r["extra"]["worker"] for r in closed} == {0, 1}
    assert all(r["extra"]["closed"].startswith("closed at a policy reload, which denies it") for r in closed)


def test_a_request_held_for_a_person_is_lost_not_let_through_when_its_worker_dies(
    topology: Topology, fakenet: FakeNet, workers_gateway: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    policy = tmp_path / "asks.yaml"
    policy.write_text("version: 1\nprofiles:\n  default:\n    on_unlisted: ask\n    ask_timeout: 30\n    allow: []\n")
    gw = workers_gateway(policy)
    argv = ["curl", "-sS", "--max-time", "20", "-x", f"http://{PROXY[0]}:{PROXY[1]}", "-w", "\n%{http_code}"]
    held = topology.popen(topology.sbx, [*argv, "http://evil.test/held"], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not [p for p in admin(gw, "GET", "/v1/approvals")["pending"] if p["waiting"] >= 1]:
        assert time.monotonic() < deadline, gw.log()[-2000:]
        time.sleep(0.1)
    for pid in worker_pids(gw).values():
        os.kill(pid, signal.SIGKILL)  # whichever holds it: its channel is lost with it
    out, _ = held.communicate(timeout=20)
    assert out.rpartition("\n")[2] != "200" and fakenet.connections("203.0.113.66", 80) == 0
    [entry] = admin(gw, "GET", "/v1/approvals")["pending"]
    assert entry["waiting"] == 0  # the desk's entry stays listed until answered or timed out; nobody waits on it
