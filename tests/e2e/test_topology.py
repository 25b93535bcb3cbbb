"""The harness proves itself: namespaces, routes, the fake internet's listeners, DNS zone and counters."""

from __future__ import annotations

import socket
import subprocess

import pytest

from airlock.verify.fakeca import FakeCA
from airlock.verify.topology import FAKE_ADDRS, GW_ROUTES, FakeNet, Topology

ALLOWED = "192.0.2.10"


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def body(ip: str, port: int, host: str, path: str) -> str:
    return f"fakenet {ip}:{port} host={host} path={path}\n"


# ------------------------------------------------------------------------------------------- HTTP / TLS / TCP


def test_http_from_gw(topology: Topology, fakenet: FakeNet) -> None:
    topology.assert_route_inside(topology.gw, ALLOWED)
    res = topology.curl(topology.gw, f"http://{ALLOWED}/x")
    assert res.returncode == 0, res.stderr
    assert res.stdout == body(ALLOWED, 80, ALLOWED, "/x")
    assert fakenet.connections(ALLOWED, 80) == 1
    assert fakenet.bytes_in(ALLOWED, 80) > 0
    (req,) = fakenet.http_requests()
    assert (req["line"], req["host"], req["client"]) == ("GET /x HTTP/1.1", ALLOWED, topology.gw_outside_ip)


