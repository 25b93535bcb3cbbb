"""`airlock gateway --workers N` against one worker: requests and tunnels per second, the CPU they cost, and how
evenly the shared listener spreads connections over the workers.

    sudo .venv/bin/python -P bench/workers.py [--workers 2] [--rounds 3] [--duration 5] [--tunnels 200]
        [--at-once 10] [--output F]

Two gateways of this checkout run side by side in the gateway namespace (e2e policy, audit to a file, no DNS,
broker or transparent listener of their own): `--workers 1` (the proxy in the gateway process, as before) and
`--workers N`. Two loads from the sandbox namespace to allowed.test in the fake internet, through the explicit proxy:

- small HTTP keep-alive: wrk -t1 -c8, `GET http://allowed.test/` over kept-alive connections, for `--duration`;
- new CONNECT + TLS tunnels: curl, `--tunnels` HTTPS requests per round, `--at-once` at a time (10), each on a new
  connection.

The rounds are interleaved, their order alternating, so drift and the shared machine's other work hit both alike;
each round gives the ratio N workers / 1 worker of the rate, the report their median and range. CPU: the gateway's
process tree (the supervisor and its workers) user + system time per unit. Balance: the share of each worker's audit
lines over the N-worker gateway's rounds (each request or tunnel is one line, `extra.worker`).

All traffic stays inside the namespaces of tests/e2e/topology.py; every process is started here and stopped by PID.
Needs root, wrk and curl.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.append(str(REPO / "bench"))

from airlock.verify.topology import GW_IP, Topology  # noqa: E402

import common  # noqa: E402
from common import HOST, fmt, run_wrk, user_system_seconds, wrk_script  # noqa: E402
from gateway_proc import GatewayProcess  # noqa: E402

PORTS = (3170, 3171)
CONNECTIONS = 8
TUNNELS_AT_ONCE = 10
GATEWAY_FLAGS = ("--dns-port", "0", "--broker-port", "0", "--transparent-port", "0")


@dataclass
class Column:
    name: str
    port: int
    gateway: GatewayProcess
    rates: list[float] = field(default_factory=list)  # units per second, per round
    cpu_s: list[float] = field(default_factory=list)
    supervisor_s: list[float] = field(default_factory=list)  # the gateway process's own part of cpu_s
    units: list[int] = field(default_factory=list)
    by_worker: collections.Counter[int] = field(default_factory=collections.Counter)

    @property
    def pid(self) -> int:
        assert self.gateway.proc is not None
        return self.gateway.proc.pid

    def us_per_unit(self) -> float:
        return sum(self.cpu_s) / sum(self.units) * 1e6 if sum(self.units) else 0.0

    def supervisor_share(self) -> float:
        return sum(self.supervisor_s) / sum(self.cpu_s) if sum(self.cpu_s) else 0.0


def tree_cpu(pid: int) -> tuple[float, float]:
    """User + system seconds of `pid` and of it with its children (the workers)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    own = sum(user_system_seconds(pid))
    total = own
    for each in map(int, children):
        with contextlib.suppress(OSError):  # ended meanwhile
            total += sum(user_system_seconds(each))
    return own, total


def keepalive(duration: float) -> Callable[[Topology, Path, int], tuple[int, float]]:
    def run(topo: Topology, workdir: Path, port: int) -> tuple[int, float]:
        lua = workdir / "wrk-keep.lua"
        lua.write_text(wrk_script(f"http://{HOST}/", HOST))
        _, micros, ok, other, conn_e, read_e, write_e, _, timeout_e, _, _ = run_wrk(
            topo.cmd(topo.sbx), lua, f"http://{GW_IP}:{port}/", duration, CONNECTIONS
        )
        if other or conn_e or read_e or write_e or timeout_e:
            raise RuntimeError(f"wrk through port {port}: {other:.0f} non-200, {conn_e + read_e + write_e:.0f} "
                               f"socket errors, {timeout_e:.0f} timeouts")  # fmt: skip
        return int(ok), micros / 1e6

    return run


def tunnels(n: int, ca: Path, at_once: int) -> Callable[[Topology, Path, int], tuple[int, float]]:
    def run(topo: Topology, workdir: Path, port: int) -> tuple[int, float]:
        argv = ["curl", "-sS", "--http1.1", "--max-time", "10", "-Z", "--parallel-max", at_once,
                "--cacert", ca, "-x", f"http://{GW_IP}:{port}", "-H", "Connection: close", "-o", "/dev/null",
                "-w", "%{http_code}\\n", f"https://{HOST}/?i=[1-{n}]"]  # fmt: skip
        started = time.monotonic()
        proc = topo.run(topo.sbx, argv, timeout=60 + n)
        elapsed = time.monotonic() - started
        if proc.returncode != 0 or proc.stdout.split() != ["200"] * n:
            raise RuntimeError(f"tunnels through port {port}: {proc.stdout.split()[:5]} {proc.stderr.strip()[:300]}")
        return n, elapsed

    return run


