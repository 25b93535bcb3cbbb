"""The gateway's CPU per request and per new tunnel, this checkout against another (before and after, in one run),
and with `--profile` where that CPU goes.

    sudo .venv/bin/python -P bench/overhead.py [--baseline OTHER/.venv/bin/python] [--rounds 3] [--duration 5]
        [--tunnels 200] [--profile] [--top 20] [--output F]

Three loads, from the sandbox namespace to allowed.test in the fake internet, through an explicit proxy:

- keep-alive: wrk -t1 -c8, `GET http://allowed.test/` (fakenet's small answer) over kept-alive connections;
- new connection each: the same with `Connection: close`, so wrk opens a new connection for every request;
- new tunnel: curl, `--tunnels` HTTPS requests per round, 4 at a time, each on a new connection (`CONNECT
  allowed.test:443`, TLS passed through and verified against the test CA, one GET, `Connection: close`).

Each load runs against `airlock gateway` of this checkout and, with `--baseline`, the same gateway of another
checkout's environment (`OTHER/.venv/bin/airlock`), both started alike (e2e policy, audit log to a file, no DNS
server, broker or transparent listener of their own). The rounds are interleaved and their order alternates (this,
baseline; baseline, this; ...), so that drift and the other work of a shared machine hit both alike. A gateway's
CPU is its process's user + system time (every thread) over the round, divided by the requests (tunnels) it
served: unlike a rate it does not depend on how the CPUs were shared. Each round gives a ratio baseline / this;
the report gives their median and range beside the µs per unit over all rounds.

`--profile`: afterwards py-spy (`pip install py-spy`) samples this checkout's gateway during one more round
of each load; the report gives the share of samples by area of the code (each sample goes
to its innermost frame outside Python's generic standard library: a `typing` call counts for whoever made it) and
the top functions by own and by total time.

All traffic stays inside the network namespaces of tests/e2e/topology.py; every process is started here and stopped
by PID, the namespaces are deleted at the end. Needs root, wrk and curl.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
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
from gateway_proc import AIRLOCK, GatewayProcess  # noqa: E402

PORTS = {"this checkout": 3160, "baseline": 3161}
CONNECTIONS = 8  # wrk's
TUNNELS_AT_ONCE = 4  # curl's --parallel-max
GATEWAY_FLAGS = ("--dns-port", "0", "--broker-port", "0", "--transparent-port", "0")
PY_SPY = Path(sys.executable).parent / "py-spy"
PROFILE_RATE = 250  # samples per second
STDLIB = sysconfig.get_paths()["stdlib"] + "/"
_RUNTIME = {"asyncio", "socket.py", "selectors.py", "ssl.py", "threading.py"}  # the standard library's own area
_DISPATCH = ("addonmanager.py", "hooks.py", "addons/")
_MESSAGES = ("proxy/layers/", "proxy/layer.py", "proxy/tunnel.py", "proxy/utils.py", "proxy/commands.py",
             "proxy/events.py", "http.py", "net/", "coretypes/", "utils/typecheck.py", "utils/strutils.py")  # fmt: skip


def area_of(function: str, path: str) -> str:
    """Where a frame's time goes, by its file (and, in mitmproxy's server.py, by its function)."""
    if path.startswith(_tree()) and "/.venv/" not in path:
        if path.endswith("/gateway/proxy_connections.py"):  # the gateway's stand-in for mitmproxy's dispatch
            return "mitmproxy's hook dispatch"
        return "airlock (its hooks, policy, audit)"
    if _mitm(path, *_DISPATCH) or (_mitm(path, "proxy/server.py") and function.endswith(("handle_hook", "hook_task"))):
        return "mitmproxy's hook dispatch"
    if _mitm(path, *_MESSAGES) or "/h11/" in path or "/h2/" in path:
        return "mitmproxy's HTTP/1 parsing, layers, messages"
    if "/mitmproxy/" in path:
        return "mitmproxy's proxy core, connections"
    if path.startswith(STDLIB) and _stdlib_part(path) in _RUNTIME:
        return "asyncio, sockets, TLS"
    return "other"


def _tree() -> str:
    return str(REPO) + "/"


def _mitm(path: str, *parts: str) -> bool:
    _, sep, rest = path.partition("/mitmproxy/")
    return bool(sep) and rest.startswith(parts)


def _stdlib_part(path: str) -> str:
    return path[len(STDLIB) :].split("/", 1)[0]


@dataclass
class Load:
    name: str
    unit: str
    run: Callable[[Topology, Path, int], int]  # (topology, workdir, proxy port) -> units served


@dataclass
class Column:
    name: str
    port: int
    pid: int
    cpu_s: list[float] = field(default_factory=list)  # per round
    system_s: list[float] = field(default_factory=list)  # the part of it in the kernel
    units: list[int] = field(default_factory=list)

    def us_per_unit(self) -> float:
        return sum(self.cpu_s) / sum(self.units) * 1e6 if sum(self.units) else 0.0

    def system_share(self) -> float:
        return sum(self.system_s) / sum(self.cpu_s) if sum(self.cpu_s) else 0.0

    def round_us(self) -> list[float]:
        return [c / u * 1e6 for c, u in zip(self.cpu_s, self.units, strict=True) if u]


# ------------------------------------------------------------------------------------------------ loads


def wrk_load(duration: float, close: bool) -> Callable[[Topology, Path, int], int]:
    def run(topo: Topology, workdir: Path, port: int) -> int:
        lua = workdir / f"wrk-{'close' if close else 'keep'}.lua"
        lua.write_text(wrk_script(f"http://{HOST}/", HOST, new_connections=close))
        _, _, ok, other, conn_e, read_e, write_e, _, timeout_e, _, _ = run_wrk(
            topo.cmd(topo.sbx), lua, f"http://{GW_IP}:{port}/", duration, CONNECTIONS
        )
        if other or conn_e or read_e or write_e or timeout_e:
            raise RuntimeError(f"wrk through port {port}: {other:.0f} non-200, {conn_e + read_e + write_e:.0f} "
                               f"socket errors, {timeout_e:.0f} timeouts")  # fmt: skip
        return int(ok)

    return run


def tunnel_load(n: int, ca: Path, at_once: int = TUNNELS_AT_ONCE) -> Callable[[Topology, Path, int], int]:
    def run(topo: Topology, workdir: Path, port: int) -> int:
        argv = ["curl", "-sS", "--http1.1", "--max-time", "10", "-Z", "--parallel-max", at_once,
                "--cacert", ca, "-x", f"http://{GW_IP}:{port}", "-H", "Connection: close", "-o", "/dev/null",
                "-w", "%{http_code} %{num_connects}\\n", f"https://{HOST}/?i=[1-{n}]"]  # fmt: skip
        proc = topo.run(topo.sbx, argv, timeout=60 + n)
        rows = proc.stdout.split("\n")[:-1]
        if proc.returncode != 0 or rows != ["200 1"] * n:
            bad = next((row for row in rows if row != "200 1"), "")
            raise RuntimeError(f"tunnels through port {port}: {len(rows)}/{n} answered, first bad {bad!r}: "
                               f"{proc.stderr.strip()[:300]}")  # fmt: skip
        return n

    return run


def measure(
    topo: Topology, workdir: Path, loads: list[Load], columns: list[Column], rounds: int
) -> dict[str, list[Column]]:
    """Each load's columns, each with its CPU and units of every round."""
    for load in loads:  # warm-up: connections, caches, imports
        for column in columns:
            load.run(topo, workdir, column.port)
    results = {load.name: [Column(c.name, c.port, c.pid) for c in columns] for load in loads}
    for i in range(rounds):
        for load in loads:
            for column in results[load.name][:: 1 if i % 2 == 0 else -1]:
                print(f"  {load.name}: {column.name} round {i + 1} ...", file=sys.stderr, flush=True)
                user0, system0 = user_system_seconds(column.pid)
                units = load.run(topo, workdir, column.port)
                user, system = user_system_seconds(column.pid)
                column.cpu_s.append(user - user0 + system - system0)
                column.system_s.append(system - system0)
                column.units.append(units)
    return results


