"""Start-up: how long `airlock --help` and `airlock run -- true` take, next to the interpreter's own start.

    sudo .venv/bin/python -P bench/startup.py [--runs 15] [--baseline OTHER/.venv/bin/python] [--output FILE]

Each command runs `--runs` times, interleaved (`python -c pass`, `airlock --help`, the import of what `airlock
run` loads, `airlock run -- true`, then again), so that drift hits every row alike; the report gives the median
and the 90th percentile of the wall time, the median CPU time of the command and everything it started (user +
system, from the reaped children's rusage: less sensitive than wall time to what else the machine runs), and the
median as a ratio to `python -c pass`. With `--baseline`, the same airlock rows are measured, in the same rounds,
for the airlock of another environment (an older checkout's venv, say): before and after in one run, on one load.

The warm-up writes the .pyc files (PYTHONDONTWRITEBYTECODE is dropped for it), as an installed airlock has them:
else every run would compile airlock's own modules again.

`airlock run -- true` needs root and builds a sandbox (namespace, veth, nftables fence, embedded gateway,
watchdog): it runs inside the gateway namespace of the end-to-end topology (airlock/verify/topology.py), never in the
host's network, with `--upstream-dns` pointing into the (empty) fake internet — `true` asks nothing — from a
scratch working directory that is no git repository. The interpreter rows run in that namespace too, so every row
pays `ip netns exec` alike. The namespaces are deleted at the end, also on Ctrl-C or SIGTERM.

`ip netns exec` hides the host's cgroups, so the run row first mounts them again in its private mount namespace
(airlock/verify/hostcgroups.py), which a run on the host never does; the row "the host's cgroups mounted, then `true`"
measures that alone, and the run's verdict is on its median less that one's (shown beside it).

Targets: `airlock run -- true` under 400 ms, `airlock --help` under 60 ms, on the 2-CPU machine. Then
what the sandbox's limits (cgroup, rlimits, seccomp filter) add, step by step (bench/limits.py: < 20 ms).
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The e2e helpers, not the repo root: the root's dns/ would shadow dnspython. bench/ last: its dns.py and
# docker.py must not shadow dnspython and docker-py.
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.append(str(REPO / "bench"))

import limits  # noqa: E402

from airlock.verify.hostcgroups import with_host_cgroups  # noqa: E402
from airlock.verify.topology import DNS_SERVER, Topology  # noqa: E402

import common  # noqa: E402
from common import fmt, percentile  # noqa: E402

TARGETS_MS = {"airlock --help": 60.0, "airlock run -- true": 400.0}
RUN = "airlock run -- true"
HARNESS = "the host's cgroups mounted, then `true` (in the run row, not airlock's)"
BASELINE = " (baseline)"


def airlock_rows(python: str, suffix: str = "") -> dict[str, list[str]]:
    airlock = str(Path(python).parent / "airlock")
    return {
        f"airlock --help{suffix}": [airlock, "--help"],
        f"import what `airlock run` loads{suffix}": [python, "-c", "import airlock.cli.run"],
        # With the host's cgroups in view, as outside the test namespace: the sandbox gets its limits.
        f"{RUN}{suffix}": with_host_cgroups([airlock, "run", "--upstream-dns", DNS_SERVER, "--", "true"]),
    }


def rows(baseline: str | None = None) -> dict[str, list[str]]:
    found = {"python -c pass": [sys.executable, "-c", "pass"], HARNESS: with_host_cgroups(["true"])}
    return found | airlock_rows(sys.executable) | (airlock_rows(baseline, BASELINE) if baseline else {})


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def once(topo: Topology, argv: list[str], workdir: Path, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Wall and CPU seconds of one run of `argv` in the gateway namespace (an error if it fails)."""
    cpu0, t0 = children_cpu(), time.perf_counter()
    proc = topo.run(topo.gw, argv, timeout=120, cwd=workdir, env=env)
    wall, cpu = time.perf_counter() - t0, children_cpu() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return wall, cpu


def measure(runs: int, workdir: Path, baseline: str | None) -> dict[str, tuple[list[float], list[float]]]:
    measured = rows(baseline)
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in measured}
    writing = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with Topology() as topo:
        for argv in measured.values():  # warm the page cache and the .pyc files: not counted
            once(topo, argv, workdir, writing)
        for round_ in range(runs):
            print(f"  round {round_ + 1}/{runs}", file=sys.stderr, flush=True)
            for name, argv in measured.items():
                wall, cpu = once(topo, argv, workdir)
                samples[name][0].append(wall)
                samples[name][1].append(cpu)
    return samples


def report(samples: dict[str, tuple[list[float], list[float]]], command: str, info: dict[str, str]) -> str:
    base = statistics.median(samples["python -c pass"][0])
    harness = statistics.median(samples[HARNESS][0])
    lines = [
        "# airlock start-up", "", f"`{command}`", "", common.machine_line(info), "",
        "| command (in a network namespace, `ip netns exec` included) | median ms | p90 ms | CPU ms | ratio to `python -c pass` | target |",  # noqa: E501
        "|---|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for name, (walls, cpus) in samples.items():
        median = statistics.median(walls)
        verdict = _verdict(name.removesuffix(BASELINE), median, harness)
        p90 = percentile(sorted(walls), 0.9) or 0.0
        row = [name, fmt(median * 1000), fmt(p90 * 1000), fmt(statistics.median(cpus) * 1000)]
        lines.append(f"| {' | '.join(row)} | {median / base:.2f}x | {verdict} |")
    return "\n".join(lines) + "\n"


def _verdict(name: str, median: float, harness: float) -> str:
    """The target column: the run's is judged without the cgroup mounts of the test namespace (see the doc)."""
    target = TARGETS_MS.get(name)
    if target is None:
        return ""
    judged = median - harness if name == RUN else median
    verdict = f"< {target:.0f} ms: {'met' if judged * 1000 < target else 'NOT met'}"
    return f"{verdict} ({fmt(judged * 1000)} ms without the mounts)" if name == RUN else verdict


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--runs", type=int, default=15, help="measured runs of each command (default 15)")
    parser.add_argument("--baseline", metavar="PYTHON", help="also measure the airlock of this environment's python")
    args = common.parse_args(parser, argv)
    if args.baseline and not (Path(args.baseline).parent / "airlock").is_file():
        parser.error(f"--baseline {args.baseline}: no airlock beside it")
    if not 3 <= args.runs <= 200:
        parser.error("keep --runs in 3..200")
    if os.geteuid() != 0:
        parser.error("needs root: `airlock run` builds a network namespace")
    if shutil.which("ip") is None:
        parser.error("ip not found (apt-get install -y iproute2)")
    common.interrupt_on_sigterm()
    command = common.command_line("-P", "bench/startup.py")
    info = common.machine_info(load=f"{os.getloadavg()[0]:.2f}")
    common.warn_if_loaded(float(info["load"]), "high")
    with common.scratch_dir("airlock-bench-startup-") as workdir:
        workdir.chmod(0o755)
        (workdir / "cwd").mkdir(mode=0o777)  # the sandbox's user (nobody) may write it: no note on stderr
        (workdir / "cwd").chmod(0o777)
        samples = measure(args.runs, workdir / "cwd", args.baseline)
    common.emit(report(samples, command, info) + limits.report(limits.measure(args.runs)), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