def worker_lines(gateway: GatewayProcess) -> collections.Counter[int]:
    """Audit lines per worker so far (-1: written by the gateway process itself, one worker)."""
    counts: collections.Counter[int] = collections.Counter()
    for line in gateway.audit_path.read_text().splitlines():
        if line.strip():
            counts[json.loads(line).get("extra", {}).get("worker", -1)] += 1
    return counts


def measure(
    topo: Topology, workdir: Path, load: Callable[[Topology, Path, int], tuple[int, float]], columns: list[Column],
    rounds: int, name: str,
) -> list[Column]:  # fmt: skip
    for column in columns:  # warm-up
        load(topo, workdir, column.port)
    results = [Column(c.name, c.port, c.gateway) for c in columns]
    for i in range(rounds):
        for column in results[:: 1 if i % 2 == 0 else -1]:
            print(f"  {name}: {column.name} round {i + 1} ...", file=sys.stderr, flush=True)
            time.sleep(0.3)  # the previous round's audit lines written
            before, (own0, cpu0) = worker_lines(column.gateway), tree_cpu(column.pid)
            units, seconds = load(topo, workdir, column.port)
            own, cpu = tree_cpu(column.pid)
            time.sleep(0.3)
            column.by_worker += worker_lines(column.gateway) - before
            column.rates.append(units / seconds)
            column.cpu_s.append(cpu - cpu0)
            column.supervisor_s.append(own - own0)
            column.units.append(units)
    return results


def report(info: dict[str, str], command: str, rounds: int, results: dict[str, list[Column]], elapsed: float) -> str:
    out = ["## airlock gateway workers", "", common.machine_line(info), f"command: `{command}` ({elapsed:.0f} s)", ""]
    w = out.append
    one, many = (c.name for c in next(iter(results.values())))
    w(f"{rounds} interleaved rounds per load. Rate: units per second of the round; CPU: the gateway's process tree "
      "(supervisor and workers), user + system, per unit (the supervisor's own share of it).\n")  # fmt: skip
    w(f"| load | {one}: per s (rounds) | {many}: per s (rounds) | {many} / {one} (median, range) | CPU µs/unit "
      f"{one} | CPU µs/unit {many} | {many}: share of units per worker |")  # fmt: skip
    w("|---|---:|---:|---:|---:|---:|---|")
    for load, (a, b) in results.items():
        ratios = [y / x for x, y in zip(a.rates, b.rates, strict=True)]
        total = sum(v for k, v in b.by_worker.items() if k >= 0) or 1
        shares = ", ".join(f"#{k} {v / total:.0%}" for k, v in sorted(b.by_worker.items()) if k >= 0)
        w(f"| {load} | {fmt(statistics.mean(a.rates))} ({', '.join(fmt(r) for r in a.rates)}) | "
          f"{fmt(statistics.mean(b.rates))} ({', '.join(fmt(r) for r in b.rates)}) | "
          f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) | {fmt(a.us_per_unit())} | "
          f"{fmt(b.us_per_unit())} (supervisor {b.supervisor_share():.0%}) | {shares} |")  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--workers", type=int, default=2, help="the many-worker gateway's --workers (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per load and gateway, interleaved (default 3)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk round (default 5)")
    parser.add_argument("--tunnels", type=int, default=200, help="new tunnels per round (default 200)")
    parser.add_argument(
        "--at-once", type=int, default=TUNNELS_AT_ONCE, help=f"tunnels opened at a time (default {TUNNELS_AT_ONCE})"
    )
    args: argparse.Namespace = common.parse_args(parser, argv)
    if not (2 <= args.workers <= 16 and 1 <= args.rounds <= 20 and 1 <= args.duration <= 60):
        parser.error("keep --workers in 2..16, --rounds in 1..20, --duration in 1..60")
    if os.geteuid() != 0:
        parser.error("needs root for network namespaces")
    for tool in ("wrk", "curl"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} not found (apt-get install -y wrk curl)")
    common.interrupt_on_sigterm()
    command = common.command_line("-P", "bench/workers.py")
    started = time.monotonic()
    info = common.machine_info(cpus=str(len(os.sched_getaffinity(0))))
    with common.scratch_dir("airlock-bench-") as workdir, common.fake_internet(workdir) as (topo, _, ca, procs):
        topo.assert_route_inside(topo.sbx, GW_IP)
        columns = []
        for count, port in zip((1, args.workers), PORTS, strict=True):
            name = f"{count} worker{'s' if count > 1 else ''}"
            (workdir / name).mkdir()
            flags = ("--proxy-port", str(port), "--workers", str(count), *GATEWAY_FLAGS)
            gateway = GatewayProcess(topo, workdir / name, extra=flags)
            procs.append(gateway)
            columns.append(Column(name, port, gateway.start()))
        results = {
            "small HTTP keep-alive (wrk -c8)": measure(
                topo, workdir, keepalive(args.duration), columns, args.rounds, "keep-alive"
            ),
            f"new CONNECT + TLS tunnels ({args.at_once} at a time)": measure(
                topo, workdir, tunnels(args.tunnels, ca.ca_cert, args.at_once), columns, args.rounds, "tunnels"
            ),
        }
    common.emit(report(info, command, args.rounds, results, time.monotonic() - started), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
