"""What every concern of the addon reads: the gateway's settings, the state of each client connection, the open
connection counts, and the one judgement of an upstream target (`ProxyState.evaluate`)."""

from __future__ import annotations

import functools
import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from mitmproxy import connection
from mitmproxy.proxy.mode_specs import TransparentMode

from airlock.audit import REFUSAL_LINES, AuditRecord, AuditThrottle
from airlock.dns.answered import AnsweredAddresses
from airlock.dns.upstream import ResolveError, Resolver
from airlock.inspection.scrub import Scrubber
from airlock.policy import (
    Decision,
    HostError,
    IPAddress,
    LivePolicy,
    ReasonCode,
    Sandbox,
    Snapshot,
    canonical_host,
    decide,
    decide_alias,
    is_ip,
    refused_addresses,
    vet,
)
from airlock.policy.held_requests import Asker

MINTED_KEPT = 64  # installation tokens the scrubber keeps looking for
KEPT_JUDGEMENT_S = 60.0  # the longest a kept-alive connection's requests reuse a judgement (a name's TTL: less)
_UNKNOWN_SANDBOX = Decision(False, "connection from an address that belongs to no sandbox", ReasonCode.UNKNOWN_SANDBOX)


class Timings(Protocol):
    """Where the proxy tells how long things took (the gateway's metrics)."""

    def decided(self, seconds: float) -> None: ...  # a target judged (ProxyState.evaluate)

    def connected(self, seconds: float) -> None: ...  # a vetted upstream connection opened

    def connect_failed(self) -> None: ...


class NoTimings:
    def decided(self, seconds: float) -> None:
        pass

    def connected(self, seconds: float) -> None:
        pass

    def connect_failed(self) -> None:
        pass


@dataclass
class GatewaySettings:
    connect_timeout: float = 10.0
    idle_timeout: float = 300.0  # a tunnel that moved no byte for this long is closed (mitmproxy's tcp_timeout)
    # A flood of idle connections must not starve the gateway. The gateway derives these from its open-file
    # limit (airlock/gateway/capacity.py): each proxied connection holds two descriptors, the sandbox's and the
    # upstream.
    max_tunnels_per_sandbox: int = 3584
    max_connections_per_sandbox: int = 4096  # client connections; upstream connections are capped alike
    max_connections: int = 65536  # client connections of all sandboxes together; upstream ones alike
    max_spliced: int = 1024  # tunnels relayed in the kernel at once (6 more descriptors each); others by mitmproxy
    # Said after each cap's refusal: with proxy workers, the caps above are this worker's share of the gateway's.
    cap_scope: str = ""
    # Refusals of one kind audited one by one per interval before the rest go into a summary line (AuditThrottle);
    # with proxy workers, this worker's share, so that N workers write no more lines than one process.
    refusal_lines: int = REFUSAL_LINES
    # Why the audit log cannot be written, or None: while it cannot, every new request is denied (fail closed).
    audit_failure: Callable[[], str | None] = field(default=lambda: None)
    timings: Timings = field(default_factory=NoTimings)


@dataclass
class Credentials:
    """What the proxy holds for injection: the secrets' values (by name), the GitHub tokens it minted for git reads
    (newest last, a bounded few), and the scrubber of their every form."""

    values: Mapping[str, str] = field(default_factory=dict)
    minted: tuple[str, ...] = ()
    scrubber: Scrubber | None = None

    @classmethod
    def of(cls, values: Mapping[str, str], minted: tuple[str, ...] = ()) -> Credentials:
        held = [*values.values(), *minted]
        return cls(dict(values), minted, Scrubber(held) if held else None)

    def scrubbed(self, text: str) -> str:
        """`text` (an error's words) with every form of every credential held masked."""
        if self.scrubber is None:
            return text
        return self.scrubber.scrub(text.encode()).decode(errors="replace")

    def holding(self, token: str) -> Credentials:
        """These credentials and one more minted token (an installation token lives an hour: the oldest go)."""
        if token in self.minted:
            return self
        return Credentials.of(self.values, (*self.minted, token)[-MINTED_KEPT:])


class ScrubbedLog(logging.Filter):
    """mitmproxy's lines about each connection, which quote what an upstream sent (a websocket ping's payload, an
    answer it could not parse), with every credential the proxy holds (`credentials()`, now) masked."""

    def __init__(self, credentials: Callable[[], Credentials]) -> None:
        super().__init__()
        self.credentials = credentials

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = self.credentials().scrubbed(record.getMessage()), None
        return True


class GitTokens(Protocol):
    """Where the proxy gets a read token for one repository a sandbox's grants name (the broker's)."""

    async def token(self, sandbox: str, repo: str, permissions: Mapping[str, str]) -> str | None: ...


