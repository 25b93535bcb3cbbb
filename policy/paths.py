"""Request paths of inspected hosts: one canonical form, and a refusal for every spelling servers may read apart.

The gateway judges a path and forwards the very form it judged, so the canonical form must mean one thing to any
upstream: no dot segments, no repeated slashes, unreserved characters never percent-encoded, every other escape in
uppercase hex. A spelling whose meaning depends on the server that decodes it (an encoded `/`, `\\` or `.`, a
double encoding, overlong UTF-8, `;` path parameters, NUL) is refused, not guessed at: a rule about `/a/b` must
not be met by one server's reading and bypassed by another's.
"""

from __future__ import annotations

import re
import unicodedata

from .codes import ReasonCode

MAX_PATH_LENGTH = 8192  # bytes of the path as sent: what common servers accept for a whole request line
# RFC 3986 pchar and "/" (sub-delims without ";", which servers read as path parameters and strip before routing).
_RAW_ALLOWED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+,=:@/")
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_~")  # "." is refused
_HEX = frozenset("0123456789ABCDEFabcdef")
_DOUBLE_ENCODED = re.compile(r"%25[0-9A-Fa-f]{2}")
# What an encoded character must not normalize to (NFKC, as some frameworks apply): U+FF0E U+FF0E U+FF0F is "../".
_NORMALIZES_TO = frozenset("/\\.%;?#\x00")
# Slashes NFKC leaves alone but Windows' best-fit conversions (IIS, ANSI file APIs) read as "/" or "\".
_SLASH_LOOKALIKES = frozenset("\u2044\u2215\u2216\u29f5\u29f8\u29f9")
# What an absolute-form target's authority may hold (RFC 3986): a "\" there starts the path for some parsers.
_AUTHORITY = re.compile(r"[A-Za-z0-9\-._~%!$&'()*+,;=:@\[\]]*")
_QUERY_REFUSED = re.compile(r"[^\x21-\x7e]|#")  # controls, space, non-ASCII; a fragment is never sent


