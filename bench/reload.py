"""Policy reload: how long a request waits while the gateway reloads a policy of N rules, and how long the load
takes — the reload of before (the file parsed on the event loop, as SIGHUP did) next to the one of now (parsed and
built in a thread, swapped in at once), in one run.

    .venv/bin/python -P bench/reload.py [--rules 100000] [--rounds 2] [--workers N] [--output FILE]

An in-process gateway listens on 127.0.0.1 (loopback only: nothing leaves the host); a client process sends a
request every 2 ms, each on a new connection, a plain-HTTP GET of a host the policy does not list (a 403 decided
by the policy, audited, no upstream), and records each request's latency. Each round reloads the policy once the
old way and once the new way; the report gives, per way, the longest latency of a request that was in flight during
the reload (what a reload delays a request by, at most, plus its usual latency), the event loop's longest stall
during it (a 1 ms sleep's lateness: what the reload does to the loop, apart from what the client process and the
rest of the machine add), the same two outside reloads, the reload's wall time under that traffic, and the CPU
time of a load alone (less sensitive to a busy machine) with the loader as it was (libyaml's CSafeLoader as it is,
every host through the full canonical_host checks) and as it is.

Targets: no request delayed more than 10 ms by a reload of 100,000 rules; such a load under 1 s.

`--workers N` (N > 1): the gateway's proxy runs in N worker processes (`airlock gateway --workers`), each parsing the
policy's text again in a thread (the two-phase reload of airlock/gateway/workers.py); only the reload of now is run
(the one of before swapped the gateway process's own policy alone), the requests' latency is the workers', the
event loop's stall the supervisor's. Target: a reload stall with workers of at most 30 ms at 100,000 rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.append(str(REPO / "bench"))

from airlock.gateway import Gateway  # noqa: E402
from airlock.gateway.config import GatewayConfig  # noqa: E402
from airlock.policy import Sandbox, fastload, hosts, load_policy, loader  # noqa: E402

import common  # noqa: E402

INTERVAL = 0.002
REQUEST = b"GET http://unlisted.example/ HTTP/1.1\r\nHost: unlisted.example\r\nConnection: close\r\n\r\n"


def write_policy(path: Path, rules: int) -> None:
    lines = ["version: 1", "profiles:", "  default:", "    allow:"]
    for i in range(rules):
        lines.append(f"      - host: h{i}.pkg.example")
        if i % 10 == 0:
            lines.append("        ports: [443, 80]")
    path.write_text("\n".join(lines) + "\n")


def client(port: int) -> None:
    """The client process: a request every INTERVAL until its stdin closes, each on a connection of its own (the
    gateway closes a connection it refused a request on); prints `[[start, latency], ...]`."""
    samples = []
    while not select.select([sys.stdin], [], [], 0)[0]:
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(REQUEST)
            while sock.recv(65536):
                pass
        samples.append((start, time.monotonic() - start))
        time.sleep(max(0.0, INTERVAL - (time.monotonic() - start)))
    print(json.dumps(samples))


class Loaders:
    """The loader as it is, and as it was (no fast path for the common shape, libyaml's loader itself, full host
    checks for every name)."""

    def __init__(self) -> None:
        self.now = (fastload.read_common, loader._YAML_LOADER, hosts._is_canonical_name)

    @contextlib.contextmanager
    def before(self) -> object:
        fastload.read_common = lambda text, filename: None
        loader._YAML_LOADER, hosts._is_canonical_name = loader._BASE_LOADER, lambda raw: False
        try:
            yield
        finally:
            fastload.read_common, loader._YAML_LOADER, hosts._is_canonical_name = self.now


async def reload_once(gateway: Gateway, path: Path, way: str, loaders: Loaders) -> tuple[float, float]:
    """(start, end) of one reload: as SIGHUP did before (load and swap on the event loop), or as now."""
    start = time.monotonic()
    if way == "before":
        with loaders.before():
            gateway.replace_policy(load_policy(path))
    else:
        assert (await gateway.reload_policy()).ok
    return start, time.monotonic()


def load_cpu(path: Path, loaders: Loaders, rounds: int) -> dict[str, list[float]]:
    """CPU seconds of a load alone (no traffic), with the loader as it was and as it is."""
    times: dict[str, list[float]] = {"before": [], "now": []}
    for _ in range(rounds):
        for way in ("before", "now"):
            with loaders.before() if way == "before" else contextlib.nullcontext():
                start = time.process_time()
                load_policy(path)
                times[way].append(time.process_time() - start)
    return times


async def watch_loop(stalls: list[tuple[float, float]]) -> None:
    """Records (when, how late) each 1 ms sleep of the event loop wakes: what a reload stalls the loop by, apart
    from what the client and the machine add to a request's latency."""
    while True:
        start = time.monotonic()
        await asyncio.sleep(0.001)
        stalls.append((start, time.monotonic() - start - 0.001))


