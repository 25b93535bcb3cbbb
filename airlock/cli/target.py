"""The target `airlock policy explain` and `policy test`'s cases name: a URL or `host:port`."""

from __future__ import annotations

from urllib.parse import urlsplit

from airlock.policy import HostError, canonical_host

from .common import UsageError


def parse_target(text: str) -> tuple[str, int]:
    """A URL (`https://host/path`) or `host:port` → (canonical host, port)."""
    if "://" in text:
        try:
            parts = urlsplit(text)
        except ValueError as e:  # an unclosed [IPv6 bracket
            raise UsageError(f"{text!r}: {e}") from None
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise UsageError(f"{text!r}: only http:// and https:// URLs")
        if parts.username is not None or parts.password is not None:
            raise UsageError(f"{text!r}: URLs with userinfo are refused")
        try:
            explicit_port = parts.port
        except ValueError as e:
            raise UsageError(f"{text!r}: {e}") from None
        raw_host = parts.netloc.rsplit(":", 1)[0] if explicit_port else parts.netloc
        port = explicit_port or (443 if parts.scheme == "https" else 80)
    else:
        raw_host, sep, port_text = text.rpartition(":")
        if not sep or not port_text.isdigit():
            raise UsageError(f"{text!r}: give a URL or host:port")
        port = int(port_text)
    if not 1 <= port <= 65535:
        raise UsageError(f"{text!r}: port out of range")
    try:
        return canonical_host(raw_host), port
    except HostError as e:
        raise UsageError(str(e)) from None
