"""airlock beside its peers, side by side in one interleaved run: squid, bare mitmproxy (`mitmdump`, no addon), and
`airlock gateway` with one worker and, with `--workers N`, with N.

    sudo .venv/bin/python -P bench/peers.py [--rounds 3] [--duration 5] [--tunnels 200] [--bulk-mb 200]
        [--requests 500] [--workers N] [--output F]

Five loads, from the sandbox namespace to allowed.test in the fake internet, through each proxy as an explicit one:

- keep-alive: wrk -t1 -c8, `GET http://allowed.test/` over kept-alive connections;
- new connection each: the same with `Connection: close`;
- new tunnel: curl, `--tunnels` HTTPS requests per round, 10 at a time, each on a new connection (`CONNECT
  allowed.test:443`, TLS passed through and verified against the test CA, one GET);
- bulk: curl downloads `--bulk-mb` MB through one passed-through tunnel;
- in a kept-alive tunnel: `--requests` GETs one after the other inside one passed-through TLS tunnel.

Each proxy's CPU is its processes' user + system time (the whole process tree: workers and squid's helpers too)
over the round, per unit served, with the kernel's share beside it: unlike a rate it does not depend on how the
CPUs were shared between the load generator, the proxy and the upstream. The rate is units per second of wall
time. Rounds are interleaved and their order alternates, so drift and other work hit every column alike.

squid: Debian's `squid` (apt-get install -y squid), no cache, an access log to a file (airlock audits every
request), names from a hosts file (no DNS), in the gateway namespace. All traffic stays inside the namespaces of
airlock/verify/topology.py; every process is started here and stopped by PID, the namespaces deleted at the end.
Needs root, wrk, curl and squid.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.append(str(REPO / "bench"))

from overhead import tunnel_load, wrk_load  # noqa: E402
from run import TlsRoute, curl_bulk, curl_requests  # noqa: E402

from airlock.verify.topology import GW_IP, Topology  # noqa: E402

import common  # noqa: E402
from common import HOST, UPSTREAM_IP, fmt  # noqa: E402
from gateway_proc import GatewayProcess  # noqa: E402

SQUID = shutil.which("squid") or "/usr/sbin/squid"
PORTS = {"squid": 3180, "mitmdump": 3181, "airlock": 3182, "airlock workers": 3183}
GATEWAY_FLAGS = ("--dns-port", "0", "--broker-port", "0", "--transparent-port", "0")
TUNNELS_AT_ONCE = 10
SQUID_CONF = """\
http_port {listen}:{port}
acl CONNECT method CONNECT
http_access allow all
cache deny all
cache_mem 8 MB
access_log stdio:{dir}/access.log
cache_log {dir}/cache.log
pid_filename none
hosts_file {dir}/hosts
dns_nameservers 127.0.0.1
coredump_dir {dir}
shutdown_lifetime 1 seconds
workers 1
via off
forwarded_for delete
"""


class Squid(common.ListeningServer):
    """squid in the gateway namespace, in the foreground (-N), one process; the machine's squid is not touched."""

    name, ss_flags, poll_s = "squid", "-Hltn", 0.1

    def __init__(self, topo: Topology, workdir: Path, port: int) -> None:
        super().__init__(topo, workdir, port, f"squid-{port}.log")
        self.folder: Path | None = None

    def start(self, timeout: float = 30) -> Squid:
        # squid drops root for its effective user (proxy), which must reach its files: a folder of its own, since
        # the run's scratch folder (which holds the test CA's key) is root's alone
        folder = self.folder = Path(tempfile.mkdtemp(prefix="airlock-bench-squid-"))
        folder.chmod(0o755)
        shutil.chown(folder, user="proxy")
        (folder / "hosts").write_text(f"127.0.0.1 localhost\n{UPSTREAM_IP} {HOST}\n")
        conf = folder / "squid.conf"
        conf.write_text(SQUID_CONF.format(listen=GW_IP, port=self.port, dir=folder))
        self._launch([SQUID, "-N", "-f", conf], timeout)
        return self

    def stop(self) -> None:
        super().stop()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def tree_user_system_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process and every live descendant (a gateway's workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    user = system = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            own_user, own_system = common.user_system_seconds(p)
        except OSError:  # it ended meanwhile
            continue
        user, system = user + own_user, system + own_system
        todo.extend(children.get(p, []))
    return user, system


@dataclass
class Load:
    name: str
    unit: str
    run: Callable[[Topology, Path, int], float]  # (topology, workdir, proxy port) -> units served


@dataclass
class Column:
    name: str
    port: int
    pid: int
    cpu_s: list[float] = field(default_factory=list)  # per round
    system_s: list[float] = field(default_factory=list)
    units: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)

    def us_per_unit(self) -> float:
        return sum(self.cpu_s) / sum(self.units) * 1e6 if sum(self.units) else 0.0

    def system_share(self) -> float:
        return sum(self.system_s) / sum(self.cpu_s) if sum(self.cpu_s) else 0.0

    def rate(self) -> float:
        return sum(self.units) / sum(self.wall_s) if sum(self.wall_s) else 0.0