@dataclass
class ClientState:
    """What the gateway knows about one sandbox client connection."""

    sandbox: Sandbox | None
    tunnel: AuditRecord | None = None  # the CONNECT decision, once the sandbox asked for a tunnel
    tunnel_decision: Decision | None = None
    denied: str | None = None  # set once anything denied this connection: no upstream may be opened
    # Judgements the early hooks vetted, by the (host, port) mitmproxy will ask to connect to: the connection
    # goes to exactly the address that was checked, and a rebinding name gets no second answer.
    vetted: dict[tuple[str, int], TargetJudgement] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    counted: bool = False  # holds one of the sandbox's connection slots
    # Transparent mode: the address and port the sandbox dialled (a hint, never a connect target), once judged.
    original: tuple[str, int] | None = None
    inspected: bool = False  # the tunnel's TLS is terminated here: its rule says `inspect: true`
    judged: Kept | None = None  # the last plain-HTTP request's allowed judgement, for the next on this connection


@dataclass(frozen=True, slots=True)
class TargetJudgement:
    decision: Decision
    host: str  # canonical when the host was valid
    resolved: list[str] = field(default_factory=list)
    chosen_ip: str | None = None

    def fill(self, record: AuditRecord) -> None:
        record.host, record.resolved, record.chosen_ip = self.host, self.resolved, self.chosen_ip
        record.decision = self.decision.verdict
        record.reason, record.code, record.hint = self.decision.reason, self.decision.code, self.decision.hint
        record.decided_by(self.decision.rule)


@dataclass(frozen=True, slots=True)
class Kept:
    """An allowed judgement of `target` under the policy snapshot in force then, good until `until` (monotonic)
    while none of the addresses it vetted has become the gateway's own since (the snapshot asks that live)."""

    target: tuple[str, int]
    snapshot: Snapshot
    until: float
    judgement: TargetJudgement
    addresses: tuple[IPAddress, ...]

    def holds(self, target: tuple[str, int], snapshot: Snapshot, now: float) -> bool:
        return (
            target == self.target
            and snapshot is self.snapshot
            and now < self.until
            and not snapshot.own.among(self.addresses)
        )


def _timed(evaluate: Callable[..., Awaitable[TargetJudgement]]) -> Callable[..., Awaitable[TargetJudgement]]:
    """Each judgement's duration, told to the settings' timings."""

    @functools.wraps(evaluate)
    async def timed(self: ProxyState, *args: Any, **kwargs: Any) -> TargetJudgement:
        started = time.perf_counter()
        try:
            return await evaluate(self, *args, **kwargs)
        finally:
            self.settings.timings.decided(time.perf_counter() - started)

    return timed


