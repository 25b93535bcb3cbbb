"""The scrubber: each secret, in each form an echoing upstream writes it in, through every way a stream may cut the
body: masked byte for byte, lengths kept, nothing else touched."""

from __future__ import annotations

import base64
import html
import json
import random
import time
import urllib.parse
from collections.abc import Callable

import pytest

from airlock.inspection.scrub import Scrubber

SECRETS = [
    "sk-ant-api03-AbC_dEf-123.x~y",  # unreserved characters only: every text form is the raw one
    "ghp_9Zx/Yw+Vu=Ts",  # base64-ish: / + = escaped differently by each encoder
    "p@ss&<w0rd>\"'\\%/",  # everything JSON and HTML escape, a percent sign (raw in JSON, PHP's `\/` beside it)
]
rng = random.Random(14)
# A GitHub installation token as issued since 2026-04-27: `ghs_` and a JWT, some 520 characters (classic: 40).
INSTALLATION_JWT = "ghs_" + ".".join(
    base64.urlsafe_b64encode(rng.randbytes(n)).decode().rstrip("=") for n in (27, 90, 256)
)
LONG_TOO = [*SECRETS, INSTALLATION_JWT]


def _lower_hex(quoted: str) -> str:
    return "".join(part if i % 2 == 0 else part.lower() for i, part in enumerate(_split_escapes(quoted)))


def _split_escapes(quoted: str) -> list[str]:
    """`quoted` as alternating plain text and %XX escapes."""
    pieces, plain, i = [], "", 0
    while i < len(quoted):
        if quoted[i] == "%":
            pieces += [plain, quoted[i : i + 3]]
            plain, i = "", i + 3
        else:
            plain, i = plain + quoted[i], i + 1
    return [*pieces, plain]


def unreserved(char: str) -> bool:
    """Letters, digits and `-._~`, which no encoder escapes (RFC 3986), and the scrubber takes as written."""
    return char.isascii() and (char.isalnum() or char in "-._~")


TEXT_FORMS: dict[str, Callable[[str], str]] = {
    "raw": lambda s: s,
    "urllib quote, nothing safe": lambda s: urllib.parse.quote(s, safe=""),
    "urllib quote, / kept": urllib.parse.quote,
    "encodeURIComponent": lambda s: urllib.parse.quote(s, safe="!'()*~"),
    "form encoding": lambda s: urllib.parse.quote_plus(s, safe=""),
    "lowercase hex": lambda s: _lower_hex(urllib.parse.quote(s, safe="")),
    "JSON (Python)": lambda s: json.dumps(s)[1:-1],
    "JSON, / escaped (PHP)": lambda s: json.dumps(s)[1:-1].replace("/", "\\/"),
    "JSON, <>& escaped (Go)": lambda s: json.dumps(s)[1:-1].translate({60: "\\u003c", 62: "\\u003e", 38: "\\u0026"}),
    "JSON, all reserved escaped": lambda s: "".join(c if unreserved(c) else f"\\u{ord(c):04X}" for c in s),
    "HTML": html.escape,
    "HTML numeric": lambda s: "".join(c if unreserved(c) else f"&#{ord(c)};" for c in s),
    "HTML hex": lambda s: "".join(c if unreserved(c) else f"&#x{ord(c):x};" for c in s),
}


@pytest.mark.parametrize("form", TEXT_FORMS)
@pytest.mark.parametrize("secret", LONG_TOO)
def test_text_forms_are_masked_exactly(secret: str, form: str) -> None:
    written = TEXT_FORMS[form](secret).encode()
    body = b'{"echo": "' + written + b'", "n": 1}'
    assert Scrubber([secret]).scrub(body) == b'{"echo": "' + b"*" * len(written) + b'", "n": 1}'


