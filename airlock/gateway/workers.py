"""`airlock gateway --workers N`: the supervisor's side of its N proxy workers (`airlock.gateway.worker`).

The gateway process stays what it was but for the proxy: it loads, validates and reloads the policy, runs the DNS
server, the broker, the admin listener, the approvals desk, the metrics and status endpoints, and is the one writer
of the audit file (held by its folder's descriptor, reopened on SIGUSR1). It binds the proxy's listening sockets
(and marks them for the fence) as before, and hands each worker the same ones, kept here too: a restarted worker
serves the very sockets, clients in their backlog waiting. One shared set, not a SO_REUSEPORT set per worker (whose
backlog would hold a dead worker's share until it is back); each worker accepts one connection per wake-up
(`ProxyRuntime.serve`), so a burst is spread too (docs/operations.md, bench/README.md: the balance measured).

Split between the workers: the connection caps, each worker holding its share (`worker_share` in
`airlock.gateway.worker_terms`: the cap divided by N, at least 1), so that together they never pass the cap (a
sandbox's tunnels may be refused by one worker while another has room: its 429 says it is this worker's share).
Shared: everything else, through the channel:
- DNS answers: the supervisor's DNS server records each answer (`BroadcastAnswers.record`), which sends it to every
  worker before the reply is sent; a worker drains its channel before naming a connection that has none (one whose
  channel is full gets it late: a connection it names meanwhile is judged by its address alone, failing closed);
- the policy: a reload is loaded and validated here, then in two phases: every worker parses the very text
  validated here, off its event loop, and checks that its hash is the validated one (`prepare`); a refusal (or no
  answer) from any aborts the reload for all, the running policy staying; else the supervisor swaps its own,
  every worker swaps (`commit`), and only then is the reload audited and answered. Every request line carries the
  hash of the policy that judged it;
- `--close-denied-on-reload`: once all have committed, each worker closes its tunnels the new policy denies;
- approvals: what a worker's addon holds for a person is held by the supervisor's desk, the worker's request
  released with its decision (`airlock.gateway.worker_approvals`; a malformed request stops the worker);
- the audit: lines encoded in the workers, written whole here; the audit log's failure sent to every worker;
- metrics and status: each worker's lock-free in-process counters (prometheus-client's multiprocess mode would put a
  lock and a file write on every count), asked for at each scrape and once a second, and added in;
- inspection: the supervisor makes each CA generation (a reload's before its prepare, held, written and published
  only at its swap); they and the secrets the policy injects go in each worker's `start` and `prepare`, over the
  channel only, and a worker adopts a reload's only at its commit (an aborted reload leaves no generation anywhere);
  a worker never makes a CA;
- git reads (`inject: github`): each read token asked of the supervisor's broker (`airlock.gateway.worker_git`).

A worker that dies is restarted (a warning in the log says so); only the connections it held are lost. SIGTERM stops
every worker; a worker never outlives the supervisor (`airlock.gateway.worker`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airlock.audit import AuditLog
from airlock.dns.answered import AnsweredAddresses
from airlock.gateway.errors import GatewayError
from airlock.gateway.metrics import MetricsSnapshot
from airlock.gateway.worker_approvals import ApprovalRequest, WorkerApprovals
from airlock.gateway.worker_channel import JSON, PICKLED, Channel, channel_pair
from airlock.gateway.worker_git import GitTokenRequest, WorkerGitTokens
from airlock.gateway.worker_terms import WorkerChannels, WorkerSettings, added_counts, added_decisions, added_metrics
from airlock.inspection.inspector import CAGeneration, Inspector
from airlock.policy import LivePolicy, Policy, PolicyError

if TYPE_CHECKING:
    from airlock.proxy.shared import GitTokens

log = logging.getLogger("airlock.gateway")

READY_TIMEOUT = 60.0  # seconds for a worker to serve (a fresh interpreter importing mitmproxy)
PREPARE_TIMEOUT = 60.0  # seconds for every worker to parse and check a reload (100,000 rules: about a second)
COMMIT_TIMEOUT = 10.0
SNAPSHOT_TIMEOUT = 5.0
SNAPSHOT_INTERVAL = 1.0
STOP_TIMEOUT = 10.0
RESTART_DELAYS = (0.1, 0.5, 1.0, 2.0, 5.0)  # before each restart in a row of failed ones


@dataclass
class _Worker:
    index: int
    process: asyncio.subprocess.Process
    channel: Channel
    ready: asyncio.Future[int]  # its pid, once it serves
    waiting: dict[int, asyncio.Future[Any]] = field(default_factory=dict)  # asks by id
    held: set[asyncio.Task[None]] = field(default_factory=set)  # its requests the approvals desk holds
    snapshot: dict[str, Any] | None = None


class WorkerPool:
    def __init__(
        self,
        settings: WorkerSettings,
        channels: WorkerChannels,
        live: LivePolicy,
        answered: AnsweredAddresses,
        audit: AuditLog,
        inspector: Inspector,
        approvals: WorkerApprovals | None = None,
    ) -> None:
        self.settings, self.channels, self.live, self.answered, self.audit = settings, channels, live, answered, audit
        self.inspector = inspector  # the supervisor's: its CA generations are the ones every worker signs with
        self.approvals = approvals  # the supervisor's desk, which holds what a worker's addon asks (None: denied)
        self.workers: dict[int, _Worker] = {}
        self.restarts = 0
        self._listeners: dict[str, socket.socket] = {}
        self._git = WorkerGitTokens(None)
        self._asks = itertools.count()
        self._generations = itertools.count(1)
        self._reloading = asyncio.Lock()  # a restart waits for a reload: it starts with the policy then in force
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._audit_failure: str | None = None
        self._failures: dict[int, int] = {}  # failed starts in a row, by worker index

    @property
    def count(self) -> int:
        return self.settings.count

    async def start(self, listeners: Mapping[str, socket.socket], git_tokens: GitTokens | None = None) -> None:
        """Start every worker on `listeners` (kept by the caller), asking `git_tokens` (the broker's) for the git
        read tokens they ask for; GatewayError if one does not come to serve."""
        self._listeners, self._git = dict(listeners), WorkerGitTokens(git_tokens)
        started = await asyncio.gather(*(self._start(i) for i in range(self.count)), return_exceptions=True)
        if failed := [e for e in started if isinstance(e, BaseException)]:
            raise GatewayError(f"proxy workers did not start: {failed[0]}")
        self._spawn_task(self._snapshots())

    async def _start(self, index: int) -> None:
        worker = await self._launch(index)
        try:
            await asyncio.wait_for(asyncio.shield(worker.ready), READY_TIMEOUT)
        except TimeoutError:
            worker.process.kill()
            raise GatewayError(f"proxy worker {index} did not serve within {READY_TIMEOUT:g}s") from None

    async def _launch(self, index: int) -> _Worker:
        ours, theirs = channel_pair()
        fds = {spec: sock.fileno() for spec, sock in self._listeners.items()}
        for sock in self._listeners.values():
            sock.set_inheritable(True)
        argv = [sys.executable, "-P", "-m", "airlock.gateway.worker"]
        argv += ["--channel", str(theirs.fileno()), "--parent", str(os.getpid()), "--index", str(index)]
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, pass_fds=(theirs.fileno(), *fds.values())
            )
        finally:
            theirs.close()
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[int] = loop.create_future()
        channel = Channel(
            ours, lambda kind, body: self._receive(worker, kind, body), lambda: self._lost(worker),
            sends=PICKLED, receives=JSON,  # a worker's messages are data, never anything to run
        )  # fmt: skip
        worker = _Worker(index, process, channel, ready)
        channel.attach(loop)
        answers = self.answered.entries(time.monotonic())
        cas, failure = self.inspector.exported(), self.audit.failure
        channel.send("start", self.settings.start(index, fds, self.live.current.policy, answers, failure, cas))
        self.workers[index] = worker
        self.channels.open[index] = channel  # from now on it hears every answer, after the ones in `start`
        return worker

    def _receive(self, worker: _Worker, kind: str, body: Any) -> None:
        try:
            self._received(worker, kind, body)
        except (TypeError, ValueError, KeyError) as e:  # not a message a worker sends: it is stopped (and restarted)
            log.error("proxy worker %d sent a malformed %r message (%s): stopping it", worker.index, kind, e)
            worker.process.kill()
            worker.channel.close()

    def _received(self, worker: _Worker, kind: str, body: Any) -> None:
        if kind == "audit":
            if not isinstance(body, str):
                raise TypeError("audit lines are text")
            self.audit.emit_lines(body)
        elif kind == "reply":
            ask, result = body
            waiter = worker.waiting.pop(ask, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(result)
        elif kind == "approval":
            request = ApprovalRequest.read(body)
            if self.approvals is None:
                worker.channel.send("approval", (request.ask, request.decision))
            else:
                self.approvals.hold(worker.channel, request, worker.held)
        elif kind == "git_token":  # a git read's token, asked of the broker (airlock/gateway/worker_git.py)
            self._git.hold(worker.channel, GitTokenRequest.read(body), worker.held)
        elif kind == "ready":
            if not worker.ready.done():
                worker.ready.set_result(body)
            log.info("proxy worker %d serving (pid %d)", worker.index, body)

    def _lost(self, worker: _Worker) -> None:
        """Its channel closed: the worker ended (or is ending). Restarted, unless the gateway stops."""
        self.channels.open.pop(worker.index, None)
        closed = ConnectionError(f"proxy worker {worker.index} ended")
        for waiter in worker.waiting.values():
            if not waiter.done():
                waiter.set_exception(closed)
        worker.waiting.clear()
        for task in list(worker.held):
            task.cancel()  # its requests leave the desk's entries (which stay listed until answered or timed out)
        if not worker.ready.done():
            worker.ready.set_exception(GatewayError(f"proxy worker {worker.index} ended before it served"))
            worker.ready.exception()  # seen: whoever waits on it is told
        if not self._stopping:
            self._spawn_task(self._restart(worker))

    async def _restart(self, worker: _Worker) -> None:
        """Once `worker` has ended: a new one in its place, after a delay that grows with each failed start in a
        row. A new worker that fails ends in turn, and is restarted by its own end; one that could not even be
        launched is tried again here."""
        code = await worker.process.wait()
        if self._stopping:
            return
        index, failures = worker.index, self._failures.get(worker.index, 0)
        log.warning(
            "proxy worker %d (pid %d) ended (exit %s): restarting it; only the connections it held are lost",
            index, worker.process.pid, code,
        )  # fmt: skip
        await asyncio.sleep(RESTART_DELAYS[min(failures, len(RESTART_DELAYS) - 1)])
        if self._stopping or self.workers.get(index) is not worker:
            return
        async with self._reloading:
            try:
                await self._start(index)
            except (GatewayError, OSError) as e:
                self._failures[index] = failures + 1
                log.error("proxy worker %d did not start again (%s): trying again", index, e)
                if self.workers.get(index) is worker:  # nothing was launched: no end of its own brings it back
                    self._spawn_task(self._restart(worker))
                return
        self._failures[index] = 0
        self.restarts += 1

    def _spawn_task(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def serving(self) -> list[int]:
        """The indexes of the workers that serve now."""
        return sorted(w.index for w in self.workers.values() if w.channel.open and w.ready.done())

    async def _ask(self, workers: Iterable[_Worker], what: str, payload: object, timeout: float) -> list[object]:
        """Each worker's answer, in order: an exception for one that ended or did not answer in time."""
        loop = asyncio.get_running_loop()
        waiters = []
        for worker in workers:
            ask = next(self._asks)
            waiter: asyncio.Future[Any] = loop.create_future()
            worker.waiting[ask] = waiter
            worker.channel.send("ask", (ask, what, payload))
            waiters.append(waiter)
        if not waiters:
            return []
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.wait(waiters), timeout)
        late = TimeoutError(f"no answer within {timeout:g}s")
        return [(w.exception() or w.result()) if w.done() else late for w in waiters]

    async def put_in_force(self, policy: Policy, cas: list[CAGeneration], swap: Callable[[], None]) -> None:
        """A reload in two phases: every serving worker prepares `policy` with the CA generations `cas` (the
        supervisor's, and the one it may have made for the reload, not held until `swap`), then `swap()` (the
        supervisor's own, which may refuse it) and every worker commits, adopting the generations it did not hold;
        returns once they all have. PolicyError when a worker refuses it, or does not answer (then none has it in
        force, `swap` was not called, and no worker adopted a generation of it); any failure aborts it in all."""
        async with self._reloading:
            workers = [self.workers[i] for i in self.serving()]
            # The text the supervisor validated (each worker parses it again), the CA generations and secrets.
            generation = next(self._generations)
            prepare = self.settings.prepare(generation, policy, cas)
            answers = await self._ask(workers, "prepare", prepare, PREPARE_TIMEOUT)
            problems = []
            for worker, answer in zip(workers, answers, strict=True):
                if isinstance(answer, ConnectionError):
                    continue  # it ended: restarted, after this reload, with the policy in force then
                if isinstance(answer, BaseException):
                    problems.append(f"proxy worker {worker.index}: {answer}")
                elif isinstance(answer, dict):
                    problems.append(f"proxy worker {worker.index}: {answer.get('error')}")
                elif isinstance(answer, list):
                    problems += [f"proxy worker {worker.index}: {problem}" for problem in answer]
            try:
                if problems:
                    raise PolicyError(problems)
                swap()
            except Exception:  # (a CA that could not be written too): prepared, never committed, in every worker
                await self._ask(workers, "abort", generation, COMMIT_TIMEOUT)
                raise
            committed = await self._ask(workers, "commit", generation, COMMIT_TIMEOUT)
            for worker, answer in zip(workers, committed, strict=True):
                if answer != policy.hash and worker.channel.open:
                    # It cannot be left judging by another policy: it starts again, with this one.
                    log.error("proxy worker %d did not commit the reload (%s): restarting it", worker.index, answer)
                    worker.process.kill()

    async def close_denied_tunnels(self) -> int:
        """`--close-denied-on-reload`: every serving worker closes its open tunnels the policy now in force denies
        (`ProxyRuntime.close_denied_tunnels`, as a single gateway does); how many, over all of them."""
        workers = [self.workers[i] for i in self.serving()]
        closed = 0
        for worker, answer in zip(workers, await self._ask(workers, "close_denied", None, COMMIT_TIMEOUT), strict=True):
            if isinstance(answer, int) and not isinstance(answer, bool):
                closed += answer
            elif not isinstance(answer, ConnectionError):  # (one that ended is restarted, with no tunnel open)
                # It went wrong or did not answer: its tunnels cannot be vouched for, so they end with it.
                log.error("proxy worker %d did not close its denied tunnels (%s): restarting it", worker.index, answer)
                if worker.channel.open:
                    worker.process.kill()
        return closed

    def audit_state(self, failure: str | None) -> None:
        """Tell every worker when the audit log stops (or starts again) being writable: they deny while it cannot."""
        if failure != self._audit_failure:
            self._audit_failure = failure
            self.channels.broadcast("audit_failure", failure)

    async def refresh(self) -> None:
        """Every serving worker's counters, asked now (a scrape)."""
        workers = [self.workers[i] for i in self.serving()]
        for worker, answer in zip(workers, await self._ask(workers, "snapshot", None, SNAPSHOT_TIMEOUT), strict=True):
            if isinstance(answer, dict) and "error" not in answer:
                worker.snapshot = answer

    async def _snapshots(self) -> None:
        while True:
            await asyncio.sleep(SNAPSHOT_INTERVAL)
            await self.refresh()

    def _snapshots_of(self) -> list[dict[str, Any]]:
        return [w.snapshot for i in self.serving() if (w := self.workers[i]).snapshot is not None]

    def metrics(self) -> list[MetricsSnapshot]:
        """The workers' latest metric snapshots (GatewayMetrics adds them in)."""
        return added_metrics(self._snapshots_of())

    def counts(self, which: str) -> dict[str, int]:
        """Open `tunnels`, `connections` or `upstreams` per sandbox, over every worker."""
        return added_counts(self._snapshots_of(), which)

    def decisions(self) -> dict[str, dict[str, int]]:
        """Audit lines the workers wrote, by kind and decision (added to the supervisor's own in /v1/status)."""
        return added_decisions(self._snapshots_of())

    def status(self) -> list[dict[str, object]]:
        """Each worker as /v1/status lists it."""
        return [
            {
                "index": w.index, "pid": w.process.pid, "serving": w.channel.open and w.ready.done(),
                "policy_hash": (w.snapshot or {}).get("policy_hash"),
                "ca_generations": (w.snapshot or {}).get("ca_generations", []),
                "tunnels": sum((w.snapshot or {}).get("counts", {}).get("tunnels", {}).values()),
            }
            for w in sorted(self.workers.values(), key=lambda w: w.index)
        ]  # fmt: skip

    async def stop(self) -> None:
        """Every worker told to stop (its connections end), killed if it has not within STOP_TIMEOUT."""
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        workers = list(self.workers.values())
        for worker in workers:
            worker.channel.send("stop")
        waits = [asyncio.ensure_future(w.process.wait()) for w in workers]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=STOP_TIMEOUT)
            for worker in workers:
                if worker.process.returncode is None:
                    worker.process.kill()
            if pending:
                await asyncio.wait(pending, timeout=STOP_TIMEOUT)
        for worker in workers:
            worker.channel.drain()  # its last audit lines, sent before it exited
            worker.channel.close()
