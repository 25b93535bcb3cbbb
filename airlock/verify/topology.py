"""Network namespaces that stand in for sandbox, gateway and internet, plus the fakenet client: the fake internet
`airlock verify` and the end-to-end tests build alike.

    ns <p>-sbx --veth-- ns <p>-gw --veth-- ns <p>-net
    10.254.0.2/30       10.254.0.1/30 | 10.253.0.1/30       10.253.0.2/30 + fake-internet addresses

Without `sandbox` (what `airlock verify` builds: its sandboxes are the launcher's own, made inside <p>-gw) there is
no <p>-sbx.

Safety model: every interface is created directly inside a namespace of this run (`ip -n NS link add ...
peer ... netns OTHER`), so nothing is ever attached to the host namespace; gw only has explicit routes towards
`net` (no default route, ip_forward=0) and sbx only has its connected /30. The host this runs on may itself use
192.0.2.0/24 on a real interface, so never send to fake-internet addresses from the host namespace: go through
run()/popen() in a namespace and call assert_route_inside() first. Teardown deletes exactly the namespaces this
object created, also from atexit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from .control import ControlledFake, stop_proc

SBX_IP = "10.254.0.2"
GW_IP = "10.254.0.1"
GW_OUTSIDE_IP = "10.253.0.1"
NET_IP = "10.253.0.2"

# Routed from gw to net; deliberately no default route, so anything else is unreachable from the gateway.
GW_ROUTES = (
    "192.0.2.0/24",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "10.1.0.0/16",
    "169.254.169.254/32",
    "100.100.100.200/32",
)
# Real addresses a sandbox would try first: never routed from the gateway namespace (create_sealed checks it).
REAL_ADDRESSES = ("8.8.8.8", "1.1.1.1", "10.0.0.1", "192.168.1.1")
FAKE_ADDRS = {
    "192.0.2.10": "allowed.test",
    "192.0.2.11": "second public upstream",
    "192.0.2.20": "fake GitHub API (api.github.test)",
    "192.0.2.30": "fake model API (api.model.example)",
    "192.0.2.53": "authoritative DNS for test.",
    "198.51.100.10": "other.test",
    "203.0.113.66": "evil.test",
    "203.0.113.10": "third public upstream",
    "10.1.2.3": "internal host no rule opens",
    "10.1.2.4": "named internal service (opened by a CIDR rule in the e2e policy)",
    "10.9.9.9": "internal, not routed from gw",
    "169.254.169.254": "cloud metadata mock",
    "100.100.100.200": "Alibaba metadata mock",
}
DNS_SERVER = "192.0.2.53"

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{1,10}$")  # keeps "<prefix>-gs" within IFNAMSIZ (15)
# `ip route get` failures that mean "no way out", i.e. the packet stays inside.
_NO_ROUTE = ("unreachable", "no route", "prohibit", "blackhole")


def new_prefix() -> str:
    return f"al{secrets.token_hex(3)}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie is already dead, only waiting for its parent


def stop_pid(pid: int, wait: float = 3.0) -> None:
    """SIGTERM, then SIGKILL if it lingers; only ever called for PIDs this run started."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + wait
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@dataclass
class DnsAnswer:
    rcode: str
    records: list[tuple[str, str, str, int]]  # (name, type, value, ttl)

    def values(self, rtype: str = "A") -> list[str]:
        return [value for _, t, value, _ in self.records if t == rtype]


_DNS_SCRIPT = """
import json, sys
from dnslib import DNSRecord, QTYPE, RCODE
name, qtype, server, port, tcp, timeout = sys.argv[1:]
raw = DNSRecord.question(name, qtype).send(server, int(port), tcp=tcp == "1", timeout=float(timeout))
reply = DNSRecord.parse(raw)
def value(rr):
    text = str(rr.rdata)
    return text.strip('"') if rr.rtype == QTYPE.TXT else text.rstrip(".")
rrs = [[str(rr.rname).rstrip("."), QTYPE[rr.rtype], value(rr), rr.ttl] for rr in reply.rr]
print(json.dumps({"rcode": RCODE[reply.header.rcode], "records": rrs}))
"""