def secret_characters(prefix: int, length: int) -> range:
    """The base64 characters that hold any bit of `length` bytes after `prefix` bytes."""
    return range(8 * prefix // 6, -(-8 * (prefix + length) // 6))


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("alphabet", [base64.b64encode, base64.urlsafe_b64encode])
@pytest.mark.parametrize(("prefix", "suffix"), [(p, s) for p in range(4) for s in range(3)])
@pytest.mark.parametrize("secret", LONG_TOO)
def test_base64_forms_at_every_alignment(
    secret: str, prefix: int, suffix: int, alphabet: Callable[[bytes], bytes], padded: bool
) -> None:
    blob = alphabet(rng.randbytes(prefix) + secret.encode() + rng.randbytes(suffix))
    blob = blob if padded else blob.rstrip(b"=")
    out = Scrubber([secret]).scrub(b"Basic " + blob + b"\r\n")
    assert out[:6] == b"Basic " and out[-2:] == b"\r\n" and len(out) == len(blob) + 8
    masked = out[6:-2]
    assert {masked[i] for i in secret_characters(prefix, len(secret.encode()))} == {ord("*")}
    outside = [i for i in range(len(blob)) if i not in secret_characters(prefix, len(secret.encode()))]
    assert all(masked[i] == blob[i] for i in outside)  # nothing of the other bytes is masked


def body_with_every_form(secret: str) -> bytes:
    """The secret in each text form and each base64 alignment, between ordinary JSON text."""
    parts = [TEXT_FORMS[form](secret).encode() for form in TEXT_FORMS]
    parts += [base64.b64encode(b"x" * p + secret.encode()) for p in range(3)]
    return b'{"a": "' + b'", "b": "'.join(parts) + b'"}\n'


def streamed(scrubber: Scrubber, chunks: list[bytes]) -> bytes:
    stream = scrubber.stream()
    return b"".join(stream(chunk) for chunk in [*chunks, b""])


@pytest.mark.parametrize("secret", SECRETS)
def test_a_stream_cut_anywhere_masks_as_the_whole_body(secret: str) -> None:
    scrubber = Scrubber([secret])
    body = body_with_every_form(secret)
    whole = scrubber.scrub(body)
    assert scrubber.scrub(whole) == whole and secret.encode() not in whole  # no form is left anywhere
    for cut in range(len(body) + 1):
        assert streamed(scrubber, [body[:cut], body[cut:]]) == whole, cut
    assert streamed(scrubber, [body[i : i + 1] for i in range(len(body))]) == whole  # one byte at a time
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(body)), 6))
        assert streamed(scrubber, [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]) == whole


def test_a_long_token_streamed_in_small_chunks_is_masked_as_the_whole_body() -> None:
    """A 520-character token: the stream holds back enough to see any of its forms whole, wherever a chunk ends."""
    scrubber = Scrubber([INSTALLATION_JWT])
    body = body_with_every_form(INSTALLATION_JWT)
    whole = scrubber.scrub(body)
    assert INSTALLATION_JWT.encode() not in whole and whole.count(b"*") > 14 * len(INSTALLATION_JWT)
    for size in (1, 7, 100, 519, 520, 521, 4096):
        assert streamed(scrubber, [body[i : i + size] for i in range(0, len(body), size)]) == whole, size


@pytest.mark.parametrize("length", range(1, 65))
def test_secrets_of_every_length(length: int) -> None:
    secret = "".join(
        rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./+=") for _ in range(length)
    )
    scrubber = Scrubber([secret])
    for written in (secret, urllib.parse.quote(secret, safe=""), json.dumps(secret)[1:-1].replace("/", "\\/")):
        assert scrubber.scrub(b"<" + written.encode() + b">") == b"<" + b"*" * len(written) + b">"
    for prefix in (0, 2) if length == 1 else range(3):  # one byte after one: no base64 character is all its bits
        blob = base64.b64encode(rng.randbytes(prefix) + secret.encode() + rng.randbytes(2))
        masked = scrubber.scrub(blob)
        assert {masked[i] for i in secret_characters(prefix, length)} == {ord("*")}, (prefix, secret)
    body = body_with_every_form(secret)
    cut = rng.randrange(len(body))
    assert streamed(scrubber, [body[:cut], body[cut:]]) == scrubber.scrub(body)


