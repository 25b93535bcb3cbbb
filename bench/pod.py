"""The sandbox pod's gateway sidecar (`airlock gateway --pod`) in a pod namespace fenced by `airlock fence --pod`:
its memory, how soon a pod serves its agent, and what a request costs it.

    sudo .venv/bin/python -P bench/pod.py [--starts 9] [--tunnels 200] [--duration 5] [--rounds 2] [--output F]
        [--baseline OTHER/.venv/bin/python]

The pod is tests/e2e/pod.py's: one network namespace for the sidecar and the agent (two users), its one link to the
fake internet, fenced by `airlock fence --pod --gateway-uid U` with no port option. The sidecar runs as
deploy/kubernetes/base/sandbox-pod.yaml runs it (--pod, the policy file, a state and a trust directory, a broker
relay with its token file; the relay's --broker-url leads where nothing listens: nothing is relayed here) with the
e2e policy, the fake internet's resolver upstream and its audit in a file.

1. Memory: the sidecar's `VmRSS` idle after it started, after the agent's first request, after a warm-up of a few
   tunnels, and with --tunnels CONNECT + TLS tunnels to allowed.test:443 held open through its proxy (one keep-alive
   GET answered on each); KiB per tunnel from the warm-up to N.
2. Start-up, medians of --starts pods, each a fresh namespace: the fence (`airlock fence --pod` run to its exit), the
   sidecar (its process started until it logs "proxy on": every listener up) and the agent's first allowed request
   (plain HTTP through the fence's redirect, from a client already running as the agent's UID). With --baseline,
   each round starts one more pod whose sidecar is the airlock of that environment (an older checkout's venv, say):
   before and after in one run, on one load, judged by the sidecar's CPU to ready.
3. Per request: wrk (one thread, --connections, small GETs; keep-alive, then `Connection: close`: a new connection
   each) as the agent through the fence's transparent redirect and through the explicit proxy, against a plain
   `airlock gateway` with the same policy through its proxy from the topology's sandbox namespace (the gateway
   `airlock run` embeds is the same, but there the load generator would run inside the sandbox it launches and the
   gateway's CPU would be the launcher's too); rounds interleaved; the gateway's CPU µs per request.

All traffic stays inside the namespaces of airlock/verify/topology.py and the pod's; every process is started here
and stopped by PID, the namespaces are deleted at the end. Needs root and wrk.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.append(str(REPO / "bench"))

from airlock.cli import pod_ports  # noqa: E402
from airlock.verify.topology import DNS_SERVER, GW_IP, FakeNet, Topology  # noqa: E402

import common  # noqa: E402
from common import HOST, UPSTREAM_IP, HttpResult, cpu_seconds, fmt, http_round, rss_kib, run_wrk, wrk_script  # noqa: E402
from gateway_proc import E2E_POLICY, GatewayProcess  # noqa: E402
from netclient import HeldTunnels  # noqa: E402
from pod import AGENT_USER, AIRLOCK, GATEWAY_UID, POD_PEER_IP, Pod  # noqa: E402

TARGET_IDLE_MIB = 80
TARGET_READY_MS = 1000
NOWHERE_BROKER = f"http://{POD_PEER_IP}:8090"  # nothing listens there: the relay is up, nothing is relayed
WARM_TUNNELS = 5

# The agent's client, started before the pod's clock runs: each line on stdin is one plain HTTP request to the
# upstream's address (the fence redirects it to the sidecar); it prints the status and the milliseconds it took.
AGENT_CLIENT = r"""
import socket, sys, time
ip, host = sys.argv[1], sys.argv[2]
print("ready", flush=True)
for _ in sys.stdin:
    started = time.perf_counter()
    try:
        with socket.create_connection((ip, 80), timeout=10) as s:
            s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        status = reply.split(b" ", 2)[1].decode() if reply else "empty"
    except (OSError, IndexError) as e:
        status = type(e).__name__
    print(status, (time.perf_counter() - started) * 1000, flush=True)
"""


def sidecar_options(state: Path) -> list[str]:
    """`airlock gateway --pod` as the manifest runs it (every port its default), in the pod's state directory."""
    return [
        "--pod", "--sandbox-id", "bench-pod", "--policy", str(E2E_POLICY), "--state-dir", str(state / "state"),
        "--upstream-dns", DNS_SERVER, "--audit", str(state / "audit.jsonl"), "--broker-url", NOWHERE_BROKER,
        "--broker-token-file", str(state / "token"), "--trust-dir", str(state / "trust"),
    ]  # fmt: skip