class Topology:
    gw_ip = GW_IP
    sbx_ip = SBX_IP
    gw_outside_ip = GW_OUTSIDE_IP
    net_ip = NET_IP

    def __init__(self, prefix: str | None = None, sandbox: bool = True) -> None:
        self.prefix = prefix or new_prefix()
        if not _PREFIX_RE.match(self.prefix):
            raise ValueError(f"bad prefix {self.prefix!r}: want [a-z][a-z0-9]{{1,10}}")
        p = self.prefix
        self.sbx, self.gw, self.net = f"{p}-sbx", f"{p}-gw", f"{p}-net"
        self.sbx_if, self.gw_sbx_if = f"{p}-sg", f"{p}-gs"  # sbx <-> gw
        self.gw_net_if, self.net_if = f"{p}-gn", f"{p}-ng"  # gw <-> net
        self.with_sandbox = sandbox
        self._devices = {
            self.sbx: {self.sbx_if, "lo"},
            self.gw: {self.gw_sbx_if, self.gw_net_if, "lo"} if sandbox else {self.gw_net_if, "lo"},
            self.net: {self.net_if, "lo"},
        }
        if not sandbox:
            del self._devices[self.sbx]
        self._owned: list[str] = []  # namespaces this object created, in creation order
        self._procs: list[subprocess.Popen[Any]] = []

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.sbx, self.gw, self.net) if self.with_sandbox else (self.gw, self.net)

    # ------------------------------------------------------------------------------------------- lifecycle

    def create(self) -> Self:
        if self._owned:
            return self
        atexit.register(self.destroy)
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise
        return self

    def _build(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "add", ns)  # fails if the name exists: never adopt someone else's namespace
            self._owned.append(ns)
            self._sysctl(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        if self.with_sandbox:
            self._veth(self.sbx, self.sbx_if, self.gw_sbx_if, self.gw)
            self._addr_up(self.sbx, self.sbx_if, f"{SBX_IP}/30")
            self._addr_up(self.gw, self.gw_sbx_if, f"{GW_IP}/30")
        self._veth(self.gw, self.gw_net_if, self.net_if, self.net)
        self._addr_up(self.gw, self.gw_net_if, f"{GW_OUTSIDE_IP}/30")
        self._addr_up(self.net, self.net_if, f"{NET_IP}/30")
        for addr in FAKE_ADDRS:
            _ip("-n", self.net, "addr", "add", f"{addr}/32", "dev", self.net_if)
        for dst in GW_ROUTES:
            _ip("-n", self.gw, "route", "add", dst, "via", NET_IP, "dev", self.gw_net_if)
        # Lets net answer a packet from sbx if gw ever forwarded one; tests prove gw never does.
        _ip("-n", self.net, "route", "add", "10.254.0.0/30", "via", GW_OUTSIDE_IP, "dev", self.net_if)
        self._wait_carrier()

    def _wait_carrier(self, timeout: float = 5) -> None:
        # Operstate lags `link set up` by up to ~1s (linkwatch); wait so the first test never sees NO-CARRIER.
        deadline = time.monotonic() + timeout
        for ns, devices in self._devices.items():
            for dev in devices - {"lo"}:
                path = ["-n", ns, "-br", "link", "show", "dev", dev]
                while _ip(*path).stdout.split()[1:2] != ["UP"]:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{dev} in {ns} never came up")
                    time.sleep(0.02)

    @staticmethod
    def _sysctl(ns: str) -> None:
        settings = [
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
            "net.ipv4.ip_forward=0",  # new namespaces inherit it from the host: pin it, gw is a proxy
        ]
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *settings],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"sysctl in {ns} failed: {proc.stderr.strip()}")

    @staticmethod
    def _veth(ns: str, dev: str, peer: str, peer_ns: str) -> None:
        """A veth pair made inside `ns`, its peer moved straight into `peer_ns`: never an end in the host's."""
        _ip("-n", ns, "link", "add", dev, "type", "veth", "peer", "name", peer, "netns", peer_ns)

    @staticmethod
    def _addr_up(ns: str, dev: str, cidr: str) -> None:
        _ip("-n", ns, "addr", "add", cidr, "dev", dev)
        _ip("-n", ns, "link", "set", dev, "up")

    def destroy(self) -> None:
        """Idempotent: stop our processes, then delete the namespaces we created (veths die with them)."""
        for proc in self._procs:
            with contextlib.suppress(Exception):
                stop_proc(proc)
        self._procs.clear()
        for ns in reversed(self._owned):
            # Anything still inside our namespace was started by this run (e.g. via ip netns exec in a test).
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(Exception):
                    stop_pid(int(pid))
            _ip("netns", "delete", ns, check=False)
        self._owned.clear()
        atexit.unregister(self.destroy)

    def __enter__(self) -> Self:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # ------------------------------------------------------------------------------------------- commands

    @staticmethod
    def cmd(ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def run(self, ns: str, argv: list[str], timeout: float = 30, **kw: Any) -> subprocess.CompletedProcess[str]:
        self._check_ns(ns)
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("check", False)
        return subprocess.run(self.cmd(ns) + [str(a) for a in argv], timeout=timeout, **kw)

    def popen(self, ns: str, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start a process in `ns`, stopped by PID in destroy(); `ip netns exec` execs, so it is the program's PID."""
        self._check_ns(ns)
        kw.setdefault("start_new_session", True)  # a ^C in the terminal goes to pytest, which then cleans up
        proc = subprocess.Popen(self.cmd(ns) + [str(a) for a in argv], **kw)
        self._procs.append(proc)
        return proc

    def curl(self, ns: str, *args: str, max_time: float = 10) -> subprocess.CompletedProcess[str]:
        return self.run(ns, ["curl", "-sS", "--max-time", str(max_time), *args], timeout=max_time + 10)

    def dns_query(
        self,
        ns: str,
        name: str,
        qtype: str = "A",
        server: str = DNS_SERVER,
        port: int = 53,
        tcp: bool = False,
        timeout: float = 3,
    ) -> DnsAnswer:
        """Ask `server` from inside `ns` with dnslib; raises on timeout or a non-DNS reply."""
        self.assert_route_inside(ns, server)
        # -P keeps the cwd (often the repo root, whose dns/ shadows dnspython) off sys.path.
        argv = [sys.executable, "-P", "-c", _DNS_SCRIPT, name, qtype, server, str(port), str(int(tcp)), str(timeout)]
        proc = self.run(ns, argv, timeout=timeout + 10)
        if proc.returncode != 0:
            raise RuntimeError(f"dns query {name} {qtype} @{server} from {ns} failed: {proc.stderr.strip()}")
        data = json.loads(proc.stdout)
        return DnsAnswer(data["rcode"], [(name, rtype, value, ttl) for name, rtype, value, ttl in data["records"]])

    # ------------------------------------------------------------------------------------------- safety

    def _check_ns(self, ns: str) -> None:
        if ns not in self._owned:
            raise AssertionError(f"{ns!r} is not a live namespace of topology {self.prefix}")

    def create_sealed(self) -> Self:
        """create(), then the proof that nothing the gateway namespace dials leaves the machine: the route to every
        fake address and to REAL_ADDRESSES stays on the topology's own devices (or there is none). Raises what
        create() and assert_route_inside() raise; the caller says it in its own words."""
        self.create()
        for destination in (*FAKE_ADDRS, *REAL_ADDRESSES):
            self.assert_route_inside(self.gw, destination)
        return self

    def assert_route_inside(self, ns: str, dst: str) -> None:
        """Assert a packet from `ns` to `dst` leaves on a test-owned device, or has no route at all."""
        self._check_ns(ns)
        proc = _ip("-n", ns, "route", "get", dst, check=False)
        text = (proc.stdout + proc.stderr).lower()
        if proc.returncode != 0:
            if any(marker in text for marker in _NO_ROUTE):
                return  # unreachable: the packet never leaves, which is inside by definition
            raise AssertionError(f"ip route get {dst} in {ns} failed oddly: {text.strip()}")
        if proc.stdout.split()[:1] in (["unreachable"], ["blackhole"], ["prohibit"]):
            return
        match = re.search(r"\bdev (\S+)", proc.stdout)
        if not match or match.group(1) not in self._devices[ns]:
            raise AssertionError(f"route from {ns} to {dst} leaves via a device not owned by the test: {proc.stdout}")


class FakeNet(ControlledFake):
    """Client for `airlock.verify.fakenet` running in the topology's `net` namespace. `zone` adds names to its DNS
    zone ({name: [(type, value)]}), e.g. the hosts a policy allows."""

    name = "fakenet"

    def __init__(
        self, cert: Path, key: Path, zone_default_ttl: int = 0, zone: dict[str, list[tuple[str, str]]] | None = None
    ) -> None:
        super().__init__(cert, key)
        self.ttl = zone_default_ttl
        self.zone = zone or {}

    def program(self) -> list[str]:
        # -P: the working directory (often a checkout, whose dns/ would shadow dnspython) stays off sys.path.
        return [sys.executable, "-P", "-m", "airlock.verify.fakenet"]

    def start(self, topology: Topology, workdir: Path, timeout: float = 20) -> Self:
        self._prepare(workdir)
        zone = workdir / "zone.json"
        zone.write_text(json.dumps(self.zone))
        self._launch(topology, ["--zone-default-ttl", str(self.ttl), "--zone", zone], timeout)
        return self

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def reset(self) -> None:
        self._call("reset")

    def connections(self, ip: str, port: int) -> int:
        return int(self.stats()["connections"].get(f"{ip}:{port}", 0))

    def bytes_in(self, ip: str, port: int) -> int:
        """Application bytes received (decrypted on TLS ports)."""
        return int(self.stats()["bytes_in"].get(f"{ip}:{port}", 0))

    def total_connections(self) -> int:
        return sum(int(n) for n in self.stats()["connections"].values())

    def dns_queries(self, name: str, qtype: str | None = None) -> int:
        name = name.rstrip(".").lower()
        stats = self.stats()
        return int(stats["dns"].get(name, 0) if qtype is None else stats["dns_typed"].get(f"{name} {qtype}", 0))

    def snis(self) -> list[str | None]:
        return list(self.stats()["sni"])

    def ws_messages(self) -> list[dict[str, Any]]:
        """Websocket messages /ws received (and echoed): dst, opcode, payload."""
        return list(self.stats()["ws"])

    def http_requests(self, dst: str | None = None) -> list[dict[str, Any]]:
        """Requests seen (optionally only those sent to "ip:port"): line, host, headers, client, tls, sni, ..."""
        requests: list[dict[str, Any]] = self.stats()["http"]
        return [r for r in requests if dst is None or r["dst"] == dst]


class Canaries(FakeNet):
    """`airlock.verify.fakenet` with canaries alone: TCP and UDP listeners on `ports` of every address of a
    namespace beside the fake internet (the gateway's, for `airlock verify`), counting what reaches them."""

    name = "canaries"

    def __init__(self, cert: Path, key: Path, ports: tuple[int, ...]) -> None:
        super().__init__(cert, key)
        self.ports = ports

    def start_in(self, topology: Topology, ns: str, workdir: Path, timeout: float = 20) -> Self:
        self._prepare(workdir)
        self._launch(topology, ["--canaries", ",".join(map(str, self.ports))], timeout, ns=ns)
        return self


class FakeModel(ControlledFake):
    """Client for `airlock.verify.fakemodel` (api.model.example) in the topology's `net` namespace: it tells
    whether the Authorization it got is `Bearer <the text of api_key_file>`."""

    name = "fakemodel"

    def __init__(self, cert: Path, key: Path, api_key_file: Path) -> None:
        super().__init__(cert, key)
        self.api_key_file = api_key_file

    def program(self) -> list[str]:
        return [sys.executable, "-P", "-m", "airlock.verify.fakemodel"]

    def start(self, topology: Topology, workdir: Path, timeout: float = 20) -> Self:
        self._prepare(workdir)
        self._launch(topology, ["--api-key-file", self.api_key_file], timeout)
        return self

    def requests(self) -> list[dict[str, Any]]:
        """What it was sent: method, path, authorization (as received), real (whether it held the key)."""
        requests: list[dict[str, Any]] = self._call("stats")["requests"]
        return requests

    def reset(self) -> None:
        self._call("reset")
