"""Transparent mode end to end: clients that ignore the proxy variables, in a sandbox whose default route leads to
the gateway's side of its link, where the fence redirects every TCP connection to the gateway's transparent
listener and every DNS query to the gateway's DNS. Real clients (curl --noproxy, Node's fetch, Python's
http.client, git, dig) against the fake internet, whose canaries count every byte; each denial asserts what the
sandbox saw and that the forbidden upstream counted nothing."""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from airlock.sandbox.fence import Interception, refuse_udp_inside
from airlock.sandbox.netns import NETNS_DIR
from airlock.verify.fakeca import FakeCA
from airlock.verify.topology import GW_IP, FakeNet, Topology

from gateway_proc import GatewayProcess
from netclient import in_netns, raw_request, tcp_probe

ALLOWED_IP = "192.0.2.10"
EVIL_IP = "203.0.113.66"
INTERNAL_IP = "10.1.2.3"
NO_RESOLVER = "198.51.100.53"  # nothing listens there: a resolver address hard-coded in the sandbox
NODE = "/usr/bin/node"
INNER_TABLE = "airlock_n_e2einner"  # sbx's own refusal of other UDP, as `airlock run` loads it in a sandbox


@pytest.fixture(scope="module")
def routed_sbx(topology: Topology) -> Iterator[Topology]:
    """sbx with a default route via the gateway and the refusal of other UDP inside it (as `airlock run` gives a
    transparent sandbox) and a resolv.conf naming an address where no resolver runs; all removed after the module."""
    etc = Path("/etc/netns") / topology.sbx
    etc.mkdir(parents=True)
    try:
        (etc / "resolv.conf").write_text(f"nameserver {NO_RESOLVER}\noptions timeout:2 attempts:1\n")
        added = topology.run(topology.sbx, ["ip", "route", "add", "default", "via", GW_IP])
        assert added.returncode == 0, added.stderr
        for destination in (ALLOWED_IP, EVIL_IP, INTERNAL_IP, NO_RESOLVER, "8.8.8.8", "1.1.1.1"):
            topology.assert_route_inside(topology.sbx, destination)  # it leaves on sbx's own link, to gw
        ratemask = topology.run(topology.sbx, ["sysctl", "-n", "net.ipv4.icmp_ratemask"]).stdout.strip()
        refuse_udp_inside(INNER_TABLE, GW_IP, (53,), Interception(3129, 53), NETNS_DIR / topology.sbx)
        yield topology
    finally:
        topology.run(topology.sbx, ["nft", "delete", "table", "inet", INNER_TABLE])
        topology.run(topology.sbx, ["sysctl", "-qw", f"net.ipv4.icmp_ratemask={ratemask}"])
        topology.run(topology.sbx, ["ip", "route", "del", "default"])
        shutil.rmtree(etc, ignore_errors=True)


def sbx(topology: Topology, *argv: str, timeout: float = 20, **kw) -> subprocess.CompletedProcess[str]:
    """A client in sbx without any proxy variable."""
    return topology.run(topology.sbx, ["env", "-u", "http_proxy", "-u", "https_proxy", *argv], timeout=timeout, **kw)


@pytest.fixture
def audit_for(gateway: GatewayProcess) -> Callable[..., dict]:
    """audit_for(host, kind="connect", code=None, gw=the shared gateway): the last transparent-mode audit line of
    this kind (and code) for host written during the test, waited for (tunnels are logged when they close)."""
    marks: dict[int, int] = {}

    def mark(gw: GatewayProcess) -> int:
        return marks.setdefault(id(gw), 0 if gw is not gateway else gw.audit_mark())

    mark(gateway)

    def find(host: str, kind: str = "connect", code: str | None = None, gw: GatewayProcess = gateway) -> dict:
        return _audit_line(gw, mark(gw), host, kind, code)

    return find


