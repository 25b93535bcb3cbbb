"""The upstream DNS servers' addresses, as `--upstream-dns` and /etc/resolv.conf give them: apart from the resolver
(`dns/upstream.py`, which imports dnslib) so that the command line reads them before a gateway is imported."""

from __future__ import annotations

import contextlib
import ipaddress

type Server = tuple[str, int]


def parse_server(text: str) -> Server:
    """`IP` or `IP:PORT` or `[IPv6]:PORT` → (ip, port)."""
    host, port = text, 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") else 53
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        port = int(port_text)
    ipaddress.ip_address(host)
    if not 1 <= port <= 65535:
        raise ValueError(f"port out of range in {text!r}")
    return host, port


def system_servers(resolv_conf: str = "/etc/resolv.conf") -> list[Server]:
    servers: list[Server] = []
    with contextlib.suppress(OSError), open(resolv_conf, encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    servers.append(parse_server(parts[1]))
    return servers
