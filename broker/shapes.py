"""JSON at the broker's edges: parsed within limits, and upstream answers checked against the fields the broker uses.

Python's `json` parser recurses once per nested array or object, so 20,000 `[` raise RecursionError (a 500 and a
traceback). `loads` counts the nesting on the text first, outside string literals, in one linear pass, and refuses
what is deeper than the caller allows before the parser sees it.

The shapes are a tiny typed checker rather than JSON Schema: the broker reads a few small objects, and the checks that
matter here (an integer that is not a bool, text fit for a header, a credential fit for an Authorization header)
read plainly in a few lines, with no dependency and no schema language to get wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

MAX_TEXT = 2048  # characters in any text field the broker takes from upstream
MAX_CREDENTIAL = 4096

# A string literal (possessive, and allowed to run to the end unterminated, so no input makes the search go back
# over text it has passed), or one bracket. The literal's loop is unrolled (runs of plain characters, then one
# escape): some four times faster on a long string, such as a base64 bundle, than one alternation per character.
_STRUCTURE = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)|[\[\]{}]', re.DOTALL)
_OPENING = frozenset("[{")


class JsonLimitError(ValueError):
    """The text nests deeper than allowed; not looked at any further."""


class ShapeError(ValueError):
    """A JSON value lacks a field the broker uses, or has one of the wrong kind."""


def nesting(text: str, limit: int) -> int:
    """How deep `text` nests arrays and objects, counting no further than `limit` + 1."""
    depth = deepest = 0
    for match in _STRUCTURE.finditer(text):
        char = text[match.start()]
        if char in _OPENING:
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                break
        elif char != '"':
            depth -= 1
    return deepest


def loads(data: bytes, max_depth: int) -> Any:
    """JSON from UTF-8 bytes, nested at most `max_depth` deep; ValueError (JsonLimitError for depth) otherwise."""
    text = data.decode("utf-8")  # RFC 8259: JSON between systems is UTF-8 (UnicodeDecodeError is a ValueError)
    if nesting(text, max_depth) > max_depth:
        raise JsonLimitError(f"JSON nested deeper than {max_depth} levels")
    return json.loads(text)


@dataclass(frozen=True, slots=True)
class Kind:
    description: str
    test: Callable[[Any], bool]


def _iso_time(value: Any) -> bool:
    try:
        datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def _text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_TEXT and value.isprintable()


POSITIVE_INT = Kind("a positive integer", lambda v: type(v) is int and 0 < v < 2**63)
BOOL = Kind("a boolean", lambda v: type(v) is bool)
TEXT = Kind(f"printable text of 1-{MAX_TEXT} characters", _text)
# `url` becomes the Location header: ASCII as well.
WEB_URL = Kind("an http(s) URL", lambda v: _text(v) and v.isascii() and v.startswith(("https://", "http://")))
# It goes into an Authorization header: visible ASCII only (no space, CR or LF).
_VISIBLE_ASCII = re.compile(r"[!-~]+")
CREDENTIAL = Kind(
    "a token", lambda v: isinstance(v, str) and len(v) <= MAX_CREDENTIAL and bool(_VISIBLE_ASCII.fullmatch(v))
)
TIMESTAMP = Kind("an ISO 8601 time", lambda v: isinstance(v, str) and len(v) <= 64 and _iso_time(v))
COUNT = Kind("a count", lambda v: type(v) is int and 0 <= v < 2**63)
MAYBE_BOOL = Kind("a boolean or null", lambda v: v is None or type(v) is bool)
_OBJECT_ID = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")
OBJECT_ID = Kind("a git object name", lambda v: isinstance(v, str) and bool(_OBJECT_ID.fullmatch(v)))


def one_of(*values: str | None) -> Kind:
    """A value from a fixed set (`None` in it: JSON null allowed)."""
    allowed = frozenset(values)
    described = ", ".join("null" if v is None else v for v in values)
    return Kind(f"one of {described}", lambda v: (v is None or isinstance(v, str)) and v in allowed)


type Shape = Mapping[str, Kind | Shape]


def conforming(value: Any, shape: Shape, what: str) -> dict[str, Any]:
    """`value`, when it is an object with every field of `shape` of its kind (other fields are ignored);
    else ShapeError naming `what` and the first field that is not. Values never appear in the message."""
    problem = _problem(value, shape, "")
    if problem:
        raise ShapeError(f"{what}: {problem}")
    checked: dict[str, Any] = value  # _problem found it to be an object
    return checked


def _problem(value: Any, shape: Shape, path: str) -> str | None:
    if not isinstance(value, dict):
        return f"{path or 'the answer'} is not an object"
    for key, expected in shape.items():
        where = f"{path}.{key}" if path else key
        if key not in value:
            return f"{where} is missing"
        if isinstance(expected, Kind):
            if not expected.test(value[key]):
                return f"{where} is not {expected.description}"
        elif problem := _problem(value[key], expected, where):
            return problem
    return None
