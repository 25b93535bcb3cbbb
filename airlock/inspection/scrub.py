"""The secrets the gateway injects, masked out of everything an inspected response brings the sandbox (body and
header values), in the forms an upstream that echoes a request would write them in:

- as text: raw; as a URL writes it (percent-encoding, either hex case, `+` for a space); as a JSON string (`\\/`,
  `\\"`, `\\\\`, `\\u00XX`); as HTML text (`&amp;`, `&#NN;`, `&#xNN;` …). Within each, any character an encoder
  may escape is found escaped or not (one encoder escapes `/`, another keeps it), but the three are not mixed in
  one occurrence: so each character's options are prefix-free (none begins another), at most one can match at
  any place, and a match is tried in time linear in its length (a mixed pattern, where a raw `\\` also begins the
  escape `\\\\`, tried paths exponential in a run of backslashes). Unreserved characters (letters, digits, `-._~`)
  are taken as written: encoders leave them.
- in base64, standard and URL-safe alphabets (either, even mixed), at each of the three byte alignments it can
  have inside a longer blob (`user:secret` in a Basic header), with or without padding: the characters wholly
  made of the secret's bits, and the one at each end that holds some of them when it is consistent with the secret.

It is a guard against reflection (an error page or an echo service quoting the injected header), not against an
upstream that wants the secret out: hex, reversal, compression, line-wrapped base64 or any other transform the
sandbox can ask an echo service for are not recognised. A compressed body must be decoded before it is scrubbed.

Each match is replaced by as many `*` as it has bytes (another mask byte when a secret holds `*`): lengths stay as
they were, so a Content-Length, chunk sizes and offsets inside a binary format remain true, and nothing needs
re-framing. Every occurrence of every form is masked, overlapping ones included (two secrets sharing characters
leave no piece of either), and as the mask byte is in none of the forms, the output holds none of them either.

Speed: one regular expression per form (four per secret: the text schemes joined, three base64 alignments), each
beginning with a literal, so that sre runs its fast literal search (~2 GB/s here) where one alternation of every
form tests each position against each branch. The cost grows with the number of secrets: `bench/scrub.py` measures
it.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_JSON_SHORT = {
    ord('"'): b'\\"',
    ord("\\"): b"\\\\",
    ord("/"): b"\\/",
    8: b"\\b",
    9: b"\\t",
    10: b"\\n",
    12: b"\\f",
    13: b"\\r",
}
_HTML_NAMED = {ord("&"): b"&amp;", ord("<"): b"&lt;", ord(">"): b"&gt;", ord('"'): b"&quot;", ord("'"): b"&apos;"}
_MASK_CANDIDATES = b"*!$^|?@"  # none is a base64, hex or escape character: only a raw secret can hold one
_B64_ALPHABETS = (
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/",
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_",
)


@dataclass(frozen=True, slots=True)
class _Form:
    """One way a secret is written: its pattern, the longest match it can have, (base64) the characters that may
    stand just before and after a match holding part of the secret's bits, and (text) the patterns `pattern` joins:
    at a match, the longest of theirs is masked."""

    pattern: re.Pattern[bytes]
    longest: int
    before: frozenset[int] = frozenset()
    after: frozenset[int] = frozenset()
    variants: tuple[re.Pattern[bytes], ...] = ()


class Scrubber:
    """Masks `secrets` (UTF-8) and their forms; immutable, shareable between threads and flows."""

    def __init__(self, secrets: Iterable[str]) -> None:
        raw = sorted({s.encode() for s in secrets if s})
        self._forms = [form for secret in raw for form in _forms(secret)]
        self._mask = next((bytes([b]) for b in _MASK_CANDIDATES if not any(b in s for s in raw)), b"*")
        # A stream holds this many bytes back, and keeps as many it sent as context: a match that reaches into what
        # it sends is then seen whole (a base64 character after it, if not yet come, is masked with the next send).
        self.window = max((f.longest for f in self._forms), default=0)

    def scrub(self, data: bytes) -> bytes:
        """`data` (a whole body, a header value) with every form of every secret masked; `data` itself if none."""
        return self._masked(data)

    def stream(self) -> Callable[[bytes], bytes]:
        """A callable for mitmproxy's `flow.response.stream`: each chunk in, the scrubbed bytes that can be sent
        out (up to `window` bytes are held back, so that a secret split across chunks is still found whole); the
        empty chunk that ends the message sends what is held. An empty chunk mid-body (an HTTP/2 upstream may send
        an empty DATA frame) sends it early: a secret that straddles that point is then masked only past it."""
        return _Stream(self)

    def _masked(self, data: bytes, start: int = 0, stop: int | None = None) -> bytes:
        """`data[start:stop]` with every match that reaches into it masked (matches are found in all of `data`:
        the bytes around are context, already sent or still to come)."""
        stop = len(data) if stop is None else stop
        spans = [span for form in self._forms for span in _matches(form, data) if span[1] > start and span[0] < stop]
        if not spans:
            return data[start:stop]
        out = bytearray(data[start:stop])
        for begin, end in spans:
            begin, end = max(begin, start) - start, min(end, stop) - start
            out[begin:end] = self._mask * (end - begin)
        return bytes(out)


class _Stream:
    def __init__(self, scrubber: Scrubber) -> None:
        self._scrubber = scrubber
        self._sent = b""  # the last bytes sent (as they came, unmasked): a match may begin in them
        self._held = b""  # bytes not sent yet: a match may end in the next chunk

    def __call__(self, chunk: bytes) -> bytes:
        window = self._scrubber.window
        data = self._sent + self._held + chunk
        start = len(self._sent)
        end = len(data) - window if chunk else len(data)
        if end <= start:
            self._held = data[start:]
            return b""
        out = self._scrubber._masked(data, start, end)
        self._sent, self._held = data[max(0, end - window) : end], data[end:]
        return out


def _matches(form: _Form, data: bytes) -> Iterable[tuple[int, int]]:
    """Every match of `form` in `data`, overlapping ones too, widened by a partial base64 character at each end."""
    position = 0
    while (match := form.pattern.search(data, position)) is not None:
        begin, end = match.span()
        if form.variants:
            end = max(m.end() for variant in form.variants if (m := variant.match(data, begin)) is not None)
        if begin > 0 and data[begin - 1] in form.before:
            begin -= 1
        if end < len(data) and data[end] in form.after:
            end += 1
        yield begin, end
        position = match.start() + 1


def _forms(secret: bytes) -> list[_Form]:
    return [_text_form(secret), *filter(None, map(partial(_base64_form, secret), range(3)))]


def _text_form(secret: bytes) -> _Form:
    """The secret as URLs, JSON and HTML write it (and raw, when none of those can be raw): one pattern of the
    schemes that differ, which sre searches once for the literal they begin with."""
    schemes = {_scheme_pattern(secret, escapes) for escapes in (_url_escapes, _json_escapes, _html_escapes)}
    if not any(re.fullmatch(pattern, secret) for pattern, _ in schemes):  # it holds `%`, `\\` or `"`, and `&`
        schemes.add((re.escape(secret), len(secret)))
    patterns = sorted(pattern for pattern, _ in schemes)
    variants = tuple(map(re.compile, patterns)) if len(patterns) > 1 else ()
    return _Form(re.compile(b"|".join(patterns)), max(longest for _, longest in schemes), variants=variants)


def _scheme_pattern(secret: bytes, escapes: Callable[[int], list[bytes]]) -> tuple[bytes, int]:
    """The pattern of the secret written in one scheme, and its longest match."""
    options = [[bytes([byte])] if byte in _UNRESERVED else sorted(set(escapes(byte))) for byte in secret]
    pattern = b"".join(
        re.escape(choices[0]) if len(choices) == 1 else b"(?:" + b"|".join(map(re.escape, choices)) + b")"
        for choices in options
    )
    return pattern, sum(max(map(len, choices)) for choices in options)


def _url_escapes(byte: int) -> list[bytes]:
    """Percent-encoded or, as encoders differ on which reserved characters they escape, raw; `%` always escaped."""
    raw = [] if byte == ord("%") else [b"+", b" "] if byte == ord(" ") else [bytes([byte])]
    return [*raw, *{b"%%%02X" % byte, b"%%%02x" % byte}]


def _json_escapes(byte: int) -> list[bytes]:
    """Raw (where JSON allows it) or escaped: `\\u00XX` for any ASCII character, the short escapes."""
    if byte >= 0x80:
        return [bytes([byte])]  # UTF-8 as is (`\\u` escapes of code points are not looked for)
    raw = [] if byte < 0x20 or byte in b'"\\' else [bytes([byte])]
    return [*raw, *{b"\\u%04X" % byte, b"\\u%04x" % byte}, *([_JSON_SHORT[byte]] if byte in _JSON_SHORT else [])]


def _html_escapes(byte: int) -> list[bytes]:
    """Raw (but `&`) or a character reference: decimal, hex in either case, the named ones."""
    if byte >= 0x80:
        return [bytes([byte])]
    raw = [] if byte == ord("&") else [bytes([byte])]
    numeric = {b"&#%d;" % byte, b"&#x%X;" % byte, b"&#x%x;" % byte}
    return [*raw, *numeric, *([_HTML_NAMED[byte]] if byte in _HTML_NAMED else [])]


def _base64_form(secret: bytes, offset: int) -> _Form | None:
    """The secret in base64 after `offset` bytes of a 3-byte group: the characters all of whose 6 bits are the
    secret's (either alphabet at each), and the characters that may hold its first and last bits. None when no
    character is all the secret's (a 1-byte secret at offset 1)."""
    bits_from, bits_to = 8 * offset, 8 * (offset + len(secret))
    first, last = -(-bits_from // 6), bits_to // 6  # the characters wholly inside the secret's bits
    if first >= last:
        return None
    encoded = base64.b64encode(bytes(offset) + secret + bytes(2))
    pattern = b"".join(_either_alphabet(c) for c in encoded[first:last])
    before = _partial(encoded[first - 1], 6 - (bits_from - 6 * (first - 1)), low=True) if bits_from % 6 else set()
    after = _partial(encoded[last], bits_to - 6 * last, low=False) if bits_to % 6 else set()
    return _Form(re.compile(pattern), last - first, frozenset(before), frozenset(after))


def _either_alphabet(char: int) -> bytes:
    index = _B64_ALPHABETS[0].index(char)
    standard, url_safe = _B64_ALPHABETS[0][index], _B64_ALPHABETS[1][index]
    if standard == url_safe:
        return bytes([char])
    return b"[" + re.escape(bytes([standard])) + re.escape(bytes([url_safe])) + b"]"


def _partial(char: int, bits: int, low: bool) -> set[int]:
    """The characters (either alphabet) whose `bits` low (or high) bits equal those of `char`'s value."""
    value = _B64_ALPHABETS[0].index(char)
    mask = (1 << bits) - 1 if low else ((1 << bits) - 1) << (6 - bits)
    return {alphabet[v] for alphabet in _B64_ALPHABETS for v in range(64) if v & mask == value & mask}
