"""What the benchmark scripts share: machine facts, CPU accounting, number formatting, servers started and stopped
by PID, the e2e topology with its fake internet, and the command-line and report boilerplate.

Not a script. Each bench script puts tests/e2e first on sys.path (never the repo root: its dns/ would shadow
dnspython) and this folder last (its dns.py and docker.py must not shadow dnspython and docker-py), then imports
this module.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airlock.verify.control import stop_proc
from airlock.verify.fakeca import FakeCA, make_fake_ca
from airlock.verify.topology import GW_IP, FakeNet, Topology

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
MITMDUMP = Path(sys.executable).parent / "mitmdump"
UPSTREAM_IP = "192.0.2.10"  # allowed.test in the fake internet
HOST = "allowed.test"


# ------------------------------------------------------------------------------------------------ CPU and machine


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far."""
    return sum(user_system_seconds(pid))


def user_system_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def machine_busy() -> float:
    """CPU seconds the whole machine spent in user + nice + system mode so far (all CPUs)."""
    user, nice, system = (int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:4])
    return (user + nice + system) / CLK_TCK


def machine_cpu_seconds() -> float:
    """CPU seconds the whole machine spent not idle so far (all CPUs): user, nice, system, and the kernel's
    interrupt and softirq time (where a network transfer's packet work is counted), steal too."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle, iowait = fields[3], fields[4]
    return (sum(fields) - idle - iowait) / CLK_TCK


def own_cpu() -> float:
    """CPU seconds of this process and of every child it has reaped (load generators, servers, fakes, ip)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherCpu:
    """CPU seconds other processes used since this was made: the machine's busy time minus this process's own and
    its reaped children's. Read it once everything started has been stopped and reaped."""

    def __init__(self) -> None:
        self.busy0, self.own0 = machine_busy(), own_cpu()

    def seconds(self) -> float:
        return max(0.0, (machine_busy() - self.busy0) - (own_cpu() - self.own0))


def rss_kib(pid: int) -> int:
    """A process's resident memory (`VmRSS`), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


def machine_info(**extra: str) -> dict[str, str]:
    """CPUs, kernel and Python, then `extra` (versions of what the benchmark exercises), in that order."""
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        **extra,
    }


def machine_line(info: dict[str, str]) -> str:
    return "machine: " + ", ".join(f"{k} {v}" for k, v in info.items())


def one_process(airlock: str) -> tuple[str, ...]:
    """The options that make `airlock gateway` of that executable one process: `--workers 1` where it has proxy
    workers (one per CPU by default), none for an airlock from before them."""
    usage = subprocess.run([airlock, "gateway", "--help"], capture_output=True, text=True, timeout=60).stdout
    return ("--workers", "1") if "--workers" in usage else ()


def tool_version(argv: list[str], pattern: str | None = None) -> str:
    """The first line a tool prints for `argv`, or with `pattern` the pattern's first group in what it printed."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return "missing"
    if pattern is None:
        text = (proc.stdout + proc.stderr).strip().splitlines()
        return text[0].strip() if text else "?"
    match = re.search(pattern, proc.stdout + proc.stderr)
    return match.group(1) if match else "?"


def warn_if_loaded(load: float, numbers: str = "low") -> None:
    if load > 0.5:
        print(
            f"warning: load average {load:.2f}: something else is running, numbers will be {numbers}", file=sys.stderr
        )


# ------------------------------------------------------------------------------------------------ numbers


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def calibrate(fn: Any, budget_s: float, min_s: float) -> int:
    """How many calls of `fn` take about `budget_s` (measured over at least `min_s`)."""
    number = 1
    while (elapsed := timeit.timeit(fn, number=number)) < min_s:
        number *= 4
    return max(1, int(number * budget_s / elapsed))


# ------------------------------------------------------------------------------------------------ HTTP load (wrk)


