"""The gateway's scrape and health endpoints (`/metrics`, `/healthz`, `/readyz`): the counters of `GatewayMetrics`
beside the state the gateway keeps anyway (open tunnels and connections, the audit queue, DNS drops), which is read
only when `/metrics` is scraped: nothing of it is on the hot path."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from airlock.gateway.metrics import Bounded, GatewayMetrics

if TYPE_CHECKING:
    from aiohttp import web
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

    from airlock.audit import AuditLog

type Checks = Callable[[], Mapping[str, str | None]]  # readiness check → what is wrong, or None
type Counts = Callable[[], Mapping[str, int]]  # open ones per sandbox, as they are now


@dataclass(frozen=True, slots=True)
class ScrapedState:
    """Where a scrape reads the gateway's state: the sandbox ids served, the proxy's open tunnels, client and upstream
    connections per sandbox (none before its addon exists), the audit log, the DNS server's drop counters."""

    sandboxes: Callable[[], Iterable[str]]
    tunnels: Counts
    connections: Counts
    upstreams: Counts
    audit: AuditLog
    dns_stats: Mapping[str, int]


class MetricsEndpoint:
    """The registry a scrape reads (the state first, then the metrics' families) and the aiohttp handlers."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        state: ScrapedState,
        readiness: Checks,
        refresh: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.metrics, self.readiness = metrics, readiness
        self._refresh = refresh  # with proxy workers: their counters asked for, before each scrape
        self._state = _StateCollector(metrics.sandbox_label, state)
        self._registry: CollectorRegistry | None = None  # made at the first scrape

    def exposition(self) -> bytes:
        """The registry in Prometheus's text format."""
        from prometheus_client import generate_latest

        return generate_latest(self._registered())

    def _registered(self) -> CollectorRegistry:
        if self._registry is None:
            from prometheus_client import CollectorRegistry

            registry = CollectorRegistry()
            for collector in (self._state, *self.metrics.families):
                # Anything with `collect` is a collector; prometheus-client's Collector is the ABC of a module
                # imported only now (at the first scrape), so neither class derives from it.
                registry.register(collector)  # type: ignore[arg-type]
            self._registry = registry
        return self._registry

    async def scrape(self, request: web.Request) -> web.Response:
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST

        if self._refresh is not None:
            await self._refresh()
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
        """The three GET routes, for any aiohttp app: `app.add_routes(endpoint.routes())`."""
        from aiohttp import web

        return [
            web.get("/metrics", self.scrape, allow_head=False),
            web.get("/healthz", self.healthz, allow_head=False),
            web.get("/readyz", self.readyz, allow_head=False),
        ]


class _StateCollector:
    """Gauges and counters read from the gateway's own state when scraped (a prometheus-client collector: it has
    `collect`)."""

    def __init__(self, sandbox: Bounded, sources: ScrapedState) -> None:
        self._sandbox, self.sources = sandbox, sources

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sources = self.sources
        tunnels_now, connections_now, upstreams_now = sources.tunnels(), sources.connections(), sources.upstreams()
        ids = list(dict.fromkeys([*sources.sandboxes(), *tunnels_now, *connections_now]))
        tunnels = GaugeMetricFamily("airlock_open_tunnels", "Open CONNECT tunnels", labels=["sandbox"])
        connections = GaugeMetricFamily(
            "airlock_open_connections", "Open proxy connections: the sandbox's and upstream", labels=["sandbox", "side"]
        )
        totals: Tally[tuple[str, ...]] = Tally()
        for sandbox_id in ids:
            label = self._sandbox(sandbox_id)
            totals[("t", label)] += tunnels_now.get(sandbox_id, 0)
            totals[("c", label, "client")] += connections_now.get(sandbox_id, 0)
            totals[("c", label, "upstream")] += upstreams_now.get(sandbox_id, 0)
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