def bulk_load(size_mb: int, ca: Path) -> Callable[[Topology, Path, int], float]:
    def run(topo: Topology, workdir: Path, port: int) -> float:
        curl_bulk(topo, TlsRoute(f"port {port}", topo.sbx, f"http://{GW_IP}:{port}", ca, None), size_mb * 10**6)
        return float(size_mb)

    return run


def tunnel_requests_load(n: int, ca: Path) -> Callable[[Topology, Path, int], float]:
    def run(topo: Topology, workdir: Path, port: int) -> float:
        route = TlsRoute(f"port {port}", topo.sbx, f"http://{GW_IP}:{port}", ca, None)
        return float(len(curl_requests(topo, route, n, fresh=False)) + 1)  # the first, which opens it, counts too

    return run


def measure(
    topo: Topology, workdir: Path, loads: list[Load], columns: list[Column], rounds: int
) -> dict[str, list[Column]]:
    for load in loads:  # warm-up: connections, caches, imports
        for column in columns:
            load.run(topo, workdir, column.port)
    results = {load.name: [Column(c.name, c.port, c.pid) for c in columns] for load in loads}
    for i in range(rounds):
        for load in loads:
            for column in results[load.name][:: 1 if i % 2 == 0 else -1]:
                print(f"  {load.name}: {column.name} round {i + 1} ...", file=sys.stderr, flush=True)
                user0, system0 = tree_user_system_seconds(column.pid)
                started = time.monotonic()
                units = load.run(topo, workdir, column.port)
                column.wall_s.append(time.monotonic() - started)
                user, system = tree_user_system_seconds(column.pid)
                column.cpu_s.append(user - user0 + system - system0)
                column.system_s.append(system - system0)
                column.units.append(units)
    return results