def _audit_line(gateway: GatewayProcess, since: int, host: str, kind: str, code: str | None, wait: float = 5) -> dict:
    deadline = time.monotonic() + wait
    while not (
        found := [
            r for r in gateway.audit()[since:]
            if r["host"] == host and r["kind"] == kind and r["extra"].get("mode") == "transparent"
            and code in (None, r["code"])
        ]
    ):  # fmt: skip
        assert time.monotonic() < deadline, f"no transparent {kind} audit line for {host}"
        time.sleep(0.05)
    return found[-1]


# --------------------------------------------------------------------------------------------------- curl


def test_curl_ignoring_the_proxy_reaches_an_allowed_host(
    routed_sbx: Topology, fakenet: FakeNet, gateway: GatewayProcess, test_ca: FakeCA, audit_for
):
    plain = sbx(routed_sbx, "curl", "-sS", "--noproxy", "*", "--max-time", "10", "http://allowed.test/hello")
    assert plain.stdout == f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/hello\n", plain.stderr
    tls = sbx(routed_sbx, "curl", "-sS", "--noproxy", "*", "--cacert", test_ca.ca_cert, "https://allowed.test/tls")
    assert tls.stdout == f"fakenet {ALLOWED_IP}:443 host=allowed.test path=/tls\n", tls.stderr
    assert fakenet.snis() == ["allowed.test"]  # the sandbox's own TLS, passed through untouched
    record = audit_for("allowed.test")
    assert record["decision"] == "allow" and record["extra"]["named_by"] == "sni"
    assert record["extra"]["original_dst"] == f"{ALLOWED_IP}:443" and record["bytes_out"] > 0


def test_curl_ignoring_the_proxy_gets_nothing_of_a_denied_host(
    routed_sbx: Topology, fakenet: FakeNet, gateway: GatewayProcess, test_ca: FakeCA, audit_for
):
    unresolved = sbx(routed_sbx, "curl", "-sS", "--noproxy", "*", "--max-time", "5", "http://evil.test/")
    assert unresolved.returncode == 6  # the gateway's DNS refused the name: curl cannot resolve it
    pinned = ("--resolve", f"evil.test:80:{EVIL_IP}", "--resolve", f"evil.test:443:{EVIL_IP}")
    plain = sbx(routed_sbx, "curl", "-sS", "--noproxy", "*", *pinned, "-w", "%{http_code}", "http://evil.test/")
    assert plain.stdout.endswith("403") and '"code": "not_allowlisted"' in plain.stdout, plain.stdout
    tls = sbx(routed_sbx, "curl", "-sS", "--noproxy", "*", *pinned, "--cacert", test_ca.ca_cert, "https://evil.test/")
    assert tls.returncode == 35, tls.stderr  # the TLS connection is closed before any handshake
    assert fakenet.total_connections() == 0
    assert audit_for("evil.test", "http", "not_allowlisted")
    assert audit_for("evil.test", code="not_allowlisted")


# --------------------------------------------------------------------------------------------------- Node, Python, git

FETCH = """
const report = (e) => { console.log("ERR", (e.cause && e.cause.code) || e.message); process.exitCode = 3 }
fetch(process.argv[1]).then(async (r) => console.log(r.status, await r.text()), report)
"""


def node_fetch(topology: Topology, url: str, ca: Path | None = None) -> str:
    env = ["env", f"NODE_EXTRA_CA_CERTS={ca}"] if ca else []
    result = sbx(topology, *env, NODE, "-e", FETCH, url)
    return result.stdout.strip() or result.stderr


def test_node_fetch_reaches_an_allowed_host_and_nothing_of_a_denied_one(
    routed_sbx: Topology, fakenet: FakeNet, gateway: GatewayProcess, test_ca: FakeCA
):
    assert (
        node_fetch(routed_sbx, "http://allowed.test/node")
        == f"200 fakenet {ALLOWED_IP}:80 host=allowed.test path=/node"
    )
    tls = node_fetch(routed_sbx, "https://allowed.test/node", test_ca.ca_cert)
    assert tls == f"200 fakenet {ALLOWED_IP}:443 host=allowed.test path=/node"
    assert fakenet.connections(ALLOWED_IP, 80) == fakenet.connections(ALLOWED_IP, 443) == 1
    fakenet.reset()
    assert node_fetch(routed_sbx, "http://evil.test/") in ("ERR EAI_AGAIN", "ERR ENOTFOUND")  # DNS refused the name
    assert node_fetch(routed_sbx, f"http://{EVIL_IP}/").startswith("403 ")
    assert node_fetch(routed_sbx, f"https://{EVIL_IP}/", test_ca.ca_cert).startswith("ERR ")  # closed, no handshake
    assert fakenet.total_connections() == 0


