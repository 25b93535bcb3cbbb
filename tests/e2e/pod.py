"""A network namespace that stands in for a Kubernetes pod (its gateway and its agent as two users in it, fenced by
`airlock fence --pod`), for tests/e2e/test_pod_fence.py and tests/e2e/test_pod_gateway.py.

    ns <p>-pod (10.252.0.2/30, fd00:a1::2/64, default routes) --veth-- ns <p>-net (10.252.0.1/30 + the fake internet)

The net namespace routes nowhere else, so even the default route ends inside the test's namespaces.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from airlock.verify.topology import FAKE_ADDRS, Topology

from gateway_proc import AIRLOCK

POD_IP, POD_PEER_IP = "10.252.0.2", "10.252.0.1"
POD_IP6, POD_PEER_IP6 = "fd00:a1::2", "fd00:a1::1"  # the link's only IPv6 (the net namespace has IPv6 off)
ALLOWED_IP, EVIL_IP = "192.0.2.10", "203.0.113.66"
GATEWAY_UID, AGENT_UID = 65534, 1  # nobody, daemon: unprivileged users every Debian has
PROXY, TRANSPARENT, DNS, BROKER, ADMIN = 3128, 3129, 5353, 8080, 8081
FENCE = ("fence", "--pod", "--gateway-uid", str(GATEWAY_UID))  # every port the sidecar's default
# The gateway's interpreter lives under root's home (mode 0700): the gateway's UID is given the one capability to
# traverse it. The agent runs the system's python, without any capability.
GATEWAY_USER = ["setpriv", f"--reuid={GATEWAY_UID}", f"--regid={GATEWAY_UID}", "--clear-groups",
                "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--"]  # fmt: skip
AGENT_USER = ["setpriv", f"--reuid={AGENT_UID}", f"--regid={AGENT_UID}", "--clear-groups", "--inh-caps=-all",
              "--bounding-set=-all", "--no-new-privs", "--"]  # fmt: skip

# What the agent tries, with the standard library only; prints one word: what it got.
PROBE = r"""
import errno, socket, struct, sys
kind, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def err(e):
    return "timeout" if isinstance(e, TimeoutError) else errno.errorcode.get(e.errno, str(e))
try:
    if kind == "tcp":
        socket.create_connection((host, port), timeout=3).close()
        print("connected")
    elif kind == "udp":
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(3); s.connect((host, port)); s.send(b"x"); s.recv(100); print("answered")
    elif kind == "ping":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP); s.settimeout(3)
        s.sendto(struct.pack("!BBHHH", 8, 0, 0, 0, 1) + b"airlock", (host, 0)); s.recv(100); print("reply")
    elif kind == "dns":
        name = sys.argv[4]
        query = struct.pack("!HHHHHH", 0x4242, 0x100, 1, 0, 0, 0)
        query += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack("!HH", 1, 1)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3); s.connect((host, port))
        s.send(query); reply = s.recv(4096)
        print(["NOERROR", "FORMERR", "SERVFAIL", "NXDOMAIN", "NOTIMP", "REFUSED"][reply[3] & 0xF])
except OSError as e:
    print(err(e))
"""


class Pod:
    """The pod's network namespace, its link to the fake internet and its gateway (started with `start_gateway`)."""

    def __init__(
        self,
        topology: Topology,
        gateway: Callable[[Path], list[str]],
        fence: tuple[str, ...] = FENCE,
        sidecar: str = AIRLOCK,  # the `airlock` the sidecar runs (a benchmark's baseline: another environment's)
    ) -> None:
        self.topology = topology
        self.gateway_options = gateway  # `airlock gateway`'s options, given the pod's state directory
        self.sidecar = sidecar
        self.fence_options = fence
        self.name = f"{topology.prefix}-pod"
        self.link, self.peer = f"{topology.prefix}-pp", f"{topology.prefix}-pn"
        self.state = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-pod-"))  # writable by the gateway's UID
        os.chown(self.state, GATEWAY_UID, GATEWAY_UID)
        self.gateway: subprocess.Popen[bytes] | None = None

    def create(self) -> None:
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True)
        net = self.topology.net
        for argv in (
            ["ip", "-n", self.name, "link", "set", "lo", "up"],
            ["ip", "-n", self.name, "link", "add", self.link, "type", "veth", "peer", "name", self.peer, "netns", net],
            ["ip", "-n", self.name, "addr", "add", f"{POD_IP}/30", "dev", self.link],
            ["ip", "-n", net, "addr", "add", f"{POD_PEER_IP}/30", "dev", self.peer],
            ["ip", "-n", self.name, "link", "set", self.link, "up"],
            ["ip", "-n", net, "link", "set", self.peer, "up"],
            ["ip", "-n", self.name, "route", "add", "default", "via", POD_PEER_IP, "dev", self.link],
            ["ip", "-n", self.name, "-6", "addr", "add", f"{POD_IP6}/64", "dev", self.link, "nodad"],
            ["ip", "-n", self.name, "-6", "route", "add", "default", "via", POD_PEER_IP6, "dev", self.link],
            # What a pod's agent could do unfenced: ping (ICMP datagram sockets, open to every group here).
            ["ip", "netns", "exec", self.name, "sysctl", "-q", "-w", "net.ipv4.ping_group_range=0 2147483647",
             "net.ipv4.ip_forward=0"],
        ):  # fmt: skip
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
            assert done.returncode == 0, (argv, done.stderr)
        for destination in (*FAKE_ADDRS, "8.8.8.8", "1.1.1.1", POD_PEER_IP6, "2001:4860::8888"):
            route = subprocess.run(["ip", "-n", self.name, "route", "get", destination], capture_output=True, text=True)
            assert re.search(rf"\bdev {self.link}\b", route.stdout), route.stdout  # a test-owned link only

    def destroy(self) -> None:
        self.stop_gateway()
        subprocess.run(["ip", "netns", "delete", self.name], check=False, capture_output=True)  # the veth with it
        # The namespace goes after its last user, its veth's peer a moment later: a next pod reuses the names.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._peer_exists():
            time.sleep(0.05)
        subprocess.run(["rm", "-rf", str(self.state)], check=False)

    def _peer_exists(self) -> bool:
        shown = subprocess.run(["ip", "-n", self.topology.net, "link", "show", self.peer], capture_output=True)
        return shown.returncode == 0

    def run(self, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
        cmd = ["ip", "netns", "exec", self.name, *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)

    def fence(self, *options: str) -> subprocess.CompletedProcess[str]:
        return self.run([AIRLOCK, *self.fence_options, *options])

    def agent(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return self.run([*AGENT_USER, *argv])

    def probe(self, kind: str, host: str, port: int, *rest: str, user: list[str] = AGENT_USER) -> str:
        return self.run([*user, "/usr/bin/python3", "-I", "-c", PROBE, kind, host, str(port), *rest]).stdout.strip()

    def start_gateway(self, timeout: float = 30, poll: float = 0.05) -> None:
        log = self.state / "gateway.log"
        options = self.gateway_options(self.state)
        argv = ["ip", "netns", "exec", self.name, *GATEWAY_USER, self.sidecar, "gateway", *options]
        with log.open("wb") as out:
            self.gateway = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while "proxy on" not in log.read_text(errors="replace"):
            assert self.gateway.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(poll)

    def stop_gateway(self, sig: int = signal.SIGTERM) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.send_signal(sig)
            try:
                self.gateway.wait(15)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
                self.gateway.wait()
