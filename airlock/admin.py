"""The gateway's admin listener: where the gateway host (never a sandbox) reloads the policy, reads the status, and,
with a broker, mints and revokes tokens.

It is a unix socket (default STATE_DIR/admin.sock) created owner-only (0600, in the 0700 state directory that
bubblewrap hides from the sandbox's command, which never runs as root), or a loopback `127.0.0.1:PORT`: a sandbox's
loopback is its own network namespace's, and the fence opens only the proxy, DNS and broker ports of the gateway.

Routes come from parts, added before the listener starts: `add_routes` takes aiohttp route definitions
(`web.get(...)`, a `RouteTableDef`), `mount` takes another aiohttp application's routes at their own paths, each
behind that application's middlewares (the broker's admin app is mounted this way)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

from airlock.brokerconfig import admin_endpoint
from airlock.reload import Reloaded

log = logging.getLogger("airlock.gateway")
HTTP_LOG = logging.getLogger("airlock.admin.http")
MAX_ADMIN_BODY = 1024 * 1024

type Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AdminApp:
    def __init__(self, address: str) -> None:
        self.address = address
        self.endpoint = admin_endpoint(address)  # BrokerConfigError for a non-loopback HOST:PORT: before any start
        self.app = web.Application(client_max_size=MAX_ADMIN_BODY)
        self._runner: web.AppRunner | None = None

    def add_routes(self, routes: Iterable[web.AbstractRouteDef]) -> None:
        """Serve these routes too (before `start`): `admin.add_routes([web.get("/metrics", handler)])`."""
        self.app.add_routes(routes)

    def mount(self, app: web.Application) -> None:
        """Serve `app`'s routes at their own paths, each behind `app`'s middlewares (before `start`)."""
        for route in app.router.routes():
            path = route.resource.canonical if route.resource is not None else None
            if path is None:
                continue
            self.app.router.add_route(route.method, path, _behind(app.middlewares, route.handler))

    async def start(self) -> None:
        runner = web.AppRunner(self.app, access_log=None, logger=HTTP_LOG)
        await runner.setup()
        self._runner = runner
        endpoint = self.endpoint
        if isinstance(endpoint, tuple):
            await web.TCPSite(runner, *endpoint, reuse_address=True).start()
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(endpoint)
        old_umask = os.umask(0o177)  # the socket is the admin credential: owner only, from its first moment
        try:
            await web.UnixSite(runner, str(endpoint)).start()
        finally:
            os.umask(old_umask)

    async def stop(self) -> None:
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        await runner.cleanup()
        if isinstance(self.endpoint, Path):
            with contextlib.suppress(OSError):
                self.endpoint.unlink()


def _behind(middlewares: Iterable[object], handler: Handler) -> Handler:
    """`handler` wrapped in `middlewares` as its own application would have run it (the first one outermost)."""
    for middleware in reversed(list(middlewares)):
        handler = _wrapped(middleware, handler)  # type: ignore[arg-type]
    return handler


def _wrapped(middleware: Callable[[web.Request, Handler], Awaitable[web.StreamResponse]], inner: Handler) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await middleware(request, inner)

    return handle


def gateway_routes(
    reload: Callable[[], Awaitable[Reloaded]], status: Callable[[], dict[str, Any]]
) -> list[web.RouteDef]:
    """`POST /v1/policy/reload` (200 with the new hash, 422 with the errors when the running policy stays) and
    `GET /v1/status`."""

    async def reload_policy(request: web.Request) -> web.Response:
        outcome = await reload()
        return web.json_response(outcome.as_json(), status=200 if outcome.ok else 422)

    async def show_status(request: web.Request) -> web.Response:
        return web.json_response(status())

    return [web.post("/v1/policy/reload", reload_policy), web.get("/v1/status", show_status)]
