"""The broker's own origin: the one a page it served would name in `Origin`, which its MCP endpoint and a pod's
broker relay compare a request's with. A module of its own so the relay, in every pod's sidecar, imports none of
the broker's machinery (tokens, JWT, tools) to read it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web


def own_origin(request: web.Request) -> str | None:
    """The origin the broker is dialled at (its socket's address): the only one a page it served would have."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if not sockname:
        return None
    host, port = sockname[0], sockname[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