def test_overlapping_secrets_leave_no_piece_of_either() -> None:
    scrubber = Scrubber(["abcdef", "defghi", "cde", "abcdefghijkl"])
    assert scrubber.scrub(b"..abcdefghi..") == b"..*********.."
    assert scrubber.scrub(b"..abcdefghijkl..") == b"..************.."
    assert scrubber.scrub(b"..xcdex..defghi..") == b"..x***x..******.."
    body = b"start abcdefghi abcdefghijkl cdefghi end"
    whole = scrubber.scrub(body)
    assert whole == b"start ********* ************ ******* end"
    for cut in range(len(body) + 1):
        assert streamed(scrubber, [body[:cut], body[cut:]]) == whole


def test_where_two_schemes_match_the_longer_is_masked() -> None:
    """`ab\\` raw ends one byte before its JSON form does, at the same place: no stray byte of the escape stays."""
    assert Scrubber(["ab\\"]).scrub(b'{"k": "ab\\\\"}') == b'{"k": "****"}'


def test_a_secret_repeated_and_overlapping_itself() -> None:
    assert Scrubber(["abab"]).scrub(b"xabababx") == b"x******x"
    assert Scrubber(["aa"]).scrub(b"aaa") == b"***"


def test_a_body_without_secrets_is_unchanged_byte_for_byte() -> None:
    scrubber = Scrubber(SECRETS)
    body = (
        rng.randbytes(200_000)
        + json.dumps({"text": "Hello! " * 1000, "b64": base64.b64encode(rng.randbytes(3000)).decode()}).encode()
    )
    assert scrubber.scrub(body) is body
    cuts = sorted(rng.sample(range(len(body)), 50))
    assert streamed(scrubber, [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]) == body


def test_a_secret_holding_the_mask_gets_another_mask() -> None:
    scrubber = Scrubber(["tok*en"])
    out = scrubber.scrub(b"atok*en tok*en*")
    assert out == b"a!!!!!! !!!!!!*" and scrubber.scrub(out) == out


def test_no_secrets() -> None:
    scrubber = Scrubber(["", ""])
    assert scrubber.scrub(b"anything") == b"anything"
    assert streamed(scrubber, [b"any", b"thing"]) == b"anything"


def test_an_empty_chunk_mid_body_sends_early_and_the_stream_goes_on() -> None:
    """An HTTP/2 upstream's empty DATA frame reaches the stream as b"": what is held goes out then, and a secret
    that starts later is masked all the same."""
    scrubber = Scrubber(["secret-value-1234"])
    stream = scrubber.stream()
    sent = stream(b"head ") + stream(b"") + stream(b"secret-value-1234 tail") + stream(b"")
    assert sent == b"head ***************** tail"


@pytest.mark.parametrize("char", ["\\", "%", "&", '"', "/"])
def test_runs_of_escaped_characters_take_linear_time(char: str) -> None:
    """Bodies of near-matches for a secret that is a run of one character JSON, URLs or HTML escape: each match is
    tried in time linear in its length (a pattern where a raw backslash also begins the escape `\\\\` took
    exponential time on a run of backslashes one short of the secret)."""
    secret = char * 64
    scrubber = Scrubber([secret])
    started = time.perf_counter()
    short = (char * 63 + "X").encode() * 100  # one short of the raw secret, and of every escaped form
    assert scrubber.scrub(short) == short
    for written in (json.dumps(secret)[1:-1], urllib.parse.quote(secret, safe=""), html.escape(secret)):
        assert scrubber.scrub(written.encode()) == b"*" * len(written)
        scrubber.scrub((written[:-1] + "X").encode() * 100)
    assert scrubber.scrub(char.encode() * 10_000) == b"*" * 10_000
    assert time.perf_counter() - started < 2


def test_non_ascii_secrets() -> None:
    secret = "pässwörd-€"
    scrubber = Scrubber([secret])
    for written in (secret, urllib.parse.quote(secret, safe="")):
        assert scrubber.scrub(f"[{written}]".encode()) == b"[" + b"*" * len(written.encode()) + b"]"