HTTP_CLIENT = """
import http.client, sys
conn = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=10)
try:
    conn.request("GET", "/py")
    response = conn.getresponse()
    print(response.status, response.read().decode(), end="")
except OSError as e:
    print("ERR", type(e).__name__)
"""


def test_python_http_client_reaches_an_allowed_host_and_nothing_of_a_denied_one(
    routed_sbx: Topology, fakenet: FakeNet, gateway: GatewayProcess
):
    allowed = sbx(routed_sbx, "python3", "-c", HTTP_CLIENT, "allowed.test", "80").stdout
    assert allowed == f"200 fakenet {ALLOWED_IP}:80 host=allowed.test path=/py\n"
    denied = sbx(routed_sbx, "python3", "-c", HTTP_CLIENT, EVIL_IP, "80").stdout
    assert denied.startswith("403 ") and '"code": "not_allowlisted"' in denied
    assert sbx(routed_sbx, "python3", "-c", HTTP_CLIENT, EVIL_IP, "8080").stdout.startswith("403 ")
    assert fakenet.connections(ALLOWED_IP, 80) == 1 and fakenet.connections(EVIL_IP, 80) == 0
    assert fakenet.connections(EVIL_IP, 8080) == 0


def test_git_without_a_proxy_reaches_an_allowed_host_and_nothing_of_a_denied_one(
    routed_sbx: Topology, fakenet: FakeNet, gateway: GatewayProcess
):
    git = ("env", "-u", "HTTP_PROXY", "-u", "HTTPS_PROXY", "GIT_TERMINAL_PROMPT=0", "git", "ls-remote")
    sbx(routed_sbx, *git, "http://allowed.test/repo.git")  # fakenet answers text, which is no repository
    requests = fakenet.http_requests(f"{ALLOWED_IP}:80")
    assert [r["target"] for r in requests] == ["/repo.git/info/refs?service=git-upload-pack"], requests
    fakenet.reset()
    denied = sbx(routed_sbx, *git, f"http://{EVIL_IP}/repo.git")
    assert denied.returncode != 0 and "403" in denied.stderr, denied.stderr
    assert sbx(routed_sbx, *git, "http://evil.test/repo.git").returncode != 0  # its name is never answered
    assert fakenet.total_connections() == 0


# --------------------------------------------------------------------------------------------------- attacks


def tls_to(address: tuple[str, int], sni: str | None, ca: Path, path: str = "/", hello_only: bool = False) -> str:
    """TLS straight to `address` (no proxy) with this SNI, verified against `ca`, then GET `path`: the body, or
    'closed: <error>' when the connection ends before an answer."""
    context = ssl.create_default_context(cafile=str(ca))
    if sni is None:
        context.check_hostname = False
    try:
        with socket.create_connection(address, timeout=10) as raw, context.wrap_socket(raw, server_hostname=sni) as tls:
            tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
    except (OSError, ssl.SSLError) as e:
        return f"closed: {type(e).__name__}"
    return data.partition(b"\r\n\r\n")[2].decode()


def test_a_transparent_passthrough_tunnel_is_relayed_in_the_kernel_once_judged(
    routed_sbx: Topology, fakenet: FakeNet, gateway: GatewayProcess, test_ca: FakeCA, audit_for
):
    size = 8 * 1024 * 1024
    body = in_netns(routed_sbx.sbx, tls_to, (ALLOWED_IP, 443), "allowed.test", test_ca.ca_cert, f"/big?n={size}")
    assert body == "x" * size
    record = audit_for("allowed.test")
    assert record["extra"]["relayed_by"] == "kernel" and record["bytes_out"] > size


