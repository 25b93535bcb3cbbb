"""Memory and file descriptors per open tunnel: `airlock gateway` and a bare `mitmdump` passthrough, side by side.

    sudo .venv/bin/python -P bench/tunnels.py [--tunnels 1000] [--output F]

For each proxy in turn: warm up (a few tunnels opened, used and closed), read its RSS (`VmRSS`) and open file
descriptors, open N/2 and then N TLS tunnels to allowed.test:443 from the sandbox namespace (each a CONNECT, a TLS
handshake verified against the test CA and one keep-alive GET, all at once), read them again with the tunnels held
idle, then send one more request on every held tunnel (each must answer 200) and close them. KiB per tunnel is
(RSS at N - RSS at 0) / N, and "second half" the same slope from N/2 to N (what one more tunnel costs once the
process has grown). The airlock gateway runs as the e2e tests run it (e2e policy, audit log to a file), with
`--max-tunnels N --max-connections N+64`.

All traffic stays inside the network namespaces of airlock/verify/topology.py; every process is started here and
stopped by PID, the namespaces are deleted at the end. Needs root.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.append(str(REPO / "bench"))

from airlock.verify.topology import GW_IP  # noqa: E402

import common  # noqa: E402
from common import HOST, Mitmdump, cpu_seconds, fmt, rss_kib  # noqa: E402
from gateway_proc import GatewayProcess  # noqa: E402
from netclient import HeldTunnels, raise_open_file_limit  # noqa: E402

AIRLOCK_PORT = 3128
BARE_PASS_PORT = 3130


@dataclass
class Sample:
    tunnels: int
    rss_kib: int
    fds: int


@dataclass
class Result:
    name: str
    samples: list[Sample]
    failures: list[str]
    cpu_s: float  # the proxy's CPU while the tunnels were opened and used

    def per_tunnel(self, first: int, last: int) -> float:
        a, b = self.samples[first], self.samples[last]
        return (b.rss_kib - a.rss_kib) / (b.tunnels - a.tunnels)

    def fds_per_tunnel(self) -> float:
        a, b = self.samples[0], self.samples[-1]
        return (b.fds - a.fds) / (b.tunnels - a.tunnels)


def sample(pid: int, tunnels: int) -> Sample:
    time.sleep(1.0)  # let the proxy finish the handshakes' bookkeeping
    return Sample(tunnels, rss_kib(pid), len(os.listdir(f"/proc/{pid}/fd")))


def measure(name: str, ns: str, proxy: tuple[str, int], pid: int, ca: Path, n: int) -> Result:
    print(f"  {name}: warm-up ...", file=sys.stderr, flush=True)
    held = HeldTunnels(ns, proxy, f"{HOST}:443", str(ca))
    try:
        failures = [f for f in held.open(20) if f != "200"]
        held.close()
        held = HeldTunnels(ns, proxy, f"{HOST}:443", str(ca))
        samples = [sample(pid, 0)]
        cpu0 = cpu_seconds(pid)
        for count in (n // 2, n - n // 2):
            print(f"  {name}: opening {count} tunnels ...", file=sys.stderr, flush=True)
            failures += [f for f in held.open(count) if f != "200"]
            samples.append(sample(pid, len(held.tunnels)))
        failures += [f for f in held.request_all() if f != "200"]
        return Result(name, samples, failures, cpu_seconds(pid) - cpu0)
    finally:
        held.close()


def report(info: dict[str, str], command: str, n: int, results: list[Result], elapsed: float) -> str:
    lines = [
        "## airlock tunnels benchmark",
        "",
        common.machine_line(info),
        f"command: `{command}` ({elapsed:.0f} s)",
        "",
        f"### Idle TLS tunnels held open (CONNECT {HOST}:443, TLS, one keep-alive GET each; {n:,} at once)",
        "",
        "| | RSS at 0 MiB | at N/2 | at N | KiB per tunnel | second half | fds per tunnel | proxy CPU ms per tunnel"
        " | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s0, s1, s2 = r.samples
        lines.append(
            f"| {r.name} | {fmt(s0.rss_kib / 1024, 1)} | {fmt(s1.rss_kib / 1024, 1)} | {fmt(s2.rss_kib / 1024, 1)}"
            f" | {fmt(r.per_tunnel(0, 2), 1)} | {fmt(r.per_tunnel(1, 2), 1)} | {fmt(r.fds_per_tunnel(), 2)}"
            f" | {fmt(r.cpu_s * 1000 / s2.tunnels, 2)} | {len(r.failures)} |"
        )
    airlock, bare = results
    lines += [
        "",
        f"airlock / bare mitmproxy, KiB per tunnel: {airlock.per_tunnel(0, 2) / bare.per_tunnel(0, 2):.2f}x",
    ]
    for r in results:
        if r.failures:
            lines.append(f"{r.name}: failures {sorted(set(r.failures))}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--tunnels", type=int, default=1000, help="tunnels held at once (default 1000)")
    args = common.parse_args(parser, argv)
    if not 10 <= args.tunnels <= 20_000:
        parser.error("keep --tunnels in 10..20000")
    if os.geteuid() != 0:
        parser.error("needs root for network namespaces")
    if raise_open_file_limit() < 2 * args.tunnels + 100:
        parser.error(f"the open-file hard limit is too low for {args.tunnels} tunnels (ulimit -Hn)")
    common.interrupt_on_sigterm()
    command = common.command_line("-P", "bench/tunnels.py")
    started = time.monotonic()
    import mitmproxy.version

    info = common.machine_info(mitmproxy=mitmproxy.version.VERSION)
    with common.scratch_dir("airlock-bench-") as workdir, common.fake_internet(workdir) as (topo, _, ca, procs):
        topo.assert_route_inside(topo.sbx, GW_IP)
        (workdir / "gateway").mkdir()
        caps = ("--max-tunnels", str(args.tunnels), "--max-connections", str(args.tunnels + 64))
        gateway = GatewayProcess(topo, workdir / "gateway", extra=(*caps, "--workers", "1")).start()
        procs.append(gateway)
        bare = Mitmdump(topo, workdir, BARE_PASS_PORT, ("--ignore-hosts", ".*")).start()
        procs.append(bare)
        assert gateway.proc is not None
        columns = [
            ("airlock", AIRLOCK_PORT, gateway.proc.pid),
            ("bare mitmproxy passthrough", BARE_PASS_PORT, bare.pid),
        ]
        results = [measure(name, topo.sbx, (GW_IP, port), pid, ca.ca_cert, args.tunnels) for name, port, pid in columns]
    common.emit(report(info, command, args.tunnels, results, time.monotonic() - started), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
