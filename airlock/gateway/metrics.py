"""The gateway's Prometheus metrics: the counters and durations of what it does (its health endpoints and the state
read at a scrape: `airlock.gateway.metrics_endpoint`).

What is counted comes from three places, each as cheap as it can be:
- the one audit path: `GatewayMetrics.observe` is called by `GatewayAudit.emit` for every audit line (decisions,
  bytes, DNS rcodes, broker calls and token failures, policy reloads) — one call and a few dict lookups a line;
- the timings the proxy and the resolver hand over (`decided`, `connected`, `connect_failed`, `resolved`);
- state the gateway keeps anyway (open tunnels and connections, the audit queue, DNS drops), read only when
  `/metrics` is scraped (`airlock.gateway.metrics_endpoint`).

The registry is the gateway's own, never prometheus-client's process-wide default: what is served is what is listed
here. Cardinality is bounded: each label takes its values from a closed set (kinds, decisions, reason codes,
rcodes, broker tools and statuses, directions) or from what the operator configured (profiles, sandbox ids), and
each label keeps at most LABEL_BOUNDS distinct values, beyond which a value is counted as "other". No host name,
address, path or request id is ever a label.

prometheus-client itself (about 30 ms to import, with http.server and wsgiref) is imported at the first scrape:
counting needs none of it, and a sandbox's start should not wait for it.

With proxy workers (`airlock gateway --workers N`), each worker counts in its own `GatewayMetrics`, and the
supervisor adds their `snapshot()`s in at each scrape (`workers`, asked over their channels). Not prometheus-client's
multiprocess mode: it keeps every count in a memory-mapped file behind a lock, the very cost these plain-attribute
counters exist to avoid on every request.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airlock.audit import AuditRecord, RepeatedDecisions
from airlock.policy import ReasonCode

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric


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
# One family's children as a worker sends them to its supervisor (`GatewayMetrics.snapshot`): a counter's value, or
# a histogram's bucket counts and sum, by the label values served.
type FamilySnapshot = dict[tuple[str, ...], float | tuple[list[int], float]]
type MetricsSnapshot = list[FamilySnapshot]  # one per family, in the order of `GatewayMetrics.families`
SLOW_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Bounded:
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
        self,
        name: str,
        doc: str,
        labels: tuple[str, ...],
        bounds: Mapping[str, Bounded],
        new: Callable[[], Child],
        others: Callable[[], Sequence[FamilySnapshot]] = lambda: (),
    ) -> None:
        self.name, self.doc, self.labels = name, doc, list(labels)
        self._new: Callable[[], Child] = new
        # The same family's children in the gateway's workers, added in at a scrape.
        self._others: Callable[[], Sequence[FamilySnapshot]] = others
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

    def snapshot(self) -> FamilySnapshot:
        """The children's values (a worker's, for its supervisor to add in)."""
        return {
            key: child.value if isinstance(child, _Count) else (list(child.counts), child.sum)
            for key, child in self._bounded.items()
        }

    def _merged(self) -> list[tuple[tuple[str, ...], Child]]:
        """This process's children, and the workers' added in (each in a new child: the own ones stay as they are)."""
        others: Sequence[FamilySnapshot] = self._others()
        if not others:
            return list(self._bounded.items())
        merged: dict[tuple[str, ...], Child] = {}
        for snapshot in (self.snapshot(), *others):
            for key, value in snapshot.items():
                child = merged.get(key)
                if child is None:
                    child = merged[key] = self._new()
                if isinstance(child, _Count):
                    assert isinstance(value, float | int)
                    child.value += value
                else:
                    assert isinstance(value, tuple)
                    counts, total = value
                    child.counts = [a + b for a, b in zip(child.counts, counts, strict=True)]
                    child.sum += total
        return list(merged.items())

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        children = self._merged()
        if self._new is _Count:
            counters = CounterMetricFamily(self.name, self.doc, labels=self.labels)
            for key, count in children:
                assert isinstance(count, _Count)
                counters.add_metric(key, count.value)
            yield counters
            return
        histograms = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, durations in children:
            assert isinstance(durations, _Durations)
            histograms.add_metric(key, durations.cumulative(), durations.sum)
        yield histograms


class GatewayMetrics:
    """The gateway's counters and durations, and the observers that fill them."""

    def __init__(self, workers: Callable[[], Sequence[MetricsSnapshot]] = lambda: ()) -> None:
        """`workers`: the latest snapshot of each of the gateway's proxy workers, added in at each scrape."""
        self._bounds = {name: Bounded(limit) for name, limit in LABEL_BOUNDS.items()}
        self.sandbox_label = self._bounds["sandbox"]  # the sandbox label's values, for the state read at a scrape
        self.families: list[_Family[Any]] = []  # the registry's, in this order
        self._registry: CollectorRegistry | None = None  # made at the first scrape

        def others(index: int) -> Callable[[], list[FamilySnapshot]]:
            return lambda: [snapshot[index] for snapshot in workers() if index < len(snapshot)]

        def counter(name: str, doc: str, *labels: str) -> _Family[_Count]:
            family = _Family(name, doc, labels, self._bounds, _Count, others(len(self.families)))
            self.families.append(family)
            return family

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> _Family[_Durations]:
            new = lambda: _Durations(buckets)  # noqa: E731
            family = _Family(name, doc, labels, self._bounds, new, others(len(self.families)))
            self.families.append(family)
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
        """The proxy judged a target (ProxyState.evaluate)."""
        self._decide("proxy").observe(seconds)

    def connected(self, seconds: float) -> None:
        """A connection to a vetted upstream address opened."""
        self._connect().observe(seconds)

    def connect_failed(self) -> None:
        self._connect_failures().inc()

    def resolved(self, result: str, seconds: float) -> None:
        """The shared resolver asked upstream: `result` is ok, nxdomain or error."""
        self._resolve(result).observe(seconds)

    def snapshot(self) -> MetricsSnapshot:
        """Every family's children (`FamilySnapshot`), in order: what a worker sends its supervisor."""
        return [family.snapshot() for family in self.families]

    def exposition(self) -> bytes:
        """The registry in Prometheus's text format."""
        from prometheus_client import generate_latest

        return generate_latest(self._registered())

    def _registered(self) -> CollectorRegistry:
        """The gateway's own registry of everything above (made once, at the first scrape)."""
        if self._registry is None:
            from prometheus_client import CollectorRegistry

            registry = CollectorRegistry()
            for collector in self.families:
                registry.register(collector)
            self._registry = registry
        return self._registry
