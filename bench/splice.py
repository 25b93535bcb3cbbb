"""Passed-through tunnels, this checkout against another (before and after, in one run): a CONNECT + TLS bulk
download, and HTTPS requests inside one kept-alive passthrough tunnel.

    sudo .venv/bin/python -P bench/splice.py [--baseline OTHER/.venv/bin/python] [--rounds 3] [--bulk-mb 200]
        [--requests 500] [--output F]

- bulk: curl downloads https://allowed.test/big (`--bulk-mb` MB) through `CONNECT allowed.test:443`, TLS passed
  through and verified against the test CA; also straight from the gateway namespace to the upstream (direct).
- kept-alive: curl sends `--requests` GETs of https://allowed.test/ one after the other over one connection (one
  tunnel), the first (which opens it) left out.

Each runs against `airlock gateway` of this checkout and, with `--baseline`, the same gateway of another checkout's
environment (`OTHER/.venv/bin/airlock`), both started alike (e2e policy, audit to a file, no DNS server, broker or
transparent listener of their own). Rounds are interleaved and their order alternates, so that drift and the other
work of a shared machine hit both alike. A gateway's CPU is its process's user + system time (every thread, the
kernel's splicing on its behalf too) over the round, per MB or per request; each round gives a ratio baseline / this.
The whole machine's busy CPUs during each bulk download (/proc/stat, softirq included) tell whether the direct
transfer alone already takes every CPU: then a relay's work can only come out of the two ends' time.

All traffic stays inside the network namespaces of airlock/verify/topology.py; every process is started here and
stopped by PID, the namespaces are deleted at the end. Needs root and curl.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.append(str(REPO / "bench"))

from run import TlsRoute, curl_bulk, curl_requests  # noqa: E402

from airlock.verify.topology import GW_IP, Topology  # noqa: E402

import common  # noqa: E402
from gateway_proc import AIRLOCK, GatewayProcess  # noqa: E402

PORTS = {"this checkout": 3170, "baseline": 3171}
GATEWAY_FLAGS = ("--dns-port", "0", "--broker-port", "0", "--transparent-port", "0")


class OtherGateway(GatewayProcess):
    """`airlock gateway` of another environment (its own executable), started as the e2e helper starts ours."""

    def __init__(self, topology: Topology, workdir: Path, executable: str, extra: tuple[str, ...]) -> None:
        super().__init__(topology, workdir, extra=extra)
        self.executable = executable

    def argv(self) -> list[str]:
        return [self.executable if arg == AIRLOCK else arg for arg in super().argv()]


@dataclass
class Column:
    route: TlsRoute
    mbps: list[float] = field(default_factory=list)
    bulk_cpu_ms_per_mb: list[float] = field(default_factory=list)  # one per round
    rps: list[float] = field(default_factory=list)
    cpu_us_per_req: list[float] = field(default_factory=list)
    busy_cpus: list[float] = field(default_factory=list)  # the whole machine's CPUs busy during a bulk download


def measure(topo: Topology, columns: list[Column], rounds: int, size_mb: int, requests: int) -> None:
    for i in range(rounds):
        order = columns if i % 2 == 0 else [columns[0], *reversed(columns[1:])]  # direct first; the others alternate
        for column in order:
            route = column.route
            print(f"  round {i + 1}: {route.name} ...", file=sys.stderr, flush=True)
            cpu0 = common.cpu_seconds(route.pid) if route.pid else 0.0
            busy0, wall0 = common.machine_cpu_seconds(), time.perf_counter()
            column.mbps.append(curl_bulk(topo, route, size_mb * 10**6))
            column.busy_cpus.append((common.machine_cpu_seconds() - busy0) / (time.perf_counter() - wall0))
            if route.pid:
                column.bulk_cpu_ms_per_mb.append((common.cpu_seconds(route.pid) - cpu0) * 1000 / size_mb)
            cpu0 = common.cpu_seconds(route.pid) if route.pid else 0.0
            latencies = curl_requests(topo, route, requests, fresh=False)
            column.rps.append(len(latencies) / sum(latencies) * 1000)
            if route.pid:
                column.cpu_us_per_req.append((common.cpu_seconds(route.pid) - cpu0) / requests * 1e6)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratios(baseline: list[float], this: list[float]) -> str:
    """baseline / this per round: median (range)."""
    each = sorted(b / t for b, t in zip(baseline, this, strict=True) if t)
    if not each:
        return "-"
    return f"{statistics.median(each):.2f}x ({each[0]:.2f}-{each[-1]:.2f})"


def report(info: dict[str, str], command: str, columns: list[Column], rounds: int, size_mb: int, n: int) -> str:
    direct = columns[0]
    lines = [
        "# Passed-through tunnels",
        "",
        common.machine_line(info),
        f"`{command}`: {rounds} rounds, bulk {size_mb} MB, {n} requests over one kept-alive tunnel",
        "",
        "| column | bulk MB/s | x direct | CPU ms/MB | machine CPUs busy (bulk) | kept-alive req/s | CPU µs/req |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in columns:
        mbps = _median(c.mbps)
        share = f"{mbps / _median(direct.mbps):.2f}" if mbps and c is not direct else "1"  # type: ignore[operator]
        lines.append(
            f"| {c.route.name} | {common.fmt(mbps)} | {share} | {common.fmt(_median(c.bulk_cpu_ms_per_mb), 2)} "
            f"| {common.fmt(_median(c.busy_cpus), 2)} of {os.cpu_count()} "
            f"| {common.fmt(_median(c.rps))} | {common.fmt(_median(c.cpu_us_per_req))} |"
        )
    if len(columns) == 3:
        this, baseline = columns[1], columns[2]
        lines += [
            "",
            "baseline / this, per round (median, range): "
            f"CPU per MB {_ratios(baseline.bulk_cpu_ms_per_mb, this.bulk_cpu_ms_per_mb)}, "
            f"CPU per request {_ratios(baseline.cpu_us_per_req, this.cpu_us_per_req)}; "
            f"this / baseline MB/s {_ratios(this.mbps, baseline.mbps)}, req/s {_ratios(this.rps, baseline.rps)}",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--baseline", help="another environment's python (OTHER/.venv/bin/python): its airlock too")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per column, interleaved (default 3)")
    parser.add_argument("--bulk-mb", type=int, default=200, help="MB per download (default 200)")
    parser.add_argument("--requests", type=int, default=500, help="requests over one kept-alive tunnel (default 500)")
    args = common.parse_args(parser, argv)
    if not (1 <= args.rounds <= 20 and 1 <= args.bulk_mb <= 2000 and 10 <= args.requests <= 10_000):
        parser.error("keep --rounds in 1..20, --bulk-mb in 1..2000, --requests in 10..10000")
    if os.geteuid() != 0:
        parser.error("needs root for network namespaces")
    if shutil.which("curl") is None:
        parser.error("curl not found (apt-get install -y curl)")
    baseline = str(Path(args.baseline).parent / "airlock") if args.baseline else None
    if baseline and not Path(baseline).exists():
        parser.error(f"no airlock beside {args.baseline}")
    common.interrupt_on_sigterm()
    command = common.command_line("-P", "bench/splice.py")
    info = common.machine_info()
    with common.scratch_dir("airlock-bench-") as workdir, common.fake_internet(workdir) as (topo, _, ca, procs):
        topo.assert_route_inside(topo.sbx, GW_IP)
        columns = [Column(TlsRoute("direct (gw → upstream)", topo.gw, None, ca.ca_cert, None))]
        for name, executable in (("this checkout", AIRLOCK), ("baseline", baseline)):
            if executable is None:
                continue
            (workdir / name).mkdir()
            flags = ("--proxy-port", str(PORTS[name]), *GATEWAY_FLAGS, *common.one_process(executable))
            gateway = OtherGateway(topo, workdir / name, executable, flags)
            procs.append(gateway)
            assert gateway.start().proc is not None
            proxy = f"http://{GW_IP}:{PORTS[name]}"
            columns.append(Column(TlsRoute(f"airlock, {name}", topo.sbx, proxy, ca.ca_cert, gateway.proc.pid)))
        for column in columns:
            curl_requests(topo, column.route, 20, fresh=False)  # warm-up: DNS cache, imports
        started = time.monotonic()
        measure(topo, columns, args.rounds, args.bulk_mb, args.requests)
        print(f"  measured in {time.monotonic() - started:.0f} s", file=sys.stderr)
    common.emit(report(info, command, columns, args.rounds, args.bulk_mb, args.requests), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