def test_the_dialled_address_is_never_the_upstream(
    routed_sbx: Topology, fakenet: FakeNet, gateway: GatewayProcess, test_ca: FakeCA, audit_for
):
    # Dial evil.test's address with allowed.test's name: the gateway connects to allowed.test's own address.
    body = in_netns(routed_sbx.sbx, tls_to, (EVIL_IP, 443), "allowed.test", test_ca.ca_cert, "/lie")
    assert body == f"fakenet {ALLOWED_IP}:443 host=allowed.test path=/lie\n"
    lie = ("--resolve", f"allowed.test:80:{EVIL_IP}")
    plain = sbx(routed_sbx, "curl", "-sS", "--noproxy", "*", *lie, "http://allowed.test/lie")
    assert plain.stdout == f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/lie\n"
    assert fakenet.connections(EVIL_IP, 443) == fakenet.connections(EVIL_IP, 80) == 0
    record = audit_for("allowed.test")
    assert record["extra"]["original_dst"] == f"{EVIL_IP}:443" and record["chosen_ip"] == ALLOWED_IP


def test_fronting_through_transparent_mode_is_denied(
    routed_sbx: Topology, fakenet: FakeNet, gateway: GatewayProcess, test_ca: FakeCA, audit_for
):
    fronted = [
        b"GET http://evil.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n",  # a request target the server reads first
        b"GET / HTTP/1.1\r\nHost: allowed.test:8080\r\n\r\n",  # another port than the one dialled
        b"GET http://evil.test/ HTTP/1.0\r\n\r\n",  # no Host: judged as the address dialled, not the target
    ]
    for request in fronted:
        reply = in_netns(routed_sbx.sbx, raw_request, (ALLOWED_IP, 80), request)
        assert reply.status == 403 and reply.headers.get("X-Airlock-Decision") == "deny", (request, reply)
    assert fakenet.total_connections() == 0
    assert audit_for("allowed.test", "http", "host_mismatch")


def test_encrypted_client_hello_through_transparent_mode_is_refused(
    routed_sbx: Topology, fakenet: FakeNet, gateway: GatewayProcess, audit_for
):
    from test_proxy import client_hello

    def send_hello() -> str:
        return tcp_probe((ALLOWED_IP, 443), payload=client_hello("allowed.test", 0xFE0D))

    assert in_netns(routed_sbx.sbx, send_hello) in ("open:", "refused")  # closed without an answer
    assert fakenet.total_connections() == 0
    assert audit_for("allowed.test", code="ech")


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("internal.allowed.test", "internal_address"),
        ("meta.allowed.test", "metadata"),
        ("loop.allowed.test", "own_address"),
    ],
)
def test_allowlisted_names_that_resolve_inside_are_denied(
    routed_sbx: Topology, fakenet: FakeNet, gateway: GatewayProcess, test_ca: FakeCA, name: str, code: str
):
    pinned = ("--resolve", f"{name}:80:{ALLOWED_IP}")
    reply = sbx(routed_sbx, "curl", "-sS", "--noproxy", "*", *pinned, "-w", "%{http_code}", f"http://{name}/")
    assert reply.stdout.endswith("403") and f'"code": "{code}"' in reply.stdout, reply.stdout
    assert in_netns(routed_sbx.sbx, tls_to, (ALLOWED_IP, 443), name, test_ca.ca_cert).startswith("closed")
    assert fakenet.total_connections() == 0