def make_volumes(state: Path) -> None:
    """The sidecar's token file (empty: no token yet) and trust directory, its UID's, as the pod's volumes are."""
    (state / "token").touch(mode=0o600)
    (state / "trust").mkdir(mode=0o755)
    for path in (state / "token", state / "trust"):
        os.chown(path, GATEWAY_UID, GATEWAY_UID)


class AgentClient:
    """AGENT_CLIENT as the agent's UID in the pod; request() sends it one line. Stopped by PID."""

    def __init__(self, pod: Pod) -> None:
        argv = ["ip", "netns", "exec", pod.name, *AGENT_USER, "/usr/bin/python3", "-I", "-c", AGENT_CLIENT]
        self.proc = subprocess.Popen(
            [*argv, UPSTREAM_IP, HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"

    def request(self) -> tuple[str, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        status, ms = self.proc.stdout.readline().split()
        return status, float(ms)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@dataclass(frozen=True)
class Start:
    """One pod's start, ms: the fence installed, the sidecar ready, the agent's first allowed request answered; and
    the CPU the fence's command and the sidecar (until ready) used, which the machine's other work does not lengthen."""

    fence_ms: float
    ready_ms: float
    first_ms: float
    fence_cpu_ms: float
    ready_cpu_ms: float

    @property
    def total_ms(self) -> float:
        return self.fence_ms + self.ready_ms + self.first_ms


def medians(starts: list[Start]) -> dict[str, float]:
    """Each phase's median and the median of the totals (not the sum of the medians)."""
    return {
        "fence": statistics.median(s.fence_ms for s in starts),
        "ready": statistics.median(s.ready_ms for s in starts),
        "first": statistics.median(s.first_ms for s in starts),
        "total": statistics.median(s.total_ms for s in starts),
        "fence_cpu": statistics.median(s.fence_cpu_ms for s in starts),
        "ready_cpu": statistics.median(s.ready_cpu_ms for s in starts),
    }


def top_imports(log: str, n: int) -> list[tuple[str, float]]:
    """The `n` costliest imports a `-X importtime` log names at its top level (cumulative ms, a module's own
    imports inside its time), costliest first."""
    found = []
    for line in log.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            _self, cumulative, name = line.removeprefix("import time:").split("|")
            if cumulative.strip().isdigit() and not name.startswith("  "):  # one space after "|": top level
                found.append((name.strip(), int(cumulative) / 1000))
    return sorted(found, key=lambda item: -item[1])[:n]


def verdict(value: float, target: float, unit: str) -> str:
    return f"met ({fmt(value, 1)} {unit} ≤ {target:g})" if value <= target else f"**missed** ({fmt(value, 1)} {unit})"


def fenced_pod(topo: Topology) -> Pod:
    """A pod created, fenced and its sidecar started (destroy() it)."""
    pod = Pod(topo, sidecar_options)
    try:
        pod.create()
        make_volumes(pod.state)
        fenced = pod.fence()
        if fenced.returncode != 0:
            raise RuntimeError(f"airlock fence --pod: {fenced.stderr}")
        pod.start_gateway()
    except BaseException:
        pod.destroy()
        raise
    return pod


def one_start(topo: Topology, importtime: bool = False, sidecar: str = AIRLOCK) -> tuple[Start, str]:
    """A fresh pod started, timed; and its sidecar's log (with `importtime`, its `-X importtime` lines too)."""
    pod = Pod(topo, sidecar_options, sidecar=sidecar)
    agent: AgentClient | None = None
    try:
        pod.create()
        make_volumes(pod.state)
        agent = AgentClient(pod)
        t0, cpu0 = time.perf_counter(), common.own_cpu()
        fenced = pod.fence()
        t1, fence_cpu = time.perf_counter(), common.own_cpu() - cpu0
        if fenced.returncode != 0:
            raise RuntimeError(f"airlock fence --pod: {fenced.stderr}")
        with profiled_imports(importtime):
            pod.start_gateway(poll=0.002)
        t2 = time.perf_counter()
        assert pod.gateway is not None
        ready_cpu = cpu_seconds(pod.gateway.pid)
        status, first_ms = agent.request()
        if status != "200":
            raise RuntimeError(f"the agent's first request: {status}")
        log = (pod.state / "gateway.log").read_text(errors="replace")
        return Start((t1 - t0) * 1000, (t2 - t1) * 1000, first_ms, fence_cpu * 1000, ready_cpu * 1000), log
    finally:
        if agent is not None:
            agent.stop()
        pod.destroy()


def plain_start(topo: Topology, workdir: Path) -> tuple[float, float]:
    """A plain `airlock gateway` with the same policy started in the gateway namespace until it logs "proxy on":
    (ms, its CPU ms). The same measure as the sidecar's ready, for a ratio within one run."""
    workdir.mkdir()
    gateway = GatewayProcess(topo, workdir, extra=("--workers", "1"))  # as the sidecar: one process
    try:
        started = time.perf_counter()
        gateway.start(poll=0.002)
        assert gateway.proc is not None
        return (time.perf_counter() - started) * 1000, cpu_seconds(gateway.proc.pid) * 1000
    finally:
        gateway.stop()


@contextlib.contextmanager
def profiled_imports(on: bool) -> Iterator[None]:
    """While on, the processes started inherit PYTHONPROFILEIMPORTTIME (`-X importtime`: their imports logged)."""
    if on:
        os.environ["PYTHONPROFILEIMPORTTIME"] = "1"
    try:
        yield
    finally:
        os.environ.pop("PYTHONPROFILEIMPORTTIME", None)


# ------------------------------------------------------------------------------------------------ 1. memory


@dataclass(frozen=True)
class Memory:
    idle_kib: int
    after_request_kib: int
    warm_kib: int  # after WARM_TUNNELS tunnels opened, used and closed
    tunnels_kib: int
    tunnels: int
    failures: list[str]

    @property
    def kib_per_tunnel(self) -> float:
        return (self.tunnels_kib - self.warm_kib) / self.tunnels


def settled_rss(pid: int) -> int:
    time.sleep(1.0)  # the event loop's bookkeeping of what just happened done
    return rss_kib(pid)


def measure_memory(pod: Pod, ca: Path, tunnels: int) -> Memory:
    assert pod.gateway is not None
    pid = pod.gateway.pid
    idle = settled_rss(pid)
    agent = AgentClient(pod)
    try:
        status, _ = agent.request()
    finally:
        agent.stop()
    if status != "200":
        raise RuntimeError(f"the agent's request: {status}")
    after_request = settled_rss(pid)
    proxy = (pod_ports.LISTEN, pod_ports.PROXY_PORT)
    held = HeldTunnels(pod.name, proxy, f"{HOST}:443", str(ca))  # root's sockets, fenced as the agent's are
    try:
        failures = [f for f in held.open(WARM_TUNNELS) if f != "200"]
        held.close()
        warm = settled_rss(pid)
        held = HeldTunnels(pod.name, proxy, f"{HOST}:443", str(ca))
        failures += [f for f in held.open(tunnels) if f != "200"]
        with_tunnels = settled_rss(pid)
        failures += [f for f in held.request_all() if f != "200"]
        return Memory(idle, after_request, warm, with_tunnels, len(held.tunnels), failures)
    finally:
        held.close()


# ------------------------------------------------------------------------------------------------ 3. per request


@dataclass(frozen=True)
class Column:
    name: str
    where: list[str]  # the command prefix wrk runs with
    url: str
    path: str
    pid: int


def columns(pod: Pod, topo: Topology, host_gateway: GatewayProcess) -> list[Column]:
    assert pod.gateway is not None and host_gateway.proc is not None
    agent = ["ip", "netns", "exec", pod.name, *AGENT_USER]
    proxy = f"http://{pod_ports.LISTEN}:{pod_ports.PROXY_PORT}/"
    return [
        Column("pod: agent → fence redirect → sidecar", agent, f"http://{UPSTREAM_IP}/", "/", pod.gateway.pid),
        Column("pod: agent → sidecar's proxy", agent, proxy, f"http://{HOST}/", pod.gateway.pid),
        Column("`airlock gateway`: sandbox → its proxy", topo.cmd(topo.sbx), f"http://{GW_IP}:3128/",
               f"http://{HOST}/", host_gateway.proc.pid),
    ]  # fmt: skip


def per_request(
    net: FakeNet, workdir: Path, cols: list[Column], args: argparse.Namespace
) -> dict[bool, list[HttpResult]]:
    """Keep-alive (False) and new-connection (True) results per column, rounds interleaved."""
    found: dict[bool, list[HttpResult]] = {}
    for fresh in (False, True):
        luas = []
        for i, col in enumerate(cols):
            lua = workdir / f"wrk-{i}-{int(fresh)}.lua"
            lua.write_text(wrk_script(col.path, HOST, new_connections=fresh))
            lua.chmod(0o644)
            run_wrk(col.where, lua, col.url, 1, args.connections)  # warm-up
            luas.append(lua)
        results = [HttpResult(col.name, []) for col in cols]
        for r in range(args.rounds):
            for col, lua, result in zip(cols, luas, results, strict=True):
                print(f"  per request ({'new' if fresh else 'kept'}): {col.name}, round {r + 1}", file=sys.stderr)
                result.rounds.append(http_round(net, col.where, lua, col.url, col.pid, args.duration, args.connections))
        found[fresh] = results
    return found


# ------------------------------------------------------------------------------------------------ report


def baseline_lines(baseline: str | None, m: dict[str, float], base_starts: list[Start]) -> list[str]:
    """With --baseline: its pods, started in the same rounds, next to this tree's."""
    if not baseline:
        return []
    b = medians(base_starts)
    return [
        f"The same pods with the sidecar of `{baseline}`, in the same rounds: ready in {fmt(b['ready'], 1)} ms, "
        f"{fmt(b['ready_cpu'])} CPU ms to ready, total {fmt(b['total'], 1)} ms; this tree's / the baseline's: ready "
        f"{common.ratio(m['ready'], b['ready'])}, CPU {common.ratio(m['ready_cpu'], b['ready_cpu'])}, total "
        f"{common.ratio(m['total'], b['total'])}.",
        "",
    ]


def report(
    info: dict[str, str], command: str, args: argparse.Namespace, memory: Memory,
    pods: tuple[list[Start], list[Start]], plain_starts: list[tuple[float, float]], imports: list[tuple[str, float]],
    requests: dict[bool, list[HttpResult]], others: str, elapsed: float,
) -> str:  # fmt: skip
    mib = 1024
    starts, base_starts = pods
    m = medians(starts)
    plain_ms = statistics.median(ms for ms, _ in plain_starts)
    plain_cpu = statistics.median(cpu for _, cpu in plain_starts)
    lines = [
        "## airlock pod sidecar benchmark",
        "",
        common.machine_line(info),
        f"command: `{command}` ({elapsed:.0f} s; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); {others}",
        "",
        "### 1. The sidecar's memory (VmRSS)",
        "",
        "| idle, started | after one request | after a warm-up of "
        f"{WARM_TUNNELS} tunnels | {memory.tunnels} tunnels open | KiB per tunnel | failed |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {fmt(memory.idle_kib / mib, 1)} MiB | {fmt(memory.after_request_kib / mib, 1)} MiB"
        f" | {fmt(memory.warm_kib / mib, 1)} MiB | {fmt(memory.tunnels_kib / mib, 1)} MiB"
        f" | {fmt(memory.kib_per_tunnel, 1)} | {len(memory.failures)} |",
        "",
        f"Target ≤ {TARGET_IDLE_MIB} MB idle (taken as MiB, after one request): "
        f"{verdict(memory.after_request_kib / mib, TARGET_IDLE_MIB, 'MiB')}.",
        "",
        f"### 2. Pod start → the agent's first allowed request answered (median of {len(starts)} pods)",
        "",
        "| fence installed | sidecar ready | first request | total | total min / max | CPU: fence, sidecar to ready |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {fmt(m['fence'], 1)} ms | {fmt(m['ready'], 1)} ms | {fmt(m['first'], 1)} ms | {fmt(m['total'], 1)} ms"
        f" | {fmt(min(s.total_ms for s in starts), 1)} / {fmt(max(s.total_ms for s in starts), 1)} ms"
        f" | {fmt(m['fence_cpu'])} ms, {fmt(m['ready_cpu'])} ms |",
        "",
        f"Target ≤ {TARGET_READY_MS} ms to ready: {verdict(m['total'], TARGET_READY_MS, 'ms')} (fence + ready + "
        "first request).",
        "",
        f"A plain `airlock gateway` with the same policy, started in the same rounds: ready in {fmt(plain_ms, 1)} ms"
        f" ({fmt(plain_cpu)} CPU ms); the sidecar's ready / the plain gateway's: {common.ratio(m['ready'], plain_ms)}"
        f", CPU {common.ratio(m['ready_cpu'], plain_cpu)}.",
        "",
        *baseline_lines(args.baseline, m, base_starts),
        "The sidecar's costliest imports, one more start with `-X importtime` (cumulative ms; mitmproxy's load in a "
        "thread of its own): " + ", ".join(f"`{name}` {fmt(ms)}" for name, ms in imports) + ".",
        "",
    ]
    for fresh, title in ((False, "keep-alive"), (True, "a new connection per request")):
        lines += [
            f"### 3. Small HTTP requests, {title} (wrk -c{args.connections}, {args.rounds} interleaved rounds of"
            f" {args.duration:g} s)",
            "",
            "| | req/s | p50 ms | p99 ms | gateway CPU µs/req | / `airlock gateway` | non-200 + errors |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        results = requests[fresh]
        base = results[-1].cpu_us_per_req
        for r in results:
            cpu = r.cpu_us_per_req
            lines.append(
                f"| {r.name} | {fmt(r.rps)} | {fmt(r.p50_ms, 2)} | {fmt(r.p99_ms, 2)} | {fmt(cpu)}"
                f" | {common.ratio(cpu, base)} | {r.non200 + r.socket_errors} |"
            )
        lines.append("")
    if memory.failures:
        lines.append(f"tunnel failures: {sorted(set(memory.failures))}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--starts", type=int, default=9, help="pods started for the start-up medians (default 9)")
    parser.add_argument("--tunnels", type=int, default=200, help="tunnels held open at once (default 200)")
    parser.add_argument("--duration", type=float, default=5, help="seconds per wrk round (default 5)")
    parser.add_argument("--rounds", type=int, default=2, help="wrk rounds per column (default 2)")
    parser.add_argument("--connections", type=int, default=8, help="wrk connections (default 8)")
    parser.add_argument("--baseline", metavar="PYTHON", help="also start pods with the airlock of this python")
    args = common.parse_args(parser, argv)
    if args.baseline and not (Path(args.baseline).parent / "airlock").is_file():
        parser.error(f"--baseline {args.baseline}: no airlock beside it")
    if os.geteuid() != 0:
        parser.error("needs root for network namespaces")
    common.interrupt_on_sigterm()
    command = common.command_line("-P", "bench/pod.py")
    started, others = time.monotonic(), common.OtherCpu()
    import mitmproxy.version

    info = common.machine_info(mitmproxy=mitmproxy.version.VERSION)
    with common.scratch_dir("airlock-bench-pod-") as workdir:
        workdir.chmod(0o711)  # the agent's wrk reads its scripts here
        with common.fake_internet(workdir) as (topo, net, ca, procs):
            starts, plain_starts, base_starts = [], [], []
            for i in range(args.starts):  # interleaved with a plain gateway's, so drift hits both alike
                print(f"  start {i + 1}/{args.starts} ...", file=sys.stderr, flush=True)
                starts.append(one_start(topo)[0])
                plain_starts.append(plain_start(topo, workdir / f"plain-{i}"))
                if args.baseline:
                    base_starts.append(one_start(topo, sidecar=str(Path(args.baseline).parent / "airlock"))[0])
            print("  one more start, its imports profiled ...", file=sys.stderr, flush=True)
            imports = top_imports(one_start(topo, importtime=True)[1], 8)
            pod = fenced_pod(topo)
            try:  # before the topology goes: the pod's link ends in its namespace
                print("  memory ...", file=sys.stderr, flush=True)
                memory = measure_memory(pod, ca.ca_cert, args.tunnels)
                (workdir / "gateway").mkdir()
                host_gateway = GatewayProcess(topo, workdir / "gateway", extra=("--workers", "1")).start()
                procs.append(host_gateway)
                requests = per_request(net, workdir, columns(pod, topo, host_gateway), args)
            finally:
                pod.destroy()
    elapsed = time.monotonic() - started
    busy = others.seconds() / (elapsed * (os.cpu_count() or 1)) * 100
    other_line = f"other processes used {busy:.0f}% of the machine's CPU meanwhile"
    text = report(info, command, args, memory, (starts, base_starts), plain_starts, imports, requests, other_line,
                  elapsed)  # fmt: skip
    common.emit(text, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
