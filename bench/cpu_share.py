"""Do this machine's CPUs slow each other? The same Python work timed alone on one CPU, then with a twin busy on
the other, interleaved.

    .venv/bin/python bench/cpu_share.py [--rounds 5] [--output F]

Two kinds of work, each in a process pinned to its CPU, timed by its own CPU time (time.process_time: waiting for a
CPU does not count): a tight loop (registers and the first cache level), and JSON-encoding objects picked at random
from some 64 MiB of them (the shared cache and memory). If two vCPUs were halves of one core, or shared a cache or
memory bus the work depends on, each would cost more CPU time with its twin busy: a ratio above 1. bench/workers.py
and bench/peers.py find a second proxy worker costing more CPU per request; a ratio of 1.00 here says that is not
the CPUs themselves. Nothing leaves the machine: no network at all.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import common


def tight() -> float:
    started, x = time.process_time(), 0
    for i in range(6_000_000):
        x += i * i % 7
    return time.process_time() - started


def walk() -> float:
    pick = random.Random(1)
    table = [{"k": i, "v": str(i) * 4} for i in range(400_000)]  # some 64 MiB of objects
    started = time.process_time()
    for _ in range(400_000):
        json.dumps(table[pick.randrange(len(table))])
    return time.process_time() - started


WORK = {"tight loop": tight, "64 MiB walk": walk}


def pinned(kind: str, cpu: int, results: multiprocessing.Queue[float]) -> None:
    os.sched_setaffinity(0, {cpu})
    results.put(WORK[kind]())


def together(kind: str, cpus: list[int]) -> list[float]:
    results: multiprocessing.Queue[float] = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=pinned, args=(kind, cpu, results)) for cpu in cpus]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    return [results.get() for _ in procs]


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each alone on CPU 0, on CPU 1, then both")
    args = common.parse_args(parser, argv)
    if len(os.sched_getaffinity(0)) < 2:
        parser.error("needs two CPUs")
    cpus = sorted(os.sched_getaffinity(0))[:2]
    lines = ["# CPUs slowing each other", "", common.machine_line(common.machine_info()), "",
             "| work | CPU s alone | CPU s with a twin on the other CPU | ratio |", "|---|---:|---:|---:|"]  # fmt: skip
    for kind in WORK:
        alone: list[float] = []
        both: list[float] = []
        for _ in range(args.rounds):
            alone += together(kind, cpus[:1]) + together(kind, cpus[1:])
            both += together(kind, cpus)
        a, b = statistics.median(alone), statistics.median(both)
        lines.append(f"| {kind} | {a:.3f} | {b:.3f} | {b / a:.2f}x |")
    common.emit("\n".join(lines) + "\n", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