async def run(rules: int, rounds: int, workdir: Path, workers: int = 1) -> dict[str, dict[str, list[float]]]:
    path = workdir / "policy.yaml"
    write_policy(path, rules)
    sandbox = Sandbox("bench", "default", ipaddress.ip_network("127.0.0.0/8"))
    config = GatewayConfig(
        load_policy(path), "127.0.0.1", proxy_port=0, sandboxes=[sandbox], upstream_dns=[("127.0.0.1", 9)],
        dns_port=0, state_dir=str(workdir / "state"), broker=common_broker_off(), transparent_port=0, workers=workers,
    )  # fmt: skip
    gateway = Gateway(config)
    await gateway.start()
    loaders = Loaders()
    port = gateway.parts.proxy.listeners["regular@0"].getsockname()[1]  # the gateway opens the proxy's socket itself
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-P", __file__, "--client", str(port), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    windows: list[tuple[str, float, float]] = []
    stalls: list[tuple[float, float]] = []
    watcher = asyncio.create_task(watch_loop(stalls))
    await asyncio.sleep(1)
    ways = ("before", "now") if workers == 1 else ("now",)
    for _ in range(rounds):
        for way in ways:
            windows.append((way, *await reload_once(gateway, path, way, loaders)))
            await asyncio.sleep(1)
    out, _ = await proc.communicate(b"")  # stdin closed: the client stops and reports
    watcher.cancel()
    await gateway.stop()
    cpu = load_cpu(path, loaders, rounds)
    samples = json.loads(out)
    results: dict[str, dict[str, list[float]]] = {
        w: {"delay": [], "stall": [], "load": [], "cpu": []} for w in ("before", "now")
    }
    for way, start, end in windows:
        during = [latency for at, latency in samples if at + latency >= start and at <= end]
        results[way]["delay"].append(max(during, default=0.0))
        results[way]["stall"].append(max((late for at, late in stalls if start <= at + late and at <= end), default=0))
        results[way]["load"].append(end - start)
        results[way]["cpu"] = cpu[way]
    busy = [(s, e) for _, s, e in windows]
    quiet = sorted(lat for at, lat in samples if not any(at + lat >= s - 0.05 and at <= e + 0.05 for s, e in busy))
    quiet_stalls = [late for at, late in stalls if not any(at + late >= s - 0.05 and at <= e + 0.05 for s, e in busy)]
    results["quiet"] = {
        "p50": [statistics.median(quiet)] if quiet else [0.0],
        "max": [max(quiet, default=0.0)],
        "count": [float(len(samples))],
        "stall": [max(quiet_stalls, default=0.0)],
    }
    return results


def common_broker_off() -> object:
    from airlock.gateway.config import BrokerConfig

    return BrokerConfig(port=0)


def report(rules: int, results: dict[str, dict[str, list[float]]], workers: int = 1) -> str:
    ms = lambda v: common.fmt(v * 1000, 1)  # noqa: E731
    lines = [
        f"# Policy reload of {rules:,} rules" + (f", {workers} proxy workers\n" if workers > 1 else "\n"),
        common.machine_line(common.machine_info()),
        f"\n`{common.command_line('bench/reload.py')}`; a request every {INTERVAL * 1000:.0f} ms, "
        f"{int(results['quiet']['count'][0]):,} requests; outside reloads p50 {ms(results['quiet']['p50'][0])} ms, "
        f"longest {ms(results['quiet']['max'][0])} ms; the event loop's longest stall outside reloads "
        f"{ms(results['quiet']['stall'][0])} ms.\n",
        "| reload | longest request during it, ms | longest event-loop stall during it, ms "
        "| reload, s (wall, under traffic) | load alone, s (CPU) |",
        "|---|---:|---:|---:|---:|",
    ]
    for way, label in (("before", "before: parsed on the event loop"), ("now", "now: parsed in a thread, swapped")):
        r = results[way]
        if not r["delay"]:
            continue  # with workers: the reload of now alone
        lines.append(
            f"| {label} | {' / '.join(ms(v) for v in r['delay'])} | {' / '.join(ms(v) for v in r['stall'])} "
            f"| {' / '.join(f'{v:.2f}' for v in r['load'])} "
            f"| {' / '.join(f'{v:.2f}' for v in r['cpu'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--rules", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1, help="the gateway's proxy workers (default 1: none)")
    args = common.parse_args(parser, argv)
    common.warn_if_loaded(os.getloadavg()[0])
    with common.scratch_dir("airlock-bench-reload-") as workdir:
        results = asyncio.run(run(args.rules, args.rounds, workdir, args.workers))
    common.emit(report(args.rules, results, args.workers), args.output)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client(int(sys.argv[2]))
        sys.exit(0)
    threading.current_thread().name = "bench"
    sys.exit(main())