# ------------------------------------------------------------------------------------------------ profile


@dataclass
class Profile:
    load: str
    samples: int
    areas: collections.Counter[str]
    own: collections.Counter[str]
    total: collections.Counter[str]


def frame(text: str) -> tuple[str, str]:
    """(function, file) of one py-spy raw frame `function (file)`."""
    function, _, rest = text.partition(" (")
    return function, rest[:-1]


def short(function: str, path: str) -> str:
    for prefix in (*sorted({p for p in sys.path if p.endswith("site-packages")}), _tree(), STDLIB):
        if path.startswith(prefix.rstrip("/") + "/"):
            path = path[len(prefix.rstrip("/")) + 1 :]
            break
    return f"{function} ({path})"


def area(frames: list[tuple[str, str]]) -> str:
    # The kernel relay's thread waits in epoll.poll in its loop's own frame: py-spy samples it as busy even under a
    # load that opens no tunnel.
    if frames[-1][0] in ("EpollSelector.select", "SpliceRelay._run"):
        return "waiting in epoll (idle, mostly)"
    for function, path in reversed(frames):
        if path.startswith(STDLIB) and _stdlib_part(path) not in _RUNTIME and "site-packages" not in path:
            continue  # generic standard library: the caller's
        return area_of(function, path)
    return "other (standard library)"