@pytest.mark.parametrize(
    ("address", "code"), [(INTERNAL_IP, "internal_address"), ("169.254.169.254", "metadata"), (GW_IP, "")]
)
def test_ip_literals_inside_are_denied(
    routed_sbx: Topology, fakenet: FakeNet, gateway: GatewayProcess, address: str, code: str
):
    reply = sbx(
        routed_sbx, "curl", "-sS", "--noproxy", "*", "--max-time", "3", "-w", "%{http_code}", f"http://{address}:81/"
    )
    if code:  # redirected, and judged as the literal it is
        assert reply.stdout.endswith("403") and f'"code": "{code}"' in reply.stdout, reply.stdout
    else:  # the gateway's own address is never redirected: only its own ports answer there
        assert reply.returncode != 0 and not reply.stdout.strip("0"), reply
    raw = in_netns(routed_sbx.sbx, tcp_probe, (address, 22), 3, b"SSH-2.0-test\r\n")
    assert raw in ("open:", "refused", "timeout"), raw  # never an answer from behind it
    assert fakenet.total_connections() == 0


def test_the_transparent_listener_is_reached_only_through_the_redirect(routed_sbx: Topology, gateway: GatewayProcess):
    assert in_netns(routed_sbx.sbx, tcp_probe, (GW_IP, 3129)) == "refused"


def test_rebinding_through_transparent_mode_never_reaches_the_internal_host(
    routed_sbx: Topology, fakenet: FakeNet, own_gateway
):
    own_gateway(extra=("--dns-min-ttl", "0"))  # every lookup goes upstream: public and internal answers alternate
    request = b"GET / HTTP/1.1\r\nHost: rebind.allowed.test\r\nConnection: close\r\n\r\n"
    statuses = {in_netns(routed_sbx.sbx, raw_request, (ALLOWED_IP, 80), request).status for _ in range(6)}
    assert statuses == {200, 403}  # each request judged on one answer, used for the decision and the connection
    assert fakenet.dns_queries("rebind.allowed.test") >= 6
    assert fakenet.connections(INTERNAL_IP, 80) == 0


# With workers, the supervisor's DNS answers: each is sent to every worker before the reply leaves, and a worker
# drains its channel before it names a connection (airlock/gateway/workers.py), so the connection right after the
# answer is that name's in whichever worker takes it.
@pytest.mark.parametrize("workers", [("--workers", "1"), ("--workers", "2")], ids=["one-process", "two-workers"])
def test_a_connection_without_a_name_counts_as_a_name_only_once_the_gateway_answered_it(
    routed_sbx: Topology, fakenet: FakeNet, own_gateway, audit_for, workers: tuple[str, ...]
):
    gateway = own_gateway(extra=workers)  # a gateway whose DNS has answered nothing yet
    echo = (ALLOWED_IP, 22)
    ssh = b"SSH-2.0-test\r\n"
    assert in_netns(routed_sbx.sbx, tcp_probe, echo, 3, ssh) == "open:"  # never resolved: judged as 192.0.2.10
    assert fakenet.connections(*echo) == 0
    assert audit_for(ALLOWED_IP, code="not_allowlisted", gw=gateway)
    # Resolved through the gateway, by a name whose rule does not say `tunnel: true`: still nothing.
    assert routed_sbx.dns_query(routed_sbx.sbx, "allowed.test", server=NO_RESOLVER).values() == [ALLOWED_IP]
    binary = (ALLOWED_IP, 80)
    assert in_netns(routed_sbx.sbx, tcp_probe, binary, 3, b"\x00\x01binary") == "open:"
    assert fakenet.connections(*binary) == 0
    assert audit_for(ALLOWED_IP, code="not_tls", gw=gateway)
    # Resolved by a name whose rule does: now the connection is that name's, at that name's own address.
    assert routed_sbx.dns_query(routed_sbx.sbx, "ssh.allowed.test", server=NO_RESOLVER).values() == [ALLOWED_IP]
    assert in_netns(routed_sbx.sbx, tcp_probe, echo, 3, ssh) == f"open:{ssh.decode()}"
    assert fakenet.connections(*echo) == 1
    record = audit_for("ssh.allowed.test", gw=gateway)
    assert record["decision"] == "allow" and record["extra"]["named_by"] == "dns"


# --------------------------------------------------------------------------------------------------- DNS


