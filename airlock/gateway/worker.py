"""One proxy worker of `airlock gateway --workers N`: mitmproxy with the airlock addon, serving the listening sockets
its supervisor bound (and keeps), in a fresh interpreter the supervisor started (`python -P -m
airlock.gateway.worker --channel FD --parent PID`; nothing secret on its command line or in its environment).

Everything else comes over the control channel (`airlock.gateway.worker_channel`), first of all `WorkerStart`: the
configuration, the policy in force (its text, parsed here and checked against the hash validated: `PolicyText`),
the `--secret` values the policy injects as the supervisor read them once (never read here), the supervisor's gateway
CA generations (this worker signs with them and never makes one: `Inspector.adopt`), this worker's share
of the connection caps, the DNS answers still alive. Then, as they happen: each DNS answer the
supervisor's DNS server gives a sandbox (sent before the reply leaves; the worker drains its channel before it
names a connection that carries no name, so an answer is never missed for being in flight), the audit log's state
(a log that cannot be written denies every request here too), the approvals desk's decisions on what this
worker's addon held for a person (`airlock.gateway.worker_approvals`), the broker's git read tokens it asked for
(`airlock.gateway.worker_git`), and the two phases of a reload (`prepare`: the
policy parsed and checked off the event loop, with the secrets it injects and the CA generations; `commit`: the one
swap, the generations adopted with it). The worker sends back its audit lines,
encoded here and written whole by the supervisor into its one file, and, when asked, its counters.

A worker never outlives its supervisor: the kernel kills it when the supervisor dies (PR_SET_PDEATHSIG), and a
closed channel makes it exit at once; either way the supervisor's sockets stop being served (fail closed)."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import gc
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airlock.audit import AuditRecord, RepeatedDecisions
from airlock.dns.answered import AnsweredAddresses
from airlock.dns.servers import system_servers
from airlock.dns.upstream import Resolver, ResolverConfig
from airlock.gateway.auditing import GatewayAudit
from airlock.gateway.capacity import ConnectionCaps
from airlock.gateway.config import GatewayConfig
from airlock.gateway.metrics import GatewayMetrics
from airlock.gateway.own_addresses import GatewayAddresses, interface_own_addresses
from airlock.gateway.proxy_runtime import ProxyProviders, ProxyRuntime
from airlock.gateway.reload import loading, release_policy
from airlock.gateway.worker_approvals import ChannelAsker
from airlock.gateway.worker_channel import JSON, PICKLED, Channel, read_message
from airlock.gateway.worker_git import ChannelGitTokens
from airlock.inspection.inspector import CAGeneration, Inspector
from airlock.inspection.secrets import SecretValues
from airlock.policy import IPAddress, LivePolicy, Policy, PolicyError, SandboxRegistry, parse_policy

log = logging.getLogger("airlock.gateway.worker")

PR_SET_PDEATHSIG = 1
FLUSH_INTERVAL = 0.1  # seconds between sends of the audit lines made meanwhile (the supervisor flushes as often)
FLUSH_LINES = 512
EXIT_ORPHANED = 3


# What stands in for GatewayConfig.policy in a worker's start message: the policy comes as text (`PolicyText`).
STAND_IN = Policy({}, "-", "<the policy in force comes as its text>")


@dataclass(frozen=True)
class PolicyText:
    """A policy as its supervisor validated it: its file's name, its text, its hash. The worker parses the text
    again (off its event loop: pickling 100,000 rules would hold the GIL ten times longer) and refuses it unless its
    hash is the one validated."""

    source: str
    text: str
    hash: str

    @classmethod
    def of(cls, policy: Policy) -> PolicyText:
        if not policy.text:
            raise PolicyError([f"{policy.source}: no text to give the proxy workers (a policy not loaded from text)"])
        return cls(policy.source, policy.text, policy.hash)

    def parse(self) -> Policy:
        """The policy; PolicyError if it does not parse, or parses to another hash."""
        policy = parse_policy(self.text, self.source)
        if policy.hash != self.hash:
            raise PolicyError([f"{self.source}: parsed as {policy.hash} here, not as the validated {self.hash}"])
        return policy


@dataclass(frozen=True)
class WorkerStart:
    """What a worker is told first."""

    config: GatewayConfig  # its `policy` is STAND_IN
    policy: PolicyText  # the policy in force when the worker starts
    secrets: dict[str, str]  # the --secret values the policy injects, as the supervisor read them
    index: int  # 0 … count-1: on each of its audit lines (`extra.worker`)
    count: int
    state_dir: str  # the supervisor's; this worker's mitmproxy keeps its own files in <state>/workers/<index>
    listeners: dict[str, int]  # mitmproxy mode spec → the descriptor (inherited) of the supervisor's socket
    caps: ConnectionCaps  # this worker's share of the caps (airlock/gateway/workers.py)
    answers: list[tuple[str, str, IPAddress, float]]  # AnsweredAddresses.entries() when the worker started
    audit_failure: str | None  # why the audit log cannot be written now (None: it can)
    cas: list[CAGeneration]  # the supervisor's gateway CA generations (a worker never makes one)


@dataclass(frozen=True)
class Prepare:
    """Phase 1 of a reload, as the supervisor sends it: the policy's text, the values of the secrets it injects and
    the gateway CA generations, the one it may have made for it included."""

    generation: int
    policy: PolicyText
    secrets: dict[str, str]
    cas: list[CAGeneration]


class ChannelAudit:
    """The worker's audit sink: each line encoded here, stamped with the worker's index, sent to the supervisor
    in batches (every FLUSH_INTERVAL, or FLUSH_LINES lines); `failure` is the supervisor's log's."""

    def __init__(self, channel: Channel, index: int, failure: str | None) -> None:
        self.channel, self.index, self.failure = channel, index, failure
        self._pending: list[str] = []

    def emit(self, record: AuditRecord | RepeatedDecisions) -> None:
        if isinstance(record, AuditRecord):
            record.extra["worker"] = self.index
        self._pending.append(record.to_json())
        if len(self._pending) >= FLUSH_LINES:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self.channel.send("audit", "\n".join(self._pending))
            self._pending.clear()


class DrainedAnswers(AnsweredAddresses):
    """The DNS answers the supervisor sent, the channel drained before each look-up: an answer sent before the
    sandbox got its reply is known before its connection is named."""

    def __init__(self, channel: Channel) -> None:
        super().__init__()
        self.channel = channel

    def names(self, sandbox: str, address: IPAddress, now: float) -> list[str]:
        self.channel.drain()
        return super().names(sandbox, address, now)


class Worker:
    def __init__(self, start: WorkerStart, policy: Policy, sock: socket.socket) -> None:
        """`policy`: `start.policy` parsed."""
        self.start, config = start, dataclasses.replace(start.config, policy=policy)
        # The supervisor's messages come pickled, this worker's go as JSON (airlock/gateway/worker_channel.py).
        self.channel = Channel(sock, self._receive, self._orphaned, sends=JSON, receives=PICKLED)
        self.metrics = GatewayMetrics()
        servers = config.upstream_dns or system_servers()
        resolver = Resolver(ResolverConfig(servers, min_ttl=config.dns_min_ttl), timed=self.metrics.resolved)
        self.audit = ChannelAudit(self.channel, start.index, start.audit_failure)
        own = GatewayAddresses(interface_own_addresses() | {ipaddress.ip_address(config.listen)})
        self.live = LivePolicy(policy, SandboxRegistry(config.sandboxes), own)
        self.auditing = GatewayAudit(self.audit.emit, config.sandboxes, None, self.metrics.observe, self.live)
        state = Path(start.state_dir) / "workers" / str(start.index)
        state.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.inspector = Inspector(state, SecretValues(start.secrets))
        self.inspector.adopt(start.cas)
        if problems := self.inspector.unsigned(policy):  # the supervisor made none for it: nothing would verify
            raise PolicyError(problems)
        self.answered = DrainedAnswers(self.channel)
        for sandbox, name, address, left in start.answers:
            self.answered.record(sandbox, name, [address], left - self.answered.grace, time.monotonic())
        audit_failure = lambda: self.audit.failure  # noqa: E731
        # What a profile holds for a person is held by the supervisor's desk (airlock/gateway/worker_approvals.py).
        self.asker = ChannelAsker(self.channel)
        self.git_tokens = ChannelGitTokens(self.channel)  # the supervisor's broker mints them (worker_git.py)
        providers = ProxyProviders(
            self.live, resolver, self.auditing.emit, audit_failure, self.metrics, self.asker, self.inspector,
            self.answered,
        )  # fmt: skip
        self.proxy = ProxyRuntime(config, start.caps, state, providers)
        self._prepared: dict[int, tuple[Policy, list[CAGeneration]]] = {}  # by reload generation
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._done: asyncio.Event | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._done = done = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, done.set)
        self.channel.attach(loop)
        listeners = {spec: socket.socket(fileno=fd) for spec, fd in self.start.listeners.items()}
        self.proxy.take(listeners)
        await self.proxy.serve(self.git_tokens)
        gc.freeze()  # as the gateway does once it serves (airlock/gateway/core.py)
        self.channel.send("ready", os.getpid())
        flusher = asyncio.create_task(self._flush())
        try:
            await done.wait()
        finally:
            self._stopping = True
            flusher.cancel()
            self.proxy.flush_refusals()
            await self.proxy.stop()
            self.audit.flush()
            self.channel.send("stopped", os.getpid())

    async def _flush(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL)
            self.audit.flush()

    def _receive(self, kind: str, body: Any) -> None:
        if kind == "answer":
            sandbox, name, addresses, ttl, now = body
            self.answered.record(sandbox, name, addresses, ttl, now)
        elif kind == "approval":
            self.asker.answered(body)
        elif kind == "git_token":
            self.git_tokens.answered(body)
        elif kind == "audit_failure":
            self.audit.failure = body
        elif kind == "ask":
            ask, what, payload = body
            self._task(self._answer(ask, what, payload))
        elif kind == "stop" and self._done is not None:
            self._done.set()

    def _task(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, ask: int, what: str, payload: Any) -> None:
        try:
            result: object = await self._answered(what, payload)
        except Exception as e:  # told to the supervisor, which refuses the reload (or drops the snapshot)
            result = {"error": f"{type(e).__name__}: {e}"}
        self.channel.send("reply", (ask, result))

    async def _answered(self, what: str, payload: Any) -> object:
        if what == "prepare":
            return await self._prepare(payload)
        if what == "commit":
            return await self._commit(payload)
        if what == "abort":
            self._prepared.pop(payload, None)
            return None
        if what == "snapshot":
            return self.snapshot()
        if what == "close_denied":  # --close-denied-on-reload, once every worker has committed the reload
            return self.proxy.close_denied_tunnels()
        raise ValueError(f"unknown request {what!r}")

    async def _prepare(self, prepare: Prepare) -> list[str]:
        """Phase 1 of a reload: the policy parsed off the event loop and checked; the problems (none: ready). The
        secrets it brings are kept at once (none is used before a policy in force asks for it); the CA generations
        are checked against, but adopted only at the commit: an aborted reload's generation, which the supervisor
        never held nor published, is never signed with here."""
        try:
            with loading():
                policy = await asyncio.to_thread(prepare.policy.parse)
        except PolicyError as e:
            return e.errors
        self.inspector.secrets.update(prepare.secrets)
        pending = self.inspector.loaded(prepare.cas)
        problems = self.live.refusals(policy) + self.inspector.problems(policy)
        problems += self.inspector.unsigned(policy, pending)
        if not problems:
            self._prepared[prepare.generation] = (policy, prepare.cas)
        return problems

    async def _commit(self, generation: int) -> str | None:
        """Phase 2: the prepared policy put in force in one swap, with the CA generations it came with (the
        supervisor has held and published them by now); the hash in force, None if it was not prepared."""
        prepared = self._prepared.pop(generation, None)
        if prepared is None:
            return None
        policy, cas = prepared
        self.inspector.adopt(cas)
        if (shared := self.proxy.shared) is not None:
            shared.inject(self.inspector.injected(policy))
        replaced: list[Policy | None] = [self.live.current.policy]
        self.live.replace(policy)
        in_force = policy.hash
        del policy
        with loading():
            await asyncio.to_thread(release_policy, replaced)
        return in_force

    def snapshot(self) -> dict[str, object]:
        """What the supervisor adds up for /metrics and /v1/status."""
        counts = {which: dict(self.proxy.counts(which)) for which in ("tunnels", "connections", "upstreams")}
        return {
            "pid": os.getpid(),
            "policy_hash": self.live.current.policy.hash,
            "ca_generations": [ca.cert_path.stem for ca in self.inspector.generations],  # what it signs with
            "counts": counts,
            "decisions": self.auditing.counters(),
            # JSON has no tuple keys: each family as [[label values, value], ...]
            "metrics": [[[list(key), value] for key, value in family.items()] for family in self.metrics.snapshot()],
        }

    def _orphaned(self) -> None:
        """The channel closed: the supervisor is gone (or stopping us): nothing here may serve on."""
        if self._stopping:
            return
        print(f"airlock worker {self.start.index}: the supervisor is gone: stopping now", file=sys.stderr, flush=True)
        os._exit(EXIT_ORPHANED)


def die_with_parent(parent: int) -> None:
    """The kernel kills this process when its parent dies; if the parent is gone already, exit now."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        os._exit(EXIT_ORPHANED)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m airlock.gateway.worker")
    parser.add_argument("--channel", type=int, required=True, help="the control channel's descriptor")
    parser.add_argument("--parent", type=int, required=True, help="the supervisor's pid")
    parser.add_argument("--index", type=int, required=True, help="which worker (for its log lines)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    die_with_parent(args.parent)
    # The terminal's ^C, SIGHUP (a reload) and SIGUSR1 (reopen the audit file) are the supervisor's to act on: sent
    # to the whole process group, they must not end a worker.
    for ignored in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(ignored, signal.SIG_IGN)
    logging.basicConfig(format=f"airlock worker {args.index}: %(message)s", level=logging.WARNING)
    logging.getLogger("airlock").setLevel(logging.INFO)
    sock = socket.socket(fileno=args.channel)
    try:
        kind, start = read_message(sock)
    except EOFError:
        return EXIT_ORPHANED
    if kind != "start" or not isinstance(start, WorkerStart):
        print(f"airlock worker {args.index}: expected the start message, got {kind!r}", file=sys.stderr)
        return 2
    try:
        worker = Worker(start, start.policy.parse(), sock)
    except PolicyError as e:
        print(f"airlock worker {args.index}: " + "; ".join(e.errors), file=sys.stderr)
        return 2
    asyncio.run(worker.run())
    return 0


if __name__ == "__main__":
    # Run as the module the supervisor's messages name (airlock.gateway.worker), not as a second copy of it.
    from airlock.gateway import worker

    sys.exit(worker.main())
