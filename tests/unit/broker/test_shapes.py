"""The broker's edges in isolation: JSON parsed within limits, upstream shapes, and the one redactor."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import pytest

from airlock.audit import AuditRecord
from airlock.broker.redact import MARK, Redactor, clip
from airlock.broker.shapes import (
    BOOL,
    POSITIVE_INT,
    TEXT,
    WEB_URL,
    JsonLimitError,
    ShapeError,
    conforming,
    loads,
    nesting,
)

# --- nesting, counted before the recursive parser sees it ---------------------------------------------------------

NESTING = [
    pytest.param("1", 0, id="scalar"),
    pytest.param("[]", 1, id="array"),
    pytest.param('{"a": [{"b": []}]}', 4, id="mixed"),
    pytest.param("[[], [], [[]]]", 3, id="siblings"),
    pytest.param('"[[[{{{"', 0, id="brackets-in-a-string"),
    pytest.param(r'["\"[[[", "\\", ["x"]]', 2, id="escaped-quote-and-backslash"),
    pytest.param(r'["\\\"]]]]"]', 1, id="escaped-backslash-then-escaped-quote"),
    pytest.param('["unterminated [[[[', 1, id="unterminated-string-runs-to-the-end"),
    pytest.param("[" * 50, 9, id="stops-counting-past-the-limit"),
]


@pytest.mark.parametrize(("text", "depth"), NESTING)
def test_nesting_counts_brackets_outside_strings(text: str, depth: int) -> None:
    assert nesting(text, 8) == depth


@pytest.mark.parametrize(
    "text",
    ['"' + '\\"' * 200_000 + "\\", '"' * 200_000, "[" * 200_000, '["' + "\\\\" * 200_000],
    ids=["escaped-quotes-unterminated", "many-quotes", "many-brackets", "many-escapes"],
)
def test_nesting_is_linear_on_hostile_text(text: str) -> None:
    started = time.monotonic()
    nesting(text, 8)
    assert time.monotonic() - started < 1.0  # a quadratic scan of 400 KB takes minutes


def test_loads_refuses_deep_nesting_before_parsing() -> None:
    with pytest.raises(JsonLimitError):
        loads(b"[" * 20_000 + b"]" * 20_000, 32)
    assert loads(b"[" * 32 + b"]" * 32, 32) is not None
    with pytest.raises(JsonLimitError):
        loads(b"[" * 33 + b"]" * 33, 32)


@pytest.mark.parametrize(
    "data", [b"\xff{}", b"\xef\xbb\xbf{}", b"{", b"1" * 5000], ids=["not-utf8", "bom", "truncated", "5000-digits"]
)
def test_loads_raises_value_error_for_what_is_not_json(data: bytes) -> None:
    with pytest.raises(ValueError):
        loads(data, 8)


# --- shapes ---------------------------------------------------------------------------------------------------------

SHAPE = {"number": POSITIVE_INT, "url": WEB_URL, "draft": BOOL, "head": {"ref": TEXT}}
GOOD = {"number": 3, "url": "https://x.test/3", "draft": False, "head": {"ref": "agent/x"}, "ignored": [1]}


def test_conforming_value_is_returned_whole() -> None:
    assert conforming(GOOD, SHAPE, "a pull") is GOOD


CONFORMING_FAILURES = [
    pytest.param([], "the answer is not an object", id="not-an-object"),
    pytest.param({k: v for k, v in GOOD.items() if k != "url"}, "url is missing", id="missing"),
    pytest.param(GOOD | {"number": True}, "number is not a positive integer", id="bool-is-not-int"),
    pytest.param(GOOD | {"number": "3"}, "number is not a positive integer", id="numeric-string"),
    pytest.param(GOOD | {"number": 0}, "number is not a positive integer", id="zero"),
    pytest.param(GOOD | {"draft": 0}, "draft is not a boolean", id="int-is-not-bool"),
    pytest.param(GOOD | {"url": "https://x.test/\r\nSet-Cookie: a"}, "url is not an http(s) URL", id="crlf"),
    pytest.param(GOOD | {"url": "ftp://x.test/"}, "url is not an http(s) URL", id="scheme"),
    pytest.param(GOOD | {"head": "agent/x"}, "head is not an object", id="nested-not-object"),
    pytest.param(GOOD | {"head": {"ref": ""}}, "head.ref is not printable text", id="nested-empty"),
    pytest.param(GOOD | {"head": {"ref": "x" * 3000}}, "head.ref is not printable text", id="nested-too-long"),
]


@pytest.mark.parametrize(("value", "problem"), CONFORMING_FAILURES)
def test_conforming_names_the_first_bad_field_never_its_value(value: Any, problem: str) -> None:
    with pytest.raises(ShapeError) as caught:
        conforming(value, SHAPE, "a pull")
    assert str(caught.value).startswith(f"a pull: {problem}")
    assert "Set-Cookie" not in str(caught.value)


# --- the redactor -------------------------------------------------------------------------------------------------

TOKEN = "ghs_" + "A1b2C3d4" * 4 + "zz"
# An installation token as GitHub issues them since 2026-04-27: `ghs_` and a JWT of some 520 characters.
INSTALLATION_JWT = "ghs_" + ".".join(secrets.token_urlsafe(n) for n in (27, 90, 256))


@pytest.mark.parametrize("token", [TOKEN, INSTALLATION_JWT], ids=["classic", "jwt"])
def test_redacts_a_credential_wherever_it_is_glued(token: str) -> None:
    redactor = Redactor()
    redactor.hold(token)
    for text in (token, f"x{token}y", f"token {token}", f"https://x.test/?t={token}#{token}"):
        assert token not in redactor.text(text) and MARK in redactor.text(text)
    assert redactor.text(f"x{token}y") == f"x{MARK}y"
    assert redactor.text(f"{token[:-1]} and {token[1:]}") == f"{token[:-1]} and {token[1:]}"  # not the token
    assert redactor.text("nothing here") == "nothing here"


def test_overlapping_credentials_leave_no_piece() -> None:
    redactor = Redactor()
    first, second = "ghs_" + "a" * 20 + "OVERLAP", "OVERLAP" + "b" * 20
    redactor.hold(first)
    redactor.hold(second)
    text = "ghs_" + "a" * 20 + "OVERLAP" + "b" * 20
    assert redactor.text(f"<{text}>") == f"<{MARK}>"


def test_a_short_credential_is_found_too() -> None:
    redactor = Redactor()
    redactor.hold(TOKEN)
    redactor.hold("s3cr")  # shorter than the index key: the index is rebuilt for it
    assert redactor.text(f"a s3cr b {TOKEN}") == f"a {MARK} b {MARK}"


def test_every_credential_ever_held_stays_redacted() -> None:
    redactor = Redactor()
    held = ["ghs_" + secrets.token_urlsafe(27) for _ in range(5000)]
    for token in held:
        redactor.hold(token)
    text = " ".join(held[::250])
    started = time.monotonic()
    assert redactor.text(text) == " ".join([MARK] * 20)
    assert time.monotonic() - started < 0.5  # does not walk 5000 credentials


def test_values_and_records_are_redacted_in_every_string() -> None:
    redactor = Redactor()
    redactor.hold(TOKEN)
    value = {"url": f"u{TOKEN}", TOKEN: [1, {"deep": TOKEN}], "n": 7, "ok": True}
    assert json.dumps(redactor.value(value)).count(MARK) == 3 and TOKEN not in json.dumps(redactor.value(value))
    record = AuditRecord("broker", "sbx", "10.0.0.2", f"h{TOKEN}", None, "error", f"echo {TOKEN}", "internal_error")
    record.extra = {"head": TOKEN, "status": 502}
    assert TOKEN not in redactor.record(record).to_json()
    assert record.extra["status"] == 502


@pytest.mark.parametrize("token", [TOKEN, INSTALLATION_JWT], ids=["classic", "jwt"])
def test_clip_drops_the_word_it_cuts(token: str) -> None:
    text = f"GitHub said: Bad credentials {token} for you"
    for cut_inside in (text.index(token) + 10, text.index(token) + len(token) - 1):
        assert token[:10] not in clip(text, cut_inside) and clip(text, cut_inside).startswith(
            "GitHub said: Bad credentials"
        )
    assert clip("short", 100) == "short"