def parse_profile(load: str, raw: str) -> Profile:
    profile = Profile(load, 0, collections.Counter(), collections.Counter(), collections.Counter())
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = [frame(f) for f in stack.split(";")]
        profile.samples += count
        profile.areas[area(frames)] += count
        profile.own[short(*frames[-1])] += count
        for name in {short(*f) for f in frames}:
            profile.total[name] += count
    return profile


def profile_load(topo: Topology, workdir: Path, load: Load, column: Column, seconds: float) -> Profile:
    """py-spy's samples of the gateway while `load` runs, again and again for at least `seconds`."""
    out = workdir / f"profile-{load.name.replace(' ', '-')}.txt"
    argv = [PY_SPY, "record", "--pid", str(column.pid), "--rate", str(PROFILE_RATE), "--format", "raw",
            "--nolineno", "--full-filenames", "--output", str(out)]  # fmt: skip
    print(f"  profile: {load.name} ...", file=sys.stderr, flush=True)
    spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # attached
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            load.run(topo, workdir, column.port)
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        _, errors = spy.communicate(timeout=60)
    if not out.exists():
        raise RuntimeError(f"py-spy wrote no profile: {errors.strip()[-500:]}")
    return parse_profile(load.name, out.read_text())


# ------------------------------------------------------------------------------------------------ report


