"""airlock's sandbox DNS server next to dnsmasq: cached allowlisted A queries and refused names, one run, one table.

    sudo .venv/bin/python -P bench/dns.py [--duration 8] [--window 64] [--generator auto|dnsperf|python]

Both servers run in the gateway namespace of airlock/verify/topology.py and forward to the fake authoritative server
192.0.2.53 in the `net` namespace (zone TTL 3600 s, so nothing expires during the run):

- airlock: `airlock gateway` (tests/e2e/gateway_proc.py: e2e policy, audit log to a file, sandbox 10.254.0.2/32)
  with `--dns-rate 1000000` (the default per-sandbox limit, 100 queries/s, would be the only thing measured);
  DNS on 10.254.0.1:53.
- dnsmasq 2.90: on 10.254.0.1:5353, `--server=/allowed.test/192.0.2.53 --server=/other.test/192.0.2.53` and
  `--no-resolv`: every other name has no upstream server, for which dnsmasq answers REFUSED without forwarding
  anything (denied.allowed.test, denied by the e2e policy, is sent to `#`, i.e. the default servers: none). It
  forwards every name below other.test too (the policy allows other.test only): dnsmasq has no exact-name rule.
  No `--stop-dns-rebind`: it counts the fake internet's documentation ranges as private and drops their answers.

The load comes from the sandbox namespace, the same generator and settings for both servers: `dnsperf` (Debian
package `dnsperf`, one socket, one thread) when installed, else a Python UDP client (one socket, one thread; it
needs about as much CPU per query as dnsmasq, so it under-reports dnsmasq). After the answers are checked and both
caches warmed, four runs per server, interleaved:

1. cached allowlisted A, max rate: `--window` queries outstanding over 8 allowlisted names for `--duration` s;
2. unlisted names, max rate: the same over 6 names neither server may forward (REFUSED by both);
3. cached allowlisted A at `--rate` queries/s (window as above): latency percentiles at a load both sustain;
4. one query at a time: latency percentiles without queueing.

dnsperf prints only a mean latency; printing every query (-v) slows it down several times, so runs 1-2 go without
-v (mean latency only) and runs 3-4 with it (p50/p99). The fake server counts every query it receives: the report
shows that none reached it during the measured runs. Every process is started here and stopped by PID; the
namespaces are deleted at the end, also on Ctrl-C or SIGTERM. Needs root, dnsmasq (apt-get install -y
dnsmasq-base) and preferably dnsperf (apt-get install -y dnsperf).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# The e2e helpers, not the repo root: the root's dns/ would shadow dnspython. bench/ last: its dns.py and
# docker.py must not shadow dnspython and docker-py.
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.append(str(REPO / "bench"))

from dnslib import QTYPE, RCODE, DNSRecord  # noqa: E402

from airlock.verify.topology import DNS_SERVER, GW_IP, FakeNet, Topology  # noqa: E402

import common  # noqa: E402
from common import cpu_seconds, fmt, percentile, ratio  # noqa: E402
from gateway_proc import GatewayProcess  # noqa: E402
from netclient import in_netns  # noqa: E402

DNSMASQ = "/usr/sbin/dnsmasq"
AIRLOCK_PORT = 53
DNSMASQ_PORT = 5353
ZONE_TTL = 3600

# Allowlisted by tests/e2e/policies/e2e.yaml and answered by the fake zone (the *.allowed.test wildcard included).
ALLOWED = {
    "allowed.test": "192.0.2.10",
    "www.allowed.test": "192.0.2.10",
    "api.allowed.test": "192.0.2.10",
    "cdn.allowed.test": "192.0.2.10",
    "files.allowed.test": "192.0.2.10",
    "pkg.allowed.test": "192.0.2.10",
    "other.test": "198.51.100.10",
    "mirror.allowed.test": "192.0.2.10",
}
# Not allowlisted (denied.allowed.test by a deny rule): neither server may forward them.
REFUSED = ["evil.test", "www.evil.test", "example.com", "pypi.org", "denied.allowed.test", "unlisted.test"]


# ------------------------------------------------------------------------------------------------ helpers


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench_info() -> dict[str, str]:
    import dnslib

    dnsmasq = common.tool_version([DNSMASQ, "--version"], r"Dnsmasq version (\S+)")
    dnsperf = common.tool_version(["dnsperf", "-h"], r"Version (\S+)") if shutil.which("dnsperf") else "not installed"
    return common.machine_info(
        dnslib=getattr(dnslib, "version", "?"), dnsmasq=dnsmasq, dnsperf=dnsperf, load=f"{os.getloadavg()[0]:.2f}"
    )


def upstream_queries(net: FakeNet) -> int:
    return sum(net.stats()["dns"].values())


# ------------------------------------------------------------------------------------------------ servers


class Dnsmasq(common.ListeningServer):
    """dnsmasq in the gateway namespace, forwarding only the allowlisted domains; stopped by PID."""

    name, ss_flags, poll_s = "dnsmasq", "-Hlun", 0.05

    def __init__(self, topo: Topology, workdir: Path, port: int) -> None:
        super().__init__(topo, workdir, port, "dnsmasq.log")

    def argv(self) -> list[str]:
        return [
            DNSMASQ, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--no-poll",
            f"--pid-file={self.workdir / 'dnsmasq.pid'}", "--user=root", "--group=root",
            f"--listen-address={GW_IP}", "--bind-interfaces", f"--port={self.port}",
            "--cache-size=10000",
            # The allowlist: these domains and every name below them go to the fake authoritative server.
            f"--server=/allowed.test/{DNS_SERVER}", f"--server=/other.test/{DNS_SERVER}",
            # The policy's deny rule: `#` = "the default servers", and --no-resolv leaves none.
            "--server=/denied.allowed.test/#",
            # Every other name has no server either, so dnsmasq answers REFUSED and forwards nothing.
        ]  # fmt: skip

    def start(self, timeout: float = 10) -> Dnsmasq:
        self._launch(self.argv(), timeout)
        return self


def ask(server: str, port: int, name: str, qtype: str = "A", timeout: float = 2.0) -> DNSRecord:
    """One query with dnslib, from whatever namespace the calling thread is in."""
    packet = DNSRecord.question(name, qtype).pack()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.connect((server, port))
        sock.send(packet)
        return DNSRecord.parse(sock.recv(4096))


def check_answers(topo: Topology, port: int) -> dict[str, str]:
    """Ask every name once from the sandbox (this also warms the cache); the answers must be what the policy says."""

    def run() -> dict[str, str]:
        seen: dict[str, str] = {}
        for name, address in ALLOWED.items():
            reply = ask(GW_IP, port, name)
            values = [str(rr.rdata) for rr in reply.rr if rr.rtype == QTYPE.A]
            if RCODE.get(reply.header.rcode) != "NOERROR" or values != [address]:
                raise RuntimeError(f"{name} @{GW_IP}:{port}: {RCODE.get(reply.header.rcode)} {values}, want {address}")
        for name in REFUSED:
            reply = ask(GW_IP, port, name)
            if reply.rr:
                raise RuntimeError(f"{name} @{GW_IP}:{port} was answered with data: {reply.rr}")
            seen[name] = RCODE.get(reply.header.rcode)
        return seen

    return in_netns(topo.sbx, run)


# ------------------------------------------------------------------------------------------------ load generators


@dataclass
class Load:
    completed: int = 0
    seconds: float = 0.0
    lost: int = 0
    rcodes: Counter[str] = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)  # every answered query, sorted; [] without -v
    mean_ms: float | None = None
    client_cpu: float = 0.0  # seconds
    server_cpu: float = 0.0  # seconds
    upstream: int = 0  # queries the fake authoritative server received during the run

    @property
    def qps(self) -> float:
        return self.completed / self.seconds if self.seconds else 0.0

    def p(self, q: float) -> float | None:
        return percentile(self.latencies_ms, q)

    @property
    def server_us_per_query(self) -> float | None:
        return self.server_cpu * 1e6 / self.completed if self.completed else None

    def client_cpu_percent(self) -> float | None:
        return self.client_cpu * 100 / self.seconds if self.seconds else None

    def server_cpu_percent(self) -> float | None:
        return self.server_cpu * 100 / self.seconds if self.seconds else None


def python_load(
    server: str, port: int, names: list[str], window: int, duration: float, rate: float | None = None
) -> Load:
    """Keeps `window` queries outstanding on one connected UDP socket (at most `rate` sent per second), in the
    calling thread's namespace. A query unanswered after 1 s is lost and replaced."""
    templates = [DNSRecord.question(name, "A").pack()[2:] for name in names]
    timeout_ns = 1_000_000_000
    sent: dict[int, int] = {}
    latencies: list[int] = []
    rcodes: Counter[int] = Counter()
    lost = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.connect((server, port))
        clock = time.perf_counter_ns
        next_id, index, count = 0, 0, 0
        cpu0 = time.thread_time()
        start = clock()
        end = start + int(duration * 1e9)
        gap = int(1e9 / rate) if rate else 0

        def send() -> None:
            nonlocal next_id, index, count
            while next_id in sent:
                next_id = (next_id + 1) & 0xFFFF
            sent[next_id] = clock()
            sock.send(next_id.to_bytes(2, "big") + templates[index])
            next_id, index, count = (next_id + 1) & 0xFFFF, (index + 1) % len(templates), count + 1

        received = 0
        now = start
        while now <= end:
            while len(sent) < window and (not gap or count * gap <= now - start):
                send()
            wait = (start + count * gap - now) / 1e9 if gap and len(sent) < window else 0.05
            sock.settimeout(max(wait, 1e-4))
            try:
                data = sock.recv(4096)
            except TimeoutError:
                data = b""
            now = clock()
            if data:
                t0 = sent.pop(int.from_bytes(data[:2], "big"), None)
                if t0 is not None and now <= end:
                    latencies.append(now - t0)
                    rcodes[data[3] & 0x0F] += 1
                received += 1
            if received % 1024 == 0 or not data:  # expire the lost ones, so the window stays full
                for qid in [q for q, t0 in sent.items() if now - t0 > timeout_ns]:
                    del sent[qid]
                    lost += 1
        client_cpu = time.thread_time() - cpu0
    return Load(
        completed=len(latencies),
        seconds=duration,
        lost=lost,
        rcodes=Counter({RCODE.get(code, str(code)): n for code, n in rcodes.items()}),
        latencies_ms=sorted(ns / 1e6 for ns in latencies),
        mean_ms=sum(latencies) / len(latencies) / 1e6 if latencies else None,
        client_cpu=client_cpu,
    )


