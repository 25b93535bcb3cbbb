"""The addresses of this network namespace's interfaces, as `ip -j addr show` lists them: read by the gateway (its
own addresses, which it must never dial) and by both sandbox backends (the subnets already in use)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import subprocess

type Interface = ipaddress.IPv4Interface | ipaddress.IPv6Interface


def parse_ip_addr(text: str) -> list[Interface]:
    """Each address with its prefix, from the JSON of `ip -j addr show`; entries without both are left out, text
    that is no such JSON is ValueError."""
    found: list[Interface] = []
    for interface in json.loads(text.strip() or "[]"):
        for info in interface.get("addr_info", []):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                found.append(ipaddress.ip_interface(f"{info['local']}/{info['prefixlen']}"))
    return found


def interface_addresses() -> list[Interface]:
    """Every address of this namespace's interfaces; OSError when `ip` cannot say."""
    try:
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, timeout=5, check=True)
        return parse_ip_addr(out.stdout)
    except (subprocess.SubprocessError, ValueError) as e:
        raise OSError(f"ip -j addr show: {e}") from e
