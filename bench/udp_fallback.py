"""UDP fallback: how soon a client in a transparent sandbox learns that UDP (QUIC) goes nowhere.

    sudo .venv/bin/python -P bench/udp_fallback.py [--runs 200] [--output FILE]

The fence refuses UDP that is not DNS with ICMP port-unreachable, so a QUIC client (HTTP/3) falls back to TCP at
once instead of after its handshake timeout. Measured from inside the sandbox namespace of the end-to-end topology
(airlock/verify/topology.py: nothing leaves the test namespaces), with the fence of `airlock run` on the gateway side
of the link, a default route to it, and the refusal inside the sandbox's namespace, as `airlock run` sets up:

- Python: a connected UDP socket sends a 1200-byte QUIC v1 Initial; the time until `recv` raises
  ECONNREFUSED (refused as it leaves, the send itself fails first, with EPERM);
- Node: a connected `dgram` socket sends the same datagram; the time until its `error` event (ECONNREFUSED);
- curl `--http3`, when this curl has HTTP/3: the whole request to an HTTPS URL until curl gives up on QUIC;
- for comparison, the same Python probe with an explicit-mode fence (no interception): the datagram is dropped,
  and the client hears nothing until its own timeout (1 s here; QUIC clients wait seconds);
- the docker backend, when dockerd and debootstrap are here: the Python probe back to back as a container's command
  (scripts/build-test-image's image, a private dockerd in the gateway namespace as airlock/verify/dockerd.py runs
  it), with the fence and the refusal inside the container's namespace that `airlock run --backend docker` gives.

The kernel rate-limits the ICMP errors it sends to each host (`net.ipv4.icmp_ratelimit`, 1000 ms by default, with
a burst of 6, for the types in `net.ipv4.icmp_ratemask`, port-unreachable among them): from the gateway side
alone, back to back, a sandbox would get its first refusals at once and then about one per second. The refusal
inside the sandbox's namespace, where port-unreachable is not rate-limited, answers each at once. So the Python
probe runs twice: paced like a client that tries QUIC now and then (one datagram every `--pause` seconds), and back
to back (`--runs` datagrams, each waiting up to 1 s for its refusal).

Target: under 100 ms to the refusal.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.append(str(REPO / "bench"))

import docker  # noqa: E402

from airlock.sandbox.docker import DockerSandbox  # noqa: E402
from airlock.sandbox.fence import Fence, Interception, refuse_udp_inside  # noqa: E402
from airlock.sandbox.netns import NETNS_DIR  # noqa: E402
from airlock.verify.dockerd import DockerDaemon, docker_problem  # noqa: E402
from airlock.verify.topology import GW_IP, Topology  # noqa: E402

import common  # noqa: E402
from common import fmt, percentile  # noqa: E402
from netclient import in_netns  # noqa: E402

BUILD_TEST_IMAGE = REPO / "scripts" / "build-test-image"

TARGET_MS = 100.0
DESTINATION = ("192.0.2.10", 443)  # allowed.test's address in the fake internet
TIMEOUT_S = 1.0

PYTHON_PROBE = """
import json, socket, sys, time
host, port, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
timeout, pause = float(sys.argv[4]), float(sys.argv[5])
initial = b"\\xc3\\x00\\x00\\x00\\x01\\x08" + bytes(8) + b"\\x00\\x00\\x44\\xd0" + bytes(1182)
times = []
for _ in range(runs):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.connect((host, port))
        started = time.perf_counter()
        try:
            sock.send(initial)
        except PermissionError:  # refused as it left; the socket reports ECONNREFUSED next
            pass
        try:
            sock.recv(2048)
            times.append("answered")
        except ConnectionRefusedError:
            times.append((time.perf_counter() - started) * 1000)
        except TimeoutError:
            times.append("timeout")
    time.sleep(pause)