DNSPERF_QUERY = re.compile(r"^> (\S+) \S+ \S+ ([0-9.]+)$", re.M)


def dnsperf_load(
    topo: Topology,
    workdir: Path,
    port: int,
    names: list[str],
    window: int,
    duration: float,
    rate: float | None = None,
    verbose: bool = False,
) -> Load:
    """dnsperf in the sandbox namespace: one socket, one thread. `verbose` (-v) prints every query's rcode and
    latency, for percentiles; printing costs dnsperf a lot of CPU, so throughput runs go without it."""
    data = workdir / "dnsperf-queries.txt"
    data.write_text("".join(f"{name} A\n" for name in names))
    out = workdir / "dnsperf.out"
    argv = [
        "dnsperf", "-s", GW_IP, "-p", port, "-d", data, "-c", "1", "-T", "1", "-q", window,
        "-l", f"{duration:g}", "-t", "1",
    ]  # fmt: skip
    argv += ["-Q", f"{rate:g}"] if rate else []
    argv += ["-v"] if verbose else []
    cpu0 = children_cpu()
    with out.open("w") as stdout:
        proc = topo.run(
            topo.sbx, argv, timeout=duration + 60, stdout=stdout, stderr=subprocess.PIPE, capture_output=False
        )
    client_cpu = children_cpu() - cpu0  # `ip netns exec` execs dnsperf: this is dnsperf's own CPU
    text = out.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"dnsperf failed ({proc.returncode}): {proc.stderr}\n{text[-2000:]}")

    def stat(key: str) -> str:
        m = re.search(rf"^\s*{re.escape(key)}:\s+(.*)$", text, re.M)
        if m is None:
            raise RuntimeError(f"dnsperf output without {key!r}:\n{text[-2000:]}")
        return m.group(1)

    load = Load(
        completed=int(stat("Queries completed").split()[0]),
        seconds=float(stat("Run time (s)")),
        lost=int(stat("Queries lost").split()[0]),
        rcodes=Counter({k: int(v) for k, v in re.findall(r"([A-Z]+) (\d+) \(", stat("Response codes"))}),
        mean_ms=float(stat("Average Latency (s)").split()[0]) * 1000,
        client_cpu=client_cpu,
    )
    if verbose:
        load.latencies_ms = sorted(float(s) * 1000 for rcode, s in DNSPERF_QUERY.findall(text) if rcode != "T")
    return load


