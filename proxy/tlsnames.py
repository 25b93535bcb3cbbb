"""The names a TLS ClientHello carries, read strictly from its raw extensions.

mitmproxy's `ClientHello.sni` answers None for every server_name extension it does not like (two names, a name that
is not a host, an IP literal, a second extension), and None reads as "no SNI", which an IP-literal CONNECT may send.
A server may still pick its virtual host by one of those names. So the extension is parsed here, and anything but
exactly one valid DNS host name is an error: what the gateway judges is the only name a server can read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from airlock.policy import HostError, canonical_host, is_ip
from airlock.policy.hosts import MAX_NAME_LENGTH

SERVER_NAME = 0  # extension type (RFC 6066 §3)
HOST_NAME = 0  # the only NameType ever defined
MAX_NAME_BYTES = MAX_NAME_LENGTH + 1  # one trailing dot, which canonical_host removes

# Every extension code point any Encrypted SNI / Encrypted Client Hello draft gave its extensions
# (draft-ietf-tls-esni-00 to -25, editor's copies included, and the whole 0xfe01-0xfe0d draft range): an old or
# experimental client must not hide the name it connects to behind a code point the gateway does not know.
# `ech_outer_extensions` only belongs in the inner (encrypted) hello; seen on the outer one it is ECH all the same.
ECH_EXTENSIONS: dict[int, str] = {
    **{code: "encrypted_client_hello, draft" for code in range(0xFE01, 0xFE0D)},
    0xFE0D: "encrypted_client_hello",
    0xFD00: "ech_outer_extensions",
    0xFE00: "outer_extensions, draft",
    0xFFCE: "encrypted_server_name, ESNI draft",
    0xFFCD: "outer_extension, draft",
    0xFF02: "encrypted_client_hello, draft",
    0xFF03: "ech_nonce, draft",
    0xFF04: "outer_extensions, draft",
    0xFF05: "outer_extension_binder, draft",
    0xFF08: "encrypted_client_hello, draft",
    0xDA09: "ech_is_inner, draft",
}


class TlsNameError(ValueError):
    """A server_name extension that is not exactly one valid DNS host name."""


def hidden_name(extensions: Iterable[tuple[int, bytes]]) -> int | None:
    """The first extension that encrypts the name the client connects to (ECH/ESNI), if any."""
    return next((kind for kind, _ in extensions if kind in ECH_EXTENSIONS), None)


def server_name(extensions: Iterable[tuple[int, bytes]]) -> str | None:
    """The canonical host the server_name extension names; None when the ClientHello has none.

    `extensions` are the raw (type, body) pairs of one ClientHello. Raises TlsNameError for anything else than
    one extension holding one host_name entry that is a valid DNS name (an IP address is not: RFC 6066 §3).
    """
    bodies = [body for kind, body in extensions if kind == SERVER_NAME]
    if not bodies:
        return None
    if len(bodies) > 1:
        raise TlsNameError(f"{len(bodies)} server_name extensions in one ClientHello")
    entries = _entries(bodies[0])
    if len(entries) != 1:
        raise TlsNameError(f"server_name list holds {len(entries)} names, not one")
    name_type, name = entries[0]
    if name_type != HOST_NAME:
        raise TlsNameError(f"server_name entry of type {name_type}, not host_name")
    return _dns_name(name)


def _entries(body: bytes) -> list[tuple[int, bytes]]:
    """The (name_type, name) entries of a ServerNameList: a 2-byte length that must cover exactly the rest."""
    if len(body) < 2:
        raise TlsNameError("server_name extension without a name list")
    length = int.from_bytes(body[:2])
    if length != len(body) - 2:
        raise TlsNameError(f"server_name list length {length}, but {len(body) - 2} bytes follow")
    return list(_split(body[2:]))


def _split(data: bytes) -> Iterator[tuple[int, bytes]]:
    at = 0
    while at < len(data):
        if len(data) - at < 3:
            raise TlsNameError("truncated server_name entry")
        name_type, length = data[at], int.from_bytes(data[at + 1 : at + 3])
        at += 3
        if at + length > len(data):
            raise TlsNameError("server_name entry runs past the end of its list")
        yield name_type, data[at : at + length]
        at += length


def _dns_name(raw: bytes) -> str:
    if not 1 <= len(raw) <= MAX_NAME_BYTES:
        raise TlsNameError(f"server name of {len(raw)} bytes (1 to {MAX_NAME_BYTES})")
    if not raw.isascii():
        raise TlsNameError(f"server name {raw!r} is not ASCII (internationalized names travel as punycode)")
    text = raw.decode("ascii")
    try:
        host = canonical_host(text)
    except HostError as e:
        raise TlsNameError(f"server name {e}") from None
    if is_ip(host):
        raise TlsNameError(f"server name {text!r} is an IP address, which SNI may not carry")
    return host
