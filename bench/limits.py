"""What the netns sandbox's limits add to its start: the cgroup (set up and removed), the exec chain that enters
it and sets the rlimits, the seccomp filter's compilation, and bubblewrap installing the filter. Part of
bench/startup.py's report; each step is timed on its own (median of `runs`), on the host's own cgroups (no network
is touched). The filter compiles in a thread while `launch()` builds the namespace, so its row is not on the
critical path in full; the other rows are.

Target: under 20 ms added in all."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from airlock.sandbox import seccomp
from airlock.sandbox.cgroups import SandboxCgroup, host_parents
from airlock.sandbox.limits import Resources, rlimit_argv

TARGET_MS = 20.0
BWRAP = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid", "--die-with-parent"]
COMPILE = "import time; t = time.perf_counter(); from airlock.sandbox import seccomp; seccomp.bpf_program(); "
COMPILE += "print(time.perf_counter() - t)"


def _wall(argv: list[str], **kw: object) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, **kw)  # type: ignore[call-overload]
    return time.perf_counter() - started


def _cgroup(index: int) -> tuple[float, list[str], SandboxCgroup]:
    group = SandboxCgroup(f"bench{os.getpid() % 10000}x{index}", Resources(), host_parents())
    started = time.perf_counter()
    group.create()
    return time.perf_counter() - started, group.enter_argv(), group


def measure(runs: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {
        name: []
        for name in (
            "cgroup: create, set cpu/memory/pids",
            "cgroup: remove (empty)",
            "`true` alone",
            "`true` after the cgroup entry + prlimit",
            "`bwrap ... true`",
            "`bwrap --seccomp FD ... true`",
            "seccomp: import libseccomp + compile (in a thread, beside the namespace)",
        )
    }
    fd = seccomp.program_fd()
    try:
        for index in range(runs + 1):
            created, enter, group = _cgroup(index)
            rows = [
                created,
                0.0,
                _wall(["true"]),
                _wall([*enter, *rlimit_argv(Resources()), "true"]),
                _wall([*BWRAP, "--", "true"]),
                _wall([*BWRAP, "--seccomp", str(fd), "--", "true"], pass_fds=(fd,)),
                float(subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True).stdout),
            ]
            os.lseek(fd, 0, os.SEEK_SET)
            started = time.perf_counter()
            group.remove()
            rows[1] = time.perf_counter() - started
            if index:  # the first round warms caches: not counted
                for name, value in zip(samples, rows, strict=True):
                    samples[name].append(value)
    finally:
        os.close(fd)
    return samples


def report(samples: dict[str, list[float]]) -> str:
    ms = {name: statistics.median(values) * 1000 for name, values in samples.items()}
    names = list(ms)
    chain = ms[names[3]] - ms[names[2]]
    bwrap = ms[names[5]] - ms[names[4]]
    on_path = ms[names[0]] + ms[names[1]] + chain + bwrap
    lines = ["", "## What the sandbox's limits add (median ms)", "", "| step | ms |", "|---|---:|"]
    lines += [f"| {name} | {value:.1f} |" for name, value in ms.items()]
    verdict = "met" if on_path < TARGET_MS else "NOT met"
    lines += [
        "",
        f"On the critical path: cgroup {ms[names[0]] + ms[names[1]]:.1f} + exec chain {chain:.1f} + filter install "
        f"{bwrap:.1f} = **{on_path:.1f} ms** (target < {TARGET_MS:.0f} ms: {verdict}); the filter's compilation "
        f"({ms[names[6]]:.1f} ms) runs beside the namespace's set-up.",
    ]
    return "\n".join(lines) + "\n"