class PathError(ValueError):
    """A request target the gateway refuses to judge; `reason` names what in it is ambiguous."""

    def __init__(self, code: ReasonCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _ambiguous(reason: str) -> PathError:
    return PathError(ReasonCode.AMBIGUOUS_PATH, reason)


def split_target(target: str) -> tuple[str, str | None]:
    """A request target (origin-form `/p?q`, or absolute-form `http://host/p?q`) as (path as sent, query or None).
    The query is not judged, but it is forwarded: it must hold no control, space, non-ASCII or `#`."""
    if target[:1] != "/" and "://" in target and target.split("://", 1)[0].lower() in {"http", "https"}:
        rest = target.split("://", 1)[1]
        start = min((i for i in (rest.find("/"), rest.find("?")) if i != -1), default=len(rest))
        if not _AUTHORITY.fullmatch(rest[:start]):
            raise _ambiguous("the target's authority holds a character no host or port may hold")
        target = rest[start:]
        if not target.startswith("/"):
            target = "/" + target  # `http://host` and `http://host?q` ask for the root
    path, mark, query = target.partition("?")
    if mark and _QUERY_REFUSED.search(query):
        raise _ambiguous("the query holds a control character, space, non-ASCII character or '#'")
    return path, query if mark else None


def canonical_path(raw: str) -> str:
    """The canonical form of a path as sent (no query), or PathError naming why it is ambiguous."""
    if len(raw) > MAX_PATH_LENGTH:
        raise _ambiguous(f"the path is longer than {MAX_PATH_LENGTH} characters")
    if not raw.startswith("/"):
        raise _ambiguous("the path does not start with '/'")
    decoded = _decode(raw)
    if _DOUBLE_ENCODED.search(decoded):
        raise _ambiguous("'%25' followed by hex digits: a double encoding, which a second decoding would change")
    segments = decoded.split("/")[1:]
    canonical = _remove_dot_segments(_collapse(segments))
    if canonical != _collapse(_remove_dot_segments(segments)):
        raise _ambiguous("'..' after repeated slashes: servers disagree on which segment it removes")
    return "/" + "/".join(canonical)


def _decode(raw: str) -> str:
    """`raw` with unreserved escapes decoded, others in uppercase hex; every character and escape checked."""
    out: list[str] = []
    i = 0
    while i < len(raw):
        char = raw[i]
        if char != "%":
            _check_raw(char)
            out.append(char)
            i += 1
            continue
        run, i = _escapes(raw, i)
        out.append(_decode_run(run))
    return "".join(out)


def _check_raw(char: str) -> None:
    if char in _RAW_ALLOWED:
        return
    if char == "\x00":
        raise _ambiguous("the path holds a NUL")
    if char == "\\":
        raise _ambiguous("the path holds '\\', which some servers read as '/'")
    if char == ";":
        raise _ambiguous("the path holds ';': path parameters, which servers strip or keep as they please")
    if not char.isascii():
        raise _ambiguous("the path holds a raw non-ASCII character (percent-encode its UTF-8)")
    if not char.isprintable() or char == " ":
        raise _ambiguous("the path holds a control character or space")
    raise _ambiguous(f"the path holds {char!r}, which a path may not hold unencoded")


def _escapes(raw: str, start: int) -> tuple[bytes, int]:
    """The bytes of the run of %XX escapes at `start`, and where the run ends."""
    run = bytearray()
    i = start
    while i < len(raw) and raw[i] == "%":
        digits = raw[i + 1 : i + 3]
        if len(digits) != 2 or not set(digits) <= _HEX:
            raise _ambiguous("a malformed percent-escape ('%' not followed by two hex digits)")
        run.append(int(digits, 16))
        i += 3
    return bytes(run), i


def _decode_run(run: bytes) -> str:
    """One run of escaped bytes: unreserved ASCII decoded, the rest kept encoded; non-ASCII must be UTF-8 whose
    characters normalize to nothing a path's structure depends on."""
    out: list[str] = []
    i = 0
    while i < len(run):
        byte = run[i]
        if byte < 0x80:
            out.append(_decode_ascii(byte))
            i += 1
            continue
        end = i
        while end < len(run) and run[end] >= 0x80:
            end += 1
        _check_utf8(run[i:end])
        out.append("".join(f"%{b:02X}" for b in run[i:end]))
        i = end
    return "".join(out)


def _decode_ascii(byte: int) -> str:
    if byte in _UNRESERVED:
        return chr(byte)
    if byte == 0:
        raise _ambiguous("the path holds an encoded NUL (%00)")
    problems = {
        ord("/"): "an encoded '/' (%2F): one server splits there, another does not",
        ord("\\"): "an encoded '\\' (%5C), which some servers read as '/'",
        ord("."): "an encoded '.' (%2E): dot segments must be written plainly, or not at all",
    }
    if byte in problems:
        raise _ambiguous(f"the path holds {problems[byte]}")
    if byte < 0x20 or byte == 0x7F:
        raise _ambiguous("the path holds an encoded control character")
    return f"%{byte:02X}"


def _check_utf8(encoded: bytes) -> None:
    try:
        text = encoded.decode("utf-8")  # strict: refuses overlong forms, surrogates, lone continuation bytes
    except UnicodeDecodeError:
        raise _ambiguous("percent-encoded bytes that are not valid UTF-8 (overlong or truncated forms)") from None
    for char in text:
        if char in _SLASH_LOOKALIKES or set(unicodedata.normalize("NFKC", char)) & _NORMALIZES_TO:
            raise _ambiguous(f"an encoded U+{ord(char):04X}, which some servers read as '/', '\\', '.' or the like")


def _collapse(segments: list[str]) -> list[str]:
    """Repeated slashes as one: the empty segments dropped, but a trailing one (a directory's `/`)."""
    return [segment for segment in segments[:-1] if segment] + segments[-1:]


def _remove_dot_segments(segments: list[str]) -> list[str]:
    """RFC 3986 5.2.4 over the segments after the root; PathError for a `..` that would climb above it."""
    out: list[str] = []
    for index, segment in enumerate(segments):
        if segment not in (".", ".."):
            out.append(segment)
            continue
        if segment == "..":
            if not out:
                raise _ambiguous("'..' climbs above the root")
            out.pop()
        if index == len(segments) - 1:
            out.append("")  # `/a/b/..` is the directory `/a/`
    return out
