"""The gateway's Prometheus metrics and its health endpoints (`/metrics`, `/healthz`, `/readyz`).

What is counted comes from three places, each as cheap as it can be:
- the one audit path: `GatewayMetrics.observe` is called by `GatewayAudit.emit` for every audit line (decisions,
  bytes, DNS rcodes, broker calls and token failures, policy reloads) — one call and a few dict lookups a line;
- the timings the proxy and the resolver hand over (`decided`, `connected`, `connect_failed`, `resolved`);
- state the gateway keeps anyway (open tunnels and connections, the audit queue, DNS drops), read only when
  `/metrics` is scraped.

The registry is the gateway's own, never prometheus-client's process-wide default: what is served is what is listed
here. Cardinality is bounded: each label takes its values from a closed set (kinds, decisions, reason codes,
rcodes, broker tools and statuses, directions) or from what the operator configured (profiles, sandbox ids), and
each label keeps at most LABEL_BOUNDS distinct values, beyond which a value is counted as "other". No host name,
address, path or request id is ever a label.

prometheus-client itself (about 30 ms to import, with http.server and wsgiref) is imported at the first scrape:
counting needs none of it, and a sandbox's start should not wait for it.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airlock.audit import AuditRecord, RepeatedDecisions
from airlock.policy import ReasonCode

if TYPE_CHECKING:
    from aiohttp import web
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

    from airlock.audit import AuditLog

OTHER = "other"  # the label value of whatever comes past a label's bound
LABEL_BOUNDS = {
    "kind": 16, "decision": 16, "profile": 256, "code": 128, "sandbox": 1024, "tool": 64, "status": 64,
    "rcode": 32, "source": 8, "result": 8, "direction": 2,
}  # fmt: skip
MAX_CACHED_LABELS = 8192  # label tuples remembered with their child metric (more are looked up each time)
# Broker refusals of the token itself, or of what it was used for (its grant): what a stolen or forged token meets.
TOKEN_FAILURES = frozenset(
    {"missing_token", "invalid_token", "revoked_token", "wrong_sandbox", "unknown_sandbox", "outside_grant"}
)
# Seconds. Decisions and DNS answers take microseconds to a resolution's milliseconds; connects and broker calls
# (GitHub's API) up to their timeouts.
FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
SLOW_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

type Checks = Callable[[], Mapping[str, str | None]]  # readiness check → what is wrong, or None


class _Bounded:
    """One label's values: the first `limit` distinct ones as they are, any later one as OTHER."""

    def __init__(self, limit: int) -> None:
        self.limit, self.seen = limit, set[str]()

    def __call__(self, value: object) -> str:
        text = "-" if value is None else str(value)
        if text in self.seen:
            return text
        if len(self.seen) < self.limit:
            self.seen.add(text)
            return text
        return OTHER


