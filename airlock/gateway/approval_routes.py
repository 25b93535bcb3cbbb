"""The admin listener's routes a person answers held requests through: the pending list, approve, deny — each
answer naming who gave it (the user on the admin socket's other end)."""

from __future__ import annotations

import pwd
import socket
import struct
from typing import TYPE_CHECKING, Any

from airlock.gateway.approval_desk import Approvals
from airlock.gateway.errors import ApprovalError

if TYPE_CHECKING:
    from aiohttp import web

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def caller(request: web.Request) -> str:
    """Who answers: the user on the other end of the admin unix socket (SO_PEERCRED), or "loopback" over TCP
    (the admin listener takes TCP on loopback only, where the kernel names no user)."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family != socket.AF_UNIX:
        return "loopback"
    _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def approval_routes(approvals: Approvals) -> list[web.RouteDef]:
    """`GET /v1/approvals`, `POST /v1/approvals/{id}/approve` ({"scope": "once"|"sandbox"|"policy", "ttl": S}) and
    `POST /v1/approvals/{id}/deny`, for an admin listener's application (`app.add_routes(...)`)."""
    from aiohttp import web

    def reply(body: dict[str, Any], status: int = 200) -> web.Response:
        return web.json_response(body, status=status)

    def refused(e: ApprovalError) -> web.Response:
        return reply({"error": e.code, "message": e.message}, e.status)

    async def listing(request: web.Request) -> web.Response:
        return reply({"pending": await approvals.pending()})

    async def approve(request: web.Request) -> web.Response:
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError:
            return refused(ApprovalError(400, "invalid_request", "the body must be a JSON object"))
        if not isinstance(body, dict):
            return refused(ApprovalError(400, "invalid_request", "the body must be a JSON object"))
        try:
            answer = await approvals.approve(
                request.match_info["id"], body.get("scope", "once"), body.get("ttl"), caller(request)
            )
        except ApprovalError as e:
            return refused(e)
        return reply(answer)

    async def deny(request: web.Request) -> web.Response:
        try:
            return reply(await approvals.deny(request.match_info["id"], caller(request)))
        except ApprovalError as e:
            return refused(e)

    return [
        web.get("/v1/approvals", listing),
        web.post("/v1/approvals/{id}/approve", approve),
        web.post("/v1/approvals/{id}/deny", deny),
    ]