# ------------------------------------------------------------------------------------------------ the run


@dataclass
class Target:
    name: str
    port: int
    pid: int


@dataclass
class Run:
    kind: str
    title: str
    names: list[str]
    window: int
    duration: float
    rate: float | None = None
    percentiles: bool = False  # dnsperf: with -v (slower client), for latency percentiles


def measure(topo: Topology, net: FakeNet, workdir: Path, target: Target, run: Run, gen: str) -> Load:
    upstream0, cpu0 = upstream_queries(net), cpu_seconds(target.pid)
    if gen == "dnsperf":
        load = dnsperf_load(topo, workdir, target.port, run.names, run.window, run.duration, run.rate, run.percentiles)
    else:
        args = (GW_IP, target.port, run.names, run.window, run.duration, run.rate)
        load = in_netns(topo.sbx, python_load, *args)
    load.server_cpu = cpu_seconds(target.pid) - cpu0
    load.upstream = upstream_queries(net) - upstream0
    return load


def plan(args: argparse.Namespace) -> list[Run]:
    short = min(args.duration, 4.0)
    return [
        Run("allowed", "cached allowlisted A, max rate", list(ALLOWED), args.window, args.duration),
        Run("refused", "unlisted names, max rate", REFUSED, args.window, args.duration),
        Run(
            "steady",
            f"cached allowlisted A at {args.rate:g} queries/s",
            list(ALLOWED),
            args.window,
            short,
            args.rate,
            True,
        ),
        Run("serial", "cached allowlisted A, one query at a time", list(ALLOWED), 1, short, None, True),
    ]