class ProxyState:
    """State all hook classes read: the live policy (policy, sandbox registry, the gateway's own addresses) and
    per-client connection state."""

    def __init__(
        self,
        live: LivePolicy,
        resolver: Resolver,
        emit: Callable[[AuditRecord], None],
        settings: GatewaySettings,
        answered: AnsweredAddresses | None = None,
        approvals: Asker | None = None,
        git_tokens: GitTokens | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.live = live
        self.resolver = resolver
        self.answered = answered if answered is not None else AnsweredAddresses()  # what the DNS told each sandbox
        self.emit = emit
        self.settings = settings
        self.clients: dict[str, ClientState] = {}
        self.tunnels: Counter[str] = Counter()
        self.connections: Counter[str] = Counter()  # open client connections per sandbox
        self.open_connections = 0  # of all sandboxes
        self.upstreams: Counter[str] = Counter()  # open upstream connections per sandbox
        self.upstream_of: dict[str, str] = {}  # server connection id → the sandbox whose upstream slot it holds
        # refusals that come in floods: a few lines each, then a summary
        self.refusals = AuditThrottle(emit, burst=settings.refusal_lines)
        self.resolved: dict[str, list[str]] = {}  # server connection id → addresses the name resolved to
        self.approvals = approvals  # where profiles with `on_unlisted: ask` hold what no rule lists
        self.credentials = credentials or Credentials()  # the secrets inspected rules inject, and minted tokens
        self.git_tokens = git_tokens  # the broker's, when one runs

    def inject(self, values: Mapping[str, str]) -> None:
        """The secrets the policy now in force injects (the minted tokens are kept)."""
        self.credentials = Credentials.of(values, self.credentials.minted)

    def hold(self, token: str) -> None:
        """One more token minted for a git read: scrubbed, as every credential held, from what comes back."""
        self.credentials = self.credentials.holding(token)

    def client(self, client: connection.Client) -> ClientState:
        state = self.clients.get(client.id)
        if state is None:
            state = self.clients[client.id] = ClientState(self.live.current.registry.identify(client.peername[0]))
        return state

    def refuse(self, record: AuditRecord) -> None:
        """Audit a refusal that may come in a flood (unknown network, over a cap): a few lines, then a summary."""
        if self.refusals.admit(record.kind, record.sandbox, record.reason, record.code, record.client):
            self.emit(record)

    def connection_refusal(self, sandbox: str) -> str | None:
        """Why one more client connection of this sandbox must be refused, if it must."""
        settings = self.settings
        if self.connections[sandbox] >= settings.max_connections_per_sandbox:
            return f"sandbox already has {settings.max_connections_per_sandbox} connections open{settings.cap_scope}"
        if self.open_connections >= settings.max_connections:
            return f"the gateway already has {settings.max_connections} connections open{settings.cap_scope}"
        return None

    def take_upstream(self, server_id: str, sandbox: str) -> str | None:
        """Hold an upstream slot for this server connection; or why none is left. A client connection may open
        several upstream connections (one per host it sends plain HTTP to): they are capped like the clients."""
        settings = self.settings
        if self.upstreams[sandbox] >= settings.max_connections_per_sandbox:
            limit = settings.max_connections_per_sandbox
            return f"sandbox already has {limit} upstream connections open{settings.cap_scope}"
        if len(self.upstream_of) >= settings.max_connections:
            return f"the gateway already has {settings.max_connections} upstream connections open{settings.cap_scope}"
        self.upstream_of[server_id] = sandbox
        self.upstreams[sandbox] += 1
        return None

    def release_upstream(self, server_id: str) -> None:
        sandbox = self.upstream_of.pop(server_id, None)
        if sandbox is not None:
            self.upstreams[sandbox] -= 1

    @_timed
    async def evaluate(
        self, sandbox: Sandbox | None, raw_host: str, port: int, kind: str = "connect", client: str = "-"
    ) -> TargetJudgement:
        """The whole judgement of one upstream target: canonicalize, decide (or ask a person), resolve, vet,
        choose; under one snapshot of the live policy, however long the resolution or the person takes. `kind` and
        `client` tell the person who asks for what."""
        judgement, _ = await self._evaluate(sandbox, raw_host, port, kind, client)
        return judgement

    @_timed
    async def judge_request(self, state: ClientState, raw_host: str, port: int, client: str) -> TargetJudgement:
        """`evaluate` of a plain-HTTP request's target: on a kept-alive connection, the previous request's allowed
        judgement of the same target holds while the policy in force is the one it was made under (a reload judges
        again), the name's resolution lasts (its TTL, at most KEPT_JUDGEMENT_S) and the audit log can be written;
        a person's answer (`ask`) is never kept."""
        target, snapshot = (raw_host, port), self.live.current
        kept = state.judged
        if kept is not None and kept.holds(target, snapshot, time.monotonic()) and not self.settings.audit_failure():
            return kept.judgement
        judgement, state.judged = await self._evaluate(state.sandbox, raw_host, port, "http", client)
        return judgement

    async def _evaluate(
        self, sandbox: Sandbox | None, raw_host: str, port: int, kind: str, client: str
    ) -> tuple[TargetJudgement, Kept | None]:
        """The judgement, and how it may be kept (None: not at all)."""
        if sandbox is None:
            return TargetJudgement(_UNKNOWN_SANDBOX, raw_host), None
        if (failure := self.settings.audit_failure()) is not None:
            reason = f"audit log unavailable ({failure}): no request is allowed until it can be written"
            return TargetJudgement(Decision(False, reason, ReasonCode.AUDIT_UNAVAILABLE), raw_host), None
        try:
            host = _target(raw_host, port)
        except HostError as e:
            return TargetJudgement(Decision(False, f"invalid host: {e}", ReasonCode.INVALID_HOST), raw_host), None
        live = self.live.current
        profile = live.profile(sandbox)
        decision = decide(profile, host, port)
        keep_for = KEPT_JUDGEMENT_S
        if not decision.allow and self.approvals is not None:
            decision = await self.approvals.decide(live, sandbox, host, port, decision, kind, client)
            keep_for = 0.0  # a person's answer is theirs to give each time
        if not decision.allow:
            return TargetJudgement(decision, host), None
        if is_ip(host):
            addresses: tuple[IPAddress, ...] = (ipaddress.ip_address(host),)
        else:
            try:
                answer = await self.resolver.resolve(host)
            except ResolveError as e:
                failed = Decision(False, f"resolution failed: {e}", ReasonCode.RESOLVE_FAILED, decision.rule)
                return TargetJudgement(failed, host), None
            if denied := decide_alias(profile, answer.cnames, port):
                return TargetJudgement(denied, host, [str(a) for a in answer.addresses]), None
            addresses, keep_for = answer.addresses, min(keep_for, answer.ttl)
        vetted = vet(profile, addresses, port, live.own.among(addresses))
        resolved = [str(a) for a in addresses]
        if not vetted.allowed:
            return TargetJudgement(refused_addresses(decision, vetted), host, resolved), None
        chosen = min(vetted.allowed, key=lambda a: a.version)  # IPv4 first: the family most often routed
        judgement = TargetJudgement(decision, host, resolved, str(chosen))
        kept = Kept((raw_host, port), live, time.monotonic() + keep_for, judgement, addresses) if keep_for > 0 else None
        return judgement, kept


def is_transparent(client: connection.Client) -> bool:
    """Did this connection come through the fence's redirect (the sandbox dialled somewhere else)?"""
    return isinstance(client.proxy_mode, TransparentMode)


def _target(raw_host: str, port: int) -> str:
    """Canonical host, or HostError. Bracketed IPv6 from URLs is accepted by canonical_host."""
    if not 1 <= port <= 65535:
        raise HostError(f"port {port} out of range")
    return canonical_host(raw_host)
