"""The gateway process: the policy, the one resolver, mitmproxy with the airlock addon, the sandbox DNS server,
the broker and the admin listener (`airlock.gateway.parts`), started and stopped together.

mitmproxy and the addon are most of a gateway's start-up (proxy layers, QUIC, pyOpenSSL, pyparsing: about 300 ms),
and aiohttp (the admin listener) a quarter of a second more, so they are imported in a thread
(`airlock.gateway.startup.preload`) while the rest starts: what a launcher builds meanwhile (the sandbox's namespace,
link, fence and DNS) waits on subprocesses and the kernel, not on this process. The proxy's sockets (explicit and
transparent) and the admin listener's listen from the start, once the policy is in force: a client that comes before
they are served waits in their backlog, and is served like any other (the proxy's by the addon) once aiohttp, then
mitmproxy, are in."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from airlock.errors import AirlockError
from airlock.gateway.accept_guard import DescriptorShortage, one_retry_per_shortage
from airlock.gateway.admin import AdminApp, gateway_routes
from airlock.gateway.approval_routes import approval_routes
from airlock.gateway.auditing import tell
from airlock.gateway.config import GatewayConfig
from airlock.gateway.errors import GatewayError
from airlock.gateway.metrics_endpoint import MetricsEndpoint, ScrapedState
from airlock.gateway.parts import GatewayParts, build_parts
from airlock.gateway.policy_change import PolicyChange
from airlock.gateway.reload import PolicyReloader, Reloaded, ReloadTeller
from airlock.gateway.startup.preload import loaded, preload_admin, preload_proxy
from airlock.gateway.status_report import gateway_status, readiness
from airlock.inspection.inspector import Inspector
from airlock.policy import LivePolicy, Policy, PolicyError, format_host_port
from airlock.sandbox.fence import mark_listeners

if TYPE_CHECKING:
    from airlock.broker.service import Broker
    from airlock.proxy.addon import Airlock
    from airlock.proxy.shared import ProxyState

log = logging.getLogger("airlock.gateway")


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.parts: GatewayParts = build_parts(config, self._put_approved)
        parts, proxy = self.parts, self.parts.proxy
        self.broker: Broker | None = None  # once the broker runs
        self._started = False
        self._in_force = False  # from start() on: the policy in force is the live policy's
        self._proxy: asyncio.Future[None] | None = None  # until the admin listener, then the proxy, serve
        self._flusher: asyncio.Task[None] | None = None
        self.tell_reload = ReloadTeller(tell if config.tell_reloads else None)  # how each reload is told
        # Reloads read the file the first policy came from, off the event loop (airlock/gateway/reload.py).
        after = [lambda policy: self.close_denied_everywhere()] if config.close_denied_on_reload else []
        self.policies = PolicyChange(config, parts, lambda: self._in_force)
        self.reloader = PolicyReloader(self, config.policy.source, self._policy, after, self.put_in_force)
        self.started_at = time.time()
        counts = proxy.counts if parts.workers is None else parts.workers.counts
        refresh = parts.workers.refresh if parts.workers is not None else None  # their counters, asked at a read
        scraped = ScrapedState(
            lambda: parts.live.current.registry.ids(),  # of the policy in force at each scrape
            lambda: counts("tunnels"),
            lambda: counts("connections"),
            lambda: counts("upstreams"),
            parts.audit,
            parts.dns.stats if parts.dns is not None else {},
        )
        self.metrics = MetricsEndpoint(parts.metrics, scraped, self.readiness, refresh)
        # The broker's routes are added when it starts.
        parts.admin.add_routes(lambda: gateway_routes(self.reload_policy, self.status, refresh))
        parts.admin.add_routes(self.metrics.routes)
        parts.admin.add_routes(lambda: approval_routes(parts.approvals))

    # What launchers and the command line read of a gateway.
    @property
    def admin(self) -> AdminApp:
        return self.parts.admin

    @property
    def live(self) -> LivePolicy:
        return self.parts.live

    @property
    def inspector(self) -> Inspector:
        return self.parts.inspector

    @property
    def airlock(self) -> Airlock | None:
        return self.parts.proxy.airlock

    @property
    def shared(self) -> ProxyState | None:
        return self.parts.proxy.shared

    async def start(self, *, wait_for_proxy: bool = True) -> None:
        """Put the policy in force, then listen: the proxy's sockets (explicit, transparent), the DNS server, the
        broker, the admin listener; all but the last marked for the fence. Returns once the admin listener and the
        proxy serve too — or, without `wait_for_proxy`, while aiohttp and mitmproxy may still be loading (their
        clients wait in the backlog meanwhile): then `proxy_started()` says when both serve, or why they cannot.
        GatewayError for anything that cannot start (the gateway is stopped again)."""
        # With workers, mitmproxy runs in them: this process never imports it.
        loading, admin_loading = preload_proxy() if self.parts.workers is None else None, preload_admin()
        one_retry_per_shortage(asyncio.get_running_loop())
        self._started = True
        try:
            await self._listen()
        except GatewayError:
            await self.stop()
            raise
        # Every route is added and every app mounted by now: the admin listener can be served as it is.
        self._proxy = asyncio.ensure_future(self._serve_loaded(admin_loading, loading))
        self._mark_listeners()
        if wait_for_proxy:
            try:
                await self.proxy_started()
            except GatewayError:
                await self.stop()
                raise

    async def _listen(self) -> None:
        """The policy in force, then every listener bound, in the parts' order; GatewayError for one that cannot."""
        config, parts = self.config, self.parts
        self._in_force = True
        try:
            self.policies.prepare_inspection(config.policy)
        except PolicyError as e:
            raise GatewayError("; ".join(e.errors)) from e
        except AirlockError as e:  # a CA that cannot be written
            raise GatewayError(str(e)) from e
        parts.proxy.listen()
        self._flusher = asyncio.create_task(self._flush_audit())
        if parts.dns is not None:
            try:
                await parts.dns.start()
            except OSError as e:
                raise GatewayError(f"DNS server could not listen on {config.listen}:{config.dns_port}: {e}") from e
        if parts.broker is not None:
            from airlock.broker.store import StoreError
            from airlock.broker.tokens import TokenError

            try:
                self.broker = await parts.broker.start(config.listen)
            except (OSError, ValueError, StoreError, TokenError) as e:
                raise GatewayError(f"broker could not start: {e}") from e
            parts.admin.mount(self.broker.admin_app())
        if parts.relay is not None:
            try:
                await parts.relay.start(config.listen)
            except OSError as e:
                where = format_host_port(config.listen, parts.relay.config.port)
                raise GatewayError(f"broker relay could not listen on {where}: {e.strerror or e}") from e
        try:
            parts.admin.listen()
        except OSError as e:
            raise GatewayError(f"admin listener could not listen on {parts.admin.address}: {e.strerror or e}") from e

    async def proxy_started(self) -> None:
        """Once the admin listener and the proxy serve; GatewayError if they cannot (then the gateway should be
        stopped)."""
        if self._proxy is None:
            raise GatewayError("the gateway has not started: no proxy")
        await asyncio.shield(self._proxy)

    async def _serve_loaded(
        self, admin_loading: concurrent.futures.Future[None], loading: concurrent.futures.Future[None] | None
    ) -> None:
        """The admin listener once aiohttp is imported, then mitmproxy with the airlock addon once that is, each
        serving the clients that have waited in their backlog until now. If either cannot, every listener of
        theirs closes at once: clients are refused, not kept, and none is served by a gateway half up."""
        admin, proxy = self.parts.admin, self.parts.proxy
        try:
            await loaded(admin_loading, "the admin listener")
            try:
                await admin.serve()
            except Exception as e:
                raise GatewayError(f"the admin listener could not start: {type(e).__name__}: {e}") from e
            if self.parts.workers is not None:
                # Each a process of its own, on these sockets; their git reads' tokens asked of the broker here.
                await self.parts.workers.start(proxy.listeners, self.broker.git_read if self.broker else None)
            else:
                assert loading is not None
                await loaded(loading, "the proxy")
                await proxy.serve(self.broker.git_read if self.broker is not None else None)
        except BaseException as e:
            await admin.stop()
            proxy.close_listeners()
            if isinstance(e, Exception) and not isinstance(e, GatewayError):
                raise GatewayError(f"the proxy could not start: {type(e).__name__}: {e}") from e
            raise
        # mitmproxy has installed its handler by now; every listener of the gateway shares this loop.
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(DescriptorShortage(loop))
        # What exists now (mitmproxy's modules, the policy) is mostly what the gateway keeps: out of the cycle
        # collector's sight, or each full collection would walk a policy of 100,000 rules on the event loop. A
        # reload's policy is frozen too (airlock/gateway/reload.py); a replaced one, which holds no reference
        # cycles, is freed by reference counting all the same.
        gc.freeze()
        ports = " and ".join(str(port) for port in proxy.ports().values())
        workers = f" ({self.config.workers} workers)" if self.parts.workers is not None else ""
        log.info("airlock proxy listening on %s port %s%s", self.config.listen, ports, workers)

    def _mark_listeners(self) -> None:
        """The fence lets sandboxes reach only sockets with the gateway's mark, never another program that binds
        these ports; without the privilege to mark them, no airlock fence lets anything reach this gateway."""
        config = self.config
        try:
            relay = config.relay.port if config.relay is not None else 0
            ports = (config.proxy_port, config.transparent_port, config.dns_port, config.broker.port, relay)
            mark_listeners(config.listen, [p for p in ports if p])
        except OSError as e:
            log.warning("listening sockets not marked (%s): an airlock fence keeps sandboxes from them", e)

    def readiness(self) -> dict[str, str | None]:
        """What /readyz checks (airlock/gateway/status_report.py)."""
        return readiness(self.config, self.parts, self._in_force, self.broker is not None)

    def reopen_audit(self) -> None:
        """SIGUSR1: the audit file opened anew at its path (after log rotation moved it away)."""
        self.parts.audit.reopen()

    async def _flush_audit(self) -> None:
        audit, workers = self.parts.audit, self.parts.workers
        while True:
            await asyncio.sleep(0.1)
            audit.flush()
            if workers is not None:
                workers.audit_state(audit.failure)  # they deny while it cannot be written, as this process does

    def replace_policy(self, policy: Policy) -> None:
        """Swap in a new, already validated policy for proxy, DNS and broker at once (airlock/gateway/policy_change.py);
        PolicyError, and the running policy stays, for one that cannot be put in force here."""
        self.policies.replace(policy)

    async def put_in_force(self, policy: Policy) -> None:
        """What a reload does with the policy it loaded: `replace_policy`; with workers, in two phases."""
        await self.policies.put_in_force(policy)

    def policy_refused(self, source: str, errors: list[str]) -> None:
        """Audit a policy file that did not load (the running policy stays)."""
        self.parts.auditing.policy_refused(source, errors)

    def _put_approved(self, policy: Policy) -> Awaitable[None] | None:
        """A policy an approval wrote (`--scope policy`) put in force, and told as a reload of its file is; with
        proxy workers, in each (the awaitable returned)."""
        previous = self._policy()
        reloaded = Reloaded(policy.source, policy.hash, previous.hash if previous is not None else None)
        if self.parts.workers is not None:
            return self._put_approved_everywhere(policy, reloaded)
        self.replace_policy(policy)
        self.tell_reload.approved(reloaded)
        return None

    async def _put_approved_everywhere(self, policy: Policy, reloaded: Reloaded) -> None:
        await self.put_in_force(policy)
        self.tell_reload.approved(reloaded)

    async def reload_policy(self) -> Reloaded:
        """Load the policy file again, off the event loop, and put it in force; a file that does not load (or lacks
        a running sandbox's profile) is audited as refused and the running policy stays."""
        return await self.reloader.reload()

    def close_denied_tunnels(self) -> int:
        """Close the open tunnels the policy in force denies; how many."""
        return self.parts.proxy.close_denied_tunnels()

    async def close_denied_everywhere(self) -> int:
        """`--close-denied-on-reload`, once a reload is in force: the open tunnels it denies closed here, or in every
        worker (each through the same code, its count added up here); how many, logged. Each closed tunnel's audit
        line says why it was closed."""
        workers = self.parts.workers
        closed = self.close_denied_tunnels() if workers is None else await workers.close_denied_tunnels()
        if closed:
            log.info("closed %d open tunnel%s the reloaded policy denies", closed, "" if closed == 1 else "s")
        return closed

    def _policy(self) -> Policy | None:
        return self.parts.live.current.policy if self._in_force else None

    def status(self) -> dict[str, Any]:
        """What `GET /v1/status` answers (airlock/gateway/status_report.py)."""
        return gateway_status(self.parts, self.started_at, self._in_force, self.config.policy)

    async def stop(self) -> None:
        """Close every listener and stop; a proxy still loading is not waited for (it will not serve)."""
        if not self._started:
            return
        self._started = False
        parts = self.parts
        if self._proxy is not None and not self._proxy.done():
            self._proxy.cancel()
        if self._proxy is not None:
            with contextlib.suppress(asyncio.CancelledError, GatewayError):
                await self._proxy  # its failure was told by start() or proxy_started(), if anyone asked
        if self._flusher is not None:
            self._flusher.cancel()
        if parts.dns is not None:
            await parts.dns.stop()
        await parts.admin.stop()
        if parts.broker is not None:
            await parts.broker.stop()
        if parts.relay is not None:
            await parts.relay.stop()
        await parts.approvals.close()
        parts.proxy.flush_refusals()
        if parts.notices is not None:
            parts.notices.flush()
        if parts.workers is not None:
            await parts.workers.stop()  # their last audit lines are written below
            parts.proxy.close_listeners()
        else:
            await parts.proxy.stop()
        parts.audit.close()
        parts.own.close()
        parts.state.remove()
