"""The fake model API of the key walk-through (docs/inspection.md): `api.model.example` on 192.0.2.30:443, which
says whether the `Authorization` it got is the real key — so that a reader sees the gateway inject the key the
sandbox only ever had a placeholder for.

Run inside the `<prefix>-net` namespace (see airlock.verify.topology.FakeModel):

    python -P -m airlock.verify.fakemodel --control /path/ctl.sock --cert leaf.crt --key leaf.key \
        --api-key-file model_api.key

Every request is answered 200 with one line, `api.model.example: the Authorization header held the real key` (or
`... did not hold the real key`), and recorded (method, path, the Authorization header as received, whether it was
`Bearer <the key>`). The control socket speaks one JSON object per line: {"cmd": "ping" | "stats" | "reset"}.
Prints READY on stdout once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ssl
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from airlock.verify.control import Commands, listening_socket, serve_until_signalled, start_control

MODEL_HOST = "api.model.example"
MODEL_IP = "192.0.2.30"
REAL_KEY = f"{MODEL_HOST}: the Authorization header held the real key\n"
NOT_THE_KEY = f"{MODEL_HOST}: the Authorization header did not hold the real key\n"
MAX_REQUESTS = 10_000
REQUESTS = web.AppKey("requests", list[dict[str, Any]])
KEY = web.AppKey("key", str)


def log(msg: str) -> None:
    print(f"fakemodel: {msg}", file=sys.stderr, flush=True)


async def answer(request: web.Request) -> web.Response:
    authorization = request.headers.get("Authorization", "")
    real = hmac.compare_digest(authorization.encode(), f"Bearer {request.app[KEY]}".encode())
    requests = request.app[REQUESTS]
    if len(requests) < MAX_REQUESTS:
        requests.append({"method": request.method, "path": request.path, "authorization": authorization, "real": real})
    return web.Response(text=REAL_KEY if real else NOT_THE_KEY)


def commands(requests: list[dict[str, Any]]) -> Commands:
    def reply(cmd: Any, request: dict[str, Any]) -> dict[str, Any] | None:
        if cmd == "stats":
            return {"requests": requests}
        if cmd == "reset":
            requests.clear()
            return {"ok": True}
        return None

    return reply


async def serve(args: argparse.Namespace) -> None:
    requests: list[dict[str, Any]] = []
    app = web.Application()
    app[REQUESTS], app[KEY] = requests, args.api_key_file.read_text().strip()
    app.router.add_route("*", "/{path:.*}", answer)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(args.cert, args.key)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.SockSite(runner, listening_socket(args.listen, args.port), ssl_context=ctx)
    await site.start()
    ctl = await start_control(args.control, commands(requests), log)

    await serve_until_signalled()

    ctl.close()
    await runner.cleanup()
    args.control.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", type=Path, required=True, help="unix socket path for the JSON control API")
    parser.add_argument("--cert", type=Path, required=True, help="TLS certificate (PEM) for api.model.example")
    parser.add_argument("--key", type=Path, required=True, help="TLS private key (PEM)")
    parser.add_argument("--listen", default=MODEL_IP, help="address to listen on")
    parser.add_argument("--port", type=int, default=443)
    parser.add_argument("--api-key-file", type=Path, required=True, help="the real key (the file's text, stripped)")
    asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
