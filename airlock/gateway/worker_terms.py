"""The terms of a gateway with proxy workers (`airlock.gateway.workers`): how many `--workers auto` means, each
worker's share of the connection caps, what each worker is started with and what a reload's prepare carries (the
policy's text, the secrets it injects, the supervisor's CA generations), the DNS answers sent to every worker as they
are recorded, and the workers' counters added up (from the snapshots each sends as JSON: `Worker.snapshot`)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airlock.dns.answered import AnsweredAddresses
from airlock.gateway.capacity import ConnectionCaps
from airlock.gateway.config import GatewayConfig
from airlock.gateway.metrics import MetricsSnapshot
from airlock.gateway.worker import STAND_IN, PolicyText, Prepare, WorkerStart
from airlock.gateway.worker_channel import Channel
from airlock.inspection.inspector import CAGeneration
from airlock.policy import IPAddress, Policy

MAX_AUTO_WORKERS = 8  # `--workers auto`: the CPUs, at most this many
CGROUP_ROOT = Path("/sys/fs/cgroup")


def auto_workers() -> int:
    """`--workers auto`: the CPUs this process may use — those it may run on, and no more than its cgroup's CPU
    limit lets it keep busy (a container's or pod's `cpu.max`: a worker past it only waits its turn) — at most
    MAX_AUTO_WORKERS."""
    cpus = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit(own_cgroups(), CGROUP_ROOT)
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, min(MAX_AUTO_WORKERS, cpus))


def own_cgroups() -> str:
    """This process's /proc/self/cgroup ("" where there is none to read)."""
    try:
        return Path("/proc/self/cgroup").read_text()
    except OSError:
        return ""


def cgroup_cpu_limit(proc_cgroup: str, root: Path) -> float | None:
    """The CPUs a process's cgroups let it use (`proc_cgroup`: its /proc/PID/cgroup; `root`: where the hierarchies
    are mounted): the smallest quota/period from its cgroup up to the top, of cgroup v2's `cpu.max` (mounted at
    `root`, or at `root/unified` beside v1's) and v1's `cpu` controller; None when none sets one."""
    limits: list[float] = []
    for line in proc_cgroup.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if not controllers:
            tops = [root, root / "unified"]
        elif "cpu" in controllers.split(","):
            tops = [root / controllers]
        else:
            continue
        if ".." in Path(path).parts:  # outside this cgroup namespace's view: nothing here is its own
            continue
        for top in tops:
            folder = top / path.strip("/")
            while True:
                limits.extend(_cpu_quota(folder))
                if folder == top:
                    break
                folder = folder.parent
    return min(limits) if limits else None


def _cpu_quota(folder: Path) -> list[float]:
    """The quota/period a cgroup folder sets, of v2 (`max` for none) or v1 (-1 for none); [] where it sets none."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = (folder / "cpu.max").read_text().split()
        return [] if quota == "max" else [int(quota) / int(period)]
    with contextlib.suppress(OSError, ValueError):
        v1_quota = int((folder / "cpu.cfs_quota_us").read_text())
        v1_period = int((folder / "cpu.cfs_period_us").read_text())
        return [v1_quota / v1_period] if v1_quota > 0 else []
    return []


def worker_share(caps: ConnectionCaps, count: int) -> ConnectionCaps:
    """Each worker's share of the caps: together the workers never pass them."""
    return dataclasses.replace(
        caps,
        total=max(1, caps.total // count),
        per_sandbox=max(1, caps.per_sandbox // count),
        tunnels=max(1, caps.tunnels // count),
        spliced=max(1, caps.spliced // count) if caps.spliced else 0,
    )


@dataclass(frozen=True)
class WorkerSettings:
    """What the pool starts each worker with, besides what changes (policy, answers, audit state)."""

    config: GatewayConfig
    count: int
    caps: ConnectionCaps  # each worker's share
    secrets: Mapping[str, str]
    state_dir: str

    def start(
        self,
        index: int,
        listeners: dict[str, int],
        policy: Policy,
        answers: list[tuple[str, str, IPAddress, float]],
        audit_failure: str | None,
        cas: list[CAGeneration],
    ) -> WorkerStart:
        """Worker `index`'s start message, with `policy` (the one in force) as its text."""
        config = dataclasses.replace(self.config, policy=STAND_IN)
        return WorkerStart(
            config, PolicyText.of(policy), self.injected(policy), index, self.count, self.state_dir, listeners,
            self.caps, answers, audit_failure, cas,
        )  # fmt: skip

    def prepare(self, generation: int, policy: Policy, cas: list[CAGeneration]) -> Prepare:
        """The `prepare` of a reload to `policy`: its text, the secrets it injects, the CA generations (after the
        supervisor's `Inspector.apply`: the one made for it, if any, among them)."""
        return Prepare(generation, PolicyText.of(policy), self.injected(policy), cas)

    def injected(self, policy: Policy) -> dict[str, str]:
        """Only the secrets `policy` injects, sent over the channel alone: the broker's and the declared tools'
        never leave this process."""
        return {name: self.secrets[name] for name in policy.secret_names() if name in self.secrets}


class WorkerChannels:
    """The channels of the workers that run now, by index: what the supervisor's DNS answers go out through."""

    def __init__(self) -> None:
        self.open: dict[int, Channel] = {}

    def broadcast(self, kind: str, body: object = None) -> None:
        for channel in list(self.open.values()):
            channel.send(kind, body)


class BroadcastAnswers(AnsweredAddresses):
    """The DNS server's record of its answers (the supervisor's copy, for workers started later), each also sent to
    every worker as it is recorded: before the DNS reply leaves."""

    def __init__(self, channels: WorkerChannels) -> None:
        super().__init__()
        self.channels = channels

    def record(self, sandbox: str, name: str, addresses: Iterable[IPAddress], ttl: float, now: float) -> None:
        addresses = list(addresses)
        super().record(sandbox, name, addresses, ttl, now)
        self.channels.broadcast("answer", (sandbox, name, addresses, ttl, now))


def added_metrics(snapshots: Iterable[dict[str, Any]]) -> list[MetricsSnapshot]:
    """Each worker's metric families, their JSON made tuples again (GatewayMetrics adds them in)."""
    return [
        [
            {tuple(key): value if isinstance(value, int | float) else (value[0], value[1]) for key, value in family}
            for family in snapshot["metrics"]
        ]
        for snapshot in snapshots
    ]


def added_counts(snapshots: Iterable[dict[str, Any]], which: str) -> dict[str, int]:
    """Open `tunnels`, `connections` or `upstreams` per sandbox, over every worker."""
    total: dict[str, int] = {}
    for snapshot in snapshots:
        for sandbox, n in snapshot["counts"][which].items():
            total[sandbox] = total.get(sandbox, 0) + n
    return total


def added_decisions(snapshots: Iterable[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Audit lines the workers wrote, by kind and decision."""
    total: dict[str, dict[str, int]] = {}
    for snapshot in snapshots:
        for kind, decisions in snapshot["decisions"].items():
            for decision, n in decisions.items():
                total.setdefault(kind, {})[decision] = total.setdefault(kind, {}).get(decision, 0) + n
    return total
