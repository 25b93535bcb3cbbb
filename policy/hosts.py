"""One canonical form for every host the gateway is asked about.

A host is either an IP address (judged as that address, however it was spelled) or a DNS name in lowercase
punycode without a trailing dot. Anything else is refused here, before any rule or resolver sees it.
"""

from __future__ import annotations

import ipaddress
import re

import idna

type IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_NAME_LENGTH = 253
MAX_LABEL_LENGTH = 63
# Used with fullmatch: `$` also matches before a final newline, and int() then ignored it (`127.0.0.1\n`).
# Digits are spelled [0-9] because `\d` and str.isdigit() accept non-ASCII digits.
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")
_NUMERIC_PART = re.compile(r"0[xX][0-9a-fA-F]*|[0-9]+")
# Whitespace (Unicode's, not only ASCII's) and C0/C1 control characters: never part of any host.
_SPACE_OR_CONTROL = re.compile(r"[\s\x00-\x1f\x7f-\x9f]")
# Characters that never belong in a name: URL structure, userinfo, zone IDs, brackets.
_FORBIDDEN = re.compile(r"[@/\\?#%\[\]<>\"'`{}|^,;:*=+!$&()~]")


class HostError(ValueError):
    """The text cannot be a host we are willing to judge."""


def parse_ipv4_libc(text: str) -> ipaddress.IPv4Address | None:
    """Parse IPv4 the way libc's inet_aton does: 1-4 parts, each decimal, 0x-hex or 0-octal.

    `2130706433`, `0x7f.1`, `0177.0.0.1` and `127.1` all mean 127.0.0.1 to curl, Python and the kernel's
    callers, so they must mean it to the policy too. Returns None when the text is not numeric at all.
    Raises HostError when it looks numeric but is out of range (e.g. `256.1.1.1`, `1.2.3.4.5`).
    """
    parts = text.split(".")
    if not all(_NUMERIC_PART.fullmatch(p) for p in parts):
        return None
    if len(parts) > 4:
        raise HostError(f"{text!r}: too many parts for an IPv4 address")
    values = [_parse_ipv4_part(p, text) for p in parts]
    # The last part fills all the bytes the earlier parts left: a.b.c.d, a.b.(16 bits), a.(24 bits), (32 bits).
    last_bits = 8 * (5 - len(values))
    if any(v > 0xFF for v in values[:-1]) or values[-1] >= 1 << last_bits:
        raise HostError(f"{text!r}: IPv4 part out of range")
    number = values[-1]
    for index, value in enumerate(values[:-1]):
        number |= value << (24 - 8 * index)
    return ipaddress.IPv4Address(number)


def _parse_ipv4_part(part: str, whole: str) -> int:
    try:
        if part[:2].lower() == "0x":
            return int(part[2:], 16) if len(part) > 2 else 0
        if len(part) > 1 and part.startswith("0"):
            return int(part, 8)
        return int(part, 10)
    except ValueError:
        raise HostError(f"{whole!r}: bad IPv4 part {part!r}") from None


def parse_ip_literal(text: str) -> IPAddress | None:
    """An IP address in any accepted spelling, or None if the text is not an address literal.

    IPv6 may come bracketed (as in URLs and CONNECT). Zone IDs (`fe80::1%eth0`) are refused: they name an
    interface of the gateway, never a remote host.
    """
    if _SPACE_OR_CONTROL.search(text):
        raise HostError(f"{text!r}: forbidden character in host (whitespace or control)")
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
        if ":" not in text:
            raise HostError(f"[{text}]: brackets are only for IPv6 addresses")
    if ":" in text:
        if "%" in text:
            raise HostError(f"{text!r}: IPv6 zone IDs are not allowed")
        try:
            return ipaddress.IPv6Address(text)
        except ValueError:
            raise HostError(f"{text!r}: not a valid IPv6 address") from None
    # One trailing dot is the root label (`127.0.0.1.` still means 127.0.0.1); `127.0.0.1..` is no address.
    return parse_ipv4_libc(text[:-1] if text.endswith(".") else text)


def canonical_host(raw: str) -> str:
    """Canonical text for a host: a compressed IP address, or a lowercase IDNA name without trailing dot."""
    if not isinstance(raw, str) or not raw:
        raise HostError("empty host")
    if _is_canonical_name(raw):
        return raw
    ip = parse_ip_literal(raw)
    if ip is not None:
        return str(ip)
    name = raw[:-1] if raw.endswith(".") else raw
    if not name or _FORBIDDEN.search(name):
        raise HostError(f"{raw!r}: forbidden character in host")
    if name.isascii():
        name = name.lower()
    else:
        try:
            name = idna.encode(name, uts46=True).decode("ascii")
        except idna.IDNAError as e:
            raise HostError(f"{raw!r}: invalid internationalized name ({e})") from None
    _check_name(raw, name)
    return name


# The characters of a name already in canonical form: lowercase ASCII, no punycode, no trailing dot (what most
# rules and requests name).
_CANONICAL_CHARS = re.compile(r"[a-z0-9_.-]+")


def _is_canonical_name(raw: str) -> bool:
    """Whether `raw` is a name canonical_host would return unchanged, told without its full checks: labels of 1 to
    63 of those characters that neither start nor end with `-`, the last one not numeric (so no IPv4 spelling; no
    ':', so no IPv6 address). Substring tests, not one regex of labels: this runs for every rule of a large
    policy, and backtracking over labels cost twice as much."""
    if len(raw) > MAX_NAME_LENGTH or not _CANONICAL_CHARS.fullmatch(raw) or "xn--" in raw:
        return False
    if raw[0] in ".-" or raw[-1] in ".-" or ".." in raw or ".-" in raw or "-." in raw:
        return False
    if len(raw) > MAX_LABEL_LENGTH and max(map(len, raw.split("."))) > MAX_LABEL_LENGTH:
        return False
    last = raw[raw.rfind(".") + 1 :]
    return not last[0].isdigit() or _NUMERIC_PART.fullmatch(last) is None  # most end in a letter: no regex run


def _check_name(raw: str, name: str) -> None:
    if len(name) > MAX_NAME_LENGTH:
        raise HostError(f"{raw!r}: name longer than {MAX_NAME_LENGTH} characters")
    labels = name.split(".")
    for label in labels:
        if not _LABEL.fullmatch(label):
            raise HostError(f"{raw!r}: invalid label {label!r}")
        if label.startswith("xn--"):
            try:
                idna.decode(label)
            except idna.IDNAError:
                raise HostError(f"{raw!r}: invalid punycode label {label!r}") from None
    # A name ending in a numeric label is a mangled IP address (e.g. `1.2.3.999`), never a real host.
    if _NUMERIC_PART.fullmatch(labels[-1]):
        raise HostError(f"{raw!r}: last label is numeric but the host is not an IP address")


def is_ip(host: str) -> bool:
    """True for a host already in canonical form that is an IP address."""
    return ":" in host or host.replace(".", "").isdigit()


def is_single_label(host: str) -> bool:
    """True for a canonical name of one label (`vm`, `localhost`): a machine's own name, which its /etc/hosts
    answers, or a short name a local search list completes — never a name the gateway resolves (it asks upstream
    for names as they are, with no search list)."""
    return "." not in host and not is_ip(host)


def format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