class _Count:
    """One counter child, counted in a plain attribute: the gateway's event loop is its one writer (and the
    scrape, on the same loop, its one reader), so it needs none of prometheus-client's locking, which costs a
    Counter child's `inc` about ten times as much."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class _Durations:
    """One histogram child, counted like _Count: a bucket count per bound (and one past the last), and the sum."""

    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts, self.sum = buckets, [0] * (len(buckets) + 1), 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1  # `le` buckets: a value on a bound is in it
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        from prometheus_client.utils import floatToGoString

        bounds = [*map(floatToGoString, self.buckets), "+Inf"]
        return list(zip(bounds, itertools.accumulate(self.counts), strict=True))


class _Family[Child: (_Count, _Durations)]:
    """A labelled counter or histogram family, its labels bounded, its children found by their raw label values
    (one dict lookup), served as a prometheus-client metric family (a collector: it has `collect`)."""

    def __init__(
        self, name: str, doc: str, labels: tuple[str, ...], bounds: Mapping[str, _Bounded], new: Callable[[], Child]
    ) -> None:
        self.name, self.doc, self.labels, self._new = name, doc, list(labels), new
        self._bounds = [bounds[label] for label in labels]
        self._children: dict[tuple[object, ...], Child] = {}  # by the raw label values
        self._bounded: dict[tuple[str, ...], Child] = {}  # by the label values served

    def __call__(self, *values: object) -> Child:
        child = self._children.get(values)
        if child is None:
            key = tuple(bound(value) for bound, value in zip(self._bounds, values, strict=True))
            child = self._bounded.get(key)
            if child is None:
                child = self._bounded[key] = self._new()
            if len(self._children) < MAX_CACHED_LABELS:
                self._children[values] = child
        return child

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        children = list(self._bounded.items())
        if self._new is _Count:
            counters = CounterMetricFamily(self.name, self.doc, labels=self.labels)
            for key, count in children:
                counters.add_metric(key, count.value)  # type: ignore[union-attr]
            yield counters
            return
        histograms = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, durations in children:
            histograms.add_metric(key, durations.cumulative(), durations.sum)  # type: ignore[union-attr]
        yield histograms


class GatewayMetrics:
    """The gateway's registry, the observers that fill it, and the aiohttp handlers that serve it."""

    def __init__(self) -> None:
        self._bounds = {name: _Bounded(limit) for name, limit in LABEL_BOUNDS.items()}
        self.readiness: Checks = lambda: {"gateway": "not started"}
        self._state = _StateCollector(self._bounds["sandbox"])
        self._collectors: list[_StateCollector | _Family[Any]] = [self._state]  # the registry's, in this order
        self._registry: CollectorRegistry | None = None  # made at the first scrape

        def counter(name: str, doc: str, *labels: str) -> _Family[_Count]:
            family = _Family(name, doc, labels, self._bounds, _Count)
            self._collectors.append(family)
            return family

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> _Family[_Durations]:
            family = _Family(name, doc, labels, self._bounds, lambda: _Durations(buckets))
            self._collectors.append(family)
            return family

        self._decisions = counter(
            "airlock_decisions", "Audited decisions (one per audit line)", "kind", "decision", "profile", "code"
        )
        self._bytes = counter(
            "airlock_bytes", "Bytes relayed: in = from the sandbox, out = to it", "sandbox", "kind", "direction"
        )
        self._dns = counter("airlock_dns_queries", "DNS queries answered, by response code", "sandbox", "rcode")
        self._broker = counter("airlock_broker_calls", "Broker calls, by tool and HTTP status", "tool", "status")
        self._token_failures = counter(
            "airlock_broker_token_failures", "Broker calls refused for their token or its grant", "code"
        )
        self._reloads = counter("airlock_policy_reloads", "Policy reloads: ok, or refused (the old stays)", "result")
        self._connect_failures = counter("airlock_upstream_connect_failures", "Vetted upstream connects that failed")
        self._decide = histogram(
            "airlock_decide_duration_seconds",
            "Time to judge a target (proxy: canonicalize, decide, resolve, vet) or answer a DNS query",
            FAST_BUCKETS,
            "source",
        )
        self._resolve = histogram(
            "airlock_resolve_duration_seconds", "Upstream DNS resolutions (cache misses)", FAST_BUCKETS, "result"
        )
        self._connect = histogram(
            "airlock_upstream_connect_duration_seconds", "TCP connects to vetted upstream addresses", SLOW_BUCKETS
        )
        self._broker_duration = histogram(
            "airlock_broker_call_duration_seconds", "Broker calls, from request to answer", SLOW_BUCKETS, "tool"
        )
        self._templates: dict[str, tuple[Any, Any]] = {}  # remembered DNS lines' template → their two counters

    # --- observers ----------------------------------------------------------------------------------------------

    def observe(self, record: AuditRecord | RepeatedDecisions) -> None:
        """One audit line (or a batch of remembered DNS answers), as GatewayAudit.emit stamped it."""
        if isinstance(record, RepeatedDecisions):
            self._repeated(record)
            return
        kind = record.kind
        self._decisions(kind, record.decision, record.profile, record.code).inc()
        if record.bytes_in:
            self._bytes(record.sandbox, kind, "in").inc(record.bytes_in)
        if record.bytes_out:
            self._bytes(record.sandbox, kind, "out").inc(record.bytes_out)
        if kind == "dns":
            self._dns(record.sandbox, record.extra.get("rcode")).inc()
            if record.duration_ms is not None:
                self._decide("dns").observe(record.duration_ms / 1000)
        elif kind == "broker":
            tool = record.method
            self._broker(tool, record.extra.get("status")).inc()
            if record.code in TOKEN_FAILURES:
                self._token_failures(record.code).inc()
            if record.duration_ms is not None:
                self._broker_duration(tool).observe(record.duration_ms / 1000)
        elif kind == "policy":
            self._reloads("ok" if record.code == ReasonCode.POLICY_LOADED else "refused").inc()

    def _repeated(self, batch: RepeatedDecisions) -> None:
        """Remembered DNS answers: each event counts like the line it repeats (its template is read once)."""
        for template, count in Tally(template for template, _ in batch.events).items():
            counters = self._templates.get(template)
            if counters is None:
                counters = self._template_counters(template)
            for counter in counters:
                counter.inc(count)

    def _template_counters(self, template: str) -> tuple[Any, Any]:
        fields = json.loads("{" + template)
        rcode = (fields.get("extra") or {}).get("rcode")
        labels = (fields.get("kind"), fields.get("decision"), fields.get("profile"), fields.get("code"))
        counters = (self._decisions(*labels), self._dns(fields.get("sandbox"), rcode))
        if len(self._templates) >= MAX_CACHED_LABELS:
            self._templates.clear()  # each remembered reply lives a second: old templates are seldom seen again
        self._templates[template] = counters
        return counters

    def decided(self, seconds: float) -> None:
        """The proxy judged a target (Shared.evaluate)."""
        self._decide("proxy").observe(seconds)

    def connected(self, seconds: float) -> None:
        """A connection to a vetted upstream address opened."""
        self._connect().observe(seconds)

    def connect_failed(self) -> None:
        self._connect_failures().inc()

    def resolved(self, result: str, seconds: float) -> None:
        """The shared resolver asked upstream: `result` is ok, nxdomain or error."""
        self._resolve(result).observe(seconds)

    def watch(
        self,
        sandboxes: Callable[[], Iterable[str]],
        tunnels: Mapping[str, int],
        connections: Mapping[str, int],
        upstreams: Mapping[str, int],
        audit: AuditLog,
        dns_stats: Mapping[str, int] | None = None,
    ) -> None:
        """What is read at scrape time: the sandbox ids served, the proxy's open tunnels, client and upstream
        connections per sandbox (the proxy's own counters), the audit log, the DNS server's drop counters."""
        self._state.sources = _Sources(sandboxes, tunnels, connections, upstreams, audit, dns_stats or {})

    def exposition(self) -> bytes:
        """The registry in Prometheus's text format."""
        from prometheus_client import generate_latest

        return generate_latest(self._registered())

    def _registered(self) -> CollectorRegistry:
        """The gateway's own registry of everything above (made once, at the first scrape)."""
        if self._registry is None:
            from prometheus_client import CollectorRegistry

            registry = CollectorRegistry()
            for collector in self._collectors:
                registry.register(collector)
            self._registry = registry
        return self._registry

    # --- aiohttp handlers ---------------------------------------------------------------------------------------

    async def metrics(self, request: web.Request) -> web.Response:
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=self.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: web.Request) -> web.Response:
        """The process is alive: its event loop answers."""
        from aiohttp import web

        return web.json_response({"alive": True})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready to serve: 200 when every check passes, else 503 naming what is wrong."""
        from aiohttp import web

        problems = {check: problem for check, problem in self.readiness().items() if problem is not None}
        return web.json_response({"ready": not problems, "problems": problems}, status=503 if problems else 200)

    def routes(self) -> list[web.RouteDef]:
        """The three GET routes, for any aiohttp app: `app.add_routes(metrics.routes())`."""
        from aiohttp import web

        return [
            web.get("/metrics", self.metrics, allow_head=False),
            web.get("/healthz", self.healthz, allow_head=False),
            web.get("/readyz", self.readyz, allow_head=False),
        ]


@dataclass(frozen=True, slots=True)
class _Sources:
    sandboxes: Callable[[], Iterable[str]]
    tunnels: Mapping[str, int]
    connections: Mapping[str, int]
    upstreams: Mapping[str, int]
    audit: AuditLog
    dns_stats: Mapping[str, int]


class _StateCollector:
    """Gauges and counters read from the gateway's own state when scraped: nothing on the hot path (a
    prometheus-client collector: it has `collect`)."""

    def __init__(self, sandbox: _Bounded) -> None:
        self.sources: _Sources | None = None
        self._sandbox = sandbox

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sources = self.sources
        if sources is None:
            return
        ids = list(dict.fromkeys([*sources.sandboxes(), *sources.tunnels, *sources.connections]))
        tunnels = GaugeMetricFamily("airlock_open_tunnels", "Open CONNECT tunnels", labels=["sandbox"])
        connections = GaugeMetricFamily(
            "airlock_open_connections", "Open proxy connections: the sandbox's and upstream", labels=["sandbox", "side"]
        )
        totals: Tally[tuple[str, ...]] = Tally()
        for sandbox_id in ids:
            label = self._sandbox(sandbox_id)
            totals[("t", label)] += sources.tunnels.get(sandbox_id, 0)
            totals[("c", label, "client")] += sources.connections.get(sandbox_id, 0)
            totals[("c", label, "upstream")] += sources.upstreams.get(sandbox_id, 0)
        for (family, *labels), value in totals.items():
            (tunnels if family == "t" else connections).add_metric(labels, value)
        yield tunnels
        yield connections
        yield from _audit_metrics(sources.audit)
        dropped = CounterMetricFamily("airlock_dns_dropped", "DNS queries dropped unanswered", labels=["reason"])
        for reason, count in sorted(sources.dns_stats.items()):
            if not reason.startswith("rcode_"):  # answered queries: airlock_dns_queries_total
                dropped.add_metric([reason], count)
        yield dropped


def _audit_metrics(audit: AuditLog) -> Iterator[Metric]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily("airlock_audit_writable", "1 while the audit log can be written", audit.failure is None)
    yield GaugeMetricFamily("airlock_audit_pending_lines", "Audit lines before the next write", audit.pending_lines)
    yield GaugeMetricFamily(
        "airlock_audit_waiting_bytes", "Audit bytes a failed write left waiting", audit.waiting_bytes
    )
    yield GaugeMetricFamily(
        "airlock_audit_lag_seconds", "How long the oldest unwritten audit line has waited (at most)", audit.lag()
    )
    yield CounterMetricFamily("airlock_audit_write_errors", "Audit writes that failed", audit.write_errors)
    yield CounterMetricFamily("airlock_audit_lines_lost", "Audit lines dropped: too many waited", audit.lines_lost)
