"""The gateway's admin listener: where the gateway host (never a sandbox) reloads the policy, reads the status, and,
with a broker, mints and revokes tokens.

It is a unix socket (default STATE_DIR/admin.sock) created owner-only (0600, in the 0700 state directory that
bubblewrap hides from the sandbox's command, which never runs as root), or a loopback `127.0.0.1:PORT`: a sandbox's
loopback is its own network namespace's, and the fence opens only the proxy, DNS and broker ports of the gateway.

Routes come from parts, added before the listener serves: `add_routes` takes a function that returns aiohttp
route definitions (`web.get(...)`, a `RouteTableDef`), called once aiohttp is imported; `mount` takes another
aiohttp application's routes at their own paths, each behind that application's middlewares (the broker's admin app
is mounted this way).

aiohttp takes about a quarter of a second to import, most of a sandbox's start if it waited for it: the gateway imports
it in a thread while the sandbox is built (`airlock.gateway.startup.preload.preload_admin`). So the listener is bound at
once (`listen()`: a bad address or a taken port is an error at start, and a client that comes early waits in the
backlog), and served once aiohttp is in (`serve()`)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airlock.gateway.config import admin_endpoint
from airlock.gateway.reload import Reloaded

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("airlock.gateway")
HTTP_LOG = logging.getLogger("airlock.admin.http")
MAX_ADMIN_BODY = 1024 * 1024
BACKLOG = 128  # aiohttp's sites' default, which the listener had when aiohttp bound it

type Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
type Routes = Callable[[], Iterable[web.AbstractRouteDef]]


class AdminApp:
    def __init__(self, address: str) -> None:
        self.address = address
        self.endpoint = admin_endpoint(address)  # BrokerConfigError for a non-loopback HOST:PORT: before any start
        self._routes: list[Routes] = []
        self._mounted: list[web.Application] = []
        self._sockets: list[socket.socket] = []  # from listen() until the runner owns them
        self._bound = False  # the socket file is ours to remove: listen() made it
        self._runner: web.AppRunner | None = None

    def add_routes(self, routes: Routes) -> None:
        """Serve these routes too (add before `serve`): `routes()` is called then, when aiohttp is imported —
        `admin.add_routes(lambda: [web.get("/metrics", handler)])`."""
        self._routes.append(routes)

    def mount(self, app: web.Application) -> None:
        """Serve `app`'s routes at their own paths, each behind `app`'s middlewares (mount before `serve`)."""
        self._mounted.append(app)

    def listen(self) -> None:
        """Bind and listen (OSError if it cannot): a client that connects before `serve()` waits in the backlog."""
        endpoint = self.endpoint
        if isinstance(endpoint, tuple):
            self._sockets = _tcp_listeners(*endpoint)
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(endpoint)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is the admin credential: owner only, from its first moment
        try:
            listener.bind(str(endpoint))
            listener.listen(BACKLOG)
        except OSError:
            listener.close()
            raise
        finally:
            os.umask(old_umask)
        self._sockets, self._bound = [listener], True

    async def serve(self) -> None:
        """Serve every route added and app mounted on the sockets `listen()` bound."""
        from aiohttp import web  # by now imported in the gateway's preload thread (see the module's doc)

        app = web.Application(client_max_size=MAX_ADMIN_BODY)
        for routes in self._routes:
            app.add_routes(routes())
        for mounted in self._mounted:
            _mount(app, mounted)
        runner = web.AppRunner(app, access_log=None, logger=HTTP_LOG)
        await runner.setup()
        self._runner = runner
        for listener in self._sockets:
            await web.SockSite(runner, listener, backlog=BACKLOG).start()
        self._sockets = []  # the runner closes them now

    async def stop(self) -> None:
        """Close the listener, served or not, and remove the socket file it made (none other: a gateway that failed
        before it listened leaves alone whatever is at its path)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        for listener in self._sockets:
            listener.close()
        self._sockets = []
        if self._bound and isinstance(self.endpoint, Path):
            self._bound = False
            with contextlib.suppress(OSError):
                self.endpoint.unlink()


def _tcp_listeners(host: str, port: int) -> list[socket.socket]:
    """One listening socket per address of the loopback `host` (`localhost` may be two), as aiohttp's TCPSite
    (asyncio's `create_server`) bound them: SO_REUSEADDR, and IPv6 sockets for IPv6 only."""
    listeners: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            listener = socket.socket(family, kind, proto)
            listeners.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            listener.bind(address)
            listener.listen(BACKLOG)
    except OSError:
        for listener in listeners:
            listener.close()
        raise
    return listeners


def _mount(app: web.Application, mounted: web.Application) -> None:
    """`mounted`'s routes added to `app` at their own paths, each behind `mounted`'s middlewares."""
    for route in mounted.router.routes():
        path = route.resource.canonical if route.resource is not None else None
        if path is None:
            continue
        app.router.add_route(route.method, path, _behind(mounted.middlewares, route.handler))


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
    reload: Callable[[], Awaitable[Reloaded]],
    status: Callable[[], dict[str, Any]],
    refresh: Callable[[], Awaitable[None]] | None = None,
) -> list[web.RouteDef]:
    """`POST /v1/policy/reload` (200 with the new hash, 422 with the errors when the running policy stays) and
    `GET /v1/status` (`refresh`ed first: the proxy workers' counters asked for)."""
    from aiohttp import web

    async def reload_policy(request: web.Request) -> web.Response:
        outcome = await reload()
        return web.json_response(outcome.as_json(), status=200 if outcome.ok else 422)

    async def show_status(request: web.Request) -> web.Response:
        if refresh is not None:
            await refresh()
        return web.json_response(status())

    return [web.post("/v1/policy/reload", reload_policy), web.get("/v1/status", show_status)]
