"""Two real proxy workers under a supervisor's pool, on a loopback listener (tests/unit/gateway/test_workers.py,
test_worker_inspection.py): mitmproxy and the addon in each, judging by RUNNING until a reload."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
from collections.abc import AsyncIterator
from pathlib import Path

from airlock.audit import AuditLog
from airlock.gateway.capacity import ConnectionCaps
from airlock.gateway.config import GatewayConfig
from airlock.gateway.proxy_runtime import _listen
from airlock.gateway.worker_terms import BroadcastAnswers, WorkerChannels, WorkerSettings, worker_share
from airlock.gateway.workers import WorkerPool
from airlock.inspection.inspector import Inspector
from airlock.policy import LivePolicy, Sandbox, SandboxRegistry, parse_policy

RUNNING = parse_policy("version: 1\nprofiles:\n  default:\n    allow:\n      - host: running.test\n", "running.yaml")
CAPS = ConnectionCaps(open_files=4096, total=1000, per_sandbox=400, tunnels=350, spliced=100)


@dataclasses.dataclass
class RunningPool:
    pool: WorkerPool
    live: LivePolicy
    port: int
    inspector: Inspector  # the supervisor's

    async def hashes(self) -> list[object]:
        await self.pool.refresh()
        return [status["policy_hash"] for status in self.pool.status()]


@contextlib.asynccontextmanager
async def running_pool(
    tmp_path: Path, secrets: dict[str, str] | None = None, inspector: Inspector | None = None
) -> AsyncIterator[RunningPool]:
    """Two real workers on a loopback listener, judging by RUNNING; `inspector`, the supervisor's."""
    listener = _listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    sandboxes = [Sandbox("sbx", "default", ipaddress.ip_network("127.0.0.0/8"))]
    config = GatewayConfig(
        policy=RUNNING, listen="127.0.0.1", proxy_port=port, transparent_port=0, dns_port=0, sandboxes=sandboxes,
        upstream_dns=[("127.0.0.1", 9)], audit_path=str(tmp_path / "audit.jsonl"), workers=2,
    )  # fmt: skip
    live = LivePolicy(RUNNING, SandboxRegistry(sandboxes))
    audit = AuditLog(tmp_path / "audit.jsonl")
    channels = WorkerChannels()
    settings = WorkerSettings(config, 2, worker_share(CAPS, 2), secrets or {}, str(tmp_path))
    inspector = inspector or Inspector(tmp_path, secrets or {})
    pool = WorkerPool(settings, channels, live, BroadcastAnswers(channels), audit, inspector)
    await pool.start({f"regular@{port}": listener})
    try:
        yield RunningPool(pool, live, port, inspector)
    finally:
        await pool.stop()
        audit.close()
        listener.close()