def test_https_from_gw_records_sni(topology: Topology, fakenet: FakeNet, test_ca: FakeCA) -> None:
    topology.assert_route_inside(topology.gw, ALLOWED)
    res = topology.curl(
        topology.gw,
        "--cacert",
        str(test_ca.ca_cert),
        "--resolve",
        f"allowed.test:443:{ALLOWED}",
        "https://allowed.test/",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == body(ALLOWED, 443, "allowed.test", "/")
    assert fakenet.snis() == ["allowed.test"]
    assert fakenet.stats()["tls"] == [
        {"dst": f"{ALLOWED}:443", "client": topology.gw_outside_ip, "sni": "allowed.test"}
    ]


def test_tls_handshake_failure_still_counted(topology: Topology, fakenet: FakeNet) -> None:
    # No --cacert: curl rejects the certificate, yet fakenet must have counted the attempt and seen the SNI.
    topology.assert_route_inside(topology.gw, "203.0.113.66")
    res = topology.curl(topology.gw, "--resolve", "evil.test:8443:203.0.113.66", "https://evil.test:8443/")
    assert res.returncode != 0
    assert fakenet.connections("203.0.113.66", 8443) == 1
    assert fakenet.snis() == ["evil.test"]
    assert fakenet.http_requests() == []


def test_keepalive_big_slow_and_headers(topology: Topology, fakenet: FakeNet) -> None:
    topology.assert_route_inside(topology.gw, ALLOWED)
    base = f"http://{ALLOWED}:8080"
    res = topology.curl(
        topology.gw, "-H", "X-Probe: 1", f"{base}/big?n=200000", f"{base}/slow?s=0.2", f"{base}/headers"
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("x" * 200000 + body(ALLOWED, 8080, f"{ALLOWED}:8080", "/slow?s=0.2"))
    assert '["X-Probe", "1"]' in res.stdout
    assert fakenet.connections(ALLOWED, 8080) == 1  # curl reused one keep-alive connection
    assert len(fakenet.http_requests(f"{ALLOWED}:8080")) == 3


def test_post_body_counted(topology: Topology, fakenet: FakeNet) -> None:
    topology.assert_route_inside(topology.gw, ALLOWED)
    upload = ["curl", "-sS", "--max-time", "10", "--data-binary", "@-", f"http://{ALLOWED}/up"]
    chunked = [*upload[:-1], "-H", "Transfer-Encoding: chunked", upload[-1]]
    for argv in (upload, chunked):
        res = topology.run(topology.gw, argv, input="y" * 5000)
        assert res.stdout == body(ALLOWED, 80, ALLOWED, "/up"), res.stderr
    assert [r["body_bytes"] for r in fakenet.http_requests()] == [5000, 5000]
    assert fakenet.bytes_in(ALLOWED, 80) > 10000


def test_echo_and_canary(topology: Topology, fakenet: FakeNet) -> None:
    topology.assert_route_inside(topology.gw, "198.51.100.10")
    echo = topology.run(topology.gw, ["socat", "-t", "2", "-", "TCP:198.51.100.10:22"], input="ping\n", timeout=10)
    assert echo.stdout == "ping\n", echo.stderr
    canary = topology.run(topology.gw, ["socat", "-u", "TCP:203.0.113.66:9999", "-"], timeout=10)
    assert canary.stdout == "canary\n", canary.stderr
    assert fakenet.bytes_in("198.51.100.10", 22) == 5
    assert fakenet.connections("203.0.113.66", 9999) == 1


@pytest.mark.parametrize("ip", [ip for ip in FAKE_ADDRS if ip != "10.9.9.9"])
def test_every_routed_fake_address_answers_from_gw(topology: Topology, fakenet: FakeNet, ip: str) -> None:
    topology.assert_route_inside(topology.gw, ip)
    res = topology.curl(topology.gw, f"http://{ip}/p")
    assert res.stdout == body(ip, 80, ip, "/p"), res.stderr
    assert fakenet.connections(ip, 80) == 1


def test_unrouted_internal_address_unreachable_from_gw(topology: Topology, fakenet: FakeNet) -> None:
    topology.assert_route_inside(topology.gw, "10.9.9.9")
    assert topology.curl(topology.gw, "http://10.9.9.9/", max_time=3).returncode != 0
    assert fakenet.total_connections() == 0


def test_bad_clients_do_not_break_fakenet(topology: Topology, fakenet: FakeNet) -> None:
    topology.assert_route_inside(topology.gw, ALLOWED)
    topology.assert_route_inside(topology.gw, "192.0.2.53")
    bad = [
        ("garbage\r\n\r\n", f"TCP:{ALLOWED}:80"),
        ("POST / HTTP/1.1\r\nContent-Length: nope\r\n\r\n", f"TCP:{ALLOWED}:80"),
        ("GET / HTTP/1.1\r\nHost: half", f"TCP:{ALLOWED}:80"),
        ("\x16\x03\x01 not a client hello", f"TCP:{ALLOWED}:443"),
        ("xx", "UDP:192.0.2.53:53"),
        ("\x00\x10short", "TCP:192.0.2.53:53"),
    ]
    for payload, address in bad:
        topology.run(topology.gw, ["socat", "-t", "0.5", "-", address], input=payload, timeout=10)
    with socket.socket(socket.AF_UNIX) as sock:  # a broken control client, too
        sock.connect(str(fakenet.control))
        sock.sendall(b"not json\n")
        assert b"error" in sock.recv(4096)
    assert topology.curl(topology.gw, f"http://{ALLOWED}/still-ok").stdout == body(ALLOWED, 80, ALLOWED, "/still-ok")
    assert topology.dns_query(topology.gw, "allowed.test").values() == [ALLOWED]
    assert fakenet.connections(ALLOWED, 80) == 4


# ----------------------------------------------------------------------------------------------- isolation


def test_sbx_has_no_direct_route(topology: Topology, fakenet: FakeNet) -> None:
    topology.assert_route_inside(topology.sbx, ALLOWED)
    routes = topology.run(topology.sbx, ["ip", "route", "show"]).stdout
    assert "default" not in routes
    res = topology.curl(topology.sbx, f"http://{ALLOWED}/", max_time=3)
    assert res.returncode != 0
    assert fakenet.total_connections() == 0


def test_gw_does_not_forward(topology: Topology, fakenet: FakeNet) -> None:
    # Even with a route towards gw, sbx's packets must die there: gw is a proxy, not a router.
    route = ["ip", "route", "add", f"{ALLOWED}/32", "via", topology.gw_ip]
    assert topology.run(topology.sbx, route).returncode == 0
    try:
        topology.assert_route_inside(topology.sbx, ALLOWED)
        res = topology.curl(topology.sbx, f"http://{ALLOWED}/", max_time=2)
        # Nothing routes it on. A gateway of an earlier test still fencing this topology answers itself: its own
        # refusal (transparent mode), never the upstream's page.
        assert res.returncode != 0 or "not_allowlisted" in res.stdout, res
    finally:
        topology.run(topology.sbx, ["ip", "route", "del", f"{ALLOWED}/32"])
    assert topology.run(topology.gw, ["sysctl", "-n", "net.ipv4.ip_forward"]).stdout.strip() == "0"
    assert fakenet.total_connections() == 0


def test_gw_routes_are_explicit(topology: Topology) -> None:
    routes = topology.run(topology.gw, ["ip", "route", "show"]).stdout
    assert "default" not in routes
    for dst in GW_ROUTES:
        assert dst.removesuffix("/32") in routes
    for ns in topology.namespaces:
        assert topology.run(ns, ["sysctl", "-n", "net.ipv6.conf.all.disable_ipv6"]).stdout.strip() == "1"


def test_assert_route_inside(topology: Topology) -> None:
    for ip in FAKE_ADDRS:
        topology.assert_route_inside(topology.gw, ip)  # routed via the gw->net veth, or unreachable
        topology.assert_route_inside(topology.sbx, ip)  # unreachable
        topology.assert_route_inside(topology.net, ip)  # local (lo)
    topology.assert_route_inside(topology.gw, "8.8.8.8")  # no default route: unreachable
    with pytest.raises(AssertionError):
        topology.assert_route_inside("not-ours", ALLOWED)


# ----------------------------------------------------------------------------------------------- DNS


def test_dns_allowed(topology: Topology, fakenet: FakeNet) -> None:
    answer = topology.dns_query(topology.gw, "allowed.test")
    assert (answer.rcode, answer.values()) == ("NOERROR", [ALLOWED])
    assert answer.records[0][3] == 0  # --zone-default-ttl 0
    assert fakenet.dns_queries("allowed.test") == 1
    assert topology.dns_query(topology.gw, "Allowed.Test.", tcp=True).values() == [ALLOWED]
    assert fakenet.dns_queries("allowed.test") == 2
    assert [e["proto"] for e in fakenet.stats()["dns_log"]] == ["udp", "tcp"]


def test_dns_rebind_alternates(topology: Topology, fakenet: FakeNet) -> None:
    answers = [topology.dns_query(topology.gw, "rebind.allowed.test") for _ in range(4)]
    assert [a.values() for a in answers] == [[ALLOWED], ["10.1.2.3"], [ALLOWED], ["10.1.2.3"]]
    assert all(a.records[0][3] == 0 for a in answers)
    assert fakenet.dns_queries("rebind.allowed.test", "A") == 4


@pytest.mark.parametrize(
    ("name", "qtype", "rcode", "expected"),
    [
        ("www.allowed.test", "A", "NOERROR", [("A", ALLOWED)]),
        ("other.test", "A", "NOERROR", [("A", "198.51.100.10")]),
        ("evil.test", "A", "NOERROR", [("A", "203.0.113.66")]),
        ("internal.allowed.test", "A", "NOERROR", [("A", "10.1.2.3")]),
        ("loop.allowed.test", "A", "NOERROR", [("A", "127.0.0.1")]),
        ("meta.allowed.test", "A", "NOERROR", [("A", "169.254.169.254")]),
        ("mixed.allowed.test", "A", "NOERROR", [("A", ALLOWED), ("A", "10.1.2.3")]),
        (
            "cname-internal.allowed.test",
            "A",
            "NOERROR",
            [("CNAME", "internal.allowed.test"), ("A", "10.1.2.3")],
        ),
        ("cname-public.allowed.test", "A", "NOERROR", [("CNAME", "allowed.test"), ("A", ALLOWED)]),
        ("svc.internal.test", "A", "NOERROR", [("A", "10.1.2.4")]),
        ("v6.allowed.test", "AAAA", "NOERROR", [("AAAA", "2001:db8::10")]),
        ("v6.allowed.test", "A", "NOERROR", [("A", ALLOWED)]),
        ("txt.allowed.test", "TXT", "NOERROR", [("TXT", "hello")]),
        ("c2VjcmV0.allowed.test", "A", "NOERROR", [("A", ALLOWED)]),
        ("allowed.test", "AAAA", "NOERROR", []),
        ("internal.test", "A", "NOERROR", []),
        ("nope.test", "A", "NXDOMAIN", []),
        ("example.com", "A", "NXDOMAIN", []),
    ],
)
def test_dns_zone(
    topology: Topology, fakenet: FakeNet, name: str, qtype: str, rcode: str, expected: list[tuple[str, str]]
) -> None:
    answer = topology.dns_query(topology.gw, name, qtype)
    assert answer.rcode == rcode
    assert [(t, v) for _, t, v, _ in answer.records] == expected
    assert fakenet.dns_queries(name) == 1


def test_fakenet_reset(topology: Topology, fakenet: FakeNet) -> None:
    topology.dns_query(topology.gw, "allowed.test")
    assert fakenet.stats()["dns"] == {"allowed.test": 1}
    fakenet.reset()
    stats = fakenet.stats()
    assert stats["dns"] == {} and stats["connections"] == {} and stats["http"] == []


# ----------------------------------------------------------------------------------------------- lifecycle


def test_teardown_removes_namespaces() -> None:
    mini = Topology()
    assert mini.prefix.startswith("al")
    try:
        mini.create()
        assert set(mini.namespaces) <= netns_names()
        # A device that is not one of the test's veths: assert_route_inside must refuse routes through it.
        # (A veth pair with both ends in gw: this kernel has no dummy driver.)
        for argv in (
            ["ip", "link", "add", "foreign0", "type", "veth", "peer", "name", "foreign1"],
            ["ip", "link", "set", "foreign0", "up"],
            ["ip", "route", "add", "198.18.0.0/15", "dev", "foreign0"],
        ):
            mini.run(mini.gw, argv, check=True)
        with pytest.raises(AssertionError, match="not owned"):
            mini.assert_route_inside(mini.gw, "198.18.0.1")
        sleeper = mini.popen(mini.net, ["sleep", "300"])
    finally:
        mini.destroy()
    assert sleeper.poll() is not None
    assert not {ns for ns in netns_names() if ns.startswith(mini.prefix)}
    mini.destroy()  # idempotent
    with pytest.raises(AssertionError):
        mini.run(mini.gw, ["true"])