print(json.dumps(times))
"""

NODE_PROBE = """
const dgram = require("dgram");
const [host, port, runs, pause] = process.argv.slice(1, 5).map((a, i) => (i ? Number(a) : a));
const initial = Buffer.concat([Buffer.from([0xc3, 0, 0, 0, 1, 8]), Buffer.alloc(8), Buffer.from([0, 0, 0x44, 0xd0]),
                               Buffer.alloc(1182)]);
const times = [];
function once() {
  if (times.length === runs) { console.log(JSON.stringify(times)); return; }
  const sock = dgram.createSocket("udp4");
  let started;
  const next = (sample) => { clearTimeout(timer); times.push(sample); sock.close(); setTimeout(once, pause * 1000); };
  const timer = setTimeout(() => next("timeout"), 1000);
  sock.on("error", (e) => next(e.code === "ECONNREFUSED" ? Number(process.hrtime.bigint() - started) / 1e6 : e.code));
  sock.on("message", () => next("answered"));
  sock.connect(port, host, () => { started = process.hrtime.bigint(); sock.send(initial, () => {}); });
}
once();
"""


def summary(name: str, samples: list[float | str]) -> str:
    numbers = sorted(s for s in samples if isinstance(s, float))
    others = len(samples) - len(numbers)
    if not numbers:
        return f"| {name} | {len(samples)} | none: {samples[0]} | | | no |"
    median, p99, worst = statistics.median(numbers), percentile(numbers, 0.99), numbers[-1]
    met = "yes" if worst < TARGET_MS and not others else "no"
    note = f" ({others} not refused)" if others else ""
    return f"| {name} | {len(samples)}{note} | {fmt(median, 3)} | {fmt(p99, 3)} | {fmt(worst, 3)} | {met} |"


def probe(topology: Topology, argv: list[str]) -> list[float | str]:
    result = topology.run(topology.sbx, argv, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{argv[0]} probe failed: {result.stderr.strip()}")
    return json.loads(result.stdout)


def curl_http3(topology: Topology, runs: int) -> str:
    version = subprocess.run(["curl", "--version"], capture_output=True, text=True, check=False).stdout
    if "HTTP3" not in version:
        first = version.splitlines()[0] if version else "curl"
        return f"| curl --http3 | - | not measured: {first.split(' (')[0]} has no HTTP/3 | | | - |"
    times = []
    for _ in range(runs):
        url = f"https://{DESTINATION[0]}:{DESTINATION[1]}/"
        argv = ["curl", "-s", "-o", "/dev/null", "--http3-only", "--max-time", "5", "-w", "%{time_total}", url]
        times.append(float(topology.run(topology.sbx, argv).stdout or "nan") * 1000)
    return summary("curl --http3-only (whole attempt)", times)


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--runs", type=int, default=50, help="datagrams back to back per client (default 50)")
    parser.add_argument("--paced", type=int, default=20, help="paced datagrams (default 20)")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between paced datagrams (default 1)")
    args = common.parse_args(parser, argv)
    if not 10 <= args.runs <= 10_000:
        parser.error("keep --runs in 10..10000")
    if os.geteuid() != 0:
        parser.error("needs root: it builds network namespaces and an nftables fence")
    common.interrupt_on_sigterm()
    info = common.machine_info(nft=common.tool_version(["nft", "--version"]), node=common.tool_version(["node", "-v"]))
    with Topology() as topology:
        rows = measure_all(topology, args.runs, args.paced, args.pause)
        rows.append(measure_docker(topology, args.runs))
    report = [
        "# UDP refusal: time from sending a QUIC Initial until the client hears ECONNREFUSED",
        "",
        common.command_line("-P", "bench/udp_fallback.py"),
        "",
        common.machine_line(info),
        "",
        "| client | runs | median ms | p99 ms | max ms | under 100 ms |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    common.emit("\n".join(report), args.output)
    return 0


def measure_all(topology: Topology, runs: int, paced: int, pause: float) -> list[str]:
    """The transparent fence's refusal for each client, then the explicit-mode fence's silence for comparison."""
    host, port = DESTINATION
    link = (topology.gw_sbx_if, GW_IP, (3128, 53), (53,))
    assert topology.run(topology.sbx, ["ip", "route", "add", "default", "via", GW_IP]).returncode == 0
    topology.assert_route_inside(topology.sbx, host)  # it leaves on the sandbox's own link, to gw
    python = [sys.executable, "-c", PYTHON_PROBE, host, str(port)]
    rows = []
    transparent = Fence(f"{topology.prefix}_bench", *link, Interception(3129, 53))
    transparent.install(topology.cmd(topology.gw))
    refuse_udp_inside(f"{topology.prefix}_bench", GW_IP, (53,), Interception(3129, 53), NETNS_DIR / topology.sbx)
    try:
        paced_probe = [*python, str(paced), str(TIMEOUT_S), str(pause)]
        rows.append(summary(f"Python, one datagram every {pause:g} s", probe(topology, paced_probe)))
        if node := shutil.which("node"):
            node_probe = [node, "-e", NODE_PROBE, host, str(port), str(paced), str(pause)]
            rows.append(summary(f"Node dgram, one datagram every {pause:g} s", probe(topology, node_probe)))
        else:
            rows.append("| Node | - | not measured: node is not installed | | | - |")
        rows.append(curl_http3(topology, 10))
        back_to_back = [*python, str(runs), str(TIMEOUT_S), "0"]  # last: it would empty a rate-limited ICMP budget
        rows.append(summary("Python, back to back", probe(topology, back_to_back)))
    finally:
        transparent.remove(topology.cmd(topology.gw))
        transparent.remove(topology.cmd(topology.sbx))  # the refusal inside: a table of the same name
    explicit = Fence(f"{topology.prefix}_bench", *link)
    explicit.install(topology.cmd(topology.gw))
    try:
        baseline = probe(topology, [*python, "5", str(TIMEOUT_S), "0"])
    finally:
        explicit.remove(topology.cmd(topology.gw))
    rows.append(summary(f"Python, explicit-mode fence (dropped; client timeout {TIMEOUT_S:g} s)", baseline))
    return rows


def measure_docker(topology: Topology, runs: int) -> str:
    """The Python probe back to back as a docker sandbox's command, in transparent mode."""
    if problem := docker_problem(also=("debootstrap",)):
        return f"| docker, Python, back to back | - | not measured: {problem} | | | - |"
    build = subprocess.run([str(BUILD_TEST_IMAGE)], capture_output=True, text=True, timeout=900, check=False)
    if build.returncode != 0:
        raise RuntimeError(f"scripts/build-test-image failed: {build.stderr.strip()[-2000:]}")
    with tempfile.TemporaryDirectory(prefix="airlock-udp-") as workdir:
        daemon = DockerDaemon(topology, Path(workdir) / "docker").start()
        try:
            image = daemon.import_image(Path(build.stdout.strip().splitlines()[-1]))
            samples = _docker_probe(topology, daemon.client(), image, runs)
        finally:
            daemon.stop()
    return summary("docker, Python, back to back", samples)


def _docker_probe(topology: Topology, client: docker.DockerClient, image: str, runs: int) -> list[float | str]:
    host, port = DESTINATION
    sandbox = DockerSandbox(client, image, f"{topology.prefix}u", (3128, 53), (53,), intercept=Interception(3129, 53))
    try:
        in_netns(topology.gw, sandbox.create)  # its network's bridge and fence live in the gateway namespace
        sandbox.start(["python3", "-c", PYTHON_PROBE, host, str(port), str(runs), str(TIMEOUT_S), "0"], {})
        if sandbox.wait(300) != 0:
            raise RuntimeError(f"the docker probe failed: {sandbox.output()[1].decode().strip()}")
        return json.loads(sandbox.output()[0])
    finally:
        in_netns(topology.gw, sandbox.destroy)


if __name__ == "__main__":
    sys.exit(main())