# wrk's request to a proxy as if it were the server (or to the server itself); `done` prints one BENCH line of
# numbers (http_round reads them). {close}: a header line that makes every request a new connection.
WRK_LUA = """
wrk.method = "GET"
wrk.path = "{path}"
wrk.headers["Host"] = "{host}"
{close}
local threads = {{}}
function setup(thread) table.insert(threads, thread) end
function init(args) ok = 0; other = 0 end
function response(status, headers, body)
  if status == 200 then ok = ok + 1 else other = other + 1 end
end
function done(summary, latency, requests)
  local n_ok, n_other = 0, 0
  for _, t in ipairs(threads) do n_ok = n_ok + t:get("ok"); n_other = n_other + t:get("other") end
  local e = summary.errors
  io.write(string.format("BENCH %.0f %.0f %.0f %.0f %.0f %.0f %.0f %.0f %.0f %.0f %.0f\\n",
    summary.requests, summary.duration, n_ok, n_other, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def wrk_script(path: str, host: str, new_connections: bool = False) -> str:
    """The Lua script for `path` with `Host: host`; with `new_connections`, `Connection: close` on every request (wrk
    opens a new connection for the next one)."""
    close = 'wrk.headers["Connection"] = "close"' if new_connections else ""
    return WRK_LUA.format(path=path, host=host, close=close)


@dataclass
class HttpRound:
    ok: int
    seconds: float
    non200: int
    socket_errors: int
    p50_ms: float
    p99_ms: float
    cpu_s: float | None  # the proxy's CPU during the round (None for direct)
    upstream_conns: int

    @property
    def rps(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0


@dataclass
class HttpResult:
    name: str
    rounds: list[HttpRound]

    @property
    def rps(self) -> float:
        return sum(r.ok for r in self.rounds) / sum(r.seconds for r in self.rounds)

    @property
    def p50_ms(self) -> float:
        return statistics.median(r.p50_ms for r in self.rounds)

    @property
    def p99_ms(self) -> float:
        return statistics.median(r.p99_ms for r in self.rounds)

    @property
    def cpu_us_per_req(self) -> float | None:
        ok = sum(r.ok for r in self.rounds)
        if not ok or any(r.cpu_s is None for r in self.rounds):
            return None
        return sum(r.cpu_s or 0.0 for r in self.rounds) / ok * 1e6

    @property
    def upstream_conns(self) -> int:
        return max(r.upstream_conns for r in self.rounds)

    @property
    def non200(self) -> int:
        return sum(r.non200 for r in self.rounds)

    @property
    def socket_errors(self) -> int:
        return sum(r.socket_errors for r in self.rounds)


def run_wrk(where: list[str], lua: Path, url: str, duration: float, connections: int) -> list[float]:
    """wrk run with the command prefix `where` (`ip netns exec NS`, a user's `setpriv` after it): its BENCH line."""
    argv = [*where, "wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--timeout", "5s", "-s", str(lua), url]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return [float(x) for x in line.split()[1:]]


def http_round(
    net: FakeNet, where: list[str], lua: Path, url: str, pid: int | None, duration: float, connections: int
) -> HttpRound:
    """One wrk round (run_wrk), with the CPU of the proxy `pid` and the upstream connections it opened."""
    net.reset()
    cpu0 = cpu_seconds(pid) if pid else 0.0
    _requests, duration_us, ok, other, conn_e, read_e, write_e, _status_e, timeout_e, p50, p99 = run_wrk(
        where, lua, url, duration, connections
    )
    return HttpRound(
        ok=int(ok),
        seconds=duration_us / 1e6,
        non200=int(other),
        socket_errors=int(conn_e + read_e + write_e + timeout_e),
        p50_ms=p50 / 1000,
        p99_ms=p99 / 1000,
        cpu_s=cpu_seconds(pid) - cpu0 if pid else None,
        upstream_conns=net.connections(UPSTREAM_IP, 80),
    )


# ------------------------------------------------------------------------------------------------ processes


class ListeningServer:
    """A server in the gateway namespace, ready once something listens on `port` (`ss_flags`: -Hltn for TCP,
    -Hlun for UDP); its output goes to `log_path`; stopped by PID."""

    name: str
    ss_flags: str
    poll_s: float

    def __init__(self, topo: Topology, workdir: Path, port: int, log_name: str) -> None:
        self.topo, self.workdir, self.port = topo, workdir, port
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / log_name

    def _launch(self, argv: list[Any], timeout: float) -> None:
        with self.log_path.open("wb") as log:
            self.proc = self.topo.popen(self.topo.gw, argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            if self.topo.run(self.topo.gw, ["ss", self.ss_flags, f"sport = :{self.port}"]).stdout.strip():
                return
            time.sleep(self.poll_s)
        raise RuntimeError(f"{self.name} did not listen on {self.port} in {timeout}s")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None:
            stop_proc(self.proc, wait=10)


class Mitmdump(ListeningServer):
    """Bare mitmproxy (no addon) in the gateway namespace. allowed.test resolves via a private /etc/hosts bind
    mount (in its own mount namespace), so mitmproxy's getaddrinfo never asks any DNS server."""

    name, ss_flags, poll_s = "mitmdump", "-Hltn", 0.1

    def __init__(self, topo: Topology, workdir: Path, port: int, extra: tuple[str, ...] = ()) -> None:
        super().__init__(topo, workdir, port, f"mitmdump-{port}.log")
        self.extra = extra

    def start(self, timeout: float = 30) -> Mitmdump:
        hosts = self.workdir / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n{UPSTREAM_IP} {HOST}\n")
        argv = [
            "unshare", "--mount", "--propagation", "private",
            "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', hosts,
            MITMDUMP, "-q", "--listen-host", GW_IP, "--listen-port", self.port,
            "--set", "connection_strategy=lazy", "--set", f"confdir={self.workdir / 'mitmproxy'}",
            *self.extra,
        ]  # fmt: skip
        self._launch(argv, timeout)
        return self


def stop_all(procs: list[Any]) -> None:
    """Stop what was started, last first; one failing stop does not keep the others running."""
    for proc in reversed(procs):
        with contextlib.suppress(Exception):
            proc.stop()


@contextlib.contextmanager
def fake_internet(workdir: Path, **fakenet: Any) -> Iterator[tuple[Topology, FakeNet, FakeCA, list[Any]]]:
    """The e2e topology (sbx ─ gw ─ net namespaces), a test CA in workdir/ca, fakenet in the `net` namespace
    (`fakenet`: FakeNet's options) and a list for what the caller starts (anything with a stop() method). On the way
    out, also on an error or a KeyboardInterrupt: what is in the list is stopped, last first, then fakenet, then
    the namespaces are deleted."""
    topo = Topology()
    net: FakeNet | None = None
    procs: list[Any] = []
    try:
        topo.create()
        ca = make_fake_ca(workdir / "ca")
        net = FakeNet(ca.leaf_cert, ca.leaf_key, **fakenet).start(topo, workdir / "fakenet")
        yield topo, net, ca, procs
    finally:
        stop_all(procs)
        if net is not None:
            with contextlib.suppress(Exception):
                net.stop()
        topo.destroy()


# ------------------------------------------------------------------------------------------------ main


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The script's own options, then --output."""
    parser.add_argument("--output", type=Path, help="also write the markdown report here")
    return parser.parse_args(argv)


def interrupt_on_sigterm() -> None:
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")  # so the finally blocks tear everything down

    signal.signal(signal.SIGTERM, interrupt)


def command_line(*args: str) -> str:
    """How this run was started, for the report: the interpreter (relative to the repo), `args`, the options."""
    command = shlex.join([os.path.relpath(sys.executable, REPO), *args, *sys.argv[1:]])
    return "sudo " + command if os.environ.get("SUDO_USER") else command


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def emit(text: str, output: Path | None) -> None:
    """Print the report, and write it to `output` too when given."""
    print(text)
    if output:
        output.write_text(text)