def report(info: dict[str, str], command: str, args: argparse.Namespace, loads: list[Load],
           results: dict[str, list[Column]], profiles: list[Profile], elapsed: float) -> str:  # fmt: skip
    out = ["## airlock gateway overhead", "", common.machine_line(info), f"command: `{command}` ({elapsed:.0f} s)", ""]
    w = out.append
    names = [c.name for c in results[loads[0].name]]
    w(f"{args.rounds} interleaved rounds per load; CPU: the gateway process's user + system time per unit served "
      "(in the kernel: its system time's share of that).\n")  # fmt: skip
    header = " | ".join(f"{n} µs/unit (per round)" for n in names)
    w(f"| load | unit | {header} |" + (" baseline / this (median, range) |" if len(names) == 2 else ""))
    w("|---|---|" + "---:|" * len(names) + ("---:|" if len(names) == 2 else ""))
    for load in loads:
        columns = results[load.name]
        cells = [f"{fmt(c.us_per_unit())} ({', '.join(fmt(x) for x in c.round_us())}; in the kernel "
                 f"{c.system_share():.0%})" for c in columns]  # fmt: skip
        row = f"| {load.name} | {load.unit} | " + " | ".join(cells) + " |"
        if len(columns) == 2:
            ratios = [b / a for a, b in zip(columns[0].round_us(), columns[1].round_us(), strict=True)]
            row += f" **{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) |"
        w(row)
    w("")
    for profile in profiles:
        w(f"### Where this checkout's gateway spends its time: {profile.load} ({profile.samples:,} samples)\n")
        w("| area (innermost frame outside the generic standard library) | share |")
        w("|---|---:|")
        for name, count in profile.areas.most_common():
            w(f"| {name} | {count / profile.samples:.0%} |")
        w("")
        w("| top functions, own time | share | | top functions, total time | share |")
        w("|---|---:|---|---|---:|")
        own = profile.own.most_common(args.top)
        # the frames under every sample (the event loop's, the command line's) say nothing
        total = [(n, c) for n, c in profile.total.most_common() if c < 0.9 * profile.samples][: args.top]
        for (o_name, o_count), (t_name, t_count) in zip(own, total, strict=False):
            w(f"| `{o_name}` | {o_count / profile.samples:.1%} | | `{t_name}` | {t_count / profile.samples:.1%} |")
        w("")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--baseline", help="another environment's python (OTHER/.venv/bin/python): its airlock too")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per load and gateway, interleaved (default 3)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk round (default 5)")
    parser.add_argument("--tunnels", type=int, default=200, help="new tunnels per round (default 200)")
    parser.add_argument("--profile", action="store_true", help="then profile this checkout's gateway (py-spy)")
    parser.add_argument("--top", type=int, default=20, help="functions per profile table (default 20)")
    args = common.parse_args(parser, argv)
    if not (1 <= args.rounds <= 20 and 1 <= args.duration <= 60 and 10 <= args.tunnels <= 10_000):
        parser.error("keep --rounds in 1..20, --duration in 1..60, --tunnels in 10..10000")
    if os.geteuid() != 0:
        parser.error("needs root for network namespaces")
    for tool in ("wrk", "curl"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} not found (apt-get install -y wrk curl)")
    if args.profile and not PY_SPY.exists():
        parser.error(f"{PY_SPY} not found (pip install py-spy)")
    baseline = str(Path(args.baseline).parent / "airlock") if args.baseline else None
    if baseline and not Path(baseline).exists():
        parser.error(f"no airlock beside {args.baseline}")
    common.interrupt_on_sigterm()
    command = common.command_line("-P", "bench/overhead.py")
    started = time.monotonic()
    import mitmproxy.version

    info = common.machine_info(mitmproxy=mitmproxy.version.VERSION)
    profiles: list[Profile] = []
    with common.scratch_dir("airlock-bench-") as workdir, common.fake_internet(workdir) as (topo, _, ca, procs):
        topo.assert_route_inside(topo.sbx, GW_IP)
        columns = []
        for name, executable in (("this checkout", AIRLOCK), ("baseline", baseline)):
            if executable is None:
                continue
            (workdir / name).mkdir()
            flags = ("--proxy-port", str(PORTS[name]), *GATEWAY_FLAGS, *common.one_process(executable))
            gateway = GatewayProcess(topo, workdir / name, extra=flags, airlock=executable)
            procs.append(gateway)
            assert gateway.start().proc is not None
            columns.append(Column(name, PORTS[name], gateway.proc.pid))
        loads = [
            Load("keep-alive", "request", wrk_load(args.duration, close=False)),
            Load("new connection each", "request", wrk_load(args.duration, close=True)),
            Load("new tunnel", "tunnel", tunnel_load(args.tunnels, ca.ca_cert)),
        ]
        results = measure(topo, workdir, loads, columns, args.rounds)
        if args.profile:
            profiles = [profile_load(topo, workdir, load, columns[0], args.duration) for load in loads]
    common.emit(report(info, command, args, loads, results, profiles, time.monotonic() - started), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