def report(info: dict[str, str], command: str, loads: list[Load], results: dict[str, list[Column]], rounds: int,
           elapsed: float) -> str:  # fmt: skip
    names = [c.name for c in results[loads[0].name]]
    out = ["## airlock beside squid and bare mitmproxy", "", common.machine_line(info),
           f"command: `{command}` ({elapsed:.0f} s, {rounds} interleaved rounds per load)", ""]  # fmt: skip
    out.append("| load | " + " | ".join(f"{n}: rate, CPU µs/unit (kernel)" for n in names) + " | airlock / squid CPU |")
    out.append("|---|" + "---:|" * (len(names) + 1))
    for load in loads:
        columns = {c.name: c for c in results[load.name]}
        cells = [f"{fmt(c.rate(), 1 if c.rate() < 100 else 0)} {load.unit}/s, {fmt(c.us_per_unit())} "
                 f"({c.system_share():.0%})" for c in results[load.name]]  # fmt: skip
        squid, airlock = columns["squid"].us_per_unit(), columns["airlock"].us_per_unit()
        versus = f"{airlock / squid:.1f}x" if squid else "-"
        out.append(f"| {load.name} | " + " | ".join(cells) + f" | {versus} |")
    if "airlock workers" in names:
        out += ["", "| load | airlock N workers / 1 worker, rate (per round: median, range) |", "|---|---:|"]
        for load in loads:
            columns = {c.name: c for c in results[load.name]}
            one, many = columns["airlock"], columns["airlock workers"]
            each = sorted((m / mw) / (o / ow) for o, ow, m, mw in zip(one.units, one.wall_s, many.units, many.wall_s,
                          strict=True) if o)  # fmt: skip
            out.append(f"| {load.name} | **{statistics.median(each):.2f}x** ({each[0]:.2f}-{each[-1]:.2f}) |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per load and column, interleaved (default 3)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk round (default 5)")
    parser.add_argument("--tunnels", type=int, default=200, help="new tunnels per round (default 200)")
    parser.add_argument("--bulk-mb", type=int, default=200, help="MB per bulk download (default 200)")
    parser.add_argument("--requests", type=int, default=500, help="requests in one kept-alive tunnel (default 500)")
    parser.add_argument("--workers", type=int, help="also airlock gateway --workers N")
    args = common.parse_args(parser, argv)
    if not (1 <= args.rounds <= 20 and 1 <= args.duration <= 60 and 10 <= args.tunnels <= 10_000):
        parser.error("keep --rounds in 1..20, --duration in 1..60, --tunnels in 10..10000")
    if not (1 <= args.bulk_mb <= 2000 and 10 <= args.requests <= 10_000):
        parser.error("keep --bulk-mb in 1..2000, --requests in 10..10000")
    if os.geteuid() != 0:
        parser.error("needs root for network namespaces")
    for tool in ("wrk", "curl", SQUID):
        if shutil.which(tool) is None:
            parser.error(f"{tool} not found (apt-get install -y wrk curl squid)")
    common.interrupt_on_sigterm()
    command = common.command_line("-P", "bench/peers.py")
    started = time.monotonic()
    import mitmproxy.version

    info = common.machine_info(mitmproxy=mitmproxy.version.VERSION, squid=common.tool_version([SQUID, "-v"]))
    with common.scratch_dir("airlock-bench-") as workdir, common.fake_internet(workdir) as (topo, _, ca, procs):
        topo.assert_route_inside(topo.sbx, GW_IP)
        squid = Squid(topo, workdir, PORTS["squid"]).start()
        procs.append(squid)
        # TLS passed through, as airlock and squid do (mitmproxy would intercept it otherwise)
        mitmdump = common.Mitmdump(topo, workdir, PORTS["mitmdump"], ("--ignore-hosts", ".*")).start()
        procs.append(mitmdump)
        columns = [Column("squid", squid.port, squid.pid), Column("mitmdump", mitmdump.port, mitmdump.pid)]
        gateways = [("airlock", ("--workers", "1"))]
        if args.workers:
            gateways.append(("airlock workers", ("--workers", str(args.workers))))
        for name, extra in gateways:
            (workdir / name).mkdir()
            gateway = GatewayProcess(topo, workdir / name, extra=("--proxy-port", str(PORTS[name]), *GATEWAY_FLAGS,
                                                                  *extra))  # fmt: skip
            procs.append(gateway)
            assert gateway.start().proc is not None
            columns.append(Column(name, PORTS[name], gateway.proc.pid))
        loads = [
            Load("keep-alive", "req", lambda t, w, p: float(wrk_load(args.duration, close=False)(t, w, p))),
            Load("new connection each", "req", lambda t, w, p: float(wrk_load(args.duration, close=True)(t, w, p))),
            Load("new CONNECT + TLS + GET", "tunnel",
                 lambda t, w, p: float(tunnel_load(args.tunnels, ca.ca_cert, TUNNELS_AT_ONCE)(t, w, p))),
            Load("CONNECT bulk", "MB", bulk_load(args.bulk_mb, ca.ca_cert)),
            Load("in a kept-alive passthrough tunnel", "req", tunnel_requests_load(args.requests, ca.ca_cert)),
        ]  # fmt: skip
        results = measure(topo, workdir, loads, columns, args.rounds)
    common.emit(report(info, command, loads, results, args.rounds, time.monotonic() - started), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
