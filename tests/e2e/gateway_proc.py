"""The gateway under test, as a real `airlock gateway` process inside the topology's gateway namespace."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from airlock.gateway import Gateway
from airlock.gateway.config import GatewayConfig
from airlock.policy import Sandbox, load_policy
from airlock.verify.topology import DNS_SERVER, GW_IP, SBX_IP, Topology

AIRLOCK = str(Path(sys.executable).parent / "airlock")
AUDIT_SCHEMA = Draft202012Validator(
    json.loads((Path(__file__).resolve().parents[2] / "docs" / "audit-record.schema.json").read_text(encoding="utf-8"))
)
POLICIES = Path(__file__).parent / "policies"
E2E_POLICY = POLICIES / "e2e.yaml"
PROXY = (GW_IP, 3128)


class AdminConnection(http.client.HTTPConnection):
    """HTTP to a gateway's admin listener, its unix socket (path-based: reachable from any namespace)."""

    def __init__(self, path: Path, timeout: float = 10) -> None:
        super().__init__("airlock-admin", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.path))


class GatewayProcess:
    def __init__(
        self,
        topology: Topology,
        workdir: Path,
        policy: Path = E2E_POLICY,
        extra: tuple[str, ...] = (),
        upstream_dns: str = DNS_SERVER,
        nofile: tuple[int, int] | None = None,
        audit_path: Path | None = None,
        verbose: bool = False,
        airlock: str = AIRLOCK,
    ):
        self.topology = topology
        self.upstream_dns = upstream_dns
        self.workdir = workdir
        self.policy = policy
        self.extra = extra
        self.nofile = nofile  # (soft, hard) RLIMIT_NOFILE to start the gateway with; None: inherited
        self.audit_path = audit_path or workdir / "audit.jsonl"
        self.verbose = verbose  # -v: its log has mitmproxy's INFO lines too
        self.airlock = airlock  # the executable: another checkout's, for a benchmark's before and after
        self.log_path = workdir / "gateway.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        limit = ["prlimit", f"--nofile={self.nofile[0]}:{self.nofile[1]}", "--"] if self.nofile else []
        verbose = ["-v"] if self.verbose else []
        return [
            *limit, self.airlock, *verbose, "gateway", "--policy", str(self.policy), "--listen", GW_IP,
            "--upstream-dns", self.upstream_dns, "--state-dir", str(self.workdir / "state"),
            "--audit", str(self.audit_path), "--sandbox", f"sbx={SBX_IP}/32",
            *self.extra,
        ]  # fmt: skip

    def start(self, timeout: float = 30, poll: float = 0.05) -> GatewayProcess:
        self.audit_path.unlink(missing_ok=True)
        log = self.log_path.open("wb")
        self.proc = self.topology.popen(self.topology.gw, self.argv(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "proxy on" in self.log():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(poll)
        raise RuntimeError(f"gateway did not start in {timeout}s:\n{self.log()}")

    def workers(self) -> int:
        """How many proxy workers it runs, as its start line says ("(N workers)"; none said: one process)."""
        found = re.search(r"proxy on .*\((\d+) workers\)", self.log())
        return int(found.group(1)) if found else 1

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int | None:
        """Stop the gateway; then every line it audited must match docs/audit-record.schema.json (so every e2e
        test that runs a gateway checks the published schema against what really gets written)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"gateway ignored signal {sig} for {timeout}s") from None
        assert_audit_schema(self.audit())
        return code

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def audit(self) -> list[dict[str, Any]]:
        if not self.audit_path.exists():
            return []
        return [json.loads(line) for line in self.audit_path.read_text().splitlines() if line.strip()]

    def audit_mark(self, settle: float = 0.3) -> int:
        """How many lines the audit log holds once the lines in flight are in: with proxy workers, each sends its
        lines to the gateway every 100 ms, so a line of an earlier request may still come after this moment's last
        one; the count is taken when it has not changed for `settle` seconds."""
        count = len(self.audit())
        if self.workers() == 1:
            return count
        steady_since = time.monotonic()
        while time.monotonic() - steady_since < settle:
            time.sleep(0.05)
            if (now := len(self.audit())) != count:
                count, steady_since = now, time.monotonic()
        return count

    def audit_for(
        self, request_id: str | None = None, host: str | None = None, wait: float = 3, kind: str | None = None
    ) -> list[dict]:
        """Audit records matching the request id, host and kind; waits briefly since lines are written every
        100 ms and tunnels are logged at close."""
        deadline = time.monotonic() + wait
        while True:
            found = [
                r for r in self.audit()
                if (request_id is None or r["request_id"] == request_id) and (host is None or r["host"] == host)
                and (kind is None or r["kind"] == kind)
            ]  # fmt: skip
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


def assert_audit_schema(records: list[dict[str, Any]]) -> None:
    """Every record matches the published audit schema."""
    problems = [
        f"{record}: {'/'.join(map(str, error.absolute_path))}: {error.message}"
        for record in records
        for error in AUDIT_SCHEMA.iter_errors(record)
    ]
    assert not problems, "audit lines outside docs/audit-record.schema.json:\n" + "\n".join(problems[:10])


def e2e_gateway_config(state: Path) -> GatewayConfig:
    """The Python API's config of a gateway like the shared one: the e2e policy, the one sandbox, its defaults."""
    return GatewayConfig(
        policy=load_policy(E2E_POLICY),
        listen=GW_IP,
        sandboxes=[Sandbox("sbx", "default", ipaddress.ip_network(f"{SBX_IP}/32"))],
        upstream_dns=[(DNS_SERVER, 53)],
        audit_path=str(state / "audit.jsonl"),
    )


@contextlib.contextmanager
def gateway_in_thread(topology: Topology, config: GatewayConfig) -> Iterator[Gateway]:
    """A Gateway object (the Python API, with GatewayConfig's defaults) on its own loop in a thread that joined
    the gateway namespace."""
    ready, stop = threading.Event(), threading.Event()
    box: dict[str, object] = {}

    async def serve() -> None:
        gateway = Gateway(config)
        await gateway.start()
        box["gateway"] = gateway
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await gateway.stop()

    def thread() -> None:
        fd = os.open(f"/run/netns/{topology.gw}", os.O_RDONLY)
        os.setns(fd, os.CLONE_NEWNET)
        os.close(fd)
        try:
            asyncio.run(serve())
        except BaseException as e:
            box["error"] = e
            ready.set()

    worker = threading.Thread(target=thread)
    worker.start()
    assert ready.wait(30) and "error" not in box, box.get("error")
    try:
        yield box["gateway"]  # type: ignore[misc]
    finally:
        stop.set()
        worker.join(30)