@pytest.mark.parametrize("transport", ["+notcp", "+tcp"])
def test_dig_at_an_address_where_no_resolver_runs_is_answered_by_the_gateway(
    routed_sbx: Topology, fakenet: FakeNet, gateway: GatewayProcess, transport: str
):
    dig = ("dig", f"@{NO_RESOLVER}", transport, "+tries=1", "+time=3")
    allowed = sbx(routed_sbx, *dig, "+short", "allowed.test", "A")
    assert allowed.stdout.split() == [ALLOWED_IP], allowed.stdout + allowed.stderr
    denied = sbx(routed_sbx, *dig, "evil.test", "A")
    assert "status: REFUSED" in denied.stdout, denied.stdout
    assert fakenet.dns_queries("evil.test") == 0  # the policy's answer: nothing was asked upstream
    deadline = time.monotonic() + 5
    while not (lines := [r for r in gateway.audit() if r["kind"] == "dns" and r["host"] == "evil.test"]):
        assert time.monotonic() < deadline, "no DNS audit line for evil.test"
        time.sleep(0.05)
    assert lines[-1]["decision"] == "deny" and lines[-1]["client"] == "10.254.0.2"


def test_dns_over_tls_to_an_unlisted_host_is_denied_like_any_host(
    routed_sbx: Topology, fakenet: FakeNet, gateway: GatewayProcess, test_ca: FakeCA, audit_for
):
    assert in_netns(routed_sbx.sbx, tls_to, (EVIL_IP, 853), "dns.evil.test", test_ca.ca_cert).startswith("closed")
    dot = sbx(routed_sbx, "dig", "+tls", f"@{NO_RESOLVER}", "+tries=1", "+time=3", "allowed.test")
    assert "ANSWER SECTION" not in dot.stdout, dot.stdout  # TLS to a bare address no rule opens: closed
    assert fakenet.total_connections() == 0
    record = audit_for("dns.evil.test", code="not_allowlisted")
    assert record["port"] == 853 and record["extra"]["original_dst"] == f"{EVIL_IP}:853"
    assert audit_for(NO_RESOLVER, code="not_allowlisted")["port"] == 853


# --------------------------------------------------------------------------------------------------- other UDP

# The first bytes of a QUIC v1 Initial (long header, version 1), padded as clients pad it to 1200 bytes.
QUIC_INITIAL = b"\xc3\x00\x00\x00\x01\x08" + bytes(8) + b"\x00\x00\x44\xd0" + bytes(1182)


def udp_refusal_ms(address: tuple[str, int], timeout: float = 2) -> float | str:
    """Milliseconds from sending a QUIC Initial to `address` until the socket reports ECONNREFUSED (send() itself may
    fail first, with EPERM: the datagram was refused as it left)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.connect(address)
        started = time.perf_counter()
        with contextlib.suppress(PermissionError):
            sock.send(QUIC_INITIAL)
        try:
            sock.recv(2048)
        except ConnectionRefusedError:
            return (time.perf_counter() - started) * 1000
        except TimeoutError:
            return "timeout"
    return "answered"


@pytest.mark.parametrize("address", [(ALLOWED_IP, 443), (EVIL_IP, 443), ("8.8.8.8", 8443)])
def test_other_udp_is_refused_at_once_so_quic_falls_back(routed_sbx: Topology, address: tuple[str, int]):
    elapsed = in_netns(routed_sbx.sbx, udp_refusal_ms, address)
    assert isinstance(elapsed, float) and elapsed < 100, elapsed  # ICMP port-unreachable, not a timeout


def test_back_to_back_udp_is_each_refused_at_once_past_the_icmp_rate_limit(routed_sbx: Topology):
    # Beyond the kernel's ICMP rate limit (a burst of 6, then one a second per destination; 50 at once per
    # namespace): every attempt of a client that retries QUIC, or of many clients, hears its refusal at once.
    results = [in_netns(routed_sbx.sbx, udp_refusal_ms, (EVIL_IP, 20000 + i), 0.2) for i in range(60)]
    late = [(i, r) for i, r in enumerate(results) if not (isinstance(r, float) and r < 100)]
    assert late == [], f"{len(late)} of 60 not refused within 100 ms: {late[:10]}"