def run_bench(args: argparse.Namespace, workdir: Path, gen: str) -> dict[str, Any]:
    with common.fake_internet(workdir, zone_default_ttl=ZONE_TTL) as (topo, net, _, procs):
        # Safety: the servers forward to the fake DNS server, the load goes from the sandbox to the gateway.
        topo.assert_route_inside(topo.gw, DNS_SERVER)
        topo.assert_route_inside(topo.sbx, GW_IP)
        (workdir / "gateway").mkdir()
        gateway = GatewayProcess(topo, workdir / "gateway", extra=("--dns-rate", "1000000", "--workers", "1")).start()
        procs.append(gateway)
        dnsmasq = Dnsmasq(topo, workdir, DNSMASQ_PORT).start()
        procs.append(dnsmasq)
        assert gateway.proc is not None
        targets = [Target("airlock", AIRLOCK_PORT, gateway.proc.pid), Target("dnsmasq", DNSMASQ_PORT, dnsmasq.pid)]

        print("  checking answers and warming the caches ...", file=sys.stderr, flush=True)
        unlisted = {t.name: check_answers(topo, t.port) for t in targets}
        warm = Run("warm", "warm-up", list(ALLOWED), args.window, 1.0)
        # Every query airlock answered must have its audit line: the checks above, then every run's answers.
        answered = {"airlock": len(ALLOWED) + len(REFUSED)}
        for t in targets:  # a short run under load: caches, code paths, socket buffers
            load = measure(topo, net, workdir, t, warm, gen)
            answered[t.name] = answered.get(t.name, 0) + load.completed

        results: dict[tuple[str, str], Load] = {}
        for run in plan(args):
            for t in targets:
                print(f"  {run.title}: {t.name} ({run.duration:g} s) ...", file=sys.stderr, flush=True)
                results[(run.kind, t.name)] = load = measure(topo, net, workdir, t, run, gen)
                answered[t.name] += load.completed
        gateway.stop()  # writes out the last audit lines
        return {
            "results": results,
            "unlisted": unlisted,
            "dnsmasq_argv": dnsmasq.argv(),
            "gw_argv": gateway.argv(),
            "audit_lines": sum(1 for _ in gateway.audit_path.open()) if gateway.audit_path.exists() else 0,
            "answered": answered["airlock"],
        }


