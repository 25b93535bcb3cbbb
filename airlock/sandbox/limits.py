"""Bounds of every sandbox limit, and the checks that hold them: docker reads 0 (memory, pids, cpus) as
"unlimited", so no limit may be 0, negative, infinite or absurd. Shared by the backends and the command line."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

DAY = 24 * 3600.0
CPUS = (0.01, 1024.0)
PIDS = (1, 1_000_000)
MEMORY = (6 * 2**20, 2**40)  # docker's own minimum is 6 MiB
TIMEOUT = (0.0, 7 * DAY)  # seconds, above the lower bound
OUTPUT_LIMIT = (1, 2**30)
DEFAULT_OUTPUT_LIMIT = 10 * 1024 * 1024  # bytes of each of stdout and stderr a sandbox's output is kept to
NOFILE = (16, 1_048_576)  # the kernel's default fs.nr_open
NPROC = (1, 4_194_304)  # the kernel's largest pid_max
# Every sandbox's compute limits unless the caller names others, in both backends.
DEFAULT_CPUS = 1.0
DEFAULT_MEMORY = "512m"  # swap is never added on top: memory+swap = memory
DEFAULT_PIDS = 256
# RLIMIT_NOFILE: soft = hard, so the sandbox cannot raise it. RLIMIT_NPROC is the kernel's count of every process
# and thread of the user (all its sandboxes together, and its own processes on the host): a backstop, well above
# --pids; the pids controller is the per-sandbox limit.
DEFAULT_NOFILE = 4096
DEFAULT_NPROC = 8192
_SIZE = re.compile(r"(\d{1,16})([bkmg]?)", re.IGNORECASE)


def memory_bytes(text: str) -> int:
    """A docker memory size (`512m`, `1g`, `65536k`, `100000000`) in bytes, within MEMORY; else ValueError."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a size like 512m or 1g")
    size = int(match.group(1)) << 10 * "bkmg".index(match.group(2).lower() or "b")  # 1024 times per unit
    if not MEMORY[0] <= size <= MEMORY[1]:
        raise ValueError(f"{text!r} is outside 6m..1024g")
    return size


@dataclass(frozen=True)
class Resources:
    """A sandbox's compute limits. `required` names the ones the caller asked for: a host that cannot enforce one
    of those refuses to start; one that cannot enforce a default says so and starts."""

    cpus: float = DEFAULT_CPUS
    memory: str = DEFAULT_MEMORY
    pids: int = DEFAULT_PIDS
    nofile: int = DEFAULT_NOFILE
    nproc: int = DEFAULT_NPROC
    required: frozenset[str] = field(default_factory=frozenset)

    def problems(self) -> list[str]:
        """Why any limit is invalid (each a finite number in its bounds; there is no value that turns one off)."""
        found = [
            limit_problem("cpus", self.cpus, CPUS),
            limit_problem("pids", self.pids, PIDS),
            limit_problem("nofile", self.nofile, NOFILE),
            limit_problem("nproc", self.nproc, NPROC),
        ]
        try:
            memory_bytes(self.memory)
        except (ValueError, AttributeError) as e:
            found.append(f"memory: {e}")
        return [p for p in found if p]

    @property
    def memory_bytes(self) -> int:
        return memory_bytes(self.memory)


def rlimit_argv(resources: Resources) -> list[str]:
    """The prefix that runs a command under the sandbox's open-file and process rlimits (util-linux prlimit)."""
    nofile, nproc = resources.nofile, resources.nproc
    return ["prlimit", f"--nofile={nofile}:{nofile}", f"--nproc={nproc}:{nproc}", "--"]


def limit_problem(name: str, value: float, bounds: tuple[float, float], lowest_included: bool = True) -> str | None:
    """Why `value` is no valid limit (not a finite number within `bounds`), or None."""
    low, high = bounds
    number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if number and (low <= value if lowest_included else low < value) and value <= high:
        return None
    opening = "[" if lowest_included else "("
    return f"{name} {value!r}: must be a finite number in {opening}{_number(low)}, {_number(high)}]"


def _number(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) and not x.is_integer() else str(int(x))
