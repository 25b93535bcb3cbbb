"""The gateway: the policy in force, the one resolver, mitmproxy with the airlock addon, the sandbox DNS server, the
broker and the admin listener, built once in start order (`airlock.gateway.parts`) and run by
`airlock.gateway.core.Gateway`.

`Gateway` is imported from `airlock.gateway.core` when it is first asked for: a command line or a launcher reads its
settings (`airlock.gateway.config`) before a sandbox exists, and must not pay for the gateway's machinery then (it is
imported in a thread while the sandbox is built: `airlock.gateway.startup.preload`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from airlock.gateway.errors import GatewayError

if TYPE_CHECKING:
    from airlock.gateway.core import Gateway
else:

    def __getattr__(name: str) -> object:
        if name == "Gateway":
            from airlock.gateway.core import Gateway

            return Gateway
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Gateway", "GatewayError"]
