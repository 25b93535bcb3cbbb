"""Bounds of every sandbox limit, and the checks that hold them: docker reads 0 (memory, pids, cpus) as
"unlimited", so no limit may be 0, negative, infinite or absurd. Shared by the backends and the command line."""

from __future__ import annotations

import math
import re

DAY = 24 * 3600.0
CPUS = (0.01, 1024.0)
PIDS = (1, 1_000_000)
MEMORY = (6 * 2**20, 2**40)  # docker's own minimum is 6 MiB
TIMEOUT = (0.0, 7 * DAY)  # seconds, above the lower bound
OUTPUT_LIMIT = (1, 2**30)
DEFAULT_OUTPUT_LIMIT = 10 * 1024 * 1024  # bytes of each of stdout and stderr a sandbox's output is kept to
_SIZE = re.compile(r"(\d{1,16})([bkmg]?)", re.IGNORECASE)


def memory_bytes(text: str) -> int:
    """A docker memory size (`512m`, `1g`, `65536k`, `100000000`) in bytes, within MEMORY; else ValueError."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a size like 512m or 1g")
    size = int(match.group(1)) * 1024 ** "bkmg".index(match.group(2).lower() or "b")
    if not MEMORY[0] <= size <= MEMORY[1]:
        raise ValueError(f"{text!r} is outside 6m..1024g")
    return size


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