def report(info: dict[str, str], command: str, args: argparse.Namespace, gen: str, data: dict[str, Any]) -> str:
    res: dict[tuple[str, str], Load] = data["results"]
    lines = [
        "# airlock DNS vs dnsmasq",
        "",
        f"`{command}`",
        "",
        common.machine_line(info),
        "",
        f"load generator: **{gen}** in the sandbox namespace, one socket, UDP; {len(ALLOWED)} allowlisted / "
        f"{len(REFUSED)} unlisted names round robin; window {args.window} outstanding queries",
        "",
        "| | airlock | dnsmasq | airlock/dnsmasq |",
        "|---|---:|---:|---:|",
    ]

    def row(label: str, fa: str, fd: str, r: str = "") -> None:
        lines.append(f"| {label} | {fa} | {fd} | {r} |")

    def pair(load: Load) -> str:
        return f"{fmt(load.p(0.5), 3)} / {fmt(load.p(0.99), 3)}"

    def rcodes(load: Load) -> str:
        return ", ".join(f"{k} {v:,}" for k, v in load.rcodes.most_common()) + f"; lost {load.lost:,}"

    for run in plan(args):
        la, ld = res[(run.kind, "airlock")], res[(run.kind, "dnsmasq")]
        t = f"{run.title} ({run.duration:g} s)"
        if run.kind in ("allowed", "refused"):
            row(f"**{t}**: queries/s", f"**{fmt(la.qps)}**", f"**{fmt(ld.qps)}**", f"**{ratio(la.qps, ld.qps)}**")
            row("  mean latency (ms)", fmt(la.mean_ms, 3), fmt(ld.mean_ms, 3), ratio(ld.mean_ms, la.mean_ms))
        elif run.rate:
            row(f"**{t}**: queries/s answered", fmt(la.qps), fmt(ld.qps))
        else:  # one at a time: the rate is the round trip plus the generator's own pauses, not a server figure
            row(f"**{t}**", "", "")
        if la.latencies_ms or ld.latencies_ms:
            row("  p50 / p99 latency (ms)", pair(la), pair(ld), ratio(ld.p(0.5), la.p(0.5)))
        row(
            "  server CPU µs/query",
            fmt(la.server_us_per_query, 1),
            fmt(ld.server_us_per_query, 1),
            ratio(ld.server_us_per_query, la.server_us_per_query),
        )
        row("  server CPU (% of one core)", fmt(la.server_cpu_percent()), fmt(ld.server_cpu_percent()))
        row("  generator CPU (% of one core)", fmt(la.client_cpu_percent()), fmt(ld.client_cpu_percent()))
        row("  rcodes", rcodes(la), rcodes(ld))
        row("  queries that reached the upstream server", str(la.upstream), str(ld.upstream))
    answers = {t: "/".join(sorted(set(v.values()))) for t, v in data["unlisted"].items()}
    row("answer to an unlisted name", answers["airlock"], answers["dnsmasq"])
    target = res[("allowed", "airlock")].qps / res[("allowed", "dnsmasq")].qps if res[("allowed", "dnsmasq")].qps else 0
    lines += [
        "",
        f"cached allowlisted A throughput airlock/dnsmasq: **{target:.2f}x** "
        f"(target >= 0.5x: {'met' if target >= 0.5 else 'NOT met'})",
        "",
        "Latency ratios are dnsmasq/airlock (below 1: airlock is slower). Server CPU µs/query is the server process's "
        "user+system CPU during the run divided by the queries answered; its ratio is dnsmasq/airlock. "
        + (
            "dnsperf reports only the mean latency of a max-rate run: printing every query (-v) would slow it "
            "down, so the percentiles come from the two shorter runs, which use -v. "
            if gen == "dnsperf"
            else ""
        )
        + f"airlock audits every query (one JSON line, flushed, to a file: {data['audit_lines']:,} lines this run "
        f"for {data['answered']:,} queries answered: "
        f"{'every answer has its line' if data['audit_lines'] >= data['answered'] else 'LINES MISSING'}; "
        "a query answered after the generator gave up on it is logged but not counted as answered); "
        "dnsmasq logs nothing. Both servers share the machine's CPUs with the load generator.",
        "",
        "airlock: `" + shlex.join(str(x) for x in data["gw_argv"]) + "`",
        "",
        "dnsmasq: `" + shlex.join(str(x) for x in data["dnsmasq_argv"]) + "`",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measured run (default 8)")
    parser.add_argument("--window", type=int, default=64, help="queries outstanding (default 64)")
    parser.add_argument("--rate", type=float, default=1000.0, help="queries/s of the steady-latency run (default 1000)")
    parser.add_argument("--generator", choices=("auto", "dnsperf", "python"), default="auto")
    args = common.parse_args(parser, argv)
    if not (1 <= args.duration <= 60 and 1 <= args.window <= 1000 and 1 <= args.rate <= 100_000):
        parser.error("keep --duration in 1..60, --window in 1..1000 and --rate in 1..100000")
    if os.geteuid() != 0:
        parser.error("needs root for network namespaces")
    for tool in (DNSMASQ, "ip", "ss"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} not found (apt-get install -y dnsmasq-base iproute2)")
    gen = args.generator
    if gen == "auto":
        gen = "dnsperf" if shutil.which("dnsperf") else "python"
    elif gen == "dnsperf" and shutil.which("dnsperf") is None:
        parser.error("dnsperf not found (apt-get install -y dnsperf)")

    common.interrupt_on_sigterm()
    command = common.command_line("-P", "bench/dns.py")
    info = bench_info()
    common.warn_if_loaded(float(info["load"]))
    with common.scratch_dir("airlock-bench-dns-") as workdir:
        data = run_bench(args, workdir, gen)
    text = report(info, command, args, gen, data)
    common.emit(text, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
